"""Perplexity the way llama.cpp's `llama-perplexity` measures it, so the numbers compare.

The text's tokens are cut into chunks of n_ctx; chunk i is tokens [i*n_ctx, (i+1)*n_ctx), its
first token replaced by BOS when the vocabulary adds one. Only the second half of each chunk
is scored, so every scored token has at least n_ctx/2 tokens of context: the logits at
positions first .. n_ctx-2 (first = n_ctx // 2) predict tokens first+1 .. n_ctx-1, that is
n_ctx - 1 - first tokens per chunk. PPL = exp(mean NLL); its ± is the standard error of the
mean NLL, sqrt((E[nll²] - E[nll]²) / (n - 1)), carried through exp (times PPL).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


class TextTooShortError(ValueError):
    """The text has fewer than two contexts of tokens."""


@dataclass(frozen=True)
class Chunking:
    n_ctx: int
    n_chunks: int

    @property
    def first(self) -> int:
        """The first position whose logits are scored (they predict position first + 1)."""
        return self.n_ctx // 2

    @property
    def scored_per_chunk(self) -> int:
        return self.n_ctx - 1 - self.first


def make_chunks(tokens: list[int], n_ctx: int, max_chunks: int | None = None,
                bos_token_id: int | None = None) -> tuple[Chunking, list[list[int]]]:
    """The chunks llama-perplexity evaluates; bos_token_id (when the vocabulary adds BOS)
    replaces each chunk's first token. Refuses texts shorter than 2 * n_ctx tokens."""
    if n_ctx < 4:
        raise ValueError(f"the context (-c) must be at least 4 tokens, got {n_ctx}")
    if len(tokens) < 2 * n_ctx:
        raise TextTooShortError(
            f"the text has {len(tokens)} tokens; perplexity with a context of {n_ctx} needs at least "
            f"{2 * n_ctx} (two contexts)"
        )
    n = len(tokens) // n_ctx
    if max_chunks is not None and max_chunks > 0:
        n = min(n, max_chunks)
    chunks = []
    for i in range(n):
        chunk = list(tokens[i * n_ctx : (i + 1) * n_ctx])
        if bos_token_id is not None:
            chunk[0] = bos_token_id
        chunks.append(chunk)
    return Chunking(n_ctx, n), chunks


def scored_nll(prompt_logprobs: list, chunking: Chunking) -> np.ndarray:
    """The NLL of each scored token of one chunk from its vLLM-shaped prompt logprobs
    (entry p holds the logprob of prompt token p, predicted from tokens 0 .. p-1)."""
    out = np.empty(chunking.scored_per_chunk, dtype=np.float64)
    for j, p in enumerate(range(chunking.first + 1, chunking.n_ctx)):
        entry = prompt_logprobs[p]
        out[j] = -next(iter(entry.values())).logprob  # the prompt token comes first
    return out


@dataclass
class PerplexityAccumulator:
    """Running sums of NLL and NLL² over the scored tokens."""

    nll: float = 0.0
    nll2: float = 0.0
    count: int = 0

    def add(self, nll: np.ndarray) -> None:
        nll = np.asarray(nll, dtype=np.float64)
        self.nll += float(nll.sum())
        self.nll2 += float((nll * nll).sum())
        self.count += int(nll.size)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def ppl_error(self) -> float:
        """PPL × the standard error of the mean NLL; NaN when undefined (one token, zero spread)."""
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        if var <= 0 or self.count < 2:
            return float("nan")
        return self.ppl * math.sqrt(var / (self.count - 1))
