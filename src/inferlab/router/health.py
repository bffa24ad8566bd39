"""Whether a replica may get traffic: readiness from active probes, and a circuit breaker fed
by passive failures of real requests.

    not ready ──probe 200──► ready ──probe fails──► not ready      (no traffic before ready)

    CLOSED ──failures──► OPEN ──ejection_s passes──► HALF_OPEN ──trial ok──► CLOSED
                           ▲                             │
                           └──────── trial fails ────────┘   (ejection_s doubles, up to a cap)

A connection refused or reset is a strong signal (the process is gone): it opens the circuit at
once. 5xx answers count: `failure_threshold` in a row open it. In HALF_OPEN one request at a
time is let through as the trial.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Circuit(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class HealthConfig:
    failure_threshold: int = 3  # consecutive 5xx / timeouts that eject
    ejection_s: float = 2.0  # first ejection; doubles on a failed trial
    max_ejection_s: float = 30.0


class ReplicaHealth:
    """The readiness and circuit state of one replica (times from the router's clock)."""

    def __init__(self, config: HealthConfig | None = None):
        self.config = config or HealthConfig()
        self.ready = False  # an active probe has answered 200, and none has failed since
        self.circuit = Circuit.CLOSED
        self.consecutive_failures = 0
        self.ejected_until = 0.0
        self._ejection_s = self.config.ejection_s
        self.trial_in_flight = False
        self.ejections = 0  # cumulative

    # ------------------------------------------------------------------ active probes
    def probe_ok(self) -> bool:
        """A probe answered 200; True if the replica just became ready (it may have restarted)."""
        became = not self.ready
        self.ready = True
        return became

    def probe_failed(self) -> None:
        self.ready = False

    # ------------------------------------------------------------------ passive outcomes
    def request_ok(self) -> None:
        self.consecutive_failures = 0
        if self.circuit is Circuit.HALF_OPEN:
            self.circuit = Circuit.CLOSED
            self._ejection_s = self.config.ejection_s
        self.trial_in_flight = False

    def request_failed(self, now: float, *, fatal: bool = False) -> bool:
        """A request failed on this replica; `fatal` (connection refused or reset) ejects at once.
        Returns True if this failure opened the circuit."""
        self.consecutive_failures += 1
        self.trial_in_flight = False
        if self.circuit is Circuit.HALF_OPEN:
            self._ejection_s = min(self._ejection_s * 2, self.config.max_ejection_s)
            return self._open(now)
        if self.circuit is Circuit.CLOSED and (fatal or self.consecutive_failures >= self.config.failure_threshold):
            return self._open(now)
        return False

    def _open(self, now: float) -> bool:
        self.circuit = Circuit.OPEN
        self.ejected_until = now + self._ejection_s
        self.ejections += 1
        return True

    # ------------------------------------------------------------------ routing
    def routable(self, now: float) -> bool:
        """May a request go there now? (OPEN turns HALF_OPEN once its time is up.)"""
        if not self.ready:
            return False
        if self.circuit is Circuit.OPEN and now >= self.ejected_until:
            self.circuit = Circuit.HALF_OPEN
        if self.circuit is Circuit.OPEN:
            return False
        if self.circuit is Circuit.HALF_OPEN:
            return not self.trial_in_flight
        return True

    def on_dispatch(self) -> None:
        """A request was sent; in HALF_OPEN it is the one trial."""
        if self.circuit is Circuit.HALF_OPEN:
            self.trial_in_flight = True

    def state(self, now: float) -> str:
        """One word for /health and logs."""
        if not self.ready:
            return "not_ready"
        self.routable(now)
        return {Circuit.CLOSED: "healthy", Circuit.OPEN: "ejected", Circuit.HALF_OPEN: "half_open"}[self.circuit]

    def request_abandoned(self) -> None:
        """The client left before the outcome was known: neither a success nor a failure, but a
        half-open trial is over (the next request becomes the trial)."""
        self.trial_in_flight = False
