"""The CUDA path on one GPU: correct against the CPU path, fast against the HBM roofline, and
what CUDA graphs save on a decode step. No network: random weights of real configurations.

    PYTHONPATH=src python3 benchmarks/gpu_check.py [--out DIR] [--skip-8b]

Prepared for a lent H200 (device tool; its image has torch, transformers, safetensors; nothing
else of ours is needed) and meant to finish well inside 8 minutes. Prints one table and writes
`gpu_check.json` to --out (default: $OUT when set, else the current directory).

1. Tiny Llama (written to a temp dir): float32 on CUDA against float32 on the CPU, 4 prompts ×
   16 greedy tokens: tokens equal, largest |Δ logprob| of the chosen tokens.
2. Llama-3.1-8B, dummy bfloat16 weights (its real config.json, written here): through the
   engine (`LLM.generate`, ignore_eos), one stream's decode tokens/s and 64 streams' output
   tokens/s, beside the roofline = (weight bytes + K/V bytes read per step) / HBM bandwidth,
   the bandwidth measured here by a device-to-device copy (bytes read + written).
3. CUDA graphs: one real decode step of (2) at batch 1 and 64, replayed from a captured graph
   against the same step run eagerly (same inputs, outputs compared): what launch overhead costs.

What this does not do yet: the engine itself does not replay graphs (step 3 measures a captured
step beside the engine), and sampling runs on the host (logits are copied back each step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from inferlab import LLM, SamplingParams  # noqa: E402
from inferlab.models.attention import meta_to  # noqa: E402
from inferlab.plan.roofline import mean_decode_context  # noqa: E402

LLAMA_31_8B = {  # meta-llama/Llama-3.1-8B's config.json (public), less the fields we do not read
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}  # fmt: skip


def sync() -> None:
    torch.cuda.synchronize()


def timed_ms(fn, reps: int = 20, rounds: int = 5) -> float:
    """Median over `rounds` of the mean time of `reps` calls, in ms (GPU work included)."""
    fn()
    sync()
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        out.append((time.perf_counter() - t) / reps * 1e3)
    return statistics.median(out)


def hbm_bandwidth() -> float:
    """Bytes/s of a 4 GiB device-to-device copy, counting bytes read and written."""
    a = torch.empty(1 << 30, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    ms = timed_ms(lambda: b.copy_(a), reps=10, rounds=5)  # noqa: F821 - called before a, b are deleted
    del a, b
    torch.cuda.empty_cache()
    return 2 * 4 * (1 << 30) / (ms / 1e3)


def check_tiny(work: Path) -> dict:
    from inferlab.models.testing import make_tiny_hf_model

    path = make_tiny_hf_model(work / "tiny", arch="llama")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 17, 33, 64)]
    cpu = LLM(str(path), dtype="float32").generate(prompts, params)
    gpu = LLM(str(path), dtype="float32", device="cuda").generate(prompts, params)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(cpu, gpu))
    delta = max(abs(x[0].logprob - y[0].logprob) for a, b in zip(cpu, gpu)
                for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs))
    return {"prompts": len(prompts), "identical_16_token_outputs": int(same), "max_abs_logprob_delta": delta}


def _decode_rate(outs) -> tuple[float, float]:
    """(output tokens / wall of the batch, per-stream decode tokens/s from each request's metrics)."""
    first = min(o.metrics.arrival_time for o in outs)
    last = max(o.metrics.finished_time for o in outs)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    per = [(len(o.outputs[0].token_ids) - 1) / (o.metrics.finished_time - o.metrics.first_token_time) for o in outs]
    return tokens / (last - first), statistics.median(per)


def run_8b(work: Path, bandwidth: float) -> dict:
    cfg = work / "llama-3.1-8b"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps(LLAMA_31_8B))
    t = time.perf_counter()
    llm = LLM(str(cfg), load_format="dummy", dtype="bfloat16", device="cuda", max_num_seqs=64, max_model_len=1024,
              max_num_batched_tokens=8192, kv_cache_memory=16 << 30)
    load_s = time.perf_counter() - t
    runner = llm.engine.runner
    m = runner.model
    weight_bytes = m.decode_weight_nbytes  # what a decode step reads of the weights
    kv_per_token = runner.kv_bytes_per_token  # as stored (an int8 cache's scales included)
    ctx = mean_decode_context(128, 128)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1000, 120000, (128,), generator=g).tolist() for _ in range(64)]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    _, one = _decode_rate(llm.generate(prompts[:1], params))
    total, per64 = _decode_rate(llm.generate(prompts, params))
    floor1 = (weight_bytes + ctx * kv_per_token) / bandwidth
    floor64 = (weight_bytes + 64 * ctx * kv_per_token) / bandwidth
    graphs = {b: graph_step(llm, prompts[:b]) for b in (1, 64)}
    return {
        "load_s": load_s, "weight_bytes": weight_bytes,
        "batch1_decode_tok_s": one, "batch1_roofline_tok_s": 1 / floor1, "batch1_of_roofline": one * floor1,
        "batch64_output_tok_s": total, "batch64_per_stream_decode_tok_s": per64,
        "batch64_roofline_decode_tok_s": 64 / floor64, "batch64_decode_of_roofline": per64 * 64 * floor64,
        "cuda_graphs": graphs,
    }  # fmt: skip


