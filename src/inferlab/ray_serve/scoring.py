"""The Ray request router's decisions, in plain Python: the router issue's core over Serve's replicas.

Serve hands its router the live replicas (with the stats each last reported and the ongoing
requests Serve counts); this turns them into `router.policies.ReplicaView`s (cached tokens
from a `router.prefix_index.PrefixIndex` of what was sent where), asks the policy, and ranks:
the chosen replica first, the rest by load, so Serve falls through to the next one when the
first is full. Kept apart from the Ray class so the tests run it without a cluster.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from inferlab.router.hashing import block_hashes, max_hit_blocks
from inferlab.router.policies import Decision, ReplicaView, RouteRequest, loads, make_policy
from inferlab.router.prefix_index import PrefixIndex


@dataclass(frozen=True)
class Candidate:
    name: str
    stats: dict[str, Any]  # what the replica's record_routing_stats() last returned ({} before the first)
    ongoing: int = 0  # Serve's count of its ongoing requests


@dataclass
class Scorer:
    policy_name: str = "cache-aware"
    prefill_rate: float = 2000.0  # tokens/s, the policies' default until measured
    clock: Callable[[], float] = time.monotonic
    index: PrefixIndex = field(default_factory=PrefixIndex)
    decisions: dict[str, int] = field(default_factory=dict)  # by reason

    def __post_init__(self) -> None:
        self.policy = make_policy(self.policy_name)
        self.last: Decision | None = None

    def request(self, route: dict[str, Any] | None, block_size: int) -> RouteRequest:
        route = route or {}
        ids = route.get("token_ids") or ()
        n = int(route.get("prompt_tokens") or len(ids))
        return RouteRequest(n, tuple(block_hashes(ids, block_size)) if ids else (), route.get("session"))

    def view(self, c: Candidate, request: RouteRequest, now: float) -> ReplicaView:
        s = c.stats
        bs = int(s.get("block_size") or 16)
        cached = 0
        if s.get("prefix_caching", True) and request.block_hashes:
            hit = self.index.match(c.name, request.block_hashes[: max_hit_blocks(request.prompt_tokens, bs)], now)
            cached = hit * bs
        share = self.live_share(c)
        return ReplicaView(name=c.name, in_flight=c.ongoing, queued_prefill_tokens=int(s.get("queued_tokens", 0) * share),
                           decoding=int(s.get("running", 0) * share), prefill_rate=self.prefill_rate,
                           external_load=0.0, cached_tokens=cached)  # fmt: skip

    @staticmethod
    def live_share(c: Candidate) -> float:
        """How much of the replica's last report still stands: its load scaled to the requests there now.

        The report is up to a stats period old (~1 s), Serve's count of ongoing requests is
        live (up on send, down on completion). A request that finished since the report must
        not keep counting: its queued tokens would outweigh the cached prefix the next request
        finds there, and a repeated prefix would flap between replicas under load.
        """
        reported = int(c.stats.get("in_flight", -1))
        if reported <= c.ongoing:  # as many or more there now (or an older replica's report)
            return 1.0
        return c.ongoing / reported

    def rank(self, route: dict[str, Any] | None, candidates: Sequence[Candidate]) -> list[str]:
        """Candidate names, most preferred first; the blocks are expected on the first."""
        if not candidates:
            return []
        now = self.clock()
        bs = next((int(c.stats["block_size"]) for c in candidates if c.stats.get("block_size")), 16)
        request = self.request(route, bs)
        views = [self.view(c, request, now) for c in candidates]
        decision = self.policy.choose(request, views)
        self.last = decision
        self.decisions[decision.reason] = self.decisions.get(decision.reason, 0) + 1
        if request.block_hashes:
            self.index.add_speculative(decision.replica, request.block_hashes, now)
        by_load = sorted(zip(loads(views), range(len(views)), views), key=lambda t: (t[0], t[1]))
        return [decision.replica, *[v.name for _, _, v in by_load if v.name != decision.replica]]

    def forget(self, name: str) -> None:
        """A replica died or left: whatever it held is gone."""
        self.index.forget(name)
