"""When speculation pays: per request and step, how many drafts (0..K) to verify.

Drafts are not free: each is one more row of the step for every request in it, and proposing
costs time (a draft model's passes). They pay when the tokens they are expected to add outweigh
the time they add. The rule, with measured numbers:

- the step cost: t(T) = a + b·T for a decode step of T rows (the decodes and their drafts),
  fitted by exponentially weighted least squares over the engine's own decode steps (prefill
  steps are left out: a prompt token costs more than a decode row); before enough spread in T
  is seen, b = a / 16 (on a CPU one more row of a small batch costs little next to streaming
  the weights once);
- the proposal cost c per draft token: the proposer's measured time per draft made;
- a request's acceptance α: each verified position is a trial (the drafts accepted, and the
  first rejected one), its successes over its trials, starting from the engine-wide rate as a
  prior of weight 2 (a chat workload whose drafts are rejected starts new requests low);
- k drafts are expected to add E(k) = α + α² + ... + α^k tokens (each is kept only if all before
  it are).

With B requests in decode this step, S = a + b·B is the step without drafts: B tokens in S.
k drafts add E(k) tokens and (b + c)·k time; they pay iff (B + E(k)) / (S + (b + c)·k) > B / S,
that is E(k)·S > B·(b + c)·k. The policy picks the k in 1..K with the largest E(k)·S - B·(b+c)·k
and drafts only if it is positive; a request it keeps from drafting still gets one draft every
PROBE_EVERY-th step, so that its estimate follows a reply that turns to copying (else a low
start would never be revised). At one stream on a CPU (b ≪ a) almost any acceptance pays;
at 32 streams a row costs about as much as the tokens it might save, and only drafts accepted
most of the time (copying) still pay.

Pure Python, no torch, no clock: the scheduler feeds it step times and verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_ROW_COST = 1 / 16  # b / a before measurements
PRIOR_WEIGHT = 2.0  # trials the engine-wide acceptance counts for in a new request's estimate
DECAY = 0.98  # weight of the past per observed step in the cost fit
PROBE_EVERY = 16  # a request kept from drafting drafts 1 token every this many steps


@dataclass
class _Acceptance:
    successes: float = 0.0
    trials: float = 0.0


@dataclass
class SpecPolicy:
    k: int
    # Exponentially weighted sums for the least-squares fit of step time on rows.
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0
    _propose_time: float = 0.0  # weighted proposer seconds and draft tokens made
    _proposed: float = 0.0
    total: _Acceptance = field(default_factory=_Acceptance)
    requests: dict[str, _Acceptance] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)  # steps without drafts since the last

    # ------------------------------------------------------------------ what is measured

    def observe_step(self, num_rows: int, seconds: float) -> None:
        """A decode-only step of `num_rows` rows took `seconds` (forward pass and sampling)."""
        if num_rows <= 0 or seconds <= 0:
            return
        d = DECAY
        self._w = d * self._w + 1
        self._x = d * self._x + num_rows
        self._y = d * self._y + seconds
        self._xx = d * self._xx + num_rows * num_rows
        self._xy = d * self._xy + num_rows * seconds

    def observe_proposal(self, seconds: float, num_drafts: int) -> None:
        """The proposer took `seconds` for `num_drafts` draft tokens this step."""
        self._propose_time = DECAY * self._propose_time + seconds
        self._proposed = DECAY * self._proposed + num_drafts

    def observe_verdict(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """Positions verified: the accepted ones, and the first rejected one if any."""
        trials = num_accepted + (1 if num_accepted < num_drafts else 0)
        for acc in (self.requests.setdefault(request_id, _Acceptance()), self.total):
            acc.successes += num_accepted
            acc.trials += trials

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.skipped.pop(request_id, None)

    # ------------------------------------------------------------------ the estimates

    def step_cost(self) -> tuple[float, float]:
        """(a, b) of t(T) = a + b·T; in the prior's units (a = 1) before any step is seen."""
        if self._w <= 0:
            return 1.0, PRIOR_ROW_COST
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var > 0.25:  # rows varied enough to fit a slope
            b = (self._xy / self._w - mx * my) / var
            a = my - b * mx
            if a > 0 and b >= 0:
                b = min(max(b, a / 1000), a)
                return a, b
        a = my / (1 + PRIOR_ROW_COST * mx)
        return a, a * PRIOR_ROW_COST

    def proposal_cost(self) -> float:
        """Seconds per draft token made (0 until measured)."""
        return self._propose_time / self._proposed if self._proposed > 0 else 0.0

    def acceptance(self, request_id: str) -> float:
        t = self.total
        prior = (t.successes + 1) / (t.trials + 2)
        r = self.requests.get(request_id)
        if r is None:
            return prior
        return (r.successes + PRIOR_WEIGHT * prior) / (r.trials + PRIOR_WEIGHT)

    # ------------------------------------------------------------------ the rule

    def num_drafts(self, request_id: str, batch: int) -> int:
        """Drafts for this request this step (0: decode one token) among `batch` decodes: the
        rule's, or a probe of 1 every PROBE_EVERY-th step the rule says 0."""
        k = self.best_drafts(request_id, batch)
        if k == 0:
            n = self.skipped.get(request_id, 0) + 1
            if n < PROBE_EVERY:
                self.skipped[request_id] = n
                return 0
            k = 1
        self.skipped[request_id] = 0
        return k

    def best_drafts(self, request_id: str, batch: int) -> int:
        """The k in 0..K with the largest E(k)·S - B·(b + c)·k (0 when none is positive)."""
        alpha = self.acceptance(request_id)
        a, b = self.step_cost()
        c = self.proposal_cost() if self._w > 0 else 0.0
        s = a + b * max(batch, 1)
        per_draft = max(batch, 1) * (b + c)
        best_k, best_gain = 0, 0.0
        expected = 0.0
        term = 1.0
        for k in range(1, self.k + 1):
            term *= alpha
            expected += term
            gain = expected * s - per_draft * k
            if gain > best_gain:
                best_k, best_gain = k, gain
        return best_k
