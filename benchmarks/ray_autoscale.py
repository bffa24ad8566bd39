"""`inferlab serve --min-replicas 1 --max-replicas 2` under a bounded load ramp: the replica count
against the prompt tokens in flight, as a timeline (PNG + JSON + a markdown summary).

    python benchmarks/ray_autoscale.py                      # a tiny model, ~2 minutes here
    python benchmarks/ray_autoscale.py --model m.gguf --high 6 --hold 40 --out benchmarks/results/ray_autoscale

Phases: idle (`--idle` s), a ramp to `--high` concurrent clients each sending `--prompt-tokens`
token prompts for `--hold` s, then idle until the deployment is back at min replicas (bounded
by `--settle` s). The policy is inferlab.ray_serve.autoscale.QueuedTokensPolicy; the replica
count is Serve's own (serve.status(): RUNNING replicas). It proves the mechanism, not a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import free_port  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: a tiny random model written to a temp dir")
    p.add_argument("--high", type=int, default=6, help="concurrent clients at the top of the ramp")
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--idle", type=float, default=5.0)
    p.add_argument("--hold", type=float, default=30.0)
    p.add_argument("--settle", type=float, default=90.0)
    p.add_argument("--target-queued-tokens", type=float, default=150.0)
    p.add_argument("--downscale-delay", type=float, default=5.0)
    p.add_argument("--replica-cpus", type=float, default=0.5)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ray_autoscale"))
    a = p.parse_args()

    import ray
    from ray import serve

    from inferlab.engine.engine_args import EngineArgs
    from inferlab.ray_serve.launch import HANDLE_METRICS_ENV, ScaleConfig, deploy
    from inferlab.server.app import ServerSettings

    model = a.model
    if model is None:
        from inferlab.models.testing import make_tiny_hf_model

        model = str(make_tiny_hf_model(Path(tempfile.mkdtemp()) / "tiny"))
    os.environ.setdefault(HANDLE_METRICS_ENV, "0")  # before the cluster starts: see launch.deploy
    # Ray's memory monitor kills workers when the *machine* is near full, whoever fills it: on a
    # shared box that is other people's processes, and it took our controller with them.
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = free_port()
    cfg = ScaleConfig(min_replicas=1, max_replicas=2, replica_cpus=a.replica_cpus,
                      target_queued_tokens=a.target_queued_tokens, downscale_delay_s=a.downscale_delay)  # fmt: skip
    deploy(cfg, EngineArgs(model=model, max_num_seqs=2, num_threads=1, num_kv_blocks=128), ServerSettings(served_model_names=("m",)),
           "127.0.0.1", port)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    rng = random.Random(0)
    in_flight_tokens = [0]
    lock = threading.Lock()
    stop_at = [0.0]
    done = {"ok": 0, "failed": 0}
    errors: dict[str, int] = {}

    def client() -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            while time.monotonic() < stop_at[0]:
                with lock:
                    in_flight_tokens[0] += a.prompt_tokens
                try:
                    r = c.post("/v1/completions", json={"model": "m", "max_tokens": a.max_tokens,
                                                            "prompt": [rng.randrange(10, 300) for _ in range(a.prompt_tokens)]})
                    done["ok" if r.status_code == 200 else "failed"] += 1
                    if r.status_code != 200:
                        errors.setdefault(r.text[:300], r.status_code)
                except httpx.HTTPError as e:
                    done["failed"] += 1
                    errors.setdefault(repr(e)[:300], 0)
                finally:
                    with lock:
                        in_flight_tokens[0] -= a.prompt_tokens

    def replicas() -> int:
        return serve.status().applications["inferlab"].deployments["engine"].replica_states.get("RUNNING", 0)

    timeline: list[dict] = []
    t0 = time.monotonic()
    clients: list[threading.Thread] = []

    def sample(phase: str) -> int:
        n = replicas()
        timeline.append({"t": round(time.monotonic() - t0, 2), "phase": phase, "replicas": n,
                         "in_flight_prompt_tokens": in_flight_tokens[0]})  # fmt: skip
        return n

    while time.monotonic() - t0 < a.idle:
        sample("idle")
        time.sleep(0.5)
    stop_at[0] = time.monotonic() + a.hold
    for _ in range(a.high):  # the ramp: one more client per second
        clients.append(threading.Thread(target=client, daemon=True))
        clients[-1].start()
        sample("ramp")
        time.sleep(1.0)
    while time.monotonic() < stop_at[0]:
        sample("hold")
        time.sleep(0.5)
    for c in clients:
        c.join()
    settle_end = time.monotonic() + a.settle
    while time.monotonic() < settle_end:
        if sample("settle") == 1 and any(s["replicas"] == 2 for s in timeline):
            break
        time.sleep(0.5)
    serve.shutdown()
    ray.shutdown()

    counts = [s["replicas"] for s in timeline]
    went = "1 -> 2 -> 1" if 2 in counts and counts[-1] == 1 and counts[0] == 1 else " -> ".join(map(str, sorted(set(counts))))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(a), "requests": done, "errors": errors, "timeline": timeline}, indent=1))
    from inferlab.bench.plots import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ts = [s["t"] for s in timeline]
    ax.step(ts, counts, where="post", label="RUNNING replicas", color="tab:blue")
    ax.set_ylim(0, 2.5)
    ax.set_xlabel("seconds")
    ax.set_ylabel("replicas")
    ax2 = ax.twinx()
    ax2.plot(ts, [s["in_flight_prompt_tokens"] for s in timeline], color="tab:orange", label="prompt tokens in flight")
    ax2.set_ylabel("prompt tokens in flight")
    ax.set_title(f"QueuedTokensPolicy, target {a.target_queued_tokens:g} tokens/replica: {went}")
    fig.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    first_two = next((s["t"] for s in timeline if s["replicas"] == 2), None)
    back = next((s["t"] for s in reversed(timeline) if s["replicas"] == 2), None)
    md = (f"# Ray Serve autoscaling on queued tokens\n\n`python benchmarks/ray_autoscale.py` ({a.high} clients, "
          f"{a.prompt_tokens}-token prompts, {a.hold:g} s hold, target {a.target_queued_tokens:g} queued tokens per "
          f"replica, downscale delay {a.downscale_delay:g} s, {a.replica_cpus:g} CPU per replica).\n\n"
          f"- replicas: {went}; 2 first seen at {first_two} s, last at {back} s (of {timeline[-1]['t']} s)\n"
          f"- requests: {done['ok']} answered, {done['failed']} failed\n\n![timeline]({out.with_suffix('.png').name})\n")  # fmt: skip
    out.with_suffix(".md").write_text(md)
    print(md)
    for text, status in list(errors.items())[:3]:
        print(f"error ({status}): {text}")
    return 0 if went == "1 -> 2 -> 1" and done["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
