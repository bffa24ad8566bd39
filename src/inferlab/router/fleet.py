"""The router's core: replicas (load, health, info), the prefix index and a policy, driven by
plain calls with the time passed in, so any driver (HTTP, a simulator, tests) can use it.

    route(request, exclude)  → Decision | None     (None: no replica may take it now)
    dispatch(decision, req)  → Ticket              (load counted, blocks expected there)
    first_token(ticket) / finish(ticket, outcome)  (load released exactly once)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from inferlab.router.hashing import block_hashes, max_hit_blocks
from inferlab.router.health import HealthConfig, ReplicaHealth
from inferlab.router.kv_sync import KVSync
from inferlab.router.policies import Decision, Policy, ReplicaView, RouteRequest
from inferlab.router.prefix_index import PrefixIndex
from inferlab.router.replica import ReplicaInfo, ReplicaMetrics, ReplicaState, Ticket

OUTCOMES = ("ok", "failed", "fatal", "abandoned")


@dataclass
class Replica:
    name: str  # its base URL
    state: ReplicaState
    health: ReplicaHealth
    kv: KVSync  # its KV event feed into the index


class Fleet:
    def __init__(
        self,
        names: Sequence[str],
        policy: Policy,
        *,
        index: PrefixIndex | None = None,
        health: HealthConfig | None = None,
        prefill_rate: float = 2000.0,
        metrics_max_age_s: float = 2.0,
        speculative_ttl_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not names:
            raise ValueError("give at least one backend")
        if len(set(names)) != len(names):
            raise ValueError("the same backend is given twice")
        self.policy = policy
        self.index = index or PrefixIndex()
        # A replica whose KV events we follow confirms a routed prompt's blocks within a poll
        # (at schedule time), so a guess about it needs to live only that long, plus its queue.
        self.speculative_ttl_s = speculative_ttl_s
        self.clock = clock
        self.replicas: dict[str, Replica] = {
            n: Replica(n, ReplicaState(n, prefill_rate=prefill_rate, metrics_max_age_s=metrics_max_age_s),
                       ReplicaHealth(health), KVSync(n, self.index))
            for n in names
        }  # fmt: skip

    # ------------------------------------------------------------------ what requests need
    @property
    def block_size(self) -> int:
        """The replicas' block size (the first that has told us; they are meant to agree)."""
        for r in self.replicas.values():
            if r.state.info.known:
                return r.state.info.block_size
        return ReplicaInfo().block_size

    def request(self, token_ids: Sequence[int] | None, cache_salt: str | None = None,
                session_key: str | None = None) -> RouteRequest:  # fmt: skip
        """The policies' view of a prompt: its length and its engine block hashes."""
        if not token_ids:
            return RouteRequest(0, (), session_key)
        return RouteRequest(len(token_ids), tuple(block_hashes(token_ids, self.block_size, cache_salt)), session_key)

    # ------------------------------------------------------------------ routing
    def routable(self, now: float | None = None) -> list[Replica]:
        now = self.clock() if now is None else now
        return [r for r in self.replicas.values() if r.health.routable(now)]

    def view(self, r: Replica, request: RouteRequest, now: float) -> ReplicaView:
        info = r.state.info
        cached = 0
        if info.prefix_caching and request.block_hashes:
            hit = self.index.match(r.name, request.block_hashes[: max_hit_blocks(request.prompt_tokens, info.block_size)], now)
            cached = hit * info.block_size
        return ReplicaView(
            name=r.name,
            in_flight=r.state.in_flight,
            queued_prefill_tokens=r.state.queued_prefill_tokens(now),
            decoding=r.state.decoding(now),
            prefill_rate=r.state.prefill_rate,
            external_load=r.state.external_load(now),
            cached_tokens=cached,
        )

    def route(self, request: RouteRequest, exclude: Iterable[str] = (),
              among: Collection[str] | None = None) -> Decision | None:  # fmt: skip
        """The policy's pick among the routable replicas (`among`: only those; a canary's pool)."""
        now = self.clock()
        skip = set(exclude)
        views = [self.view(r, request, now) for r in self.routable(now)
                 if r.name not in skip and (among is None or r.name in among)]  # fmt: skip
        if not views:
            return None
        return self.policy.choose(request, views)

    def dispatch(self, decision: Decision, request: RouteRequest, *, streamed: bool = True) -> Ticket:
        """Count the request on its replica and expect its blocks cached there."""
        now = self.clock()
        r = self.replicas[decision.replica]
        uncached = max(request.prompt_tokens - decision.predicted_cached_tokens, 0)
        prefill_s = None if streamed else (r.state.queued_prefill_tokens(now) + uncached) / max(r.state.prefill_rate, 1e-6)
        ticket = r.state.acquire(request.prompt_tokens, uncached, now, prefill_s)
        r.health.on_dispatch()
        if request.block_hashes and r.state.info.prefix_caching:
            ttl = min(self.speculative_ttl_s, self.index.ttl_s) if r.kv.synced else None
            self.index.add_speculative(r.name, request.block_hashes, now, ttl)
        return ticket

    def first_token(self, ticket: Ticket) -> None:
        self.replicas[ticket.replica].state.first_token(ticket, self.clock())

    def finish(self, ticket: Ticket, outcome: str) -> bool:
        """Release the ticket. `failed` (5xx, timeout) and `fatal` (connection refused or reset)
        feed the circuit breaker; `abandoned` (the client left) feeds nothing. True if the
        replica was ejected by this outcome."""
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}")
        r = self.replicas[ticket.replica]
        if ticket.released:
            return False
        r.state.release(ticket, ok=outcome == "ok")
        if outcome == "ok":
            r.health.request_ok()
        elif outcome == "abandoned":
            r.health.request_abandoned()
        else:
            ejected = r.health.request_failed(self.clock(), fatal=outcome == "fatal")
            if ejected:
                self.forget(r.name)  # it may come back empty
            return ejected
        return False

    # ------------------------------------------------------------------ what probes report
    def probe_ok(self, name: str, metrics: ReplicaMetrics | None = None, info: ReplicaInfo | None = None) -> None:
        r = self.replicas[name]
        if r.health.probe_ok():
            self.forget(name)  # (re)started: whatever we believed it held is gone
        if info is not None:
            r.state.info = info
            if info.num_blocks:
                self.index.set_capacity(name, info.num_blocks)
        if metrics is not None:
            r.state.update_metrics(metrics)

    def forget(self, name: str) -> None:
        """Drop what the index holds for a replica; its event feed resyncs from a snapshot."""
        self.index.forget(name)
        self.replicas[name].kv.reset()

    def probe_failed(self, name: str) -> None:
        self.replicas[name].health.probe_failed()

    def states(self) -> dict[str, str]:
        now = self.clock()
        return {n: r.health.state(now) for n, r in self.replicas.items()}
