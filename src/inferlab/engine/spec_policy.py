"""When speculation pays: per request and step, how many drafts (0..K) to verify.

Drafts are not free: each is one more row of the step for every request in it, and proposing
costs time (a draft model's passes, a suffix search). They pay when the tokens they are
expected to add outweigh the time they add. The rule, with measured numbers:

- the step cost: t(T) = a + b·T for a decode step of T rows (the decodes and their drafts),
  fitted by exponentially weighted least squares over the engine's own decode steps (prefill
  steps are left out: a prompt token costs more than a decode row). A slope needs rows that
  vary (a standard deviation of at least a quarter of their mean). While they do not (32
  streams in lock step: every step 32 rows, a few more when drafts ride along), a is the fixed
  part the engine measured at start-up (llm_engine.py `_measure_step_cost`: decode steps of 1
  and of up to 32 rows) and b what the measured steps cost beyond it per row, their real
  contexts' attention included, never a smaller share of a than the start-up b / a (the line
  always through the steps' measured mean). Before, b / a was a prior 1/16
  (a Zen 5's): on a 2-core Zen 4 a row costs ~1/8 of a (8 ms + 1.05 ms x 32 rows at ~250-token
  contexts), 32 rows looked cheap, and drafts at 32 streams kept 89% of the time lost 2%. b is
  the verify cost of a draft: a row through every layer, the lm_head and the sampler;
- the proposal cost c per draft token: the proposer's measured time over the drafts it made
  (so a proposer that is asked often and finds little is charged for its misses);
- a request's acceptance per position: α_j, the chance draft j is kept given drafts 1..j-1
  were, each from its own verdicts (successes over trials at that position) with the
  engine-wide rate at that position as a prior of weight 2 (a chat workload whose drafts are
  rejected starts new requests low). Per position and not one α: copying is all or nothing
  (a copy's second draft is kept nearly always when its first was), chat's first draft is
  the likeliest; one α would undercount the first and overcount the second. The engine-wide
  rate at a position is itself centred on the position before (a position not yet drafted, as
  after one-token probes, is expected to go like the last one seen);
- k drafts are expected to add E(k) = α_1 + α_1·α_2 + ... + α_1···α_k tokens.

With B requests in decode this step, S = a + b·B is the step without drafts: B tokens in S.
k drafts add E(k) tokens and (b + c)·k time; they pay iff (B + E(k)) / (S + (b + c)·k) > B / S,
that is E(k)·S > B·(b + c)·k. The policy picks the k in 1..K with the largest
E(k)·S - (1 + MARGIN)·B·(b + c)·k and drafts only if it is positive: drafts must beat the
step's own rate by MARGIN, because near the break-even the estimates' errors (acceptance that
drifts within a reply, a step cost that is not exactly linear in rows) make them a loss as
often as a gain, and at 32 streams that is where plain chat sits.

A step that carries prompt tokens (a prefill chunk beside the decodes) verifies no drafts. Such a
step is compute-bound: a draft's row there costs what a prompt token costs plus its logits,
more than the decode row it may save later, and it takes budget from the prompts (their first
tokens come later). Measured on the AVX2 path at 32 streams (code edits, 5,400 prompt tokens a
turn in three 1.3-3.4 s steps): drafts all accepted in those steps still cost 3.3-3.8 ms a row
against ~2.4 ms a decode row at 32 streams, and pushed prompt tokens into the next step; the
rule's step cost, fitted on decode-only steps, cannot see that. SGLang likewise speculates in
decode batches only.

A request the rule keeps from drafting still gets a probe now and then, so that its estimate
follows a reply that turns to copying (else a low start would never be revised). With a proposer
that is not a model (n-gram, suffix) a probe is a *shadow*: K drafts are proposed but not
scheduled, and checked against the tokens the request then decodes: the verdict a verification
would give (greedy exactly; sampled, a draft matches with probability p(draft), the rejection
rule's acceptance) at no row's cost, only the proposer's. Shadows come every PROBE_EVERY-th step,
less often where the proposer's measured time per request would take more than SHADOW_SHARE of the
step (up to every SHADOW_MAX-th: 32 streams with suffix decoding, where a probe's search costs
~0.3 ms between forward passes and drafting gains a percent or two at best on a CPU).
A draft model's probe is one real draft (its proposal is a model pass either way), spaced so
that probes cost at most PROBE_SHARE of the step time (every PROBE_EVERY-th step at one stream)
but come at least every PROBE_MAX-th step (the 64th at 32 streams). A new request's first probe
is staggered, so that even short replies at 32 streams probe. The engine-wide rates decay
(TOTAL_DECAY per verdict), so the prior follows a workload that changes. At one stream on a CPU
(b << a) almost any acceptance pays; at 32 streams a row costs about as much as the tokens it
might save, and only drafts accepted most of the time (copying) still pay.

Pure Python, no torch, no clock: the scheduler feeds it step times and verdicts.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

PRIOR_ROW_COST = 1 / 16  # b / a before anything is measured
SPREAD = 0.25  # a slope is fitted once the rows' standard deviation is this share of their mean
PRIOR_WEIGHT = 2.0  # trials the engine-wide acceptance counts for in a new request's estimate
DECAY = 0.98  # weight of the past per observed step in the cost fit
PROBE_EVERY = 16  # a request kept from drafting is probed every this many steps (shadows: exactly)
PROBE_SHARE = 0.005  # ... and at most this share of the step time goes to probes,
PROBE_MAX = 64  # ... but at least once in a reply of this many tokens
SHADOW_SHARE = 0.0025  # shadow probes: at most this share of the step time,
SHADOW_MAX = 128  # ... but at least every this many steps
TOTAL_DECAY = 0.995  # weight of the past per verdict in the engine-wide acceptance (the prior)
MARGIN = 0.2  # drafts must add tokens at (1 + MARGIN) x the step's own rate


def measured_step_cost(steps: list[tuple[int, float]]) -> tuple[float, float] | None:
    """(a, b) of t(T) = a + b·T through two groups of decode steps (rows, seconds), the smaller
    and the larger half of the row counts seen, each taken at its median step time and mean rows
    (medians: a few steps at start-up, and one slow one must not set the rule for good). None
    when the rows do not spread or the line is not a + b·T with a, b > 0."""
    if not steps:
        return None
    mid = (min(r for r, _ in steps) + max(r for r, _ in steps)) / 2
    low = [(r, t) for r, t in steps if r < mid]
    high = [(r, t) for r, t in steps if r >= mid]
    if not low or not high:
        return None
    r1, t1 = statistics.mean(r for r, _ in low), statistics.median(t for _, t in low)
    r2, t2 = statistics.mean(r for r, _ in high), statistics.median(t for _, t in high)
    if r2 - r1 < 1:
        return None
    b = (t2 - t1) / (r2 - r1)
    a = t1 - b * r1
    return (a, b) if a > 0 and b > 0 else None


@dataclass
class _Acceptance:
    """Per draft position j: verifications that reached j (drafts 1..j-1 kept) and kept j."""

    successes: list[float] = field(default_factory=list)
    trials: list[float] = field(default_factory=list)

    def add(self, num_drafts: int, num_accepted: int, decay: float = 1.0) -> None:
        if decay != 1.0:
            self.trials = [t * decay for t in self.trials]
            self.successes = [x * decay for x in self.successes]
        reached = min(num_accepted + 1, num_drafts)  # the kept ones, and the first rejected
        if len(self.trials) < reached:
            grow = reached - len(self.trials)
            self.trials.extend([0.0] * grow)
            self.successes.extend([0.0] * grow)
        for j in range(reached):
            self.trials[j] += 1
            if j < num_accepted:
                self.successes[j] += 1


def _blend(r: _Acceptance, j: int, prior: float) -> float:
    """α_j for a request: its own verdicts at position j over the engine-wide rate as a prior
    of PRIOR_WEIGHT trials (the prior alone where it never reached j)."""
    if j >= len(r.trials):
        return prior
    return (r.successes[j] + PRIOR_WEIGHT * prior) / (r.trials[j] + PRIOR_WEIGHT)


@dataclass
class SpecPolicy:
    k: int
    shadow_probes: bool = False  # probes proposed and checked against the decoded tokens, not verified
    row_cost_ratio: float = PRIOR_ROW_COST  # b / a while the rows do not vary: start-up's, then each fit's
    base_cost: float | None = None  # a in seconds, measured at start-up (see _fit)
    base_ratio: float = PRIOR_ROW_COST  # b / a measured at start-up: a row's least share of a (see _fit)
    # Exponentially weighted sums for the least-squares fit of step time on rows.
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0
    _propose_time: float = 0.0  # weighted proposer seconds, draft tokens made, requests asked for
    _proposed: float = 0.0
    _asked: float = 0.0
    total: _Acceptance = field(default_factory=_Acceptance)
    requests: dict[str, _Acceptance] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)  # steps without drafts since the last
    # Asked per request and step (32 times a step at 32 streams): kept until what they come from changes.
    _cost: tuple[float, float] | None = None
    _prior: list[float] | None = None
    _arrivals: int = 0  # requests seen, to stagger their first probes
    _shadows: dict[str, tuple[list[int], int]] = field(default_factory=dict)  # request → (drafts, matched so far)

    # ------------------------------------------------------------------ what is measured

    def observe_step(self, num_rows: int, seconds: float) -> None:
        """A decode-only step of `num_rows` rows took `seconds` (forward pass and sampling)."""
        if num_rows <= 0 or seconds <= 0:
            return
        d = DECAY
        self._cost = None
        self._w = d * self._w + 1
        self._x = d * self._x + num_rows
        self._y = d * self._y + seconds
        self._xx = d * self._xx + num_rows * num_rows
        self._xy = d * self._xy + num_rows * seconds

    def observe_proposal(self, seconds: float, num_drafts: int, num_requests: int = 1) -> None:
        """The proposer took `seconds` for `num_drafts` draft tokens to `num_requests` requests
        this step."""
        self._propose_time = DECAY * self._propose_time + seconds
        self._proposed = DECAY * self._proposed + num_drafts
        self._asked = DECAY * self._asked + num_requests

    def observe_verdict(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """Positions verified: the accepted ones, and the first rejected one if any."""
        self._shadows.pop(request_id, None)  # a verification says more than a pending shadow
        self._record(request_id, num_drafts, num_accepted)

    def _record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        self.requests.setdefault(request_id, _Acceptance()).add(num_drafts, num_accepted)
        self.total.add(num_drafts, num_accepted, TOTAL_DECAY)  # the prior follows the workload
        self._prior = None

    def observe_shadow(self, request_id: str, drafts: list[int]) -> None:
        """A shadow probe's drafts, proposed to follow the request's tokens as scheduled."""
        if drafts:
            self._shadows[request_id] = (list(drafts), 0)

    def observe_tokens(self, request_id: str, tokens: list[int]) -> None:
        """Tokens the request decoded, in order: a pending shadow is checked against them and,
        at its first mismatch or its end, counts as the verdict a verification would have given."""
        pending = self._shadows.get(request_id)
        if pending is None:
            return
        drafts, matched = pending
        for token in tokens:
            if token != drafts[matched]:
                break
            matched += 1
            if matched == len(drafts):
                break
        else:
            self._shadows[request_id] = (drafts, matched)
            return
        del self._shadows[request_id]
        self._record(request_id, len(drafts), matched)

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.skipped.pop(request_id, None)
        self._shadows.pop(request_id, None)

    # ------------------------------------------------------------------ the estimates

    def step_cost(self) -> tuple[float, float]:
        """(a, b) of t(T) = a + b·T; in the prior's units (a = 1) before any step is seen."""
        if self._cost is None:
            self._cost = self._fit()
        return self._cost

    def _fit(self) -> tuple[float, float]:
        r = self.row_cost_ratio
        if self._w <= 0:
            return 1.0, r
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var > max(0.25, (SPREAD * mx) ** 2):  # rows varied enough to fit a slope
            b = (self._xy / self._w - mx * my) / var
            a = my - b * mx
            if a > 0 and b >= 0:
                b = min(max(b, a / 1000), a)
                self.row_cost_ratio = b / a
                return a, b
        if self.base_cost is not None:
            # The fixed part (the weights read once) hardly moves with the contexts; what the rows
            # at this batch cost beyond it is what the steps measure, real contexts included (a
            # start-up measure attends to short shared ones). A row never costs a smaller share of
            # a than at start-up: in a faster spell both shrink. Either way the line goes through
            # the steps' mean. (The floor was the last slope fit's b / a, times a: after drafting
            # workloads fitted 0.48, 32-stream chat was modelled at 136 ms a step against 40
            # measured, and shadow probes came 3.4x as often as SHADOW_SHARE allows.)
            b = (my - self.base_cost) / mx
            if b >= self.base_ratio * self.base_cost:
                return self.base_cost, b
            a = my / (1 + self.base_ratio * mx)
            return a, self.base_ratio * a
        a = my / (1 + r * mx)
        return a, a * r

    def proposal_cost(self) -> float:
        """Seconds per draft token made (0 until measured)."""
        return self._propose_time / self._proposed if self._proposed > 0 else 0.0

    def acceptance(self, request_id: str) -> list[float]:
        """α_1..α_K for the request: at each position the chance a draft is kept given the ones
        before it were, its own record over the engine-wide one as a prior."""
        prior = self._prior_rates()
        r = self.requests.get(request_id)
        if r is None:
            return list(prior)
        return [_blend(r, j, p) for j, p in enumerate(prior)]

    def _prior_rates(self) -> list[float]:
        """The engine-wide rate per position, each centred on the one before it (the first on
        1/2): a position never drafted yet (probes draft one token) is expected to copy like the
        last seen."""
        if self._prior is None:
            t, self._prior, centre = self.total, [], 0.5
            for j in range(self.k):
                ts, tt = (t.successes[j], t.trials[j]) if j < len(t.trials) else (0.0, 0.0)
                centre = (ts + 2 * centre) / (tt + 2)
                self._prior.append(centre)
        return self._prior

    def _first_rate(self, request_id: str) -> float:
        """α_1 alone (acceptance()[0] without the rest)."""
        p = self._prior_rates()[0]
        r = self.requests.get(request_id)
        return p if r is None else _blend(r, 0, p)

    def expected(self, request_id: str) -> list[float]:
        """E(1)..E(K): tokens k drafts are expected to add."""
        out, kept, total = [], 1.0, 0.0
        for a in self.acceptance(request_id):
            kept *= a
            total += kept
            out.append(total)
        return out

    def probe_every(self, batch: int) -> int:
        """Steps between probes of a request kept from drafting: at least PROBE_EVERY, and so
        many that the batch's probes (batch / n rows a step) cost at most PROBE_SHARE of S, up
        to PROBE_MAX (a request that never probes would live on the prior alone)."""
        return self._spaced(batch, self.step_cost()[1])

    def shadow_every(self, batch: int) -> int:
        """Steps between shadow probes: the same spacing for what a shadow costs, one request's
        proposal at the proposer's measured time per request asked (no row), against
        SHADOW_SHARE of the step. Per request and not K x the time per draft made: a chat probe
        often finds fewer than K drafts, and its search costs the same. At 32 streams of chat
        with suffix decoding (~0.3 ms a probe between forward passes, 45 ms steps, 2-core Zen 4)
        the engine read 0.99 against plain decoding with nothing drafted and probes every 64th
        step (0.5% of the step's time allowed them): drafts pay there only when nearly all are
        kept, and a copy found a hundred steps late still has most of its reply ahead."""
        if self._w <= 0 or self._asked <= 0:
            return PROBE_EVERY
        return self._spaced(batch, self._propose_time / self._asked, SHADOW_SHARE, SHADOW_MAX)

    def _spaced(self, batch: int, probe_seconds: float, share: float = PROBE_SHARE, most: int = PROBE_MAX) -> int:
        a, b = self.step_cost()
        s = a + b * max(batch, 1)
        return min(most, max(PROBE_EVERY, math.ceil(max(batch, 1) * probe_seconds / (share * s))))

    # ------------------------------------------------------------------ the rule

    def plan(self, request_id: str, batch: int, prefill: bool = False) -> tuple[int, bool]:
        """(drafts, shadow) for this request this step among `batch` decodes: the rule's drafts
        to verify (0: decode one token); or, every probe_every(batch)-th step the rule says 0, a
        probe: (1, False), or with shadow probes (K, True): propose up to K, verify none, and
        report them to observe_shadow. A step that carries `prefill` verifies no drafts (a
        shadow may still be proposed): see the module's docstring."""
        return self.plan_step([request_id], batch, prefill)[0]

    def plan_step(self, request_ids: Sequence[str], batch: int, prefill: bool = False) -> list[tuple[int, bool]]:
        """plan() for each of the step's requests in decode, with what is the same for all of
        them worked out once: S, the cost of a draft, the probe spacing. And a bound settles a
        request the rule keeps from drafting without its full estimate: E(k) <= k·α_1 (every
        α <= 1), so no k pays while α_1·S <= (1 + MARGIN)·B·(b + c). At 32 streams of plain
        chat every request is such a one at every step: asked one by one, each with its full
        estimate, the plans (and the scheduler's room for each) took ~0.23 ms of a ~42 ms step
        on a 2-core Zen 4, half of what suffix decoding cost there with nothing drafted (the
        paired measure read 0.98); ~0.06 ms this way (1.00 on chat alone, 0.99 after copy /
        edit / code turns had filled the suffix corpus)."""
        s, per_draft = self._step_terms(batch)
        every = self.shadow_every(batch) if self.shadow_probes else self.probe_every(batch)
        out = []
        for rid in request_ids:
            k = 0
            if not prefill and self._first_rate(rid) * s > per_draft:
                k = self._best(rid, s, per_draft)
            if k:
                self.skipped[rid] = 0
                out.append((k, False))
            elif prefill and not self.shadow_probes:
                out.append((0, False))
            else:
                out.append(self._probe(rid, every))
        return out

    def _probe(self, request_id: str, every: int) -> tuple[int, bool]:
        """A request the rule keeps from drafting: a probe every `every`-th step, else nothing."""
        n = self.skipped.get(request_id)
        if n is None:  # a new request: probes staggered over the interval, not all at once
            n, self._arrivals = self._arrivals % every, self._arrivals + 1
        n += 1
        if n < every or request_id in self._shadows:
            self.skipped[request_id] = n
            return 0, False
        self.skipped[request_id] = 0
        return (self.k, True) if self.shadow_probes else (1, False)

    def num_drafts(self, request_id: str, batch: int) -> int:
        """Drafts to verify for this request this step (plan's, a shadow probe's being none)."""
        k, shadow = self.plan(request_id, batch)
        return 0 if shadow else k

    def best_drafts(self, request_id: str, batch: int) -> int:
        """The k in 0..K with the largest E(k)·S - (1 + MARGIN)·B·(b + c)·k (0 when none is
        positive)."""
        return self._best(request_id, *self._step_terms(batch))

    def _step_terms(self, batch: int) -> tuple[float, float]:
        """(S, (1 + MARGIN)·B·(b + c)): the step without drafts, and what a draft must repay."""
        a, b = self.step_cost()
        c = self.proposal_cost() if self._w > 0 else 0.0
        return a + b * max(batch, 1), (1 + MARGIN) * max(batch, 1) * (b + c)

    def _best(self, request_id: str, s: float, per_draft: float) -> int:
        best_k, best_gain = 0, 0.0
        for k, expected in enumerate(self.expected(request_id), start=1):
            gain = expected * s - per_draft * k
            if gain > best_gain:
                best_k, best_gain = k, gain
        return best_k
