"""What does the HTTP server cost? The same workload through `inferlab serve` and the offline API.

    .venv/bin/python benchmarks/http_vs_offline.py                 # default model, N=32 x 128 tokens
    .venv/bin/python benchmarks/http_vs_offline.py --model tiny    # a tiny random model (smoke run)

Workload: N distinct prompts, each generating exactly --max-tokens tokens (ignore_eos), greedy.
Offline: one `LLM.generate(prompts)` call. HTTP: the server in a subprocess (its own process,
as in production), N concurrent streaming clients (`/v1/completions`, stream=True,
include_usage) in this process. Both print output tokens per second of wall time (measured);
the ratio HTTP / offline is the share of engine throughput the server keeps (target >= 0.85).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

TOPICS = ["a lighthouse", "a lost key", "the tide", "a train at night", "an old map", "a small robot",
          "a garden in winter", "a letter never sent"]  # fmt: skip


def make_prompts(n: int) -> list[str]:
    return [f"Story {i}: write a long story about {TOPICS[i % len(TOPICS)]}, number {i}." for i in range(n)]


def offline_run(model: str | None, prompts: list[str], max_tokens: int, args) -> float:
    from inferlab import LLM, SamplingParams

    llm = LLM(model, dtype=args.dtype, max_num_seqs=max(len(prompts), 1), max_model_len=args.max_model_len)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    print(f"offline: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} tok/s")
    return tokens / elapsed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def http_run(model: str | None, prompts: list[str], max_tokens: int, args) -> float:
    port = _free_port()
    cmd = [sys.executable, "-m", "inferlab.cli", "serve", "--port", str(port), "--dtype", args.dtype,
           "--max-num-seqs", str(max(len(prompts), 1)), "--max-model-len", str(args.max_model_len),
           "--log-level", "warning"]  # fmt: skip
    if model is not None:
        cmd += ["--model", model]
    server = subprocess.Popen(cmd)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.5)
        tokens, elapsed = asyncio.run(_http_load(base, prompts, max_tokens))
    finally:
        server.terminate()
        server.wait(60)
    print(f"http:    {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} tok/s")
    return tokens / elapsed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path/id; 'tiny' = a tiny random model; default: SmolLM2-135M")
    p.add_argument("-n", "--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    model = args.model
    tmp = None
    if model == "tiny":
        from inferlab.models.testing import make_tiny_hf_model

        tmp = tempfile.TemporaryDirectory()
        model = str(make_tiny_hf_model(Path(tmp.name) / "tiny", arch="llama"))
    prompts = make_prompts(args.num_requests)
    print(f"workload: {len(prompts)} requests x {args.max_tokens} output tokens, model {args.model or 'default'}, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    offline = offline_run(model, prompts, args.max_tokens, args)
    http = http_run(model, prompts, args.max_tokens, args)
    ratio = http / offline
    verdict = "meets" if ratio >= 0.85 else "misses"
    print(f"ratio http/offline = {ratio:.3f} ({verdict} the 0.85 target)")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
