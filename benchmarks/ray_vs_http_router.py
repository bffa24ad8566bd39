"""Prefix affinity through Ray Serve's request router against `inferlab router`, same workload.

    python benchmarks/ray_vs_http_router.py                  # a tiny model, 2 replicas each way
    python benchmarks/ray_vs_http_router.py --systems 4 --questions 12 --out benchmarks/results/ray_vs_http_router.md

The workload: K system prompts (token ids, `--system-tokens` long) × Q short questions, in one
shuffled order, `--concurrency` at a time, as completions of 4 tokens. Per system: the share of
prompt tokens the replicas served from their prefix cache (their own `cached_tokens`) and how
the requests spread. Both use the cache-aware policy of router/policies.py; the HTTP router
asks the replicas' /metrics and /tokenize, Ray's router reads the replicas' routing stats and
the ingress's tokens. Here it compares routing decisions, not speed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import free_port, routed, served  # noqa: E402


def workload(a: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(a.seed)
    systems = [[rng.randrange(10, 300) for _ in range(a.system_tokens)] for _ in range(a.systems)]
    items = [s + [rng.randrange(10, 300) for _ in range(12)] for s in systems for _ in range(a.questions)]
    rng.shuffle(items)
    return items


def drive(base: str, items: list[list[int]], concurrency: int) -> dict:
    def one(ids: list[int]) -> tuple[int, int, str]:
        r = httpx.post(base + "/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": 4}, timeout=120)
        r.raise_for_status()
        u = r.json()["usage"]
        return u["prompt_tokens"], (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0), r.headers.get(
            "x-inferlab-replica", "?")

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        out = list(pool.map(one, items))
    wall = time.monotonic() - t0
    prompt = sum(p for p, _, _ in out)
    cached = sum(c for _, c, _ in out)
    return {"requests": len(out), "cached_share": cached / max(prompt, 1), "wall_s": wall,
            "spread": dict(Counter(r for _, _, r in out))}  # fmt: skip


def via_http(a: argparse.Namespace, model: str, items: list[list[int]]) -> dict:
    import contextlib

    launcher = [sys.executable, "-m", "inferlab.cli"]
    env = {"PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        bases = []
        for i in range(2):
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            stack.enter_context(served([*launcher, "serve", "--model", model, "--served-model-name", "m", "--port", str(port),
                                        "--num-threads", "1", "--num-kv-blocks", str(a.kv_blocks), "--log-level", "warning"],
                                       base, Path(tmp) / f"r{i}.log", env=env))  # fmt: skip
            bases.append(base)
        with routed(launcher, bases, Path(tmp) / "router.log", env=env, options=["--policy", "cache-aware"]) as base:
            result = drive(base, items, a.concurrency)
    result["spread"] = dict(zip(("replica-a", "replica-b"), sorted(result["spread"].values(), reverse=True)))
    return result


def via_ray(a: argparse.Namespace, model: str, items: list[list[int]]) -> dict:
    import ray
    from ray import serve

    from inferlab.engine.engine_args import EngineArgs
    from inferlab.ray_serve.launch import ScaleConfig, deploy
    from inferlab.server.app import ServerSettings

    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = free_port()
    try:
        deploy(ScaleConfig(replicas=2, replica_cpus=0.5),
               EngineArgs(model=model, num_threads=1, num_kv_blocks=a.kv_blocks),
               ServerSettings(served_model_names=("m",)), "127.0.0.1", port)  # fmt: skip
        result = drive(f"http://127.0.0.1:{port}", items, a.concurrency)
    finally:
        serve.shutdown()
        ray.shutdown()
    result["spread"] = dict(zip(("replica-a", "replica-b"), sorted(result["spread"].values(), reverse=True)))
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: a tiny random model in a temp dir")
    p.add_argument("--systems", type=int, default=4)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=160)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--kv-blocks", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    model = a.model
    if model is None:
        from inferlab.models.testing import make_tiny_hf_model

        model = str(make_tiny_hf_model(Path(tempfile.mkdtemp()) / "tiny"))
    items = workload(a)
    rows = {"inferlab router (HTTP)": via_http(a, model, items), "Ray Serve request router": via_ray(a, model, items)}
    lines = ["| system | requests | prompt tokens from the prefix cache | spread over the 2 replicas |", "|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['requests']} | {r['cached_share']:.1%} | {r['spread']} |")
    text = (f"{a.systems} system prompts of {a.system_tokens} tokens x {a.questions} questions, shuffled, "
            f"concurrency {a.concurrency}, cache-aware policy both ways.\n\n" + "\n".join(lines))  # fmt: skip
    print(text)
    if a.out:
        a.out.write_text(f"# Prefix affinity: Ray Serve's router vs inferlab router\n\n`python benchmarks/ray_vs_http_router.py`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
