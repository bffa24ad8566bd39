"""Where one engine step's time goes: matmuls, attention, norms/rope/activations, sampling,
scheduling, and the Python around them. For a decode step at batch sizes 1 and 32, a
prefill step of a 512-token prompt, and one step of eight 256-token prompts (what 32 clients'
prompts look like under a 2,048-token budget).

    .venv/bin/python benchmarks/profile_step.py [--model PATH] [--dtype auto] [--weight-dtype auto] [--steps 10]

Method: torch.profiler records every aten op's self time over --steps steps; ops are put in
buckets by name; the scheduler, output processing and sampler are timed by wrapping them.
"Python/other" is what remains of the step's wall time (the profiler's own few µs per op land here too): the runner's batch building, op
dispatch, and everything no bucket names. Medians are per step.

Each column also gets its roof, from this machine measured in the same run (`measure_cpu`:
streaming read bandwidth, the matmul rate of the products the model runs: int8 for w8a8, bf16
where it multiplies in bf16, else float32; and the rate of what attention multiplies in: bf16 for
our bf16 flash attention and for decode attention over a bf16 cache, else float32), read again just before each of the case's timed
runs, because a shared host's bandwidth moves between spells minutes long (the same sum read
28 and 40 GB/s ten minutes apart here): each run is held against the roof read seconds before
it, and the % shown is the median of the three. A decode step cannot beat (weight bytes + the
K/V bytes its sequences' contexts hold) / bandwidth, a prefill step 2 × parameters × tokens /
the products' rate + attention's 2 × 2 × layers × heads × head dim per query-key pair / the rate of
attention's own arithmetic (w8a8's attention is not int8: held to int8's rate, a 512-token
prefill's roof read ~12 ms short on a Zen 4). The roof is
held against the step timed with no profiler attached ("step, no profiler", runs alternated
with the profiled ones): the profiler's per-operator cost lands in "python/other".
"parts roof": the same bound taken per part and summed, the matmuls' (weight bytes or their
FLOPs, whichever binds) plus attention's (K/V bytes or its FLOPs): a step runs its matmuls and
its attention one after the other, so at 32 decoding sequences the compute-bound matmuls cannot
hide the memory-bound K/V reads, and the whole step's max() is a bound no schedule reaches.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from inferlab import LLM, SamplingParams
from inferlab.engine.request import RequestOptions
from inferlab.plan.measure import measure_cpu
from inferlab.plan.roofline import attention_pairs

BUCKETS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::linear", "aten::bmm", "aten::matmul", "mkl", "mkldnn",
               "inferlab::linear_"),
    "attention": ("scaled_dot_product", "aten::index_copy_", "aten::index_select", "_flash_attention",
                  "inferlab::paged_attention", "inferlab::rope_write_kv", "inferlab::prefill_attention"),
}


def bucket_of(name: str) -> str:
    for b, keys in BUCKETS.items():
        if any(k in name for k in keys):
            return b
    return "elementwise/other ops"


class Timed:
    """Wraps a callable and adds its wall time to a bucket."""

    def __init__(self, fn, sink: dict, key: str):
        self.fn, self.sink, self.key = fn, sink, key

    def __call__(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.sink[self.key] += time.perf_counter() - t


# DecoderStep.phase_seconds() (kernels/csrc/decoder_step.cpp), in its order, into our buckets.
STEP_PHASES = ("matmul", "attention", "matmul", "elementwise/other ops", "matmul", "matmul", "elementwise/other ops")
STEP_EVENT = "inferlab::decoder_step"


def start_case(eng, prompts: list[list[int]], max_tokens: int, skip: int) -> None:
    """Add the case's requests (greedy, no prefix cache) and run its `skip` unmeasured steps."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"prof-{time.monotonic_ns()}-{i}", p, params, RequestOptions(use_prefix_cache=False))
    for _ in range(skip):  # get past the prefill into steady decode (or stop before it)
        eng.step()


def end_case(eng) -> None:
    """Abort what is left of the case and let the engine drain."""
    eng.abort_request(list(eng.output_processor.requests))
    while eng.has_unfinished_requests():
        eng.step()


