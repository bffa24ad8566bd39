"""A fleet plan: how many GPUs a service needs at an arrival rate and SLO, colocated or with
prefill and decode in separate pools, what that costs per hour and what goodput it gives.

Two kinds of figure, each labelled (the course's rule):
- computed: closed forms on the roofline. Colocated, the planner's own operating point per
  replica at rate R/N (`build_plan`: Little's law, busy fraction, TTFT and TPOT with prefill
  stalls). Disaggregated, a prefill pool busy R × prefill time / P, a decode pool whose batch
  n solves n = (R/D) × (output − 1) × step(n), and a link busy (R/P) × K/V bytes / bandwidth.
- simulated: the same fleets in `fleet_sim.simulate_fleet` (the engine's real scheduler per
  replica on the roofline step cost, Poisson arrivals), starting at the computed size and
  stepping one GPU at a time to the fewest that meet the SLO for `attainment` of requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from inferlab.bench.metrics import SLO
from inferlab.config import CacheConfig, SchedulerConfig
from inferlab.plan.cost_model import RooflineCost
from inferlab.plan.figures import Figure, format_value
from inferlab.plan.fleet_sim import (
    Disaggregation,
    FleetSimResult,
    KVLink,
    comparison_row,
    render_comparison,
    simulate_fleet,
)
from inferlab.plan.hardware import HardwareSpec
from inferlab.plan.model_spec import ModelSpec
from inferlab.plan.planner import PlanInputs, Workload, build_plan
from inferlab.plan.roofline import Roofline
from inferlab.plan.simulator import SimWorkload


@dataclass(frozen=True)
class FleetSpec:
    """The service, its load and target, and the assumptions the plan rests on."""

    model: ModelSpec
    hardware: HardwareSpec
    input_len: int
    output_len: int
    request_rate: float  # requests/s, Poisson
    slo: SLO
    attainment: float = 0.95  # share of requests that must meet the SLO
    usd_per_hour: float = 3.0  # per GPU
    usd_source: str = "assumed"
    kv_transfer_gbps: float = 100.0
    kv_transfer_latency_s: float = 0.0
    memory_efficiency: float = 1.0
    compute_efficiency: float = 1.0
    efficiency_notes: tuple[str, ...] = ()
    headroom: float = 0.8  # computed sizing: the busiest resource at most this share of its capacity
    num_prompts: int = 400
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    block_size: int = 16
    seed: int = 0
    max_simulations: int = 12

    def __post_init__(self) -> None:
        if not (self.request_rate > 0 and math.isfinite(self.request_rate)):
            raise ValueError(f"--rate must be a finite number > 0, got {self.request_rate}")
        if self.slo.empty:
            raise ValueError("a fleet plan needs an SLO (TTFT and/or TPOT)")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"--attainment must be in (0, 1], got {self.attainment}")
        if not 0 < self.headroom <= 1:
            raise ValueError(f"--headroom must be in (0, 1], got {self.headroom}")

    def plan_inputs(self, rate: float | None = None) -> PlanInputs:
        return PlanInputs(self.model, self.hardware, Workload(self.input_len, self.output_len, request_rate=rate),
                          usd_per_hour=self.usd_per_hour, memory_efficiency=self.memory_efficiency,
                          compute_efficiency=self.compute_efficiency, block_size=self.block_size)  # fmt: skip


@dataclass
class FleetPlan:
    spec: FleetSpec
    figures: list[Figure]
    rows: list[dict[str, Any]]  # simulated deployments, in the order tried
    chosen: dict[str, dict[str, Any]]  # "colocated" / "disaggregated" → its row
    notes: list[str] = field(default_factory=list)

    def markdown(self, command: str) -> str:
        s = self.spec
        out = [f"# Fleet plan: {s.model.name} on {s.hardware.name}, {s.input_len:,}-token prompts, "
               f"{s.output_len}-token replies", "",
               f"Regenerate: `{command}` (arithmetic and simulation only, no GPU).", "",
               f"Load and target: **{s.request_rate:g} requests/s** (Poisson); SLO **{s.slo.describe()}** for at "
               f"least **{s.attainment:.0%}** of requests; ${s.usd_per_hour:g} per GPU-hour ({s.usd_source}).", "",
               "## Recommendation", ""]  # fmt: skip
        for key in ("colocated", "disaggregated"):
            row = self.chosen.get(key)
            if row is None:
                out.append(f"- {key}: no size tried met the SLO (see the table)")
                continue
            out.append(f"- **{key}: {row['deployment']}** = {row['replicas']} GPUs, ${row['usd_per_hour']:.2f}/hour "
                       f"(computed); simulated: {row['slo_attainment']:.1%} of requests in SLO, so a goodput of "
                       f"{row['request_goodput']:.2f} of the {s.request_rate:g} requests/s offered; "
                       f"TTFT p99 {row['p99_ttft_ms']:.0f} ms, ITL p99 {row['p99_itl_ms']:.1f} ms, "
                       f"TPOT p99 {row['p99_tpot_ms']:.1f} ms")
        out += ["", "## Computed (closed form)", "", "| figure | value | kind | how |", "|---|---|---|---|"]
        for f in self.figures:
            how = "; ".join(f.assumptions) + (f" [{f.source}]" if f.source else "")
            out.append(f"| {f.title} | {format_value(f.value, f.unit)} | {f.kind} | {how} |")
        out += ["", "## Simulated (the engine's scheduler per replica, roofline step cost)", ""]
        out += render_comparison(self.rows, markdown=True)
        out += ["", "Every row is simulated except $/hour (GPUs × price, computed). goodput = share of requests in "
                f"SLO × the {s.request_rate:g} requests/s offered, and $/1k good req = $/hour over it; req/s is "
                "`inferlab bench`'s completed requests per second of the run (first send to last answer), which the "
                "ramp and drain of a finite run pull below the offered rate.", ""]
        out += ["## Assumptions", ""] + [f"- {n}" for n in self.notes] + [""]
        return "\n".join(out)


def plan_fleet(spec: FleetSpec, log=lambda s: None) -> FleetPlan:
    inp = spec.plan_inputs()
    rf = inp.roofline()
    base = build_plan(inp)
    figs: list[Figure] = []

    def add(name, value, unit, assumptions, label, kind="computed", source=None) -> Figure:
        f = Figure(name, value, unit, kind, list(assumptions), source, label)
        figs.append(f)
        return f

    prefill_s = rf.prefill(spec.input_len).time_s
    add("prefill_time", prefill_s, "s", [f"{spec.input_len} tokens alone, roofline at compute × "
                                         f"{spec.compute_efficiency:.2g}, bandwidth × {spec.memory_efficiency:.2g}"],
        "prefill time (alone)")  # fmt: skip
    max_seqs = int(base.value("max_sequences") or 0)
    add("max_sequences", max_seqs, "sequences", base.figure("max_sequences").assumptions, "sequences that fit per GPU")
    kv_bytes = spec.input_len * rf.kv_bytes_per_token
    link = KVLink(spec.kv_transfer_gbps, spec.kv_transfer_latency_s)
    xfer_s = link.busy_time(kv_bytes) + link.latency_s
    add("kv_bytes_per_request", kv_bytes, "bytes", [f"{spec.input_len} prompt tokens × {rf.kv_bytes_per_token:,.0f} "
                                                   "bytes of K/V per token"], "K/V moved per request")  # fmt: skip
    add("kv_transfer_time", xfer_s, "s", [f"bytes / {spec.kv_transfer_gbps:g} Gbit/s"
                                          + (f" + {link.latency_s * 1e3:g} ms" if link.latency_s else "")],
        "K/V transfer (alone)")  # fmt: skip

    # ---- colocated, computed: GPU time per request at the fullest batch, then the planner per replica.
    ctx = spec.input_len + spec.output_len / 2
    full = rf.decode_step(max(max_seqs, 1), ctx).time_s
    work = prefill_s + (spec.output_len - 1) * full / max(max_seqs, 1)
    n_colo = _colocated_size(spec, math.ceil(spec.request_rate * work / spec.headroom - 1e-9))
    p = build_plan(spec.plan_inputs(spec.request_rate / n_colo))
    add("colocated_gpu_seconds_per_request", work, "s",
        [f"prefill alone + {spec.output_len - 1} decode steps shared by the {max_seqs} that fit "
         f"({full * 1e3:.1f} ms each)"], "colocated GPU time per request")  # fmt: skip
    add("colocated_replicas", n_colo, "GPUs",
        [f"ceil({spec.request_rate:g}/s × GPU time per request / {spec.headroom:.0%}), then the planner's "
         f"operating point at {spec.request_rate:g}/N requests/s within the SLO: batch {p.value('concurrency'):.0f}, "
         f"TTFT {(p.value('ttft') or 0) * 1e3:.0f} ms, TPOT {(p.value('tpot') or 0) * 1e3:.1f} ms with prefill "
         "stalls"], "colocated GPUs")  # fmt: skip
    add("colocated_usd_per_hour", n_colo * spec.usd_per_hour, "USD", [f"{n_colo} × ${spec.usd_per_hour:g}"],
        "colocated $/hour")

    # ---- disaggregated, computed.
    p_pool = max(math.ceil(spec.request_rate * prefill_s / spec.headroom - 1e-9),
                 math.ceil(spec.request_rate * link.busy_time(kv_bytes) / spec.headroom - 1e-9), 1)
    d_pool, batch, step = _decode_pool(spec, rf, max_seqs)
    add("prefill_replicas", p_pool, "GPUs",
        [f"ceil({spec.request_rate:g}/s × {prefill_s * 1e3:.0f} ms prefill / {spec.headroom:.0%}), and the link "
         f"busy ≤ {spec.headroom:.0%}: {spec.request_rate / p_pool * link.busy_time(kv_bytes):.0%} per prefill GPU"],
        "prefill pool")  # fmt: skip
    add("decode_replicas", d_pool, "GPUs",
        [f"fewest D whose steady batch n = ({spec.request_rate:g}/D) × {spec.output_len - 1} × step(n) exists, "
         f"n ≤ {spec.headroom:.0%} of the {max_seqs} that fit, step(n) within TPOT: n = {batch:.1f}, "
         f"step {step * 1e3:.1f} ms"], "decode pool")  # fmt: skip
    add("disaggregated_ttft", prefill_s + xfer_s, "s", ["prefill alone + K/V transfer alone, no queueing"],
        "disaggregated TTFT (no queue)")
    add("disaggregated_usd_per_hour", (p_pool + d_pool) * spec.usd_per_hour, "USD",
        [f"({p_pool} + {d_pool}) × ${spec.usd_per_hour:g}"], "disaggregated $/hour")

    # ---- simulated: step from the computed sizes to the fewest GPUs that meet the SLO.
    num_blocks = int((base.value("kv_memory_available") or 0.0) // (spec.block_size * rf.kv_bytes_per_token))
    sched = SchedulerConfig(max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
                            max_model_len=spec.input_len + spec.output_len)
    wl = SimWorkload(spec.num_prompts, spec.input_len, spec.output_len, request_rate=spec.request_rate,
                     vocab_size=spec.model.vocab_size, seed=spec.seed)  # fmt: skip
    cost = RooflineCost(rf)
    rows: list[dict[str, Any]] = []
    budget = [spec.max_simulations]

    def run(dis: Disaggregation | None, n: int) -> dict[str, Any]:
        budget[0] -= 1
        # Every prompt distinct: no prefix cache to model (and no block hashing to pay for).
        cache = CacheConfig(block_size=spec.block_size, enable_prefix_caching=False)
        res: FleetSimResult = simulate_fleet(wl, sched, cache, num_blocks, cost,
                                             replicas=n, policy="least-load", disaggregation=dis)  # fmt: skip
        row = comparison_row(res, spec.slo, spec.usd_per_hour)
        # Goodput at the offered rate: a finite run's good requests / its length (the bench's
        # figure) is pulled down by its ramp and drain, which a service running all day has not.
        row["request_goodput"] = row["slo_attainment"] * spec.request_rate
        good_per_hour = row["request_goodput"] * 3600.0
        row["usd_per_1k_good_requests"] = row["usd_per_hour"] / good_per_hour * 1000.0 if good_per_hour else None
        rows.append(row)
        log(f"simulated {row['deployment']}: {row['slo_attainment']:.1%} in SLO")
        return row

    def ok(row: dict[str, Any]) -> bool:
        return row["slo_attainment"] >= spec.attainment

    def dis_of(pp: int, dd: int, gbps: float | None = None) -> Disaggregation:
        lk = link if gbps is None else KVLink(gbps, link.latency_s)
        return Disaggregation(pp, dd, lk, rf.kv_bytes_per_token)

    chosen: dict[str, dict[str, Any]] = {}
    best = _smallest(lambda n: run(None, n), n_colo, ok, budget)
    if best is not None:
        chosen["colocated"] = best
    # Disaggregated: grow the pool that misses (TTFT: prefill; TPOT: decode), then shrink each while it holds.
    pp, dd = p_pool, d_pool
    row = run(dis_of(pp, dd), 0)
    while not ok(row) and budget[0] > 0:
        ttft_bad = spec.slo.ttft_ms is not None and (row["p90_ttft_ms"] or 0) > spec.slo.ttft_ms
        pp, dd = (pp + 1, dd) if ttft_bad else (pp, dd + 1)
        row = run(dis_of(pp, dd), 0)
    if ok(row):
        for shrink in ("p", "d"):
            while budget[0] > 0 and (pp if shrink == "p" else dd) > 1:
                cand = (pp - 1, dd) if shrink == "p" else (pp, dd - 1)
                r2 = run(dis_of(*cand), 0)
                if not ok(r2):
                    break
                pp, dd, row = cand[0], cand[1], r2
        chosen["disaggregated"] = row
    # Same GPUs as the colocated choice, split by the computed prefill share; and the chosen split
    # on a slower link, to show what the K/V transfer costs.
    if best is not None and budget[0] > 0:
        share = p_pool / (p_pool + d_pool)
        n = best["replicas"]
        if n >= 2 and (round(n * share), n - round(n * share)) != (pp, dd):
            ps = min(max(round(n * share), 1), n - 1)
            run(dis_of(ps, n - ps), 0)
    if "disaggregated" in chosen and budget[0] > 0:
        slow = spec.kv_transfer_gbps / 4
        r3 = run(dis_of(pp, dd, slow), 0)
        r3["deployment"] += f" @ {slow:g} Gbit/s"

    notes = [
        f"computed and simulated from {spec.model.name}'s configuration ({spec.model.source}) and the "
        f"{spec.hardware.name} spec sheet ({spec.hardware.source})",
        *spec.efficiency_notes,
        f"price: {spec.usd_source}",
        f"simulated: {spec.num_prompts} requests per run, Poisson at {spec.request_rate:g}/s (seed {spec.seed}); each "
        f"GPU the real scheduler (max_num_seqs {spec.max_num_seqs}, max_num_batched_tokens "
        f"{spec.max_num_batched_tokens}, chunked prefill) with {num_blocks:,} KV blocks of {spec.block_size}; "
        "router least-load over the replicas that take prompts",
        f"disaggregated: each prefill GPU sends one request's K/V at a time over its own {spec.kv_transfer_gbps:g} "
        "Gbit/s link; the first token reaches the client when its K/V lands; the decode GPU with the fewest "
        "sequences takes it at its next step",
        "not modelled: tokenization, HTTP and network time to the client; replica failures; autoscaling delays; "
        "prefix-cache hits (every prompt distinct)",
        f"computed sizing keeps the busiest resource at most {spec.headroom:.0%} busy (headroom for Poisson "
        "bursts); the simulation then decides",
    ]
    return FleetPlan(spec, figs, rows, chosen, notes)


def _colocated_size(spec: FleetSpec, start: int) -> int:
    """From `start`, the fewest replicas at which the planner's operating point for R/N exists and
    its computed TTFT and TPOT (prefill stalls included) meet the SLO."""
    for n in range(max(start, 1), 10_000):
        p = build_plan(spec.plan_inputs(spec.request_rate / n))
        if p.value("concurrency") is None:  # overloaded: the queue grows without bound
            continue
        tpot, ttft = p.value("tpot"), p.value("ttft")
        if spec.slo.tpot_ms is not None and (tpot is None or tpot * 1e3 > spec.slo.tpot_ms):
            continue
        if spec.slo.ttft_ms is not None and (ttft is None or ttft * 1e3 > spec.slo.ttft_ms):
            continue
        return n
    raise ValueError("no colocated fleet size below 10,000 meets the SLO on paper")


def _decode_pool(spec: FleetSpec, rf: Roofline, max_seqs: int) -> tuple[int, float, float]:
    """Fewest decode replicas (and their steady batch and step time) for the output load."""
    ctx = spec.input_len + spec.output_len / 2
    for d in range(1, 10_000):
        lam = spec.request_rate / d * (spec.output_len - 1)  # sequences' tokens per second per replica
        n = 1.0
        for _ in range(500):  # n = lam × step(n): converges while a steady batch exists
            new = lam * rf.decode_step(max(math.ceil(n), 1), ctx).time_s
            if abs(new - n) < 1e-9 or new > 10 * max_seqs:
                n = new
                break
            n = new
        step = rf.decode_step(max(math.ceil(n), 1), ctx).time_s
        if n > spec.headroom * max_seqs:
            continue
        if spec.slo.tpot_ms is not None and step * 1e3 > spec.slo.tpot_ms:
            continue
        return d, n, step
    raise ValueError("no decode pool below 10,000 replicas meets the SLO on paper")


def _smallest(run, start: int, ok, budget: list[int]) -> dict[str, Any] | None:
    """From `start` replicas: up one at a time until a size passes, else down while it passes."""
    n = start
    row = run(n)
    while not ok(row) and budget[0] > 0:
        n += 1
        row = run(n)
    if not ok(row):
        return None
    while n > 1 and budget[0] > 0:
        r2 = run(n - 1)
        if not ok(r2):
            break
        n, row = n - 1, r2
    return row
