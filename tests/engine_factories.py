"""Factories for the bookkeeping-core tests: requests, schedulers, hand-made runner outputs.

Pure Python (no torch), so the scheduler tests run the real classes on the CPU in milliseconds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from inferlab.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from inferlab.engine.outputs import ModelRunnerOutput, SchedulerOutput
from inferlab.engine.request import Request, SamplingParams
from inferlab.engine.scheduler import Scheduler

EOS = 2  # the eos token id of make_request's requests


class FakeClock:
    """A clock the test moves by hand: timestamps without wall-clock dependence."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float = 1.0) -> None:
        self.now += seconds


def make_request(
    request_id: str | int = "r0",
    prompt_token_ids: Sequence[int] | None = None,
    *,
    num_prompt_tokens: int = 8,
    first_token: int = 1000,
    max_tokens: int | None = 16,
    min_tokens: int = 0,
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    eos_token_ids: tuple[int, ...] = (EOS,),
    cache_salt: str | None = None,
    use_prefix_cache: bool = True,
    max_model_len: int | None = None,
    arrival_time: float = 0.0,
) -> Request:
    """A request; without explicit ids the prompt is `first_token, first_token+1, ...`
    (distinct `first_token`s give prompts that share no prefix)."""
    if prompt_token_ids is None:
        prompt_token_ids = list(range(first_token, first_token + num_prompt_tokens))
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
    )
    return Request(
        request_id=str(request_id),
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=params,
        eos_token_ids=eos_token_ids,
        arrival_time=arrival_time,
        cache_salt=cache_salt,
        use_prefix_cache=use_prefix_cache,
        max_model_len=max_model_len,
    )


def make_requests(n: int, num_prompt_tokens: int = 8, **kwargs) -> list[Request]:
    """`n` requests with disjoint prompts, ids "0".."n-1"."""
    return [
        make_request(str(i), num_prompt_tokens=num_prompt_tokens, first_token=1000 * (i + 1), **kwargs)
        for i in range(n)
    ]


def make_scheduler(
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    block_size: int = 4,
    num_blocks: int = 64,
    enable_prefix_caching: bool = True,
    clock: FakeClock | None = None,
    speculative_config: SpeculativeConfig | None = None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        num_blocks,
        clock=clock or FakeClock(),
        speculative_config=speculative_config,
    )


def make_runner_output(
    scheduler_output: SchedulerOutput, tokens: int | Mapping[str, int] = 7
) -> ModelRunnerOutput:
    """What a runner would return: one token per request whose chunk samples.

    `tokens` is one token for all, or a per-request-id mapping (missing ids get 7).
    """
    ids = [s.request_id for s in scheduler_output.scheduled if s.sample]
    if isinstance(tokens, int):
        sampled = [tokens] * len(ids)
    else:
        sampled = [tokens.get(rid, 7) for rid in ids]
    return ModelRunnerOutput(request_ids=ids, sampled_token_ids=sampled)


def scheduled_tokens(scheduler_output: SchedulerOutput) -> dict[str, int]:
    """request id → number of tokens scheduled this step."""
    return {s.request_id: len(s.token_ids) for s in scheduler_output.scheduled}


def step(scheduler: Scheduler, tokens: int | Mapping[str, int] = 7):
    """One engine step with a fake runner: (SchedulerOutput, list[EngineCoreOutput])."""
    out = scheduler.schedule()
    core_outputs = scheduler.update_from_output(out, make_runner_output(out, tokens))
    scheduler.kv_cache_manager.block_pool.check_integrity()
    return out, core_outputs


def shared_prefix_requests(rng, n: int, prefix_len: int, max_tail: int, max_tokens: int) -> list[Request]:
    """`n` requests whose prompts start with a random cut of one of three random bases (so
    prefixes are shared at every length) plus a random tail; 1..max_tokens-1 tokens out each."""
    bases = [[rng.randrange(10, 500) for _ in range(prefix_len)] for _ in range(3)]
    reqs = []
    for i in range(n):
        base = bases[rng.randrange(3)]
        prompt = base[: rng.randrange(1, prefix_len)] + [rng.randrange(10, 500) for _ in range(rng.randrange(0, max_tail))]
        reqs.append(make_request(str(i), prompt or [10], max_tokens=rng.randrange(1, max_tokens)))
    return reqs

