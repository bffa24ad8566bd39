"""What does the HTTP server cost? The same workload through `inferlab serve` and the offline API.

    .venv/bin/python benchmarks/http_vs_offline.py                 # default model, N=32 x 128 tokens
    .venv/bin/python benchmarks/http_vs_offline.py --model tiny    # a tiny random model (smoke run)

Workload: N distinct prompts, each generating exactly --max-tokens tokens (ignore_eos), greedy.
Offline: one `LLM.generate(prompts)` call. HTTP: the server in a subprocess (its own process,
as in production), N concurrent streaming clients (`/v1/completions`, stream=True,
include_usage) in this process. Both print output tokens per second of wall time (measured);
the ratio HTTP / offline is the share of engine throughput the server keeps (target >= 0.85).

The two sides run --repeats times each in A B B A order (offline, HTTP, HTTP, offline, ...)
with the model loaded once on each side, and the ratio is of the medians: on a small shared
machine one run of either can be 20% off when the host drifts, and the order spreads the
drift over both. The load average is printed beside every run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from harness import free_port, served

TOPICS = ["a lighthouse", "a lost key", "the tide", "a train at night", "an old map", "a small robot",
          "a garden in winter", "a letter never sent"]  # fmt: skip


def make_prompts(n: int) -> list[str]:
    return [f"Story {i}: write a long story about {TOPICS[i % len(TOPICS)]}, number {i}." for i in range(n)]


class Offline:
    """The offline API with its model loaded once; `run()` times one `generate` call."""

    def __init__(self, model: str | None, prompts: list[str], max_tokens: int, args) -> None:
        from inferlab import LLM, SamplingParams

        self.llm = LLM(model, dtype=args.dtype, max_num_seqs=max(len(prompts), 1), max_model_len=args.max_model_len,
                       enable_prefix_caching=False)  # every run computes every prompt
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.prompts = prompts
        self.llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up

    def run(self) -> float:
        start = time.perf_counter()
        outs = self.llm.generate(self.prompts, self.params)
        elapsed = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        print(f"offline: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} tok/s  (load {_load()})")
        return tokens / elapsed


def _load() -> str:
    return f"{os.getloadavg()[0]:.2f}"


async def _one_stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> int:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    tokens = 0
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return tokens


async def _http_load(base: str, prompts: list[str], max_tokens: int) -> tuple[int, float]:
    url = base + "/v1/completions"
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        await _one_stream(client, url, prompts[0], 4)  # warm-up
        start = time.perf_counter()
        counts = await asyncio.gather(*(_one_stream(client, url, p, max_tokens) for p in prompts))
        return sum(counts), time.perf_counter() - start


def server_command(port: int, model: str | None, num_prompts: int, args) -> list[str]:
    cmd = [sys.executable, "-m", "inferlab.cli", "serve", "--port", str(port), "--dtype", args.dtype,
           "--max-num-seqs", str(max(num_prompts, 1)), "--max-model-len", str(args.max_model_len),
           "--log-level", "warning", "--no-prefix-caching"]  # fmt: skip
    return cmd + (["--model", model] if model is not None else [])


class Http:
    """N concurrent streams against the server at `base`; `run()` times them."""

    def __init__(self, base: str, prompts: list[str], max_tokens: int) -> None:
        self.base, self.prompts, self.max_tokens = base, prompts, max_tokens

    def run(self) -> float:
        tokens, elapsed = asyncio.run(_http_load(self.base, self.prompts, self.max_tokens))
        print(f"http:    {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} tok/s  (load {_load()})")
        if tokens != len(self.prompts) * self.max_tokens:
            raise RuntimeError(f"expected {len(self.prompts) * self.max_tokens} tokens over HTTP, got {tokens}")
        return tokens / elapsed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path/id; 'tiny' = a tiny random model; default: SmolLM2-135M")
    p.add_argument("-n", "--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--repeats", type=int, default=3, help="runs of each side, A B B A order (default 3)")
    args = p.parse_args()
    model = args.model
    tmp = tempfile.TemporaryDirectory()
    if model == "tiny":
        from inferlab.models.testing import make_tiny_hf_model

        model = str(make_tiny_hf_model(Path(tmp.name) / "tiny", arch="llama"))
    prompts = make_prompts(args.num_requests)
    print(f"workload: {len(prompts)} requests x {args.max_tokens} output tokens, model {args.model or 'default'}, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    offline = Offline(model, prompts, args.max_tokens, args)
    results: dict[str, list[float]] = {"offline": [], "http": []}
    port = free_port()
    cmd = server_command(port, model, len(prompts), args)
    with served(cmd, f"http://127.0.0.1:{port}", Path(tmp.name) / "server.log") as server:
        http = Http(server.base_url, prompts, args.max_tokens)
        # A B B A ...: each pair reverses the last, so a drift in the machine's speed hits both.
        for i in range(args.repeats):
            order = ("offline", "http") if i % 2 == 0 else ("http", "offline")
            for side in order:
                results[side].append((offline if side == "offline" else http).run())
    off, web = (statistics.median(results[k]) for k in ("offline", "http"))
    ratio = web / off
    verdict = "meets" if ratio >= 0.85 else "misses"
    print(f"medians over {args.repeats} runs each: offline {off:.1f} tok/s, http {web:.1f} tok/s")
    print(f"ratio http/offline = {ratio:.3f} ({verdict} the 0.85 target); per pair: "
          + ", ".join(f"{h / o:.3f}" for o, h in zip(results["offline"], results["http"])))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
