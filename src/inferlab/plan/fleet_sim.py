"""`inferlab simulate --replicas N --router POLICY`: a fleet of simulated replicas behind the
router's own scoring core, on one virtual clock.

Each replica is the engine's real `Scheduler` and prefix cache (as in simulator.py) with a
step cost model; the router is `router.fleet.Fleet` with the chosen policy, its tickets, its
prefix index fed by each replica's KV events (the block pool's own `KVEventLog`, followed
through `KVSync` every `kv_poll_s`, as `inferlab router` polls GET /kv_events) and its
speculative entries. Discrete events, in time order:

    a request reaches the router (its send time + request_latency_s)
        → Fleet.route → dispatch (ticket) → the replica's inbox; an idle replica starts a step
    a replica's step ends (start + cost model's time for its shape)
        → update_from_output: tokens to the traces, first token / finish to the Fleet
        → the inbox into the scheduler, the next step starts at once if there is work

The workload: K system prompts of `shared_prefix_len` tokens (one per request, at random) and a
private tail, as the router benchmark sends; the session key is the system prompt's number.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from inferlab.bench.arrivals import arrival_offsets
from inferlab.config import CacheConfig, SchedulerConfig
from inferlab.engine.kv_events import KVEventLog
from inferlab.engine.outputs import ModelRunnerOutput, SchedulerOutput
from inferlab.engine.request import Request, SamplingParams
from inferlab.engine.scheduler import Scheduler
from inferlab.plan.cost_model import StepCostModel, shape_of
from inferlab.plan.simulator import SimTrace, SimWorkload, VirtualClock, _sample, _token_ids
from inferlab.router.fleet import Fleet
from inferlab.router.policies import Policy, make_policy
from inferlab.router.replica import ReplicaInfo, Ticket


@dataclass
class _Replica:
    name: str
    sched: Scheduler
    log: KVEventLog
    inbox: list[Request] = field(default_factory=list)
    step: SchedulerOutput | None = None  # in flight
    step_dt: float = 0.0
    requests: int = 0


@dataclass
class FleetSimResult:
    policy: str
    traces: list[SimTrace]
    per_replica: dict[str, int]  # requests routed to each
    reasons: dict[str, int]  # routing decisions by reason
    predicted_cached_tokens: int

    @property
    def duration_s(self) -> float:
        return max(t.end_time for t in self.traces) - min(t.send_time for t in self.traces)

    def summary(self) -> dict[str, float]:
        ttft = np.array([t.token_times[0] - t.send_time for t in self.traces]) * 1000.0
        prompt = sum(t.prompt_tokens for t in self.traces)
        cached = sum(t.num_cached_tokens for t in self.traces)
        out = sum(len(t.token_times) for t in self.traces)
        return {
            "requests": len(self.traces),
            "ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p95_ms": float(np.percentile(ttft, 95)),
            "cached_token_share": cached / prompt if prompt else 0.0,
            "predicted_cached_token_share": self.predicted_cached_tokens / prompt if prompt else 0.0,
            "output_throughput": out / self.duration_s if self.duration_s > 0 else math.inf,
            "duration_s": self.duration_s,
        }


def simulate_fleet(
    workload: SimWorkload,
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    num_blocks: int,
    cost_model: StepCostModel,
    *,
    replicas: int,
    policy: str | Policy,
    num_shared_prefixes: int = 1,
    kv_poll_s: float = 0.5,
    max_events: int = 10_000_000,
) -> FleetSimResult:
    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    if num_shared_prefixes < 1:
        raise ValueError(f"--shared-prefixes must be >= 1, got {num_shared_prefixes}")
    need = workload.input_len + workload.output_len
    if -(-need // cache_config.block_size) > num_blocks:
        raise ValueError(f"one request of {need} tokens needs more than the {num_blocks} KV blocks of a replica")
    clock = VirtualClock()
    names = [f"replica-{i}" for i in range(replicas)]
    fleet = Fleet(names, make_policy(policy) if isinstance(policy, str) else policy, clock=clock)
    reps: dict[str, _Replica] = {}
    for n in names:
        sched = Scheduler(scheduler_config, cache_config, num_blocks, clock=clock)
        log = KVEventLog(block_size=cache_config.block_size)
        sched.kv_cache_manager.block_pool.events = log
        reps[n] = _Replica(n, sched, log)
        fleet.probe_ok(n, info=ReplicaInfo(block_size=cache_config.block_size,
                                           prefix_caching=cache_config.enable_prefix_caching,
                                           num_blocks=num_blocks, max_num_seqs=scheduler_config.max_num_seqs,
                                           known=True))  # fmt: skip

    rng = np.random.default_rng(workload.seed)
    releases = arrival_offsets(workload.num_prompts, workload.load, workload.seed)
    prefixes = [_token_ids(rng, workload.shared_prefix_len, workload) for _ in range(num_shared_prefixes)]
    pending: deque[int] = deque(range(workload.num_prompts))
    slots: list[float] | None = [0.0] * workload.max_concurrency if workload.max_concurrency is not None else None
    traces: dict[str, SimTrace] = {}
    tickets: dict[str, Ticket] = {}
    arrivals: list[tuple[float, int, Request, int]] = []  # (at the router, index, request, prefix)
    reasons: dict[str, int] = {}
    predicted = 0
    done = 0
    last_poll = -math.inf

    def poll(force: bool = False) -> None:
        nonlocal last_poll
        if not force and clock.now - last_poll < kv_poll_s:
            return
        last_poll = clock.now
        for r in reps.values():
            kv = fleet.replicas[r.name].kv
            while True:
                if not kv.synced:
                    kv.apply_snapshot(r.log.snapshot())
                page = r.log.since(kv.seq, 10_000)
                if kv.apply_page(page) and len(page.events) < 10_000:
                    break

    def release_due() -> None:
        while pending and releases[pending[0]] <= clock.now + 1e-12:
            if slots is not None and not slots:
                break
            i = pending.popleft()
            send = float(releases[i]) if slots is None else max(float(releases[i]), heapq.heappop(slots))
            k = int(rng.integers(num_shared_prefixes)) if num_shared_prefixes > 1 else 0
            prompt = prefixes[k] + _token_ids(rng, workload.input_len - workload.shared_prefix_len, workload)
            rid = f"sim-{i}"
            traces[rid] = SimTrace(i, rid, workload.input_len, float(releases[i]), send_time=send)
            req = Request(request_id=rid, prompt_token_ids=prompt,
                          sampling_params=SamplingParams(max_tokens=workload.output_len, temperature=0.0),
                          eos_token_ids=(workload.eos_token_id,), arrival_time=send)  # fmt: skip
            heapq.heappush(arrivals, (send + workload.request_latency_s, i, req, k))

    def start_step(r: _Replica) -> None:
        for req in r.inbox:
            r.sched.add_request(req)
        r.inbox.clear()
        if r.step is not None or not r.sched.has_unfinished_requests():
            return
        so = r.sched.schedule()
        if so.is_empty:
            raise ValueError(f"a replica cannot make progress with {num_blocks} KV blocks")
        r.step, r.step_dt = so, cost_model.step_time(shape_of(so))
        heapq.heappush(steps, (clock.now + r.step_dt, r.name))

    steps: list[tuple[float, str]] = []  # (end time, replica)
    for _ in range(max_events):
        if done == workload.num_prompts:
            break
        release_due()
        t_arrival = arrivals[0][0] if arrivals else math.inf
        t_step = steps[0][0] if steps else math.inf
        if pending and (slots is None or slots):
            t_arrival = min(t_arrival, float(releases[pending[0]]))
        if t_arrival == math.inf and t_step == math.inf:  # pragma: no cover - nothing left to wait for
            raise AssertionError("the fleet simulation has nothing left to wait for")
        if t_arrival <= t_step:
            clock.now = max(clock.now, t_arrival)
            release_due()
            while arrivals and arrivals[0][0] <= clock.now + 1e-12:
                _, _, req, k = heapq.heappop(arrivals)
                poll()
                rr = fleet.request(req.prompt_token_ids, None, f"s{k}")
                d = fleet.route(rr)
                assert d is not None  # every simulated replica is always healthy
                reasons[d.reason] = reasons.get(d.reason, 0) + 1
                predicted += d.predicted_cached_tokens
                tickets[req.request_id] = fleet.dispatch(d, rr, streamed=True)
                r = reps[d.replica]
                r.requests += 1
                r.inbox.append(req)
                if r.step is None:
                    start_step(r)
            continue
        end, name = heapq.heappop(steps)
        clock.now = end
        r = reps[name]
        so, r.step = r.step, None
        assert so is not None
        ids = [s.request_id for s in so.scheduled if s.sample]
        outs = r.sched.update_from_output(so, ModelRunnerOutput(ids, _sample(rng, len(ids), workload), step_time=r.step_dt))
        for out in outs:
            trace = traces[out.request_id]
            ticket = tickets[out.request_id]
            if not trace.token_times and out.new_token_ids:
                fleet.first_token(ticket)
            trace.token_times.extend([clock.now] * len(out.new_token_ids))
            trace.num_cached_tokens = out.num_cached_tokens
            trace.num_preemptions = out.num_preemptions
            if out.finish_reason is not None:
                trace.end_time, trace.finish_reason = clock.now, out.finish_reason
                fleet.finish(ticket, "ok")
                done += 1
                if slots is not None:
                    heapq.heappush(slots, clock.now)
        start_step(r)
    else:
        raise ValueError(f"the fleet simulation did not finish within {max_events} events")

    ordered = sorted(traces.values(), key=lambda t: t.index)
    return FleetSimResult(policy if isinstance(policy, str) else policy.name, ordered, {n: r.requests for n, r in reps.items()}, reasons, predicted)


def render_table(results: list[FleetSimResult], replicas: int) -> list[str]:
    lines = [f"simulated fleet: {replicas} replicas (each the real scheduler and prefix cache on the step cost model)",
             f"{'policy':<13} {'TTFT p50 ms':>11} {'TTFT p95 ms':>11} {'cached share':>12} {'predicted':>9} "
             f"{'out tok/s':>10}  requests per replica"]  # fmt: skip
    for r in results:
        s = r.summary()
        spread = " ".join(str(v) for v in r.per_replica.values())
        lines.append(f"{r.policy:<13} {s['ttft_p50_ms']:>11.1f} {s['ttft_p95_ms']:>11.1f} "
                     f"{s['cached_token_share']:>12.1%} {s['predicted_cached_token_share']:>9.1%} "
                     f"{s['output_throughput']:>10.1f}  {spread}")  # fmt: skip
    return lines
