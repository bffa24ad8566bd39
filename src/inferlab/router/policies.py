"""Routing policies: a request and a view of each routable replica in, a decision out.

Pure functions of plain data (plus a counter for rotation), so the HTTP router, a simulator and
the tests drive the same code. Loads are in requests; the cache-aware score is in seconds of
predicted time to first token, computed from tokens:

    ttft(r) = (queued prefill tokens(r) + this request's uncached tokens(r)) / prefill rate(r)
              + decode_weight_tokens * (decoding requests(r) + external load(r)) / prefill rate(r)

A replica whose metrics are stale has an unknown external load; it is taken as the largest
external load any fresh replica reports (as busy as the busiest we know), not as zero.

Bounded load (consistent hashing with bounded loads): a replica is eligible for cache-aware or
session placement only while its load + 1 <= max(min_cap, ceil(load_factor * (total + 1) / N)),
so a popular prefix or a heavy session spreads once its owner carries more than its share.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class RouteRequest:
    """What the policies know of a request."""

    prompt_tokens: int = 0  # 0: unknown (no tokenizer answered)
    block_hashes: tuple[int, ...] = ()  # the prompt's full blocks, engine hashes
    session_key: str | None = None


@dataclass(frozen=True)
class ReplicaView:
    """One routable replica at decision time."""

    name: str
    in_flight: int = 0  # router's own requests
    queued_prefill_tokens: int = 0  # uncached prompt tokens of its requests not yet past prefill
    decoding: int = 0  # its requests past prefill
    prefill_rate: float = 2000.0  # tokens/s
    external_load: float | None = 0.0  # requests from elsewhere (scraped); None = unknown (stale)
    cached_tokens: int = 0  # of this request, predicted from the prefix index


@dataclass(frozen=True)
class Decision:
    replica: str
    reason: str
    predicted_cached_tokens: int = 0
    predicted_ttft_s: float | None = None


class Policy(Protocol):
    name: str

    def choose(self, request: RouteRequest, views: Sequence[ReplicaView]) -> Decision: ...


def external_loads(views: Sequence[ReplicaView]) -> list[float]:
    """Each view's external load, unknown ones as the largest known (0 if none is known)."""
    known = [v.external_load for v in views if v.external_load is not None]
    worst = max(known, default=0.0)
    return [worst if v.external_load is None else v.external_load for v in views]


def loads(views: Sequence[ReplicaView]) -> list[float]:
    return [v.in_flight + e for v, e in zip(views, external_loads(views))]


def load_cap(total: float, n: int, load_factor: float, min_cap: int) -> float:
    """The most requests one replica may carry, this one included."""
    return max(float(min_cap), math.ceil(load_factor * (total + 1) / max(n, 1)))


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, request: RouteRequest, views: Sequence[ReplicaView]) -> Decision:
        v = views[next(self._next) % len(views)]
        return Decision(v.name, "round_robin", v.cached_tokens)


class LeastLoad:
    """Fewest requests (then fewest queued prefill tokens); ties rotate, so an idle fleet is
    not all sent to its first replica."""

    name = "least-load"

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, request: RouteRequest, views: Sequence[ReplicaView], reason: str = "least_load") -> Decision:
        ls = loads(views)
        keys = [(load, v.queued_prefill_tokens) for load, v in zip(ls, views)]
        best = min(keys)
        tied = [v for k, v in zip(keys, views) if k == best]
        v = tied[next(self._next) % len(tied)]
        return Decision(v.name, reason, v.cached_tokens)


class CacheAware:
    """Lowest predicted TTFT among replicas under the bounded-load cap.

    Reasons: `prefix_hit` (the chosen replica holds the longest cached prefix), `prefix_spill`
    (a replica with a longer one was passed over: over the cap or slower by queue),
    `no_prefix` (no replica holds any of it; placement by load alone).
    """

    name = "cache-aware"

    def __init__(self, load_factor: float = 1.5, min_cap: int = 4, decode_weight_tokens: float = 16.0):
        self.load_factor = load_factor
        self.min_cap = min_cap
        self.decode_weight_tokens = decode_weight_tokens
        self._tie = LeastLoad()

    def predicted_ttft(self, request: RouteRequest, view: ReplicaView, external: float) -> float:
        uncached = max(request.prompt_tokens - view.cached_tokens, 0)
        rate = max(view.prefill_rate, 1e-6)
        decode = self.decode_weight_tokens * (view.decoding + external)
        return (view.queued_prefill_tokens + uncached + decode) / rate

    def choose(self, request: RouteRequest, views: Sequence[ReplicaView]) -> Decision:
        ls = loads(views)
        ext = external_loads(views)
        cap = load_cap(sum(ls), len(views), self.load_factor, self.min_cap)
        eligible = [i for i, load in enumerate(ls) if load + 1 <= cap] or [min(range(len(views)), key=ls.__getitem__)]
        best_cached = max(v.cached_tokens for v in views)
        scores = {i: self.predicted_ttft(request, views[i], ext[i]) for i in eligible}
        low = min(scores.values())
        tied = [i for i, s in scores.items() if s <= low * (1 + 1e-9)]
        if len(tied) > 1:  # equal predictions: rotate by load, as least-load does
            d = self._tie.choose(request, [views[i] for i in tied])
            i = next(i for i in tied if views[i].name == d.replica)
        else:
            i = tied[0]
        v = views[i]
        if best_cached == 0:
            reason = "no_prefix"
        elif v.cached_tokens == best_cached:
            reason = "prefix_hit"
        else:
            reason = "prefix_spill"
        return Decision(v.name, reason, v.cached_tokens, scores[i])


def rendezvous_weight(key: str, replica: str) -> int:
    """Highest-random-weight hashing: stable across processes (SHA-256, not hash())."""
    return int.from_bytes(hashlib.sha256(f"{key}\x00{replica}".encode()).digest()[:8], "big")


class Session:
    """The same session to the same replica (rendezvous hashing: adding a replica moves only
    ~1/N of the sessions), unless it is over the bounded-load cap; then the next in the
    session's own order. No session key: least-load."""

    name = "session"

    def __init__(self, load_factor: float = 1.5, min_cap: int = 4):
        self.load_factor = load_factor
        self.min_cap = min_cap
        self._fallback = LeastLoad()

    def choose(self, request: RouteRequest, views: Sequence[ReplicaView]) -> Decision:
        if request.session_key is None:
            return self._fallback.choose(request, views, reason="no_session")
        ls = loads(views)
        cap = load_cap(sum(ls), len(views), self.load_factor, self.min_cap)
        order = sorted(range(len(views)), key=lambda i: rendezvous_weight(request.session_key or "", views[i].name),
                       reverse=True)  # fmt: skip
        for rank, i in enumerate(order):
            if ls[i] + 1 <= cap:
                return Decision(views[i].name, "session" if rank == 0 else "session_spill", views[i].cached_tokens)
        i = min(order, key=ls.__getitem__)
        return Decision(views[i].name, "session_spill", views[i].cached_tokens)


POLICIES = ("cache-aware", "least-load", "round-robin", "session")


def make_policy(name: str) -> Policy:
    factories: dict[str, type] = {"cache-aware": CacheAware, "least-load": LeastLoad, "round-robin": RoundRobin,
                                  "session": Session}  # fmt: skip
    if name not in factories:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    return factories[name]()
