"""A canary release: a second pool of replicas (a new version) gets a weighted share of the
traffic, sticky per session, and loses it by itself when it does worse than the stable pool.
Plain Python with the time passed in, like the rest of the core.

    pool_for(session)  → "canary" | "stable"
        a session: canary iff its hash, as a fraction in [0, 1), is below the weight (a session
        stays in its pool while the weight holds; raising the weight only moves stable sessions
        to the canary, never back); no session: every 1/weight-th request, in turn (exact share)
    record(pool, ok, ttft_s, now)  an outcome of a request served by that pool
    check(now) → reason | None     rollback when, over the last `window_s`, with at least
        `min_requests` outcomes in each pool:
          canary error rate  > stable error rate + max_error_rate_delta          ("error_rate")
          canary TTFT p95    > stable TTFT p95 × max_ttft_ratio + ttft_slack_s   ("ttft_p95")
        and (proxy.py) when its failures have ejected every canary replica ("ejected": the
        circuit breaker would otherwise starve the window of canary outcomes)
    rollback / promote / set_weight: the admin's hand (promote: the canary takes all the
        traffic and is no longer judged)

A rollback sets the weight to 0: no new request goes to the canary; those in flight finish.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from inferlab.server.live import percentiles

POOLS = ("stable", "canary")


@dataclass(frozen=True)
class CanaryConfig:
    weight: float = 0.1
    window_s: float = 60.0
    min_requests: int = 20  # outcomes per pool in the window before judging
    max_error_rate_delta: float = 0.05
    max_ttft_ratio: float = 1.5
    ttft_slack_s: float = 0.05  # TTFTs this close are noise, whatever their ratio

    def __post_init__(self) -> None:
        if not 0.0 <= self.weight <= 1.0:
            raise ValueError(f"the canary weight must be within [0, 1], got {self.weight}")
        if self.window_s <= 0 or self.min_requests < 1 or self.max_ttft_ratio < 1 or self.max_error_rate_delta < 0:
            raise ValueError("canary window must be > 0, min requests >= 1, TTFT ratio >= 1, error delta >= 0")


@dataclass(frozen=True)
class Outcome:
    at: float
    pool: str
    ok: bool
    ttft_s: float | None


@dataclass(frozen=True)
class PoolStats:
    requests: int
    errors: int
    ttft_p95_s: float | None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


def session_fraction(key: str) -> float:
    """A session's place in [0, 1), the same in every process."""
    return int.from_bytes(hashlib.sha256(b"canary\x00" + key.encode()).digest()[:8], "big") / 2.0**64


class Canary:
    def __init__(self, stable: Sequence[str], canary: Sequence[str], config: CanaryConfig | None = None,
                 versions: tuple[str, str] = ("stable", "canary")):  # fmt: skip
        if not stable or not canary:
            raise ValueError("a canary needs a stable pool and a canary pool")
        self.config = config or CanaryConfig()
        self.versions = dict(zip(POOLS, versions))  # the release each pool runs, for people
        self.members = {"stable": frozenset(stable), "canary": frozenset(canary)}
        self.weight = self.config.weight
        self.state = "active"  # active | rolled_back | promoted
        self.reason: str | None = None  # why it was rolled back
        self._outcomes: deque[Outcome] = deque()
        self._turn = 0
        self.rollbacks = 0

    def pool_of(self, replica: str) -> str:
        return "canary" if replica in self.members["canary"] else "stable"

    def pool_for(self, session_key: str | None) -> str:
        w = self.weight
        if w <= 0.0:
            return "stable"
        if w >= 1.0:
            return "canary"
        if session_key is not None:
            return "canary" if session_fraction(session_key) < w else "stable"
        self._turn += 1
        return "canary" if math.floor(self._turn * w) > math.floor((self._turn - 1) * w) else "stable"

    # ------------------------------------------------------------------ judging
    def record(self, pool: str, ok: bool, ttft_s: float | None, now: float) -> str | None:
        """Count an outcome; returns the rollback reason if this one triggered it."""
        if self.state != "active":
            return None
        self._outcomes.append(Outcome(now, pool, ok, ttft_s))
        return self.check(now)

    def stats(self, now: float) -> dict[str, PoolStats]:
        self._trim(now)
        out = {}
        for pool in POOLS:
            mine = [o for o in self._outcomes if o.pool == pool]
            ttfts = [o.ttft_s for o in mine if o.ok and o.ttft_s is not None]
            out[pool] = PoolStats(len(mine), sum(1 for o in mine if not o.ok), percentiles(ttfts, (95,))["p95"])
        return out

    def check(self, now: float) -> str | None:
        if self.state != "active" or self.weight <= 0.0:
            return None
        c = self.config
        st = self.stats(now)
        s, k = st["stable"], st["canary"]
        if s.requests < c.min_requests or k.requests < c.min_requests:
            return None
        if k.error_rate > s.error_rate + c.max_error_rate_delta:
            return self.rollback(f"error_rate: canary {k.error_rate:.1%} vs stable {s.error_rate:.1%}")
        if k.ttft_p95_s is not None and s.ttft_p95_s is not None \
                and k.ttft_p95_s > s.ttft_p95_s * c.max_ttft_ratio + c.ttft_slack_s:  # fmt: skip
            return self.rollback(f"ttft_p95: canary {k.ttft_p95_s:.3f} s vs stable {s.ttft_p95_s:.3f} s")
        return None

    def _trim(self, now: float) -> None:
        while self._outcomes and self._outcomes[0].at < now - self.config.window_s:
            self._outcomes.popleft()

    # ------------------------------------------------------------------ the admin's hand
    def rollback(self, reason: str = "manual") -> str:
        self.weight = 0.0
        self.state = "rolled_back"
        self.reason = reason
        self.rollbacks += 1
        return reason

    def promote(self) -> None:
        self.weight = 1.0
        self.state = "promoted"
        self.reason = None

    def set_weight(self, weight: float) -> None:
        """A new share, judged afresh (the window restarts: old outcomes were another split)."""
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"weight must be within [0, 1], got {weight}")
        self.weight = weight
        self.state = "active"
        self.reason = None
        self._outcomes.clear()

    def describe(self, now: float) -> dict:
        st = self.stats(now)
        return {
            "state": self.state, "weight": self.weight, "reason": self.reason, "rollbacks": self.rollbacks,
            "pools": {p: {"version": self.versions[p], "replicas": sorted(self.members[p]),
                          "requests": st[p].requests, "errors": st[p].errors,
                          "error_rate": st[p].error_rate, "ttft_p95_s": st[p].ttft_p95_s} for p in POOLS},
        }  # fmt: skip
