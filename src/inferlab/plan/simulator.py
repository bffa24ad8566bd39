"""`simulate`: the engine's real `Scheduler`, driven step by step on a virtual clock.

Each step: release the requests whose send time has come, `schedule()`, ask the cost model
how long that step's shape takes, advance the clock by it, sample dummy token ids (never
EOS unless `eos_probability` says so) and `update_from_output()`. What comes out is, per
request, the times a real client would have seen its tokens arrive, in the bench's own
`RequestRecord`s, so the bench's metrics and report apply unchanged. With a speculative config
the replies are fixed in advance and drafted from at a given acceptance (plan/sim_speculation.py).

Load follows the bench (`inferlab.bench.arrivals`): a closed loop of N clients
(rate inf, max concurrency N), or Poisson/gamma arrivals at a rate, optionally capped.
A request's send time is when it was released *and* a client slot was free; it reaches the
scheduler `request_latency_s` later (HTTP, tokenization) and waits there, so TTFT includes
queueing in the engine, as measured. Why a latency at all: a real engine starts its next step
the moment the last one ends, so a request sent when another finishes (a closed loop) is
never in that next step, however fast the network; with 0 it would be, and at c clients the
simulated prefill of the replacements lands one step early.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from inferlab.bench.arrivals import LoadSpec, arrival_offsets
from inferlab.bench.records import RequestRecord
from inferlab.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from inferlab.engine.outputs import ModelRunnerOutput
from inferlab.engine.request import Request, SamplingParams
from inferlab.engine.scheduler import Scheduler
from inferlab.engine.spec_decode import SpecDecodeStats
from inferlab.plan.cost_model import StepCostModel, shape_of
from inferlab.plan.sim_speculation import SimProposer, SimReplies, startup_step_cost


class VirtualClock:
    """The scheduler's clock: seconds since the simulation started, moved only by us."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class SimWorkload:
    """Fixed-length requests under a bench-style load."""

    num_prompts: int
    input_len: int
    output_len: int
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    shared_prefix_len: int = 0  # leading prompt tokens common to every request (prefix-cache hits)
    vocab_size: int = 32000
    eos_token_id: int = 0
    eos_probability: float = 0.0  # per sampled token; 0 = every reply runs to output_len
    seed: int = 0
    request_latency_s: float = 0.0  # from a client's send to the scheduler (HTTP, tokenization)

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"input and output lengths must be >= 1, got {self.input_len} and {self.output_len}")
        if not 0 <= self.shared_prefix_len <= self.input_len:
            raise ValueError(f"shared prefix ({self.shared_prefix_len}) must be in [0, input length {self.input_len}]")
        if self.vocab_size < 2:
            raise ValueError(f"vocab size must be >= 2, got {self.vocab_size}")
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError(f"EOS id {self.eos_token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        if not 0.0 <= self.eos_probability < 1.0:
            raise ValueError(f"EOS probability must be in [0, 1), got {self.eos_probability}")
        if not (self.request_latency_s >= 0.0 and math.isfinite(self.request_latency_s)):
            raise ValueError(f"request latency must be a finite number >= 0, got {self.request_latency_s}")
        LoadSpec(self.request_rate, self.burstiness, self.max_concurrency)  # validates the load

    @property
    def load(self) -> LoadSpec:
        return LoadSpec(self.request_rate, self.burstiness, self.max_concurrency)


@dataclass
class SimTrace:
    """One simulated request as its client saw it (times in simulated seconds)."""

    index: int
    request_id: str
    prompt_tokens: int
    release_time: float  # when the load generator released it
    send_time: float = math.nan  # when a client slot sent it (release, or later under a cap)
    token_times: list[float] = field(default_factory=list)
    end_time: float = math.nan
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0

    def to_record(self) -> RequestRecord:
        # Tokens of one step (a verification's accepted drafts) arrive in one chunk, as streamed.
        chunks = [(t, len(list(g))) for t, g in itertools.groupby(self.token_times)]
        return RequestRecord(
            index=self.index,
            send_time=self.send_time,
            end_time=self.end_time,
            chunk_times=[t for t, _ in chunks],
            chunk_tokens=[n for _, n in chunks],
            prompt_tokens=self.prompt_tokens,
            output_tokens=len(self.token_times),
            output_tokens_source="simulated",
        )


@dataclass
class StepRecord:
    """One simulated step, for plots and for checking the simulator itself."""

    start: float
    duration: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preempted: int


@dataclass
class SimResult:
    traces: list[SimTrace]
    steps: list[StepRecord]
    num_blocks: int
    block_size: int
    num_preemptions: int
    spec: SpecDecodeStats | None = None  # drafts and acceptance, when speculation was simulated

    @property
    def duration_s(self) -> float:
        """First send to last answer, as the bench counts it."""
        sends = [t.send_time for t in self.traces]
        ends = [t.end_time for t in self.traces]
        return max(ends) - min(sends) if self.traces else 0.0

    def records(self) -> list[RequestRecord]:
        return [t.to_record() for t in self.traces]

    @property
    def max_kv_cache_usage(self) -> float:
        return max((s.kv_cache_usage for s in self.steps), default=0.0)


def simulate(
    workload: SimWorkload,
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    num_blocks: int,
    cost_model: StepCostModel,
    max_steps: int = 10_000_000,
    speculative_config: SpeculativeConfig | None = None,
    acceptance: Sequence[float] = (0.5,),
) -> SimResult:
    """Run the workload to completion through the real Scheduler; see the module docstring.
    With `speculative_config`, drafts are right with `acceptance` per position (plan/sim_speculation.py)."""
    if num_blocks < 1:
        raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
    need = workload.input_len + workload.output_len
    if scheduler_config.max_model_len is not None and need > scheduler_config.max_model_len:
        raise ValueError(f"input + output = {need} tokens exceeds max_model_len {scheduler_config.max_model_len}")
    if -(-need // cache_config.block_size) > num_blocks:
        raise ValueError(f"one request of {need} tokens needs {-(-need // cache_config.block_size)} KV blocks; "
                         f"the cache has {num_blocks}")

    clock = VirtualClock()
    rng = np.random.default_rng(workload.seed)
    replies: SimReplies | None = None
    proposer: SimProposer | None = None
    if speculative_config is not None:
        replies = SimReplies(lambda n: _sample(rng, n, workload))
        proposer = SimProposer(replies, speculative_config.num_speculative_tokens, acceptance, workload.vocab_size,
                               workload.seed + 1)
    step_cost = None
    if speculative_config is not None and speculative_config.adaptive:
        step_cost = startup_step_cost(cost_model, workload.input_len + workload.output_len // 2,
                                      scheduler_config.max_num_seqs)
    sched = Scheduler(scheduler_config, cache_config, num_blocks, clock=clock,
                      speculative_config=speculative_config, proposer=proposer, step_cost=step_cost)
    releases = arrival_offsets(workload.num_prompts, workload.load, workload.seed)
    prefix = _token_ids(rng, workload.shared_prefix_len, workload)
    traces: list[SimTrace] = []
    by_id: dict[str, SimTrace] = {}
    pending: deque[int] = deque(range(workload.num_prompts))
    # Client slots as a heap of the times each became free (all free at 0); None = no cap.
    slots: list[float] | None = None
    if workload.max_concurrency is not None:
        slots = [0.0] * workload.max_concurrency
    # Sent but not yet at the scheduler: (arrival at the engine, index, request), a heap.
    in_flight: list[tuple[float, int, Request]] = []
    steps: list[StepRecord] = []
    done = 0
    idle_steps = 0

    def release_due() -> None:
        while pending and releases[pending[0]] <= clock.now + 1e-12:
            if slots is not None and not slots:
                break
            i = pending.popleft()
            send = float(releases[i])
            if slots is not None:
                send = max(send, heapq.heappop(slots))
            rid = f"sim-{i}"
            prompt = prefix + _token_ids(rng, workload.input_len - workload.shared_prefix_len, workload)
            trace = SimTrace(i, rid, workload.input_len, float(releases[i]), send_time=send)
            traces.append(trace)
            by_id[rid] = trace
            heapq.heappush(in_flight, (send + workload.request_latency_s, i, Request(
                request_id=rid,
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=workload.output_len, temperature=0.0),
                eos_token_ids=(workload.eos_token_id,),
                arrival_time=send,
            )))
        while in_flight and in_flight[0][0] <= clock.now + 1e-12:
            sched.add_request(heapq.heappop(in_flight)[2])

    def next_event() -> float:
        """When something can next arrive at an idle engine: a request in flight, or a release
        (only while a client slot is free; else the releases wait for a finish)."""
        times = [in_flight[0][0]] if in_flight else []
        if pending and (slots is None or slots):
            times.append(float(releases[pending[0]]))
        if not times:  # pragma: no cover - an idle engine with nothing in flight has a free slot
            raise AssertionError("the simulation has nothing left to wait for")
        return min(times)

    for _ in range(max_steps):
        if done == workload.num_prompts:
            break
        release_due()
        if not sched.has_unfinished_requests():
            # Idle: jump to the next arrival.
            clock.now = max(clock.now, next_event())
            continue
        so = sched.schedule()
        if so.is_empty:
            # One empty step follows a self-preemption; two in a row means nothing can ever run.
            idle_steps += 1
            if idle_steps > 2:
                raise ValueError(f"the scheduler cannot make progress with {num_blocks} KV blocks of "
                                 f"{cache_config.block_size} tokens")
            continue
        idle_steps = 0
        shape = shape_of(so)
        dt = cost_model.step_time(shape)
        start = clock.now
        clock.now += dt
        ids = [s.request_id for s in so.scheduled if s.sample]
        if replies is None:
            runner_out = ModelRunnerOutput(ids, _sample(rng, len(ids), workload), step_time=dt)
        else:
            got = {s.request_id: replies.verify(s) for s in so.scheduled if s.sample}
            runner_out = ModelRunnerOutput(ids, [got[r][0] for r in ids], step_time=dt, spec_token_ids={
                s.request_id: got[s.request_id] for s in so.scheduled if s.sample and s.num_draft_tokens})
        outs = sched.update_from_output(so, runner_out)
        for out in outs:
            trace = by_id[out.request_id]
            trace.token_times.extend([clock.now] * len(out.new_token_ids))
            trace.num_preemptions = out.num_preemptions
            trace.num_cached_tokens = out.num_cached_tokens
            if out.finish_reason is not None:
                trace.end_time = clock.now
                trace.finish_reason = out.finish_reason
                done += 1
                if slots is not None:
                    heapq.heappush(slots, clock.now)
        stats = sched.get_stats()
        steps.append(StepRecord(start, dt, shape.num_prefill_tokens, shape.num_decode_tokens, stats.num_running,
                                stats.num_waiting, stats.kv_cache_usage, len(so.preempted_request_ids)))
    else:
        raise ValueError(f"the simulation did not finish within {max_steps} steps")

    traces.sort(key=lambda t: t.index)
    return SimResult(traces, steps, num_blocks, cache_config.block_size, sched.get_stats().num_preemptions,
                     spec=sched.spec_stats if speculative_config is not None else None)


def _token_ids(rng: np.random.Generator, n: int, w: SimWorkload) -> list[int]:
    """n random ids, never EOS: drawn from vocab − 1 values, shifted past the EOS id."""
    ids = rng.integers(0, w.vocab_size - 1, size=n)
    ids = np.where(ids >= w.eos_token_id, ids + 1, ids)
    return ids.tolist()


def _sample(rng: np.random.Generator, n: int, w: SimWorkload) -> list[int]:
    ids = _token_ids(rng, n, w)
    if w.eos_probability > 0:
        hits = rng.random(n) < w.eos_probability
        ids = [w.eos_token_id if h else t for t, h in zip(ids, hits)]
    return ids
