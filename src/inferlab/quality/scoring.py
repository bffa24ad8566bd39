"""Chunks through the engine: each chunk one request (max_tokens=1, prompt logprobs from its
prefill), `chunks_per_step` of them per `LLM.generate` call so that a call is one engine step
of many chunks (llama-perplexity's n_seq = n_batch / n_ctx sequences per pass)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from inferlab.engine.request import SamplingParams
from inferlab.quality.perplexity import Chunking, scored_nll


@dataclass
class ChunkScore:
    index: int  # 0-based chunk number
    nll: np.ndarray  # float64 [scored_per_chunk]: the scored tokens' NLL
    targets: np.ndarray  # int64 [scored_per_chunk]: the scored tokens
    rows: np.ndarray | None  # float32 [scored_per_chunk, vocab]: whole log-softmax rows when asked


def score_chunks(llm, chunks: list[list[int]], chunking: Chunking, chunks_per_step: int,
                 whole_rows: bool = False) -> Iterator[ChunkScore]:
    """Yield every chunk's scores in order. whole_rows: also the log-softmax rows of the scored
    positions (prompt_logprobs=-1), for the KL divergence; else only the tokens' logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=-1 if whole_rows else 0)
    lo, hi = chunking.first, chunking.n_ctx - 1  # rows lo .. hi-1 predict tokens lo+1 .. hi
    for a in range(0, len(chunks), chunks_per_step):
        wave = chunks[a : a + chunks_per_step]
        outs = llm.generate(wave, params, use_prefix_cache=False)
        for i, (chunk, out) in enumerate(zip(wave, outs)):
            rows = out.prompt_logprob_rows[lo:hi] if whole_rows else None
            targets = np.asarray(chunk[lo + 1 : hi + 1], dtype=np.int64)
            yield ChunkScore(a + i, scored_nll(out.prompt_logprobs, chunking), targets, rows)
