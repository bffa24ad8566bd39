"""Speculative decoding's bookkeeping: greedy verification of drafts and the acceptance counts.

Pure Python, no torch: the runner verifies with it, the scheduler counts with it (and the
planner's simulator can). Greedy verification is exact: a draft is kept only where it equals
the target model's argmax at its position, so the tokens out are the tokens that decoding one
at a time would have produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def accept_greedy(drafts: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens one verification step yields: the longest prefix of `drafts` equal to the
    argmax `targets` at the same positions, then the target after it (the correction, or the
    bonus token when every draft is accepted). targets[j] is the argmax after draft j - 1
    (targets[0]: after the last real token), so len(targets) == len(drafts) + 1."""
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

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request-step's verdict: `num_accepted` of its `num_draft_tokens` drafts kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification step: 1 (the target's own token) + accepted drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
