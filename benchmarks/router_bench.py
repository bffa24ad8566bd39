"""The router's policies side by side on a workload with shared prefixes: K system prompts ×
many questions, sent in the same shuffled order to N replicas of the same model on loopback.

The full run (≤ ~8 min on 2 cores; what benchmarks/results/router_bench.md shows):

    .venv/bin/python benchmarks/router_bench.py --out benchmarks/results/router_bench.md \
        --png benchmarks/results/router_bench.png

It (1) calibrates the step cost model on this machine (`inferlab simulate --calibrate-engine`,
one thread, a short profile; skipped with --sim-cost-model); (2) starts 2 replicas of the default
model (`--num-threads 1`) and runs cache-aware, least-load and round-robin behind a fresh router
each (16 system prompts of ~600 tokens x 6 questions by default; the router tokenizes with the
replicas' model, no /tokenize round trip), with `inferlab simulate`'s fleet model of the same
shape beside them; (3) does the same
over 16 simulated replicas (`inferlab serve --simulate` on the calibrated cost model, the
replicas' own KV cache size), where K is 16, and a hot-prefix workload (one system prompt
for every request) that must spread. A smoke run:

    .venv/bin/python benchmarks/router_bench.py --systems 2 --questions 3 --system-words 40 --max-tokens 4 \
        --sim-replicas 4 --sim-systems 4 --sim-questions 3 --calibrate-max-prefill 64 --calibrate-max-batch 4

Each policy runs behind a fresh router with its own `cache_salt`, so every policy starts from
cold caches on the same warm replicas. Per policy: the share of prompt tokens served from the
prefix cache (the replicas' own usage), TTFT p50/p95, end-to-end p50, requests/s and output
tokens/s, how the requests spread over the replicas, and the cached share the router predicted
when it chose (its own /metrics). With --repeats R the policies run R times, alternated, and
each figure is the median of the R runs. Bounded: a policy's run stops sending new requests
after --max-seconds-per-policy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
from harness import free_port, routed, served_many

from inferlab.models.registry import DEFAULT_MODEL

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


def simulated_rows(cost_file: Path, shape: tuple[int, int, int, int], policies: list[str], *, replicas: int,
                   systems: int, questions: int, concurrency: int, max_tokens: int, seed: int) -> list[dict]:  # fmt: skip
    """`inferlab simulate`'s fleet model on the same shape: (shared prefix tokens, prompt tokens,
    KV blocks per replica, block size) as measured, the same K, requests and concurrency."""
    from inferlab.config import CacheConfig, SchedulerConfig
    from inferlab.plan.cost_model import load_cost_model
    from inferlab.plan.fleet_sim import simulate_fleet
    from inferlab.plan.simulator import SimWorkload

    prefix_len, prompt_len, num_blocks, block_size = shape
    cost = load_cost_model(str(cost_file))
    wl = SimWorkload(num_prompts=systems * questions, input_len=max(prompt_len, prefix_len + 1), output_len=max_tokens,
                     shared_prefix_len=prefix_len, vocab_size=49152,  # the default model's
                     max_concurrency=concurrency, seed=seed, request_latency_s=0.002)  # fmt: skip
    sched = SchedulerConfig(max_model_len=wl.input_len + wl.output_len)
    rows = []
    for policy in policies:
        r = simulate_fleet(wl, sched, CacheConfig(block_size=block_size), num_blocks, cost, replicas=replicas,
                           policy=policy, num_shared_prefixes=systems)  # fmt: skip
        s = r.summary()
        rows.append({"policy": f"{policy} (simulated)", "requests": s["requests"], "cached_share": s["cached_token_share"],
                     "predicted_share": s["predicted_cached_token_share"], "ttft_p50_ms": s["ttft_p50_ms"],
                     "ttft_p95_ms": s["ttft_p95_ms"], "e2e_p50_ms": None, "req_per_s": None,
                     "out_tok_per_s": s["output_throughput"], "spread": r.per_replica})  # fmt: skip
    return rows


def plot(sections: list[tuple[str, list[dict]]], path: Path) -> None:
    from inferlab.bench.plots import pyplot

    plt = pyplot()

    fig, axes = plt.subplots(len(sections), 2, figsize=(12, 4 * len(sections)), squeeze=False)
    for (title, rows), (a, b) in zip(sections, axes):
        names = [r["policy"] for r in rows]
        a.bar(names, [100 * r["cached_share"] for r in rows], color="tab:green")
        a.set_ylabel("prompt tokens from the prefix cache (%)")
        a.set_ylim(0, 100)
        a.set_title(title, fontsize=9)
        x = range(len(rows))
        b.bar([i - 0.2 for i in x], [r["ttft_p50_ms"] for r in rows], width=0.4, label="TTFT p50")
        b.bar([i + 0.2 for i in x], [r["ttft_p95_ms"] for r in rows], width=0.4, label="TTFT p95")
        b.set_xticks(list(x), names)
        b.set_ylabel("ms")
        b.legend()
        for ax in (a, b):
            ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.suptitle("inferlab router: policies on K shared system prompts × questions")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare(launcher: list[str], env: dict, bases: list[str], items: list[tuple[str, str]], args: argparse.Namespace,
            policies: list[str], tmp: Path, tag: str, concurrency: int) -> list[dict]:  # fmt: skip
    """Every policy behind its own router over `bases`, alternated over the repeats; medians."""
    runs: dict[str, list[dict]] = {pol: [] for pol in policies}
    run_args = argparse.Namespace(**{**vars(args), "concurrency": concurrency})
    for rep, policy in ((r, pol) for r in range(args.repeats) for pol in policies):
        options = ["--policy", policy]
        if args.tokenizer != "replica":  # tokenized in the router: no /tokenize round trip per request
            options += ["--tokenizer", args.tokenizer or args.model or DEFAULT_MODEL.name]
        with routed(launcher, bases, tmp / f"router-{tag}-{policy}.log", env=env, options=options) as base:
            time.sleep(1.0)  # a probe round or two: the KV event feeds synced
            results, wall = asyncio.run(drive(base, items, run_args, salt=f"{tag}-{policy}-{uuid.uuid4().hex}"))
            # only cache-aware looks prompts up in the index (the others predict nothing)
            predicted = router_predicted_share(base) if policy == "cache-aware" else None
        runs[policy].append(row(policy, results, wall, predicted))
        print(f"{tag} {policy} (run {rep + 1}/{args.repeats}): {len(results)} requests in {wall:.1f} s", flush=True)
    return [median_rows(runs[pol]) for pol in policies]


def calibrate(launcher: list[str], env: dict, args: argparse.Namespace, tmp: Path) -> Path:
    """A step profile of the default model here, one thread, fitted and saved: the simulator's
    and the simulated replicas' clock."""
    cost = tmp / "cost.json"
    cmd = [*launcher, "simulate", "--calibrate-engine", "--profile-out", str(tmp / "profile.json"), "--save-cost-model",
           str(cost), "--num-threads", str(args.num_threads), "--profile-max-batch", str(args.calibrate_max_batch),
           "--profile-max-prefill", str(args.calibrate_max_prefill)]  # fmt: skip
    if args.model:
        cmd += ["--model", args.model]
    t0 = time.perf_counter()
    subprocess.run(cmd, env={**os.environ, **env}, check=True, stdout=subprocess.DEVNULL)
    print(f"calibrated the step cost model in {time.perf_counter() - t0:.0f} s", flush=True)
    return cost


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policies", default="cache-aware,least-load,round-robin")
    # 16 prompts of ~600 tokens: more than a replica's share of the traffic can keep warm by
    # chance, so where a request lands decides whether its prefix is prefilled again.
    p.add_argument("--systems", type=int, default=16, help="K shared system prompts")
    p.add_argument("--questions", type=int, default=6, help="questions per system prompt")
    p.add_argument("--system-words", type=int, default=500, help="words per system prompt (~1.2 tokens each)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--model", default=None, help="replica model (default: the server's default)")
    p.add_argument("--tokenizer", default=None,
                   help="--tokenizer for the router (default: the replicas' model; 'replica': their /tokenize)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="runs per policy, alternated; medians reported")
    p.add_argument("--max-seconds-per-policy", type=float, default=75.0,
                   help="a policy's run sends no new request after this long (default 75)")
    p.add_argument("--sim-cost-model", type=Path, default=None,
                   help="a saved linear step cost (inferlab simulate --save-cost-model) instead of calibrating here")
    p.add_argument("--calibrate-max-batch", type=int, default=8, help="the calibration's largest decode batch")
    p.add_argument("--calibrate-max-prefill", type=int, default=512, help="the calibration's longest prompt")
    p.add_argument("--sim-replicas", type=int, default=16, help="simulated replicas for the second comparison (0: none)")
    p.add_argument("--sim-systems", type=int, default=16, help="K there")
    p.add_argument("--sim-questions", type=int, default=8, help="questions per system prompt there")
    p.add_argument("--sim-concurrency", type=int, default=32)
    p.add_argument("--out", type=Path, default=None, help="write the tables (markdown) and the rows (JSON beside it)")
    p.add_argument("--png", type=Path, default=None, help="draw cached share and TTFT per policy here (matplotlib)")
    args = p.parse_args(argv)
    policies = [x for x in args.policies.split(",") if x]

    launcher = [sys.executable, "-m", "inferlab.cli"]
    env = {"PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    sections: list[tuple[str, list[dict]]] = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="inferlab-router-bench-") as tmp_name:
        tmp = Path(tmp_name)
        cost = args.sim_cost_model or calibrate(launcher, env, args, tmp)
        # (1) real replicas of the model
        items = workload(args)
        ports = [free_port() for _ in range(args.replicas)]
        bases = [f"http://127.0.0.1:{port}" for port in ports]
        cmds = []
        for port in ports:
            cmd = [*launcher, "serve", "--port", str(port), "--num-threads", str(args.num_threads), "--log-level", "warning"]
            cmds.append(cmd + (["--model", args.model] if args.model else []))
        with served_many(cmds, bases, [tmp / f"replica{i}.log" for i in range(args.replicas)], env=env, grace_s=5):
            for base in bases:  # warm: the first request of a process pays one-off costs
                httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                "max_tokens": 2}, timeout=300).raise_for_status()  # fmt: skip
            info = httpx.get(bases[0] + "/server_info", timeout=30).json()["kv_cache"]
            shape = (*shared_prefix_tokens(bases[0], items[0][0]), info["num_blocks"], info["block_size"])
            rows = compare(launcher, env, bases, items, args, policies, tmp, "real", args.concurrency)
        rows += simulated_rows(cost, shape, policies, replicas=args.replicas, systems=args.systems,
                               questions=args.questions, concurrency=args.concurrency, max_tokens=args.max_tokens,
                               seed=args.seed)  # fmt: skip
        sections.append((f"{args.replicas} replicas of the model (--num-threads {args.num_threads}), K={args.systems} "
                         f"system prompts × {args.questions} questions, concurrency {args.concurrency}", rows))
        # (2) simulated replicas on the calibrated clock, the replicas' own KV cache size
        if args.sim_replicas:
            sim_args = argparse.Namespace(**{**vars(args), "systems": args.sim_systems, "questions": args.sim_questions})
            ports = [free_port() for _ in range(args.sim_replicas)]
            bases = [f"http://127.0.0.1:{port}" for port in ports]
            cmds = [[*launcher, "serve", "--simulate", str(cost), "--port", str(port), "--num-kv-blocks",
                     str(info["num_blocks"]), "--log-level", "warning"] for port in ports]  # fmt: skip
            with served_many(cmds, bases, [tmp / f"sim{i}.log" for i in range(len(ports))], env=env, timeout_s=180,
                             grace_s=5):
                rows = compare(launcher, env, bases, workload(sim_args), sim_args, policies, tmp, "sim",
                               args.sim_concurrency)  # fmt: skip
                hot_args = argparse.Namespace(**{**vars(sim_args), "systems": 1,
                                                 "questions": args.sim_systems * args.sim_questions})  # fmt: skip
                hot = compare(launcher, env, bases, workload(hot_args), hot_args, policies, tmp, "hot",
                              args.sim_concurrency)  # fmt: skip
            rows += simulated_rows(cost, shape, policies, replicas=args.sim_replicas, systems=args.sim_systems,
                                   questions=args.sim_questions, concurrency=args.sim_concurrency,
                                   max_tokens=args.max_tokens, seed=args.seed)  # fmt: skip
            sections.append((f"{args.sim_replicas} simulated replicas (serve --simulate, calibrated clock), "
                             f"K={args.sim_systems} × {args.sim_questions}, concurrency {args.sim_concurrency}", rows))
            sections.append((f"the same {args.sim_replicas} simulated replicas, one hot system prompt for all "
                             f"{args.sim_systems * args.sim_questions} requests (it must spread)", hot))
    text = "\n\n".join(f"### {title}\n\n{table(rows)}" for title, rows in sections)
    print(text)
    print(f"whole run: {time.perf_counter() - t_start:.0f} s")
    if args.png:
        plot(sections, args.png)
        print(f"plot written to {args.png}")
    if args.out:
        cmdline = " ".join(argv if argv is not None else sys.argv[1:])
        args.out.write_text(f"`benchmarks/router_bench.py {cmdline}`\n\n{text}\n")
        args.out.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                             "sections": sections}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