def profile_steps(llm: LLM, prompts: list[list[int]], max_tokens: int, steps: int, skip: int) -> dict[str, float]:
    eng = llm.engine
    start_case(eng, prompts, max_tokens, skip)
    wall: dict[str, float] = defaultdict(float)
    sched, proc, sampler = eng.scheduler.schedule, eng.output_processor.process, eng.runner.sampler
    eng.scheduler.schedule = Timed(sched, wall, "scheduling")
    eng.output_processor.process = Timed(proc, wall, "detokenize/outputs")
    eng.runner.sampler = Timed(sampler, wall, "(of which sampling)")
    # A decode-only step runs every layer in one DecoderStep call, one event to the profiler:
    # the kernel's own per-phase clock splits it (qkv, o, gate/up and down are matmuls).
    step_kernel = eng.runner.model._step
    if step_kernel is not None:
        step_kernel.set_profiling(True)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            for _ in range(steps):
                eng.step()
            total = time.perf_counter() - t
    finally:
        eng.scheduler.schedule, eng.output_processor.process, eng.runner.sampler = sched, proc, sampler
        phases = step_kernel.phase_seconds() if step_kernel is not None else []  # the measured steps only
        if step_kernel is not None:
            step_kernel.set_profiling(False)
        end_case(eng)
    ops: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        if ev.key == STEP_EVENT and phases:
            for bucket, sec in zip(STEP_PHASES, phases):
                ops[bucket] += sec
            ops["elementwise/other ops"] += max(ev.self_cpu_time_total / 1e6 - sum(phases), 0.0)  # checks, set-up
        else:
            ops[bucket_of(ev.key)] += ev.self_cpu_time_total / 1e6
    # The sampler's ops are inside the op buckets; its wall time is shown apart, not added.
    out = {k: v / steps for k, v in ops.items()}
    out.update({k: v / steps for k, v in wall.items()})
    accounted = sum(ops.values()) + wall["scheduling"] + wall["detokenize/outputs"]
    out["python/other"] = max(total - accounted, 0.0) / steps
    out["step total"] = total / steps
    return out


def time_steps(llm: LLM, prompts: list[list[int]], max_tokens: int, steps: int, skip: int) -> float:
    """Seconds per step of the same case with nothing watching: the profiler's own cost per
    operator (~13 ms of a 512-token prefill step, ~40 ms of a 2,048-token one) is in
    `profile_steps`' total, so the roof is held against this one."""
    eng = llm.engine
    start_case(eng, prompts, max_tokens, skip)
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    total = time.perf_counter() - t
    end_case(eng)
    return total / steps


def mean_context(prompt_len: int, decodes_before: int, steps: int) -> float:
    """Mean tokens attended over `steps` measured decode steps that follow a prompt of
    `prompt_len` and `decodes_before` unmeasured decode steps (each step attends one more)."""
    return prompt_len + decodes_before + 1 + (steps - 1) / 2


def attention_rates(precision, flops: dict[str, float]) -> tuple[float, float]:
    """The FLOP rates attention's arithmetic is held against, (prefill, decode), from `measure_cpu`'s
    rates: bf16 where it multiplies in bf16 (our bf16 flash attention; decode attention over a
    bf16 cache), float32 otherwise (float16 or int8 K/V are widened to float32; torch's SDPA)."""
    prefill = "bf16" if precision.prefill_attention == "bfloat16" and "bf16" in flops else "fp32"
    decode = "bf16" if precision.bf16_decode_attention and "bf16" in flops else "fp32"
    return flops[prefill], flops[decode]


