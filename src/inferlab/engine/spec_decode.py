"""Speculative decoding's bookkeeping: verification of deterministic drafts and the acceptance counts.

Pure Python, no torch: the runner verifies with it, the scheduler counts with it (and the
planner's simulator can).

Verification samples the target at every draft position (row j as if drafts 0..j-1 were the
request's tokens: `position_rows`) and keeps drafts while each equals the target's token there.
Greedy, that is argmax verification: the tokens out are the ones decoding one at a time gives.
With temperature > 0 it is rejection sampling (Leviathan et al., Chen et al.) for a proposal
that is one token with certainty (q = one-hot, as n-gram and suffix drafts are): draft x is
accepted with probability p(x) (the sampled y equals x), and a rejected one is replaced by y,
which given y != x is distributed as p with x removed and renormalised: the residual
max(0, p - q) / (1 - p(x)). So every output token is distributed as the sampler's p (after
logit bias, penalties, temperature, top-k/top-p/min-p: the sampler makes it), and a seeded
request draws the same uniform at output position m as without drafts: the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from inferlab.engine.outputs import ScheduledRequest
from inferlab.engine.request import Request


class Proposer(Protocol):
    """What the scheduler asks for drafts: n-gram and suffix (pure Python) or a draft model
    (the engine builds that one; the scheduler sees only this)."""

    def propose_requests(self, batch: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Drafts for each (request in decode, at most this many): request id → drafts
        (absent or [] for none). One call per step, so a draft model runs the batch at once."""
        ...

    def finish(self, request: Request) -> None:
        """The request left (finished or aborted): drop its state (a suffix proposer keeps its
        output for others)."""
        ...


def position_rows(s: ScheduledRequest) -> list[ScheduledRequest]:
    """The sampler's rows for a request with k drafts: 1 + k views, row j with the drafts
    before it as output tokens, so that penalties, min_tokens and a seed's per-position
    uniform see what they would if those drafts had been sampled (and the target at row j is
    the one decoding one at a time would meet when they are accepted); a grammar's mask at row
    j is its state after drafts 0..j-1 (`draft_depth`)."""
    k = s.num_draft_tokens
    if not k:
        return [s]
    drafts = s.draft_token_ids
    out = list(s.output_token_ids)
    return [s] + [replace(s, output_token_ids=out + drafts[:j], draft_depth=j) for j in range(1, k + 1)]


def until_end(drafts: list[int], end_token_ids: frozenset[int]) -> list[int]:
    """The drafts before the first one that would end the reply. A draft that ends it is the
    token the row before it samples anyway (accepted or not, the reply ends the same step), and
    what follows it is never kept: rows spent for nothing (at the end of a reply that copied
    its prompt, the prompt goes on where the reply stops)."""
    for i, token in enumerate(drafts):
        if token in end_token_ids:
            return drafts[:i]
    return drafts


def accept_greedy(drafts: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens one verification step yields: the longest prefix of `drafts` equal to the
    `targets` sampled at the same positions (argmax when greedy), then the target after it (the
    correction, or the bonus token when every draft is accepted). targets[j] is the target after draft j - 1
    (targets[0]: after the last real token), so len(targets) == len(drafts) + 1. For sampled
    targets this is the rejection rule for one-hot proposals (the module's docstring)."""
    if len(targets) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} targets, got {len(targets)}")
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return list(targets[: a + 1])


@dataclass
class SpecDecodeStats:
    """Cumulative counts under vLLM's metric names (vllm:spec_decode_*)."""

    num_drafts: int = 0  # request-steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: drafts accepted at position j
    # [j]: verifications that had a draft at position j (drafts vary in length: the policy, suffix
    # confidence, the budget), so accepted_per_pos[j] / drafted_per_pos[j] is position j's rate.
    drafted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request-step's verdict: `num_accepted` of its `num_draft_tokens` drafts kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for counts, n in ((self.accepted_per_pos, num_accepted), (self.drafted_per_pos, num_draft_tokens)):
            counts.extend([0] * (num_draft_tokens - len(counts)))  # as long as the longest draft
            for j in range(n):
                counts[j] += 1
