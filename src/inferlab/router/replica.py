"""One replica's load as the router sees it: the requests it sent (tickets) and what the
replica last reported on /metrics, with the report's age.

The router's own counts are always right for its own traffic (a ticket is taken at dispatch
and released exactly once, whatever happens to the request); the scraped metrics add what
other clients send, but only while fresh: a stale report is unknown, never zero. What other
clients send is the report less the router's own requests *when it was scraped*: the router's
requests that ended since would otherwise count as someone else's until the next scrape, and a
replica that just finished a burst (holding the prefix the next request wants) would look busy.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReplicaMetrics:
    """The numbers read from a replica's /metrics at `scraped_at` (router clock)."""

    scraped_at: float
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float | None = None


@dataclass(frozen=True)
class ReplicaInfo:
    """What /server_info says (defaults until it has answered)."""

    block_size: int = 16
    prefix_caching: bool = True
    num_blocks: int | None = None
    max_num_seqs: int | None = None
    known: bool = False


@dataclass(eq=False)
class Ticket:
    """One request dispatched to a replica, from dispatch to its end."""

    replica: str
    prompt_tokens: int
    uncached_tokens: int
    sent_at: float
    # Until when its prefill counts as queued: streamed requests until their first token;
    # plain ones (no first token to see) until the predicted prefill time has passed.
    prefill_until: float | None = None
    first_token_at: float | None = None
    released: bool = False
    id: int = field(default_factory=itertools.count().__next__)

    def in_prefill(self, now: float) -> bool:
        if self.first_token_at is not None:
            return False
        return self.prefill_until is None or now < self.prefill_until


class ReplicaState:
    """Tickets, the measured prefill rate and the last metrics of one replica."""

    def __init__(self, name: str, *, prefill_rate: float = 2000.0, metrics_max_age_s: float = 2.0, ewma: float = 0.2):
        self.name = name
        self.prefill_rate = prefill_rate  # tokens/s, refined by each first token observed
        self.metrics_max_age_s = metrics_max_age_s
        self.ewma = ewma
        self.tickets: dict[int, Ticket] = {}
        self.metrics: ReplicaMetrics | None = None
        self.own_at_scrape = 0  # the router's requests there when `metrics` was read
        self.info = ReplicaInfo()
        self.completed = 0
        self.failed = 0

    # ------------------------------------------------------------------ load kept by the router
    def acquire(self, prompt_tokens: int, uncached_tokens: int, now: float, prefill_s: float | None = None) -> Ticket:
        """A ticket for a request sent now; `prefill_s` (plain responses) bounds its prefill."""
        t = Ticket(self.name, prompt_tokens, uncached_tokens, now, None if prefill_s is None else now + prefill_s)
        self.tickets[t.id] = t
        return t

    def first_token(self, ticket: Ticket, now: float) -> None:
        """The first token came back: the prefill is done, and its time calibrates the rate."""
        if ticket.first_token_at is not None or ticket.released:
            return
        queued = sum(t.uncached_tokens for t in self.tickets.values()
                     if t is not ticket and t.first_token_at is None and t.sent_at <= ticket.sent_at)  # fmt: skip
        ticket.first_token_at = now
        elapsed = now - ticket.sent_at
        work = queued + ticket.uncached_tokens
        if elapsed > 1e-3 and work >= 16:
            rate = work / elapsed
            self.prefill_rate = (1 - self.ewma) * self.prefill_rate + self.ewma * rate

    def release(self, ticket: Ticket, ok: bool = True) -> None:
        """End of the request, whatever the outcome; a second call is a no-op."""
        if ticket.released:
            return
        ticket.released = True
        self.tickets.pop(ticket.id, None)
        if ok:
            self.completed += 1
        else:
            self.failed += 1

    @property
    def in_flight(self) -> int:
        return len(self.tickets)

    def queued_prefill_tokens(self, now: float) -> int:
        return sum(t.uncached_tokens for t in self.tickets.values() if t.in_prefill(now))

    def decoding(self, now: float) -> int:
        return sum(1 for t in self.tickets.values() if not t.in_prefill(now))

    # ------------------------------------------------------------------ what the replica reports
    def update_metrics(self, metrics: ReplicaMetrics) -> None:
        """A report just read: the router's own requests there now are the ones it counts."""
        self.metrics = metrics
        self.own_at_scrape = self.in_flight

    def fresh_metrics(self, now: float) -> ReplicaMetrics | None:
        """The last report if it is younger than metrics_max_age_s, else None (unknown)."""
        m = self.metrics
        if m is None or now - m.scraped_at > self.metrics_max_age_s:
            return None
        return m

    def external_load(self, now: float) -> float | None:
        """Requests the replica held beyond the router's own (other clients) at the last scrape;
        None = unknown."""
        m = self.fresh_metrics(now)
        if m is None:
            return None
        return max(0.0, m.running + m.waiting - self.own_at_scrape)