def graph_step(llm: LLM, prompts: list[list[int]]) -> dict:
    """Capture one real decode step of `prompts` and replay it; the same step eager beside it."""
    eng, runner = llm.engine, llm.engine.runner
    saved: list = []
    real = runner._prepare

    def spy(decodes, prefills):
        out = real(decodes, prefills)
        if decodes and not prefills and len(decodes) == len(prompts):
            saved[:] = [out]
        return out

    runner._prepare = spy
    try:
        for i, p in enumerate(prompts):
            eng.add_request(f"graph-{len(prompts)}-{i}", p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
    finally:
        runner._prepare = real
    ids, pos, meta, sidx = saved[0]
    dev = runner.device
    ids, pos, sidx = ids.to(dev), pos.to(dev), sidx.to(dev)
    meta = meta_to(meta, dev)
    model, kv = runner.model, runner.kv_caches

    def step() -> torch.Tensor:
        return model.compute_logits(model.forward(ids, pos, kv, meta).index_select(0, sidx))

    with torch.inference_mode():
        eager_ms = timed_ms(step)
        ref = step().clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = step()
        graph_ms = timed_ms(graph.replay)
        diff = (static_out.float() - ref.float()).abs().max().item()
    return {"batch": len(prompts), "eager_ms": eager_ms, "graph_ms": graph_ms, "speedup": eager_ms / graph_ms,
            "max_abs_logit_delta": diff}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip-8b", action="store_true", help="only the tiny-model correctness check")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        report["tiny_cuda_vs_cpu"] = check_tiny(work)
        print("tiny model, CUDA vs CPU (float32):", report["tiny_cuda_vs_cpu"], flush=True)
        report["hbm_bytes_per_s"] = bw = hbm_bandwidth()
        print(f"HBM: {bw / 1e12:.2f} TB/s (device-to-device copy, read + write)", flush=True)
        if not args.skip_8b:
            r = report["llama_3_1_8b"] = run_8b(work, bw)
            print(f"Llama-3.1-8B dummy bf16: {r['weight_bytes'] / 1e9:.2f} GB of weights, loaded in {r['load_s']:.0f} s")
            print(f"  batch 1 decode   {r['batch1_decode_tok_s']:8.1f} tok/s   roofline {r['batch1_roofline_tok_s']:8.1f}"
                  f"   ({r['batch1_of_roofline']:.0%})")
            print(f"  batch 64 output  {r['batch64_output_tok_s']:8.1f} tok/s   per stream decode "
                  f"{r['batch64_per_stream_decode_tok_s']:.1f}; roofline for 64 decodes "
                  f"{r['batch64_roofline_decode_tok_s']:.0f} tok/s ({r['batch64_decode_of_roofline']:.0%})")
            for b, gr in r["cuda_graphs"].items():
                print(f"  decode step, batch {b}: eager {gr['eager_ms']:.2f} ms, CUDA graph {gr['graph_ms']:.2f} ms "
                      f"(×{gr['speedup']:.2f}), max |Δ logit| {gr['max_abs_logit_delta']:.3g}")
    report["wall_s"] = time.perf_counter() - t0
    out = Path(args.out) / "gpu_check.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out} ({report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
