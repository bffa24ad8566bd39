"""The router's policies side by side on a workload with shared prefixes: K system prompts ×
many questions, sent in the same shuffled order to N replicas of the same model on loopback.

    python benchmarks/router_bench.py                       # 2 replicas, 3 policies, a markdown table
    python benchmarks/router_bench.py --systems 4 --questions 24 --concurrency 4 --out /tmp/rb.md

Each policy runs behind a fresh router with its own `cache_salt`, so every policy starts from
cold caches on the same warm replicas. Per policy: the share of prompt tokens served from the
prefix cache (the replicas' own usage), TTFT p50/p95, end-to-end p50, requests/s and output
tokens/s, and how the requests spread over the replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
from harness import free_port, served

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "in distant valleys where rivers carry stories of old kingdoms and forgotten songs").split()


@dataclass
class Result:
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    replica: str


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def workload(args: argparse.Namespace) -> list[tuple[str, str]]:
    rng = random.Random(args.seed)
    systems = [f"You are assistant number {k}. " + " ".join(rng.choice(WORDS) for _ in range(args.system_words))
               for k in range(args.systems)]  # fmt: skip
    items = [(systems[k], f"Question {q} for {k}: what does the story say about item {q}?")
             for k in range(args.systems) for q in range(args.questions)]  # fmt: skip
    rng.shuffle(items)
    return items


async def one(client: httpx.AsyncClient, base: str, system: str, question: str, args: argparse.Namespace,
              salt: str) -> Result:  # fmt: skip
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "cache_salt": salt}  # fmt: skip
    t0 = time.perf_counter()
    ttft = None
    usage: dict = {}
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        replica = r.headers.get("x-inferlab-replica", "?")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error']}")
            if ttft is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    e2e = time.perf_counter() - t0
    return Result(ttft if ttft is not None else e2e, e2e, int(usage.get("prompt_tokens", 0)),
                  int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)),
                  int(usage.get("completion_tokens", 0)), replica)  # fmt: skip


async def drive(base: str, items: list[tuple[str, str]], args: argparse.Namespace, salt: str) -> tuple[list[Result], float]:
    queue: asyncio.Queue = asyncio.Queue()
    for it in items:
        queue.put_nowait(it)
    results: list[Result] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            system, question = queue.get_nowait()
            results.append(await one(client, base, system, question, args, salt))

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
    return results, time.perf_counter() - t0


def row(policy: str, results: list[Result], wall: float) -> dict:
    prompt = sum(r.prompt_tokens for r in results)
    spread: dict[str, int] = {}
    for r in results:
        spread[r.replica] = spread.get(r.replica, 0) + 1
    return {
        "policy": policy,
        "requests": len(results),
        "cached_share": sum(r.cached_tokens for r in results) / prompt if prompt else 0.0,
        "ttft_p50_ms": 1000 * percentile([r.ttft_s for r in results], 0.5),
        "ttft_p95_ms": 1000 * percentile([r.ttft_s for r in results], 0.95),
        "e2e_p50_ms": 1000 * statistics.median(r.e2e_s for r in results),
        "req_per_s": len(results) / wall,
        "out_tok_per_s": sum(r.completion_tokens for r in results) / wall,
        "spread": dict(sorted(spread.items())),
        "wall_s": wall,
    }


def table(rows: list[dict]) -> str:
    out = ["| policy | requests | cached tokens | TTFT p50 (ms) | TTFT p95 (ms) | E2E p50 (ms) | req/s | out tok/s | per replica |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        spread = " / ".join(str(v) for v in r["spread"].values())
        out.append(f"| {r['policy']} | {r['requests']} | {100 * r['cached_share']:.1f}% | {r['ttft_p50_ms']:.0f} | "
                   f"{r['ttft_p95_ms']:.0f} | {r['e2e_p50_ms']:.0f} | {r['req_per_s']:.2f} | {r['out_tok_per_s']:.1f} | {spread} |")  # fmt: skip
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policies", default="cache-aware,least-load,round-robin")
    p.add_argument("--systems", type=int, default=4, help="K shared system prompts")
    p.add_argument("--questions", type=int, default=16, help="questions per system prompt")
    p.add_argument("--system-words", type=int, default=300, help="words per system prompt (~1.2 tokens each)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--model", default=None, help="replica model (default: the server's default)")
    p.add_argument("--tokenizer", default=None, help="--tokenizer for the router (default: the replicas' /tokenize)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the table (markdown) and the rows (JSON beside it)")
    args = p.parse_args(argv)

    launcher = [sys.executable, "-m", "inferlab.cli"]
    env = {"PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    items = workload(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="inferlab-router-bench-") as tmp, contextlib.ExitStack() as stack:
        bases = []
        for i in range(args.replicas):
            port = free_port()
            cmd = [*launcher, "serve", "--port", str(port), "--num-threads", str(args.num_threads), "--log-level", "warning"]
            if args.model:
                cmd += ["--model", args.model]
            base = f"http://127.0.0.1:{port}"
            stack.enter_context(served(cmd, base, Path(tmp) / f"replica{i}.log", env=env))
            bases.append(base)
        for base in bases:  # warm: the first request of a process pays one-off costs
            httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 2}, timeout=300).raise_for_status()  # fmt: skip
        for policy in args.policies.split(","):
            port = free_port()
            cmd = [*launcher, "router", "--port", str(port), "--policy", policy, "--log-level", "warning"]
            for b in bases:
                cmd += ["--backend", b]
            if args.tokenizer:
                cmd += ["--tokenizer", args.tokenizer]
            base = f"http://127.0.0.1:{port}"
            with served(cmd, base, Path(tmp) / f"router-{policy}.log", env=env, timeout_s=120):
                deadline = time.monotonic() + 60
                while httpx.get(base + "/health", timeout=5).json().get("replicas", {}) != {b: "healthy" for b in bases}:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the router did not see every replica ready")
                    time.sleep(0.2)
                results, wall = asyncio.run(drive(base, items, args, salt=f"{policy}-{uuid.uuid4().hex}"))
            rows.append(row(policy, results, wall))
            print(f"{policy}: done in {wall:.1f} s", flush=True)
    text = table(rows)
    print(text)
    if args.out:
        args.out.write_text(f"`benchmarks/router_bench.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n\n{text}\n")
        args.out.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                             "rows": rows}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
