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

Prefill/decode disaggregation (`Disaggregation`, `--disaggregate P:D`) is the same loop with
two pools. The router chooses among the P prefill replicas, which run each prompt with
max_tokens=1; when one samples a request's first token, the request's K/V (prompt tokens ×
bytes per token) goes over that replica's link, one transfer after another:

    start = max(first token, link free);  link free = start + bytes / bandwidth;
    lands = link free + latency

On landing the client sees the first token (it travels with the K/V) and the request joins the
decode replica with the fewest sequences, admitted by `Scheduler.add_computed_request` (blocks
for the prompt, next step a decode) at that replica's next step boundary, once its blocks allow.
So TTFT = queue + prefill + link queue + transfer, and a decode replica's steps carry no prompt
chunks (unless a preempted request is recomputed there).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inferlab.bench.arrivals import arrival_offsets
from inferlab.bench.metrics import DEFAULT_PERCENTILES, SLO, RunSummary, summarize
from inferlab.bench.records import RequestRecord
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


@dataclass(frozen=True)
class KVLink:
    """Each prefill replica's link to the decode pool: one transfer at a time."""

    gbit_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.gbit_per_s > 0 and math.isfinite(self.gbit_per_s)):
            raise ValueError(f"--kv-transfer-gbps must be a finite number > 0, got {self.gbit_per_s}")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"--kv-transfer-latency-ms must be a finite number >= 0, got {self.latency_s * 1e3}")

    @property
    def bytes_per_s(self) -> float:
        return self.gbit_per_s * 1e9 / 8.0

    def busy_time(self, num_bytes: float) -> float:
        """How long the link is occupied: bytes / bandwidth (the latency overlaps the next one)."""
        return num_bytes / self.bytes_per_s


@dataclass(frozen=True)
class Disaggregation:
    """Separate prefill and decode pools, and what moving a request's K/V between them costs."""

    prefill_replicas: int
    decode_replicas: int
    link: KVLink
    kv_bytes_per_token: float

    def __post_init__(self) -> None:
        if self.prefill_replicas < 1 or self.decode_replicas < 1:
            raise ValueError(f"--disaggregate P:D needs P >= 1 and D >= 1, got {self.prefill_replicas}:"
                             f"{self.decode_replicas}")
        if not self.kv_bytes_per_token > 0:
            raise ValueError(f"KV bytes per token must be > 0, got {self.kv_bytes_per_token}")

    @property
    def label(self) -> str:
        return f"{self.prefill_replicas}P:{self.decode_replicas}D"

    def transfer_bytes(self, prompt_tokens: int) -> float:
        return prompt_tokens * self.kv_bytes_per_token


def parse_disaggregate(text: str) -> tuple[int, int]:
    """`"3:2"` → (3, 2): prefill replicas, decode replicas."""
    p, sep, d = str(text).partition(":")
    try:
        if not sep:
            raise ValueError
        pd = int(p), int(d)
    except ValueError:
        raise ValueError(f"--disaggregate takes P:D (prefill and decode replicas, e.g. 3:2), got {text!r}") from None
    if min(pd) < 1:
        raise ValueError(f"--disaggregate P:D needs P >= 1 and D >= 1, got {text!r}")
    return pd


@dataclass
class _Replica:
    name: str
    sched: Scheduler
    log: KVEventLog
    role: str = "colocated"  # or "prefill" / "decode"
    inbox: list[Request] = field(default_factory=list)
    step: SchedulerOutput | None = None  # in flight
    step_dt: float = 0.0
    requests: int = 0
    link_free: float = 0.0  # prefill: when its link to the decode pool is next free


