"""Where one engine step's time goes: matmuls, attention, norms/rope/activations, sampling,
scheduling, and the Python around them. For a decode step at batch sizes 1 and 32 and a
prefill step of a 512-token prompt.

    .venv/bin/python benchmarks/profile_step.py [--model PATH] [--dtype auto] [--steps 10]

Method: torch.profiler records every aten op's self time over --steps steps; ops are put in
buckets by name; the scheduler, output processing and sampler are timed by wrapping them.
"Python/other" is what remains of the step's wall time (the profiler's own few µs per op land here too): the runner's batch building, op
dispatch, and everything no bucket names. Medians are per step.
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

BUCKETS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::linear", "aten::bmm", "aten::matmul", "mkl", "mkldnn"),
    "attention": ("scaled_dot_product", "aten::index_copy_", "aten::index_select", "_flash_attention"),
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


def profile_steps(llm: LLM, prompts: list[list[int]], max_tokens: int, steps: int, skip: int) -> dict[str, float]:
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"prof-{time.monotonic_ns()}-{i}", p, params, use_prefix_cache=False)
    for _ in range(skip):  # get past the prefill into steady decode (or stop before it)
        eng.step()
    wall: dict[str, float] = defaultdict(float)
    sched, proc, sampler = eng.scheduler.schedule, eng.output_processor.process, eng.runner.sampler
    eng.scheduler.schedule = Timed(sched, wall, "scheduling")
    eng.output_processor.process = Timed(proc, wall, "detokenize/outputs")
    eng.runner.sampler = Timed(sampler, wall, "(of which sampling)")
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            for _ in range(steps):
                eng.step()
            total = time.perf_counter() - t
    finally:
        eng.scheduler.schedule, eng.output_processor.process, eng.runner.sampler = sched, proc, sampler
        eng.abort_request([r for r in list(eng.output_processor.requests)])
        while eng.has_unfinished_requests():
            eng.step()
    ops: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        ops[bucket_of(ev.key)] += ev.self_cpu_time_total / 1e6
    # The sampler's ops are inside the op buckets; its wall time is shown apart, not added.
    out = {k: v / steps for k, v in ops.items()}
    out.update({k: v / steps for k, v in wall.items()})
    accounted = sum(ops.values()) + wall["scheduling"] + wall["detokenize/outputs"]
    out["python/other"] = max(total - accounted, 0.0) / steps
    out["step total"] = total / steps
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_num_batched_tokens=2048, max_num_seqs=64)
    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(100, min(vocab, 30000), (n,), generator=g).tolist()

    cases = {
        "decode, batch 1 (ctx ~140)": ([prompt(128)], 64, 2),
        "decode, batch 32 (ctx ~280)": ([prompt(256) for _ in range(32)], 64, 6),
        "prefill, 512 tokens": ([prompt(512)], 1, 0),
    }
    print(f"model {llm.engine.model_name}, dtype {llm.engine.runner.dtype}, threads {torch.get_num_threads()}, "
          f"load avg {os.getloadavg()[0]:.2f}")
    results = {}
    for name, (prompts, max_tokens, skip) in cases.items():
        steps = 1 if max_tokens == 1 else args.steps
        runs = [profile_steps(llm, prompts, max_tokens, steps, skip) for _ in range(3)]
        results[name] = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0]}
    keys = ["matmul", "attention", "elementwise/other ops", "(of which sampling)", "scheduling", "detokenize/outputs",
            "python/other", "step total"]
    print(f"{'ms per step':<24}" + "".join(f"{n:>30}" for n in results))
    for k in keys:
        print(f"{k:<24}" + "".join(f"{r.get(k, 0.0) * 1000:>30.2f}" for r in results.values()))


if __name__ == "__main__":
    main()
