"""`build_plan`: the memory budget, roofline speeds and cost of one model on one device for
one workload, as a list of `Figure`s that each say how they were obtained.

The operating points: one request alone, and the workload's concurrency (given, derived from
a request rate by Little's law, or by default as many sequences as the memory holds).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from inferlab.plan.figures import Figure
from inferlab.plan.hardware import HardwareSpec
from inferlab.plan.model_spec import ModelSpec
from inferlab.plan.roofline import (
    Roofline,
    blocks_for,
    cost_per_million_tokens,
    kv_memory_available,
    mean_decode_context,
    sequences_that_fit,
)

SCHEMA = "inferlab.plan/1"


@dataclass(frozen=True)
class Workload:
    """Every request the same shape; either a fixed concurrency or a Poisson request rate."""

    input_len: int = 1024
    output_len: int = 256
    concurrency: int | None = None  # None and no rate: as many as fit in memory
    request_rate: float | None = None  # requests/s

    def __post_init__(self) -> None:
        if self.input_len < 1:
            raise ValueError(f"input length must be >= 1, got {self.input_len}")
        if self.output_len < 1:
            raise ValueError(f"output length must be >= 1, got {self.output_len}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and not (self.request_rate > 0 and math.isfinite(self.request_rate)):
            raise ValueError(f"request rate must be a finite number > 0, got {self.request_rate}")
        if self.concurrency is not None and self.request_rate is not None:
            raise ValueError("give either a concurrency or a request rate, not both")


@dataclass(frozen=True)
class PlanInputs:
    model: ModelSpec
    hardware: HardwareSpec
    workload: Workload = field(default_factory=Workload)
    weight_precision: str | None = None  # None = as stored (a file's bytes, or the native precision)
    kv_precision: str = "bf16"
    compute_precision: str = "bf16"  # the precision the matrix products run in (its FLOP/s is used)
    usd_per_hour: float | None = None
    reserve_fraction: float = 0.10  # memory kept back for activations and the runtime (vLLM's 0.9)
    reserve_bytes: float = 0.0  # a fixed activation reserve on top of the fraction
    memory_efficiency: float = 1.0  # share of peak bandwidth a step achieves
    compute_efficiency: float = 1.0  # share of peak dense FLOP/s a step achieves
    step_overhead_s: float = 0.0  # fixed cost per step (launches, scheduling)
    block_size: int = 16

    def __post_init__(self) -> None:
        if not 0.0 <= self.reserve_fraction < 1.0:
            raise ValueError(f"memory reserve fraction must be in [0, 1), got {self.reserve_fraction}")
        if self.reserve_bytes < 0:
            raise ValueError(f"reserve bytes must be >= 0, got {self.reserve_bytes}")
        if self.usd_per_hour is not None and self.usd_per_hour < 0:
            raise ValueError(f"USD per hour must be >= 0, got {self.usd_per_hour}")
        if self.block_size < 1:
            raise ValueError(f"block size must be >= 1, got {self.block_size}")

    def roofline(self) -> Roofline:
        return Roofline(self.model, self.hardware, self.weight_precision, self.kv_precision,
                        compute_precision=self.compute_precision, memory_efficiency=self.memory_efficiency,
                        compute_efficiency=self.compute_efficiency, step_overhead_s=self.step_overhead_s)


@dataclass
class BatchRow:
    """One decode batch size: step time, speeds, which roof it hits, whether it fits."""

    batch: int
    step_time: Figure
    per_user_tokens_per_s: Figure
    total_tokens_per_s: Figure
    bound: str
    fits: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "bound": self.bound,
            "fits": self.fits,
            "step_time": self.step_time.to_dict(),
            "per_user_tokens_per_s": self.per_user_tokens_per_s.to_dict(),
            "total_tokens_per_s": self.total_tokens_per_s.to_dict(),
        }


@dataclass
class Plan:
    inputs: dict[str, Any]
    figures: list[Figure]
    by_batch: list[BatchRow]

    def figure(self, name: str) -> Figure:
        for f in self.figures:
            if f.name == name:
                return f
        raise KeyError(name)

    def value(self, name: str) -> float | None:
        return self.figure(name).value

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "inputs": self.inputs,
            "figures": [f.to_dict() for f in self.figures],
            "decode_by_batch": [r.to_dict() for r in self.by_batch],
        }


def build_plan(inp: PlanInputs) -> Plan:
    m, hw, wl = inp.model, inp.hardware, inp.workload
    rf = inp.roofline()
    figs: list[Figure] = []
    hw_kind, hw_src = hw.kind, hw.source

    def add(name: str, value: float | None, unit: str, kind: str, assumptions: list[str] | None = None,
            source: str | None = None, label: str = "") -> Figure:
        f = Figure(name, value, unit, kind, list(assumptions or []), source, label)  # type: ignore[arg-type]
        figs.append(f)
        return f

    # ---- sizes
    add("num_params", m.num_params, "params", m.params_kind, [], m.source, "parameters")
    if rf.from_file:
        w_assume = ["bytes of the tensors actually stored in the file, summed (metadata excluded)"]
    else:
        w_assume = [f"{m.num_params:,} params × {rf.weight_precision.bits:g} bits / 8 ({rf.weight_precision.note})",
                    "every tensor at the same precision"]
    add("weight_bytes", rf.weight_bytes, "bytes", "computed", w_assume, m.source, "weights")
    read_assume = (["tied head: the whole table is read as the output projection"] if m.tie_word_embeddings
                   else ["all weights but the input embedding table (a decode step gathers only its rows)"])
    add("weight_bytes_read_per_step", rf.weight_bytes_read_per_step, "bytes", "computed", read_assume,
        label="weights read per step")
    kvp = rf.kv_precision
    add("kv_bytes_per_token", rf.kv_bytes_per_token, "bytes", "computed",
        [f"2 (K,V) × {m.num_layers} layers × {m.num_kv_heads} KV heads × {m.head_dim} head dim × "
         f"{kvp.bytes_per_element:g} bytes ({kvp.name})", "full attention in every layer"],
        label="KV per token")
    seq_tokens = wl.input_len + wl.output_len
    seq_blocks = blocks_for(seq_tokens, inp.block_size)
    kv_seq = seq_blocks * inp.block_size * rf.kv_bytes_per_token
    add("kv_bytes_per_sequence", kv_seq, "bytes", "computed",
        [f"{wl.input_len} prompt + {wl.output_len} output = {seq_tokens} tokens, in {seq_blocks} blocks of "
         f"{inp.block_size}", "no prefix shared between sequences"], label="KV per sequence")

    # ---- memory budget
    add("memory_total", hw.memory_bytes, "bytes", hw_kind, ["spec-sheet GB = 10^9 bytes"] if hw_kind == "cited"
        else [], hw_src, "device memory")
    reserve = hw.memory_bytes * inp.reserve_fraction + inp.reserve_bytes
    reserve_text = f"{inp.reserve_fraction:.0%} of memory" + (
        f" + {inp.reserve_bytes:,.0f} bytes fixed" if inp.reserve_bytes else "")
    add("memory_reserve", reserve, "bytes", "computed",
        [f"reserve = {reserve_text}, for activations, CUDA graphs and the runtime"], label="reserve")
    avail = kv_memory_available(hw.memory_bytes, rf.weight_bytes, inp.reserve_fraction, inp.reserve_bytes)
    add("kv_memory_available", avail, "bytes", "computed", ["memory − reserve − weights"],
        label="memory for KV")
    max_seqs = sequences_that_fit(hw.memory_bytes, rf.weight_bytes, kv_seq, inp.reserve_fraction,
                                  inp.reserve_bytes)
    add("max_sequences", max_seqs, "sequences", "computed",
        [f"floor(memory for KV / KV per sequence), reserve {reserve_text}",
         "every sequence at its full length at once (the worst case)"], label="sequences that fit")

    # ---- device
    add("memory_bandwidth", hw.memory_bandwidth, "B/s", hw_kind, [], hw_src)
    add("compute_peak", rf.compute_rate, "FLOP/s", hw_kind,
        [f"dense {rf.compute_precision} (no 2:4 sparsity); weight-only quantized formats assumed to compute "
         "in this precision"], hw_src, "dense compute")
    eff = [f"bandwidth × {inp.memory_efficiency:g}, compute × {inp.compute_efficiency:g} of peak"]
    if inp.step_overhead_s:
        eff.append(f"+ {inp.step_overhead_s * 1000:g} ms fixed per step")

    # ---- prefill
    pre = rf.prefill(wl.input_len)
    add("prefill_flops", pre.flops, "FLOP", "computed",
        [f"2 × {m.matmul_params:,} matmul params × {wl.input_len} tokens + 4 × layers × heads × head dim "
         "× causal pairs (n(n+1)/2)"], label="prefill FLOPs")
    pre_assume = ["one request alone, the whole prompt in one pass, no prefix-cache hit",
                  f"{pre.bound}-bound: max(bytes/bandwidth, FLOPs/compute)", *eff]
    add("prefill_time", pre.time_s, "s", "computed", pre_assume, label="prefill time (alone)")
    add("prefill_tokens_per_s", wl.input_len / pre.time_s, "tokens/s", "computed", pre_assume,
        label="prefill speed")

    # ---- decode
    ctx = mean_decode_context(wl.input_len, wl.output_len)
    dec_assume = [f"mean context {ctx:g} tokens (prompt + half the output)",
                  "step = max((weights read + K/V read) / bandwidth, FLOPs / compute)", *eff]
    one = rf.decode_step(1, ctx)
    add("decode_step_time_single", one.time_s, "s", "computed", dec_assume + [f"{one.bound}-bound"],
        label="decode step (alone)")
    add("decode_tokens_per_s_single", 1.0 / one.time_s, "tokens/s", "computed", dec_assume,
        label="decode speed (alone)")

    cost_assume = [f"${inp.usd_per_hour or 0:g}/hour ÷ (tokens/s × 3600) × 10^6", "output tokens only"]
    if inp.usd_per_hour is not None:
        add("cost_per_million_tokens_single", cost_per_million_tokens(inp.usd_per_hour, 1.0 / one.time_s),
            "USD", "computed", cost_assume + ["one request at a time, decode only"],
            label="$ per 1M tokens (alone)")

    # ---- operating point
    conc = _operating_point(inp, rf, max_seqs, pre.time_s, ctx, figs)
    if conc is not None:
        step = rf.decode_step(conc, ctx)
        fits_note = [] if conc <= max_seqs else [f"{conc} sequences do NOT fit ({max_seqs} do): expect queueing "
                                                 "or preemption"]
        at = [f"{conc} sequences decoding together", *dec_assume, f"{step.bound}-bound", *fits_note]
        add("decode_step_time", step.time_s, "s", "computed", at, label=f"decode step at {conc}")
        per_user = 1.0 / step.time_s
        total = conc / step.time_s
        add("per_user_tokens_per_s", per_user, "tokens/s", "computed", at, label=f"per-user speed at {conc}")
        add("total_tokens_per_s", total, "tokens/s", "computed", at + ["decode only: prefill time not counted"],
            label=f"total output speed at {conc}")
        cycle = conc * pre.time_s + (wl.output_len - 1) * step.time_s
        total_pf = conc * wl.output_len / cycle
        add("total_tokens_per_s_with_prefill", total_pf, "tokens/s", "computed",
            at + [f"closed loop: per {conc} requests, {conc} prefills alone + {wl.output_len - 1} decode steps "
                  "(prefill not overlapped with decode)"], label=f"total output speed at {conc}, prefill included")
        add("ttft", pre.time_s, "s", "computed",
            ["the prefill alone; no queueing (the simulator adds it)", *eff], label="time to first token")
        # While one request decodes, each of the other conc − 1 requests is replaced once, and its
        # prefill holds up everyone's next token (steady state, prefill not overlapped).
        stall = (conc - 1) * pre.time_s / max(wl.output_len - 1, 1)
        tpot = step.time_s + stall
        add("tpot", tpot, "s", "computed",
            [f"decode step + the other {conc - 1} requests' prefills spread over {wl.output_len - 1} tokens",
             "steady state: each other request is replaced once per reply; prefill not overlapped with decode"],
            label="time per output token (prefill stalls included)")
        add("e2el", pre.time_s + (wl.output_len - 1) * tpot, "s", "computed",
            ["ttft + (output − 1) × time per output token"], label="end-to-end latency")
        if inp.usd_per_hour is not None:
            add("cost_per_million_tokens", cost_per_million_tokens(inp.usd_per_hour, total), "USD", "computed",
                cost_assume + [f"at {conc} concurrent, decode only"], label=f"$ per 1M tokens at {conc}")
            add("cost_per_million_tokens_with_prefill", cost_per_million_tokens(inp.usd_per_hour, total_pf),
                "USD", "computed", cost_assume + [f"at {conc} concurrent, prefill time included"],
                label=f"$ per 1M tokens at {conc}, prefill included")

    # ---- where decode turns compute-bound
    crossover = rf.compute_bound_batch(ctx)
    add("compute_bound_batch", crossover, "sequences", "computed",
        [f"at mean context {ctx:g}: the batch where FLOP time = memory time"]
        + ([] if crossover is not None else
           ["never: each sequence's K/V read takes longer than its FLOPs, so decode stays memory-bound"]),
        label="decode compute-bound from batch")
    add("compute_bound_batch_weights_only", rf.compute_bound_batch(0), "sequences", "computed",
        ["context → 0: (weights read / bandwidth) ÷ (2 × matmul params / compute)"],
        label="compute-bound batch, short contexts")

    rows = _batch_rows(rf, ctx, max_seqs, conc)
    inputs = {"model": m.name, "hardware": hw.name,
              "weight_precision": "as stored in the file" if rf.from_file else rf.weight_precision.name,
              "kv_precision": rf.kv_precision.name, **asdict(wl),
              **{f: getattr(inp, f) for f in ("usd_per_hour", "reserve_fraction", "reserve_bytes", "memory_efficiency",
                                               "compute_efficiency", "step_overhead_s", "block_size")}}  # fmt: skip
    return Plan(inputs, figs, rows)


def _operating_point(inp: PlanInputs, rf: Roofline, max_seqs: int, prefill_s: float, ctx: float,
                     figs: list[Figure]) -> int | None:
    """The concurrency to report at (None: overloaded); appends Figures saying where it came from."""
    wl = inp.workload
    if wl.concurrency is not None:
        figs.append(Figure("concurrency", wl.concurrency, "sequences", "computed", ["given"], label="concurrency"))
        return wl.concurrency
    if wl.request_rate is None:
        conc = max(max_seqs, 1)
        note = ["as many sequences as fit in memory"] if max_seqs >= 1 else \
            ["not even one sequence fits: reported for 1 anyway"]
        figs.append(Figure("concurrency", conc, "sequences", "computed", note, label="concurrency"))
        return conc
    # Little's law: N = rate × time in system, where the time depends on N; iterate to a fixed point.
    rate, out = wl.request_rate, wl.output_len

    def busy(n: int) -> float:
        """Share of device time the load needs at batch n: each request's prefill plus its share
        of (out − 1) decode steps taken together with n − 1 others."""
        return rate * (prefill_s + (out - 1) * rf.decode_step(n, ctx).time_s / n)

    n = 1.0
    for _ in range(200):
        new_n = rate * (prefill_s + (out - 1) * rf.decode_step(max(math.ceil(n), 1), ctx).time_s)
        if abs(new_n - n) < 1e-9:
            break
        n = new_n
    little = max(math.ceil(n - 1e-9), 1)
    cap = max(max_seqs, 1)
    figs.append(Figure("offered_tokens_per_s", rate * out, "tokens/s", "computed",
                       [f"{rate:g} requests/s × {out} output tokens"], label="offered output rate"))
    if busy(cap) >= 1.0:
        figs.append(Figure("utilization", busy(cap), "", "computed",
                           [f"at the largest batch that fits ({cap}); ≥ 1 means overloaded"],
                           label="device busy fraction"))
        figs.append(Figure("concurrency", None, "sequences", "computed",
                           [f"{rate:g} requests/s exceeds what the device sustains even at {cap} sequences: "
                            "the queue grows without bound"], label="concurrency"))
        return None
    # busy(n) falls as n grows (the weights are read once per step for all n), so the smallest
    # batch that keeps up is found by bisection; below it the queue grows until the batch gets there.
    lo, hi = 1, cap
    while lo < hi:
        mid = (lo + hi) // 2
        if busy(mid) < 1.0:
            hi = mid
        else:
            lo = mid + 1
    conc = max(little, lo)
    figs.append(Figure("utilization", busy(conc), "", "computed",
                       ["rate × (prefill alone + (output − 1) × step / concurrency); ≥ 1 means overloaded"],
                       label="device busy fraction"))
    figs.append(Figure("concurrency", conc, "sequences", "computed",
                       [f"Little's law: {rate:g} requests/s × time in system = {little}, solved for a fixed point",
                        f"at least {lo}, the smallest batch at which the device keeps up (below it the queue grows)",
                        "no Poisson queueing delay beyond that"], label="concurrency"))
    return conc


def _batch_rows(rf: Roofline, ctx: float, max_seqs: int, conc: int | None) -> list[BatchRow]:
    top = max(max_seqs, conc or 1, 1)
    sizes = {1, top, max(max_seqs, 1)}
    if conc:
        sizes.add(conc)
    b = 2
    while b < top and b <= 4096:
        sizes.add(b)
        b *= 2
    rows = []
    for b in sorted(sizes):
        est = rf.decode_step(b, ctx)
        assume = [f"batch {b}, mean context {ctx:g}", f"{est.bound}-bound"]
        rows.append(BatchRow(
            batch=b,
            step_time=Figure("decode_step_time", est.time_s, "s", "computed", assume),
            per_user_tokens_per_s=Figure("per_user_tokens_per_s", 1.0 / est.time_s, "tokens/s", "computed", assume),
            total_tokens_per_s=Figure("total_tokens_per_s", b / est.time_s, "tokens/s", "computed", assume),
            bound=est.bound,
            fits=b <= max_seqs,
        ))
    return rows
