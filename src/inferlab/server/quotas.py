"""Per-tenant admission in the server: concurrency caps and token-bucket rates.

Each tenant has its own counters, so a tenant at its limit is refused at once (429 +
Retry-After) and never waits in line in front of another tenant: there is no shared waiting
room here. What is shared is the engine behind (FCFS scheduler, --max-queue-len): a tenant
with `max_concurrent` holds at most that many of its places, which is how one tenant's burst
is kept from delaying the others.

    max_concurrent        requests in flight; the slot is freed when the response ends
    requests_per_minute   a bucket of that many requests, refilled continuously (rate/60 per s)
    tokens_per_minute     a bucket of tokens: a request takes prompt + n x max_tokens up front
                          (its prompt alone when it sets no max_tokens), and when it ends the
                          bucket is settled to what it really used (unused tokens come back;
                          tokens beyond the estimate are owed, so the next request waits)

A request is admitted when the bucket holds min(cost, capacity), so a request larger than a
minute's budget waits for a full bucket instead of being refused forever; the balance may go
below zero. All of this runs on the event loop (one thread): no locks. The clock is injectable
so that tests can step through rate windows without sleeping.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from inferlab.server.protocol import ApiError
from inferlab.server.tenants import Tenant

LIMITS = ("concurrency", "requests", "tokens")  # the `limit` label of the rate-limited counter


class RateLimitedError(ApiError):
    """429 + Retry-After, with OpenAI's `rate_limit_exceeded` code."""

    def __init__(self, message: str, limit: str, retry_after_s: int):
        super().__init__(
            429,
            message,
            "rate_limit_exceeded",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(retry_after_s)},
            extra={"limit": limit},
        )
        self.limit = limit
        self.retry_after_s = retry_after_s


class TokenBucket:
    """`per_minute` units of capacity, refilled continuously."""

    def __init__(self, per_minute: int, now: float):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self._t = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self._t) * self.rate)
        self._t = now

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until `amount` (at most a full bucket) can be taken; 0 = now."""
        self._refill(now)
        need = min(amount, self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount

    def give(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)


class _State:
    def __init__(self, tenant: Tenant, now: float):
        lim = tenant.limits
        self.in_flight = 0
        self.requests = TokenBucket(lim.requests_per_minute, now) if lim.requests_per_minute else None
        self.tokens = TokenBucket(lim.tokens_per_minute, now) if lim.tokens_per_minute else None


@dataclass(eq=False)
class Lease:
    """One admitted request's hold on its tenant's quotas; `release` once, when it ends."""

    gate: TenantGate
    tenant: Tenant
    estimated_tokens: int
    released: bool = False

    def release(self, used_tokens: int = 0) -> None:
        """Free the concurrency slot and settle the token bucket to `used_tokens` (idempotent)."""
        if self.released:
            return
        self.released = True
        self.gate._release(self, used_tokens)


class TenantGate:
    """Admits or refuses (429) each generation request by its tenant's limits."""

    def __init__(
        self,
        tenants: Iterable[Tenant],
        *,
        clock: Callable[[], float] = time.monotonic,
        on_limited: Callable[[Tenant, str], None] | None = None,
        on_in_flight: Callable[[Tenant, int], None] | None = None,
    ):
        self._clock = clock
        now = clock()
        self._states = {t.name: _State(t, now) for t in tenants}
        self._on_limited = on_limited
        self._on_in_flight = on_in_flight

    def in_flight(self, tenant: Tenant) -> int:
        return self._states[tenant.name].in_flight

    def admit(self, tenant: Tenant, estimated_tokens: int) -> Lease:
        """A lease, or `RateLimitedError` (nothing is taken from any bucket when refused)."""
        st = self._states[tenant.name]
        lim = tenant.limits
        now = self._clock()
        if lim.max_concurrent is not None and st.in_flight >= lim.max_concurrent:
            self._refuse(
                tenant, "concurrency", 1,
                f"tenant {tenant.name!r} already has {st.in_flight} requests in flight (its limit is "
                f"{lim.max_concurrent}); retry when one finishes",
            )  # fmt: skip
        if st.requests is not None:
            wait = st.requests.wait_s(1, now)
            if wait > 0:
                self._refuse(
                    tenant, "requests", wait,
                    f"rate limit reached for tenant {tenant.name!r}: {lim.requests_per_minute} requests per minute",
                )  # fmt: skip
        if st.tokens is not None:
            wait = st.tokens.wait_s(estimated_tokens, now)
            if wait > 0:
                self._refuse(
                    tenant, "tokens", wait,
                    f"rate limit reached for tenant {tenant.name!r}: {lim.tokens_per_minute} tokens per minute "
                    f"(this request needs {estimated_tokens})",
                )  # fmt: skip
        if st.requests is not None:
            st.requests.take(1, now)
        if st.tokens is not None:
            st.tokens.take(estimated_tokens, now)
        st.in_flight += 1
        if self._on_in_flight is not None:
            self._on_in_flight(tenant, st.in_flight)
        return Lease(self, tenant, estimated_tokens)

    def _refuse(self, tenant: Tenant, limit: str, wait_s: float, message: str) -> None:
        retry = max(1, math.ceil(wait_s))
        if self._on_limited is not None:
            self._on_limited(tenant, limit)
        raise RateLimitedError(f"{message}; retry after {retry} s", limit, retry)

    def _release(self, lease: Lease, used_tokens: int) -> None:
        st = self._states[lease.tenant.name]
        st.in_flight -= 1
        if st.tokens is not None:
            st.tokens.give(lease.estimated_tokens - used_tokens, self._clock())
        if self._on_in_flight is not None:
            self._on_in_flight(lease.tenant, st.in_flight)
