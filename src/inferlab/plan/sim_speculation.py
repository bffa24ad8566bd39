"""Speculative decoding in the simulator: drafts that are right as often as measured.

Each simulated request's reply is fixed in advance (drawn lazily, `SimReplies`): the simulated
sampler emits it, and `SimProposer` drafts from it, right at draft position j with probability
α_j given the drafts before it were right (the acceptance per position that `inferlab bench`
reports and `vllm:spec_decode_*` counts), and wrong from the first miss on. So the engine's own
scheduler, its "when it pays" rule (shadow probes included) and greedy verification
(`accept_greedy`) run unchanged; the step's time is the cost model's, drafts counted as decode
rows. The rule starts from the step cost the engine measures at start-up, here read off the cost
model (`startup_step_cost`). The proposer's own time is not modelled (the virtual clock does not
move while it runs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from inferlab.engine.outputs import ScheduledRequest
from inferlab.engine.request import Request
from inferlab.engine.spec_decode import accept_greedy
from inferlab.engine.spec_policy import measured_step_cost
from inferlab.plan.cost_model import StepCostModel
from inferlab.plan.roofline import StepShape

STARTUP_ROWS = 32  # the larger of the engine's two start-up row counts (llm_engine.py _measure_step_cost)


def parse_acceptance(text: str) -> tuple[float, ...]:
    """'0.8' or '0.8,0.9,0.9': α per draft position, the last one repeating for the rest."""
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--spec-acceptance: comma-separated numbers in [0, 1], got {text!r}") from None
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise ValueError(f"--spec-acceptance: each value must be in [0, 1], got {text!r}")
    return values


class SimReplies:
    """Every request's reply token by token, drawn on first use by `draw(n)` (the simulator's
    dummy sampler, EOS included) and then fixed, so that drafts and samples agree on it."""

    def __init__(self, draw: Callable[[int], list[int]]) -> None:
        self._draw = draw
        self._replies: dict[str, list[int]] = {}

    def at(self, request_id: str, position: int) -> int:
        reply = self._replies.setdefault(request_id, [])
        if position >= len(reply):
            reply.extend(self._draw(position + 1 - len(reply)))
        return reply[position]

    def forget(self, request_id: str) -> None:
        self._replies.pop(request_id, None)

    def verify(self, s: ScheduledRequest) -> list[int]:
        """The tokens a sampling step for `s` yields: its reply's next token, or with drafts
        the accepted ones and the token after them."""
        pos = len(s.output_token_ids)
        k = s.num_draft_tokens
        targets = [self.at(s.request_id, pos + j) for j in range(k + 1)]
        return accept_greedy(s.draft_token_ids, targets) if k else targets


class SimProposer:
    """The scheduler's proposer (engine/spec_decode.Proposer) for the simulator."""

    def __init__(self, replies: SimReplies, k: int, acceptance: Sequence[float], vocab_size: int, seed: int) -> None:
        self.replies = replies
        self.k = k
        self.acceptance = tuple(acceptance)
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)

    def propose_requests(self, batch: list[tuple[Request, int]]) -> dict[str, list[int]]:
        out = {}
        for request, room in batch:
            pos = request.num_output_tokens
            drafts, right = [], True
            for j in range(min(self.k, room)):
                token = self.replies.at(request.request_id, pos + j)
                alpha = self.acceptance[min(j, len(self.acceptance) - 1)]
                right = right and self.rng.random() < alpha
                drafts.append(token if right else (token + 1) % self.vocab_size)
            out[request.request_id] = drafts
        return out

    def finish(self, request: Request) -> None:
        self.replies.forget(request.request_id)  # the scheduler calls this as the request ends


def startup_step_cost(cost: StepCostModel, context: int, max_num_seqs: int) -> tuple[float, float] | None:
    """(a, b) of the decode step's a + b·rows as the engine measures it at start-up (decode steps
    of 1 row and of up to 32), here on the cost model's clock at `context` tokens, for the rule
    (engine/spec_policy.py); None when the model's decode steps do not grow with rows (a constant
    cost): the rule then keeps its prior, as an engine whose measure failed does. Without it the
    simulated rule priced a row at 1/16 of the step whatever the cost model said."""
    def t(rows: int) -> float:
        return cost.step_time(StepShape.from_chunks([(context, 1, True)] * rows))

    rows = min(max_num_seqs, STARTUP_ROWS)
    return measured_step_cost([(1, t(1)), (rows, t(rows))]) if rows > 1 else None
