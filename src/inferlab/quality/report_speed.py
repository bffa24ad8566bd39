"""Decode speed of the report's modes: one stream and N streams, offline, the modes taking turns.

Fixed prompts (seeded token ids, the same for every mode), greedy, ignore_eos, so every mode
decodes the same number of tokens. Decode tokens/s is what the streams produce after their first
token, over the time from the first first-token to the last token: the engine's token budget
(LLM's max_num_batched_tokens) must take every prompt at once (in as many pieces as the
scheduler cuts it into, the same for every stream), so that all streams finish their prefill in
the same step and the span holds decode steps only (speed_run checks the budget). The median of
`runs` rounds is reported, with every round's figure.

The modes take turns (`alternated_speeds`): round r builds every mode's engine in turn (the order
reversed every other round), runs its one-stream and N-stream runs and frees it, so a spell of
host load lands on every mode alike. Measured mode after mode, a spell inverted two rows of one
report (a bfloat16 K/V cache 752 against float16's 952 tok/s at 32 streams, where alternated
runs in one process put bfloat16 at or above float16). Rebuilding keeps one model in memory at
a time; a build's first N-stream run pays the prefill outside the timed span (the span starts
at the first first-token).
"""

from __future__ import annotations

import gc
import statistics
import time
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


def speed_run(llm, settings: SpeedSettings) -> tuple[float, float]:
    """One one-stream and one N-stream run on a built engine: their decode tokens/s."""
    budget = llm.engine.scheduler_config.max_num_batched_tokens
    if budget < settings.tokens_per_step or llm.engine.max_num_seqs < settings.streams:
        raise ValueError(f"the engine takes {budget} tokens and {llm.engine.max_num_seqs} sequences per step; "
                         f"the speed runs need {settings.tokens_per_step} and {settings.streams}")
    prompts = fixed_prompts(settings.streams, settings.prompt_tokens, llm.engine.model_config.vocab_size)
    decode_tokens_per_second(llm, [prompts[0][:8]], 4)  # a fresh engine's first steps, untimed
    one = decode_tokens_per_second(llm, prompts[:1], settings.output_tokens)
    return one, decode_tokens_per_second(llm, prompts, settings.output_tokens)


def alternated_speeds(labels: list[str], build: Callable[[str], object], settings: SpeedSettings,
                      on_run: Callable[[], object] | None = None) -> tuple[dict[str, Speed], dict[str, float]]:
    """Every mode's Speed (medians of settings.runs rounds) and its seconds (builds included):
    each round builds, runs and frees every mode's engine in turn, the order reversed every
    other round (see the module docstring). on_run() after each run (progress)."""
    one: dict[str, list[float]] = {k: [] for k in labels}
    many: dict[str, list[float]] = {k: [] for k in labels}
    seconds = dict.fromkeys(labels, 0.0)
    for r in range(settings.runs):
        for label in labels if r % 2 == 0 else labels[::-1]:
            t0 = time.perf_counter()
            llm = build(label)
            a, b = speed_run(llm, settings)
            del llm
            gc.collect()
            one[label].append(a)
            many[label].append(b)
            seconds[label] += time.perf_counter() - t0
            if on_run:
                on_run()
                on_run()
    speeds = {k: Speed(statistics.median(one[k]), statistics.median(many[k]), one[k], many[k]) for k in labels}
    return speeds, seconds
