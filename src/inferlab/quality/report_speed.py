"""Decode speed of an engine already built for the report: one stream and N streams, offline.

Fixed prompts (seeded token ids, the same for every mode), greedy, ignore_eos, so every mode
decodes the same number of tokens. Decode tokens/s is what the streams produce after their first
token, over the time from the first first-token to the last token: the engine's token budget
(LLM's max_num_batched_tokens) must take every prompt at once (in as many pieces as the
scheduler cuts it into, the same for every stream), so that all streams finish their prefill in
the same step and the span holds decode steps only (measure_speed checks the budget). The median of `runs` runs is reported, with the runs.
Every run uses the same prompts through the prefix cache, so only the first run pays the prefill
(4,096 tokens at 32 x 128, the bulk of a run's time on a small CPU) and the rest decode at once;
decode reads the same K/V either way.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from inferlab.engine.request import SamplingParams


@dataclass(frozen=True)
class SpeedSettings:
    streams: int = 32  # the concurrent run's stream count (the one-stream run is always there too)
    prompt_tokens: int = 128
    output_tokens: int = 64
    runs: int = 3

    def __post_init__(self) -> None:
        if self.streams < 1 or self.prompt_tokens < 1 or self.output_tokens < 2 or self.runs < 1:
            raise ValueError("--streams, --prompt-tokens and --speed-runs must be >= 1, --output-tokens >= 2")

    @property
    def tokens_per_step(self) -> int:
        """The token budget that prefills every stream's prompt in one step."""
        return self.streams * self.prompt_tokens


@dataclass
class Speed:
    one_stream: float  # decode tokens/s, medians
    streams: float
    one_stream_runs: list[float] = field(default_factory=list)
    streams_runs: list[float] = field(default_factory=list)


def fixed_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    low = min(100, max(vocab - 1, 1))
    return [torch.randint(low, vocab, (length,), generator=g).tolist() for _ in range(n)]


def decode_tokens_per_second(llm, prompts: list[list[int]], output_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_prefix_cache=True)
    first = min(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.last_token_time for o in outs)
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    return tokens / (last - first) if last > first else float("nan")


def measure_speed(llm, settings: SpeedSettings, on_run: Callable[[], object] | None = None) -> Speed:
    """Medians of settings.runs one-stream and N-stream runs; on_run() after each run (progress)."""
    budget = llm.engine.scheduler_config.max_num_batched_tokens
    if budget < settings.tokens_per_step or llm.engine.max_num_seqs < settings.streams:
        raise ValueError(f"the engine takes {budget} tokens and {llm.engine.max_num_seqs} sequences per step; "
                         f"the speed runs need {settings.tokens_per_step} and {settings.streams}")
    vocab = llm.engine.model_config.vocab_size
    one, many = [], []
    prompts = fixed_prompts(settings.streams, settings.prompt_tokens, vocab)
    for _ in range(settings.runs):
        one.append(decode_tokens_per_second(llm, prompts[:1], settings.output_tokens))
        if on_run:
            on_run()
        many.append(decode_tokens_per_second(llm, prompts, settings.output_tokens))
        if on_run:
            on_run()
    return Speed(statistics.median(one), statistics.median(many), one, many)