def roofs(llm: LLM, bandwidth: float, flops: float, attn_flops_rate: tuple[float, float],
          steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per step at the machine's roof, per case of `main` (see the module docstring):
    the larger of the bytes over the bandwidth and the FLOPs over the matmul rate (at 32
    sequences the compute roof binds on this CPU, in a prefill always). Then the same per part,
    summed: the matmuls' (weight bytes, their FLOPs) plus attention's (K/V bytes, its FLOPs),
    each at its own binding roof, since a step runs them one after the other. `flops`: the
    products' rate; `attn_flops_rate`: attention's, (prefill, decode) (`attention_rates`)."""
    mc = llm.engine.model_config
    kv_per_token = llm.engine.runner.kv_bytes_per_token  # as stored (an int8 cache's scales included)
    wb = llm.engine.runner.model.decode_weight_nbytes
    layer_params = (mc.hidden_size * (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
                    + mc.num_heads * mc.head_dim * mc.hidden_size + 3 * mc.hidden_size * mc.intermediate_size)
    head_flops = 2 * mc.vocab_size * mc.hidden_size  # once per sampled token
    attn_per_pair = 4 * mc.num_layers * mc.num_heads * mc.head_dim

    def roof(tokens: int, sampled: int, pairs: float, kv_tokens: float, attn_rate: float) -> tuple[float, float]:
        kv_bytes, attn_flops = kv_tokens * kv_per_token, attn_per_pair * pairs
        linear_flops = tokens * 2 * mc.num_layers * layer_params + sampled * head_flops
        whole = max((wb + kv_bytes) / bandwidth, linear_flops / flops + attn_flops / attn_rate)
        parts = max(wb / bandwidth, linear_flops / flops) + max(kv_bytes / bandwidth, attn_flops / attn_rate)
        return whole, parts

    # The cases' shapes (see main): decodes measured after 1 and 2 unmeasured decode steps.
    ctx1, ctx32 = mean_context(128, 1, steps), mean_context(256, 2, steps)
    prefill_rate, decode_rate = attn_flops_rate
    cases = {
        "decode, batch 1 (ctx ~140)": roof(1, 1, ctx1, ctx1, decode_rate),
        "decode, batch 32 (ctx ~280)": roof(32, 32, 32 * ctx32, 32 * ctx32, decode_rate),
        "prefill, 512 tokens": roof(512, 1, attention_pairs(0, 512), 0, prefill_rate),
        "prefill, 8 x 256 tokens": roof(2048, 8, 8 * attention_pairs(0, 256), 0, prefill_rate),
    }
    return {n: r[0] for n, r in cases.items()}, {n: r[1] for n, r in cases.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--weight-dtype", default="auto")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, weight_dtype=args.weight_dtype, max_num_batched_tokens=2048,
              max_num_seqs=64)
    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(100, min(vocab, 30000), (n,), generator=g).tolist()

    cases = {
        "decode, batch 1 (ctx ~140)": ([prompt(128)], 64, 2),
        "decode, batch 32 (ctx ~280)": ([prompt(256) for _ in range(32)], 64, 6),
        "prefill, 512 tokens": ([prompt(512)], 1, 0),
        "prefill, 8 x 256 tokens": ([prompt(256) for _ in range(8)], 1, 0),  # a step of 32 clients' prompts
    }
    hw = measure_cpu(array_mib=512, repeats=5)
    # The compute roof is the rate of the products the model runs (the engine's precision):
    # int8 ones for w8a8 (the fastest library int8 GEMM here: oneDNN's _int_mm with VNNI, fbgemm's
    # vpmaddubsw without), bf16 ones (oneDNN, vdpbf16ps) where it decided on bf16 products,
    # float32 otherwise.
    precision = llm.engine.precision
    rate = "int8" if precision.int8_activations and "int8" in hw.flops else "bf16" if precision.bf16_products else "fp32"
    wb = llm.engine.runner.model.decode_weight_nbytes
    print(f"model {llm.engine.model_name}, {precision.describe(llm.engine.model_config)}, weights {wb / 1e6:.0f} MB, "
          f"threads {torch.get_num_threads()}, load avg {os.getloadavg()[0]:.2f}; measured here: "
          f"{hw.memory_bandwidth / 1e9:.1f} GB/s read, {hw.flops[rate] / 1e9:.0f} GFLOP/s {rate} matmul")
    results, roof, parts, reads = {}, {}, {}, []
    for name, (prompts, max_tokens, skip) in cases.items():
        steps = 1 if max_tokens == 1 else args.steps
        runs, plain, whole_r, parts_r = [], [], [], []
        for _ in range(3):  # alternated: profiled (the breakdown), the roof read, then plain (the step's time)
            runs.append(profile_steps(llm, prompts, max_tokens, steps, skip))
            hw = measure_cpu(array_mib=512, repeats=3)
            attn = attention_rates(precision, hw.flops)
            reads.append((hw.memory_bandwidth, hw.flops[rate], *attn))
            w, p = roofs(llm, hw.memory_bandwidth, hw.flops[rate], attn, args.steps)
            whole_r.append(w[name])
            parts_r.append(p[name])
            plain.append(time_steps(llm, prompts, max_tokens, steps, skip))
        results[name] = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0]}
        results[name]["step, no profiler"] = statistics.median(plain)
        roof[name] = (statistics.median(whole_r), statistics.median(r / t for r, t in zip(whole_r, plain)))
        parts[name] = (statistics.median(parts_r), statistics.median(r / t for r, t in zip(parts_r, plain)))
    keys = ["matmul", "attention", "elementwise/other ops", "(of which sampling)", "scheduling", "detokenize/outputs",
            "python/other", "step total", "step, no profiler"]
    print(f"{'ms per step':<24}" + "".join(f"{n:>30}" for n in results))
    for k in keys:
        print(f"{k:<24}" + "".join(f"{r.get(k, 0.0) * 1000:>30.2f}" for r in results.values()))
    print(f"{'roof (see docstring)':<24}" + "".join(f"{roof[n][0] * 1000:>30.2f}" for n in results))
    print(f"{'% of roof (no profiler)':<24}" + "".join(f"{100 * roof[n][1]:>29.0f}%" for n in results))
    print(f"{'parts roof (docstring)':<24}" + "".join(f"{parts[n][0] * 1000:>30.2f}" for n in results))
    print(f"{'% of parts roof':<24}" + "".join(f"{100 * parts[n][1]:>29.0f}%" for n in results))
    def span(i: int, digits: int = 0) -> str:
        xs = [r[i] / 1e9 for r in reads]
        return f"{min(xs):.{digits}f}-{max(xs):.{digits}f} (median {statistics.median(xs):.{digits}f})"

    prefill_kind = "bf16" if precision.prefill_attention == "bfloat16" else "fp32"
    decode_kind = "bf16" if precision.bf16_decode_attention else "fp32"
    print(f"roofs read before the timed runs: GB/s {span(0, 1)}, GFLOP/s {rate} products {span(1)}, "
          f"prefill attention ({prefill_kind}) {span(2)}, decode attention ({decode_kind}) {span(3)}")


if __name__ == "__main__":
    main()
