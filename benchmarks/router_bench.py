"""The router's policies side by side on a workload with shared prefixes: K system prompts ×
many questions, sent in the same shuffled order to N replicas of the same model on loopback.

    python benchmarks/router_bench.py                       # 2 replicas, 3 policies, a markdown table
    python benchmarks/router_bench.py --systems 4 --questions 24 --concurrency 4 --out /tmp/rb.md --png /tmp/rb.png
    python benchmarks/router_bench.py --repeats 3 --sim-cost-model cost.json   # medians; the simulator beside
    python benchmarks/router_bench.py --systems 2 --questions 3 --system-words 40 --max-tokens 4   # a smoke run

Each policy runs behind a fresh router with its own `cache_salt`, so every policy starts from
cold caches on the same warm replicas. Per policy: the share of prompt tokens served from the
prefix cache (the replicas' own usage), TTFT p50/p95, end-to-end p50, requests/s and output
tokens/s, how the requests spread over the replicas, and the cached share the router predicted
when it chose (its own /metrics). With --repeats R the policies run R times, alternated, and
each figure is the median of the R runs. Bounded: a policy's run stops sending new requests
after --max-seconds-per-policy.

With --sim-cost-model (a linear step cost saved by `inferlab simulate --calibrate PROFILE.json
--save-cost-model cost.json`), `inferlab simulate`'s fleet model runs the same shape (K system
prompts of the measured length, the measured prompt length, the same concurrency and number of
replicas) through the same routing core, and its rows are printed beside the measured ones.
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
    stop_at = time.perf_counter() + args.max_seconds_per_policy

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty() and time.perf_counter() < stop_at:
            system, question = queue.get_nowait()
            results.append(await one(client, base, system, question, args, salt))

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
    return results, time.perf_counter() - t0


def router_predicted_share(base: str) -> float | None:
    """The cached share the router predicted (its own counters), or None if it has no usage."""
    text = httpx.get(base + "/metrics", timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("inferlab:router_") and " " in line:
            name, _, v = line.rpartition(" ")
            values[name] = float(v)
    prompt = values.get("inferlab:router_prompt_tokens_total", 0.0)
    return values.get("inferlab:router_predicted_cached_tokens_total", 0.0) / prompt if prompt else None


def row(policy: str, results: list[Result], wall: float, predicted: float | None = None) -> dict:
    prompt = sum(r.prompt_tokens for r in results)
    spread: dict[str, int] = {}
    for r in results:
        spread[r.replica] = spread.get(r.replica, 0) + 1
    return {
        "policy": policy,
        "requests": len(results),
        "cached_share": sum(r.cached_tokens for r in results) / prompt if prompt else 0.0,
        "predicted_share": predicted,
        "ttft_p50_ms": 1000 * percentile([r.ttft_s for r in results], 0.5),
        "ttft_p95_ms": 1000 * percentile([r.ttft_s for r in results], 0.95),
        "e2e_p50_ms": 1000 * statistics.median(r.e2e_s for r in results),
        "req_per_s": len(results) / wall,
        "out_tok_per_s": sum(r.completion_tokens for r in results) / wall,
        "spread": dict(sorted(spread.items())),
        "wall_s": wall,
    }


def median_rows(runs: list[dict]) -> dict:
    """One row per policy: the median of each figure over its runs."""
    out = dict(runs[-1])
    for k in ("cached_share", "ttft_p50_ms", "ttft_p95_ms", "e2e_p50_ms", "req_per_s", "out_tok_per_s", "wall_s"):
        out[k] = statistics.median(r[k] for r in runs)
    preds = [r["predicted_share"] for r in runs if r.get("predicted_share") is not None]
    out["predicted_share"] = statistics.median(preds) if preds else None
    out["runs"] = len(runs)
    return out


def table(rows: list[dict]) -> str:
    out = ["| policy | requests | cached tokens | router predicted | TTFT p50 (ms) | TTFT p95 (ms) | E2E p50 (ms) | req/s "
           "| out tok/s | per replica |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        spread = " / ".join(str(v) for v in r["spread"].values())
        pred = "" if r.get("predicted_share") is None else f"{100 * r['predicted_share']:.1f}%"
        e2e = "" if r.get("e2e_p50_ms") is None else f"{r['e2e_p50_ms']:.0f}"
        req_s = "" if r.get("req_per_s") is None else f"{r['req_per_s']:.2f}"
        out.append(f"| {r['policy']} | {r['requests']} | {100 * r['cached_share']:.1f}% | {pred} | {r['ttft_p50_ms']:.0f} | "
                   f"{r['ttft_p95_ms']:.0f} | {e2e} | {req_s} | {r['out_tok_per_s']:.1f} | {spread} |")  # fmt: skip
    return "\n".join(out)


def shared_prefix_tokens(base: str, system: str) -> tuple[int, int]:
    """(tokens two chats with this system prompt share, tokens of one whole chat), from /tokenize."""
    def toks(q: str) -> list[int]:
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]}
        return httpx.post(base + "/tokenize", json=body, timeout=30).json()["tokens"]

    a, b = toks("Question 1 for 0: what does the story say about item 1?"), toks("Question 2 for 0: why?")
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n, len(a)


def simulated_rows(args: argparse.Namespace, prefix_len: int, prompt_len: int, num_blocks: int, block_size: int,
                   policies: list[str]) -> list[dict]:  # fmt: skip
    """`inferlab simulate`'s fleet model on the same shape (see the module docstring)."""
    from inferlab.config import CacheConfig, SchedulerConfig
    from inferlab.plan.cost_model import load_cost_model
    from inferlab.plan.fleet_sim import simulate_fleet
    from inferlab.plan.simulator import SimWorkload

    cost = load_cost_model(str(args.sim_cost_model))
    n = args.systems * args.questions
    wl = SimWorkload(num_prompts=n, input_len=max(prompt_len, prefix_len + 1), output_len=args.max_tokens,
                     shared_prefix_len=prefix_len, vocab_size=49152,  # the default model's max_concurrency=args.concurrency, seed=args.seed,
                     request_latency_s=0.002)  # fmt: skip
    sched = SchedulerConfig(max_model_len=wl.input_len + wl.output_len)
    rows = []
    for policy in policies:
        r = simulate_fleet(wl, sched, CacheConfig(block_size=block_size), num_blocks, cost, replicas=args.replicas,
                           policy=policy, num_shared_prefixes=args.systems)  # fmt: skip
        s = r.summary()
        rows.append({"policy": f"{policy} (simulated)", "requests": s["requests"], "cached_share": s["cached_token_share"],
                     "predicted_share": s["predicted_cached_token_share"], "ttft_p50_ms": s["ttft_p50_ms"],
                     "ttft_p95_ms": s["ttft_p95_ms"], "e2e_p50_ms": None, "req_per_s": None,
                     "out_tok_per_s": s["output_throughput"], "spread": r.per_replica})  # fmt: skip
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["policy"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar(names, [100 * r["cached_share"] for r in rows], color="tab:green")
    a.set_ylabel("prompt tokens from the prefix cache (%)")
    a.set_ylim(0, 100)
    x = range(len(rows))
    b.bar([i - 0.2 for i in x], [r["ttft_p50_ms"] for r in rows], width=0.4, label="TTFT p50")
    b.bar([i + 0.2 for i in x], [r["ttft_p95_ms"] for r in rows], width=0.4, label="TTFT p95")
    b.set_xticks(list(x), names)
    b.set_ylabel("ms")
    b.legend()
    for ax in (a, b):
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle("inferlab router: policies on K shared system prompts × questions")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    p.add_argument("--repeats", type=int, default=1, help="runs per policy, alternated; medians reported")
    p.add_argument("--max-seconds-per-policy", type=float, default=600.0,
                   help="a policy's run sends no new request after this long (default 600)")
    p.add_argument("--sim-cost-model", type=Path, default=None,
                   help="a saved linear step cost (inferlab simulate --save-cost-model): the simulator's rows beside")
    p.add_argument("--out", type=Path, default=None, help="write the table (markdown) and the rows (JSON beside it)")
    p.add_argument("--png", type=Path, default=None, help="draw cached share and TTFT per policy here (matplotlib)")
    args = p.parse_args(argv)
    policies = [x for x in args.policies.split(",") if x]

    launcher = [sys.executable, "-m", "inferlab.cli"]
    env = {"PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    items = workload(args)
    runs: dict[str, list[dict]] = {pol: [] for pol in policies}
    sim_shape = None
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
        if args.sim_cost_model:
            info = httpx.get(bases[0] + "/server_info", timeout=30).json()["kv_cache"]
            sim_shape = (*shared_prefix_tokens(bases[0], items[0][0]), info["num_blocks"], info["block_size"])
        for rep, policy in ((r, pol) for r in range(args.repeats) for pol in policies):
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
                # only cache-aware looks prompts up in the index (the others predict nothing)
                predicted = router_predicted_share(base) if policy == "cache-aware" else None
            runs[policy].append(row(policy, results, wall, predicted))
            print(f"{policy} (run {rep + 1}/{args.repeats}): {len(results)} requests in {wall:.1f} s", flush=True)
    rows = [median_rows(runs[pol]) for pol in policies]
    if sim_shape is not None:
        rows += simulated_rows(args, *sim_shape, policies)
    text = table(rows)
    print(text)
    if args.png:
        plot(rows, args.png)
        print(f"plot written to {args.png}")
    if args.out:
        args.out.write_text(f"`benchmarks/router_bench.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n\n{text}\n")
        args.out.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                             "rows": rows, "runs": runs}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
