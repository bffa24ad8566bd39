"""Offline engine speed on this machine (issue: the engine's must-show figures).

Prints, for the default model (or --model): single-request decode tokens/s, prefill tokens/s
on a 1,024-token prompt, and total output tokens/s with 16 and 32 concurrent requests through
the offline API; medians of --runs runs (default 3), with the spread.

    .venv/bin/python benchmarks/engine_speed.py [--model PATH] [--dtype auto|float32] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from inferlab import LLM, SamplingParams


def prompt_of(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 30000), (n,), generator=g).tolist()


def decode_tps(llm: LLM, vocab: int, seed: int) -> float:
    out = llm.generate(prompt_of(128, seed, vocab), SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_prefix_cache=False)[0]
    m = out.metrics
    return (len(out.outputs[0].token_ids) - 1) / (m.last_token_time - m.first_token_time)


def prefill_tps(llm: LLM, vocab: int, seed: int) -> float:
    out = llm.generate(prompt_of(1024, seed, vocab), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_prefix_cache=False)[0]
    m = out.metrics
    return 1024 / (m.first_token_time - m.first_scheduled_time)


def concurrent_tps(llm: LLM, vocab: int, seed: int, n: int) -> float:
    prompts = [prompt_of(256, seed * 100 + i, vocab) for i in range(n)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_prefix_cache=False)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=64, max_num_batched_tokens=2048)
    vocab = llm.engine.model_config.vocab_size
    # Warm-up (first calls pay for allocator growth and oneDNN kernel selection).
    llm.generate(prompt_of(64, 0, vocab), SamplingParams(max_tokens=8, ignore_eos=True))
    rows = []
    for name, fn in [
        ("decode tok/s, 1 request (128 in / 128 out)", lambda s: decode_tps(llm, vocab, s)),
        ("prefill tok/s, 1,024-token prompt", lambda s: prefill_tps(llm, vocab, s)),
        ("output tok/s, 16 concurrent (256 in / 128 out)", lambda s: concurrent_tps(llm, vocab, s, 16)),
        ("output tok/s, 32 concurrent (256 in / 128 out)", lambda s: concurrent_tps(llm, vocab, s, 32)),
    ]:
        vals = [fn(s + 1) for s in range(args.runs)]
        rows.append((name, statistics.median(vals), min(vals), max(vals)))
    load = os.getloadavg()
    print(f"model: {llm.engine.model_name}  {llm.engine.precision.describe()}  threads: {torch.get_num_threads()}  "
          f"load avg: {load[0]:.2f} {load[1]:.2f}")
    print(f"{'figure':<50} {'median':>10} {'min':>10} {'max':>10}")
    for name, med, lo, hi in rows:
        print(f"{name:<50} {med:>10.1f} {lo:>10.1f} {hi:>10.1f}")


if __name__ == "__main__":
    main()