@dataclass
class FleetSimResult:
    policy: str
    traces: list[SimTrace]
    per_replica: dict[str, int]  # requests routed to each
    reasons: dict[str, int]  # routing decisions by reason
    predicted_cached_tokens: int
    disaggregation: Disaggregation | None = None
    # Per request sent over the link (disaggregated only): first token at the prefill replica
    # to landing (link queue + transfer + latency), in seconds.
    kv_transfer_s: list[float] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def num_replicas(self) -> int:
        return len(self.per_replica)

    @property
    def label(self) -> str:
        d = self.disaggregation
        return d.label if d is not None else f"{self.num_replicas} colocated"

    def records(self) -> list[RequestRecord]:
        return [t.to_record() for t in self.traces]

    def bench_summary(self, slo: SLO | None = None, percentiles=DEFAULT_PERCENTILES,
                      usd_per_hour_per_replica: float | None = None) -> RunSummary:
        """The bench's own summary (TTFT/TPOT/ITL percentiles, goodput under `slo`); the fleet
        costs one replica's price per replica."""
        usd = None if usd_per_hour_per_replica is None else usd_per_hour_per_replica * self.num_replicas
        return summarize(self.records(), self.duration_s, percentiles=percentiles, slo=slo, usd_per_hour=usd)

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
    disaggregation: Disaggregation | None = None,
) -> FleetSimResult:
    """`replicas` colocated replicas behind the router, or with `disaggregation` its P prefill
    replicas behind the router and its D decode replicas after the link (`replicas` unused)."""
    dis = disaggregation
    if dis is None and replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    if num_shared_prefixes < 1:
        raise ValueError(f"--shared-prefixes must be >= 1, got {num_shared_prefixes}")
    need = workload.input_len + workload.output_len
    if -(-need // cache_config.block_size) > num_blocks:
        raise ValueError(f"one request of {need} tokens needs more than the {num_blocks} KV blocks of a replica")
    clock = VirtualClock()
    if dis is None:
        names = [f"replica-{i}" for i in range(replicas)]
        decode_names: list[str] = []
    else:
        names = [f"prefill-{i}" for i in range(dis.prefill_replicas)]
        decode_names = [f"decode-{i}" for i in range(dis.decode_replicas)]
    # the router sees the replicas that take prompts
    fleet = Fleet(names, make_policy(policy) if isinstance(policy, str) else policy, clock=clock)
    reps: dict[str, _Replica] = {}
    for n in names + decode_names:
        sched = Scheduler(scheduler_config, cache_config, num_blocks, clock=clock)
        log = KVEventLog(block_size=cache_config.block_size)
        sched.kv_cache_manager.block_pool.events = log
        role = "colocated" if dis is None else ("decode" if n in decode_names else "prefill")
        reps[n] = _Replica(n, sched, log, role)
        if role == "decode":
            continue
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
    prompts: dict[str, list[int]] = {}  # disaggregated: each prompt, for its decode-side request
    landings: list[tuple[float, int, str, int, bool]] = []  # (lands, index, id, first token, finished)
    transfers: list[float] = []
    prefill_preemptions: dict[str, int] = {}
    predicted = 0
    done = 0
    last_poll = -math.inf

    def poll(force: bool = False) -> None:
        nonlocal last_poll
        if not force and clock.now - last_poll < kv_poll_s:
            return
        last_poll = clock.now
        for r in reps.values():
            if r.role == "decode":
                continue  # the router never picks a decode replica: it needs no view of its cache
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
            if dis is not None:
                prompts[rid] = prompt
            req = Request(request_id=rid, prompt_token_ids=prompt,
                          sampling_params=SamplingParams(max_tokens=1 if dis is not None else workload.output_len,
                                                         temperature=0.0),
                          eos_token_ids=(workload.eos_token_id,), arrival_time=send)  # fmt: skip
            heapq.heappush(arrivals, (send + workload.request_latency_s, i, req, k))

    def start_step(r: _Replica) -> None:
        if r.role == "decode":
            # K/V that has landed, in order, as far as max_num_seqs and the blocks allow.
            while r.inbox and r.sched.add_computed_request(r.inbox[0], workload.input_len):
                r.inbox.pop(0)
        else:
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

    def finish(trace: SimTrace, reason: str | None) -> None:
        nonlocal done
        trace.end_time, trace.finish_reason = clock.now, reason
        done += 1
        if slots is not None:
            heapq.heappush(slots, clock.now)

    def land() -> None:
        """A request's K/V is at the decode pool: the client sees its first token; the least
        busy decode replica takes it at its next step."""
        _, _, rid, token, finished = heapq.heappop(landings)
        trace = traces[rid]
        trace.token_times.append(clock.now)
        if finished or workload.output_len == 1:
            finish(trace, "stop" if finished else "length")
            return
        r = min((reps[n] for n in decode_names),
                key=lambda x: len(x.sched.running) + len(x.sched.waiting) + len(x.inbox))
        req = Request(request_id=rid, prompt_token_ids=prompts.pop(rid),
                      sampling_params=SamplingParams(max_tokens=workload.output_len, temperature=0.0),
                      eos_token_ids=(workload.eos_token_id,), arrival_time=trace.send_time,
                      output_token_ids=[token])  # fmt: skip
        r.requests += 1
        r.inbox.append(req)
        if r.step is None:
            start_step(r)

    steps: list[tuple[float, str]] = []  # (end time, replica)
    for _ in range(max_events):
        if done == workload.num_prompts:
            break
        release_due()
        t_arrival = arrivals[0][0] if arrivals else math.inf
        t_step = steps[0][0] if steps else math.inf
        t_land = landings[0][0] if landings else math.inf
        if pending and (slots is None or slots):
            t_arrival = min(t_arrival, float(releases[pending[0]]))
        if t_arrival == math.inf and t_step == math.inf and t_land == math.inf:  # pragma: no cover
            raise AssertionError("the fleet simulation has nothing left to wait for")
        if t_land < t_arrival and t_land <= t_step:
            clock.now = max(clock.now, t_land)
            land()
            continue
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
            if r.role == "decode":
                trace.token_times.extend([clock.now] * len(out.new_token_ids))
                trace.num_preemptions = prefill_preemptions.get(out.request_id, 0) + out.num_preemptions
                if out.finish_reason is not None:
                    finish(trace, out.finish_reason)
                continue
            ticket = tickets[out.request_id]
            if out.new_token_ids and (r.role == "prefill" or not trace.token_times):
                fleet.first_token(ticket)
            trace.num_cached_tokens = out.num_cached_tokens
            trace.num_preemptions = out.num_preemptions
            if r.role == "prefill":
                prefill_preemptions[out.request_id] = out.num_preemptions
                if out.finish_reason is not None:  # the first token: its K/V goes over the link
                    assert dis is not None
                    fleet.finish(ticket, "ok")
                    start = max(clock.now, r.link_free)
                    r.link_free = start + dis.link.busy_time(dis.transfer_bytes(workload.input_len))
                    lands = r.link_free + dis.link.latency_s
                    transfers.append(lands - clock.now)
                    heapq.heappush(landings, (lands, trace.index, out.request_id, out.new_token_ids[0],
                                              out.finish_reason == "stop"))
                continue
            trace.token_times.extend([clock.now] * len(out.new_token_ids))
            if out.finish_reason is not None:
                fleet.finish(ticket, "ok")
                finish(trace, out.finish_reason)
        start_step(r)
    else:
        raise ValueError(f"the fleet simulation did not finish within {max_events} events")

    ordered = sorted(traces.values(), key=lambda t: t.index)
    return FleetSimResult(policy if isinstance(policy, str) else policy.name, ordered,
                          {n: r.requests for n, r in reps.items()}, reasons, predicted,
                          disaggregation=dis, kv_transfer_s=transfers,
                          num_preemptions=sum(r.sched.num_preemptions for r in reps.values()))


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


def comparison_row(r: FleetSimResult, slo: SLO | None, usd_per_hour_per_replica: float | None) -> dict[str, Any]:
    """One deployment's simulated figures, as `inferlab simulate --disaggregate` and the fleet
    plan print them: latency percentiles from the bench's own summary, goodput under `slo`."""
    s = r.bench_summary(slo, (50.0, 90.0, 99.0), usd_per_hour_per_replica).to_dict()
    usd = s["usd_per_hour"]
    goodput = s["request_goodput"]
    row: dict[str, Any] = {
        "deployment": r.label,
        "replicas": r.num_replicas,
        "requests": s["num_requests"],
        "request_throughput": s["request_throughput"],
        "request_goodput": goodput,
        "slo_attainment": s["slo_attainment"],
        "usd_per_hour": usd,
        "usd_per_1k_good_requests": (usd / (goodput * 3600.0) * 1000.0 if usd is not None and goodput else None),
        "preemptions": r.num_preemptions,
    }
    for m in ("ttft", "itl", "tpot"):
        for p in ("p50", "p90", "p99"):
            row[f"{p}_{m}_ms"] = s.get(f"{p}_{m}_ms")
    xfer = np.array(r.kv_transfer_s) * 1e3
    row["p50_kv_transfer_ms"] = float(np.percentile(xfer, 50)) if len(xfer) else None
    row["p99_kv_transfer_ms"] = float(np.percentile(xfer, 99)) if len(xfer) else None
    return row


COMPARISON_COLUMNS = (
    ("deployment", "deployment", "{}"), ("replicas", "GPUs", "{}"), ("p50_ttft_ms", "TTFT p50 ms", "{:.0f}"),
    ("p99_ttft_ms", "TTFT p99 ms", "{:.0f}"), ("p50_itl_ms", "ITL p50 ms", "{:.1f}"),
    ("p99_itl_ms", "ITL p99 ms", "{:.1f}"), ("p99_tpot_ms", "TPOT p99 ms", "{:.1f}"),
    ("p50_kv_transfer_ms", "KV move p50 ms", "{:.1f}"), ("request_throughput", "req/s", "{:.2f}"),
    ("request_goodput", "goodput req/s", "{:.2f}"), ("slo_attainment", "in SLO", "{:.1%}"),
    ("usd_per_hour", "$/hour", "{:.2f}"), ("usd_per_1k_good_requests", "$/1k good req", "{:.3f}"),
)  # fmt: skip


def render_comparison(rows: list[dict[str, Any]], markdown: bool = False) -> list[str]:
    """The rows as a fixed-width table (or a Markdown one); '–' where a figure does not apply."""
    cells = [[h for _, h, _ in COMPARISON_COLUMNS]]
    for row in rows:
        cells.append([fmt.format(row[k]) if row.get(k) is not None else "–" for k, _, fmt in COMPARISON_COLUMNS])
    if markdown:
        out = ["| " + " | ".join(cells[0]) + " |", "|" + "|".join("---" for _ in cells[0]) + "|"]
        return out + ["| " + " | ".join(c) + " |" for c in cells[1:]]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    return ["  ".join(c[i].rjust(widths[i]) if i else c[i].ljust(widths[i]) for i in range(len(c))) for c in cells]
