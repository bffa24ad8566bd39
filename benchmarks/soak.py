"""Soak test: does the server stay up, answer everything and hold its memory under overload?

    .venv/bin/python benchmarks/soak.py                       # 4 min, default model, rate = 2x capacity
    .venv/bin/python benchmarks/soak.py --duration 60 --rate 4 --model tiny-path.gguf

Starts `inferlab serve` on 127.0.0.1 (its own process), measures its capacity with a short
closed loop (max_num_seqs requests at a time), then sends Poisson arrivals at twice that for
--duration seconds: streamed completions of varied prompt and output lengths, a share of them
cancelled after three chunks (the client closes the connection), a share of bad inputs (prompt
longer than the context, bad sampling values, malformed JSON) and a few non-streamed requests.

Every request ends as exactly one of: ok, cancelled (by us), 4xx, 503 (queue full: load
shedding), 5xx (anything else: a bug), hung (no answer within --hang-after seconds). Each
--interval seconds it records those counts, the server's RSS (psutil) and its KV usage from
/metrics. After the load it waits for the server to drain and checks that nothing hung, nothing
was lost and the KV pool is back to zero blocks in use.

Writes benchmarks/results/soak.{md,json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from harness import free_port, served

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUTCOMES = ("ok", "cancelled", "4xx", "503", "5xx", "hung")
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "in distant valleys where rivers carry stories of old kingdoms and forgotten songs").split()


@dataclass
class Sample:
    t: float  # seconds since the load started
    rss_mb: float
    kv_usage: float | None
    running: float | None
    waiting: float | None
    outcomes: dict[str, int] = field(default_factory=dict)  # finished in this interval
    in_flight: int = 0


def server_argv(args: argparse.Namespace, port: int) -> list[str]:
    launcher = shlex.split(args.launcher) if args.launcher else [sys.executable, "-m", "inferlab.cli"]
    cmd = [*launcher, "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-num-seqs", str(args.max_num_seqs), "--max-queue-len", str(args.max_queue_len),
           "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", str(args.max_model_len),
           "--log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    return cmd


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        out[name.partition("{")[0]] = float(value)
    return out


def prompt_text(rng: random.Random, max_words: int) -> str:
    n = int(min(max_words, rng.expovariate(1 / (max_words / 4)) + 4))
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Load:
    """The request mix and the outcome of every request sent."""

    def __init__(self, base: str, args: argparse.Namespace, seed: int = 0):
        self.base = base
        self.args = args
        self.rng = random.Random(seed)
        self.done: list[tuple[float, str]] = []  # (finish time, outcome)
        self.in_flight = 0
        self.sent = 0
        self.t0 = time.monotonic()

    def body(self) -> tuple[str, dict | bytes, bool]:
        """(kind, JSON body or raw bytes, stream)."""
        r, a = self.rng.random(), self.args
        max_tokens = self.rng.randint(8, a.max_tokens)
        prompt = prompt_text(self.rng, a.max_prompt_words)
        if r < a.bad_frac:
            bad = self.rng.randrange(3)
            if bad == 0:  # longer than the context window: 400
                return "bad", {"prompt": "hello " * (a.max_model_len + 10), "max_tokens": 8}, False
            if bad == 1:
                return "bad", {"prompt": prompt, "max_tokens": 8, "temperature": -1}, False
            return "bad", b'{"prompt": "unterminated', False
        if r < a.bad_frac + a.cancel_frac:
            return "cancel", {"prompt": prompt, "max_tokens": max(max_tokens, 16), "stream": True}, True
        if r < a.bad_frac + a.cancel_frac + 0.1:
            return "plain", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8}, False
        return "stream", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "stream": True}, True

    async def one(self, client: httpx.AsyncClient) -> str:
        kind, body, stream = self.body()
        url = self.base + "/v1/completions"
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
        if not stream:
            r = await client.post(url, **kw)
            return _status_outcome(r.status_code)
        async with client.stream("POST", url, **kw) as r:
            if r.status_code != 200:
                await r.aread()
                return _status_outcome(r.status_code)
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return "ok"
                if '"error"' in line[:20]:
                    return "5xx"
                chunks += 1
                if kind == "cancel" and chunks >= 3:
                    return "cancelled"  # leaving the block closes the connection mid-stream
            return "5xx"  # the stream ended without [DONE]

    async def tracked(self, client: httpx.AsyncClient) -> None:
        self.in_flight += 1
        self.sent += 1
        try:
            outcome = await asyncio.wait_for(self.one(client), self.args.hang_after)
        except TimeoutError:
            outcome = "hung"
        except httpx.HTTPError:
            outcome = "5xx"
        self.in_flight -= 1
        self.done.append((time.monotonic() - self.t0, outcome))


def _status_outcome(status: int) -> str:
    if status == 200:
        return "ok"
    if status == 503:
        return "503"
    return "4xx" if 400 <= status < 500 else "5xx"


async def measure_capacity(base: str, args: argparse.Namespace, seconds: float) -> float:
    """Completed requests per second with max_num_seqs requests always in flight (also the warm-up)."""
    load = Load(base, args, seed=1)
    load.args = argparse.Namespace(**{**vars(args), "bad_frac": 0.0, "cancel_frac": 0.0, "hang_after": 600.0})
    stop = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        async def worker() -> None:
            while time.monotonic() < stop:
                await load.tracked(client)
        await asyncio.gather(*(worker() for _ in range(args.max_num_seqs)))
    elapsed = time.monotonic() - load.t0
    return sum(1 for _, o in load.done if o == "ok") / elapsed


async def soak(base: str, pid: int, args: argparse.Namespace, rate: float) -> tuple[list[Sample], Load, dict]:
    proc = psutil.Process(pid)
    load = Load(base, args)
    samples: list[Sample] = []
    tasks: set[asyncio.Task] = set()
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:

        counted = 0

        async def sample() -> None:
            nonlocal counted
            try:
                m = parse_metrics((await client.get(base + "/metrics", timeout=10)).text)
            except httpx.HTTPError:
                m = {}
            new = Counter(o for _, o in load.done[counted:])
            counted = len(load.done)
            samples.append(Sample(time.monotonic() - load.t0, proc.memory_info().rss / 1e6,
                                  m.get("vllm:kv_cache_usage_perc"), m.get("vllm:num_requests_running"),
                                  m.get("vllm:num_requests_waiting"), dict(new), load.in_flight))

        async def sampler(until: float) -> None:
            while time.monotonic() < until:
                await asyncio.sleep(args.interval)
                await sample()

        end = load.t0 + args.duration
        await sample()
        sampling = asyncio.ensure_future(sampler(end + args.hang_after + 30))
        rng = random.Random(2)
        next_t = time.monotonic()
        while True:
            next_t += rng.expovariate(rate)
            if next_t >= end:
                break
            await asyncio.sleep(max(0.0, next_t - time.monotonic()))
            t = asyncio.ensure_future(load.tracked(client))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        # Drain: every request sent must end (ok, cancelled, an error or hung after hang_after).
        if tasks:
            await asyncio.wait(set(tasks), timeout=args.hang_after + 10)
        lost = len(tasks)
        # The server's side: nothing running or waiting, no KV block held.
        drained = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = parse_metrics((await client.get(base + "/metrics", timeout=10)).text)
            drained = {k: m.get(f"vllm:{k}") for k in ("num_requests_running", "num_requests_waiting",
                                                          "kv_cache_usage_perc")}
            if all(v == 0 for v in drained.values()):
                break
            await asyncio.sleep(0.5)
        sampling.cancel()
        await sample()
    return samples, load, {"lost": lost, "drained": drained}


def rss_summary(samples: list[Sample], duration: float) -> dict:
    during = [s for s in samples if s.t <= duration + 1]
    start, mid, end = during[0], during[len(during) // 2], during[-1]
    second_half = [s for s in during if s.t >= duration / 2]
    ts = [s.t for s in second_half]  # the least-squares slope of RSS over the second half
    slope = statistics.linear_regression(ts, [s.rss_mb for s in second_half]).slope if len(set(ts)) > 1 else 0.0
    return {"start_mb": start.rss_mb, "middle_mb": mid.rss_mb, "end_mb": end.rss_mb,
            "after_drain_mb": samples[-1].rss_mb, "peak_mb": max(s.rss_mb for s in samples),
            "second_half_slope_mb_per_min": slope * 60}


def plot(samples: list[Sample], path: Path) -> None:
    from inferlab.bench.plots import pyplot

    plt = pyplot()
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ts = [s.t for s in samples]
    a1.plot(ts, [s.rss_mb for s in samples], color="tab:red", label="server RSS (MB)")
    a1.set_ylabel("RSS (MB)")
    a1b = a1.twinx()
    a1b.plot(ts, [100 * (s.kv_usage or 0) for s in samples], color="tab:blue", alpha=0.6, label="KV in use (%)")
    a1b.set_ylabel("KV blocks in use (%)")
    a1.legend(loc="upper left")
    a1b.legend(loc="upper right")
    bottom = [0.0] * len(samples)
    for o in OUTCOMES:
        vals = [s.outcomes.get(o, 0) for s in samples]
        if any(vals):
            a2.bar(ts, vals, bottom=bottom, width=samples[1].t - samples[0].t if len(samples) > 1 else 1, label=o)
            bottom = [b + v for b, v in zip(bottom, vals)]
    a2.set_ylabel("requests finished per interval")
    a2.set_xlabel("seconds since the load started")
    a2.legend(ncol=len(OUTCOMES), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_report(result: dict, out: Path) -> None:
    r, t = result["rss"], result["totals"]
    a = result["args"]
    ok = result["hung"] == 0 and result["lost"] == 0 and result["kv_back_to_zero"]
    lines = [
        "# Soak: `inferlab serve` under overload",
        "",
        f"`{result['command']}`",
        "",
        f"Server: max_num_seqs {a['max_num_seqs']}, max_queue_len {a['max_queue_len']}, KV {a['kv_cache_memory']}, "
        f"max_model_len {a['max_model_len']}, model {a['model'] or 'default'}. Measured capacity "
        f"{result['capacity_rps']:.2f} req/s (closed loop, {a['max_num_seqs']} in flight); offered "
        f"{result['rate_rps']:.2f} req/s Poisson for {a['duration']:.0f} s: {result['sent']} requests "
        f"({a['cancel_frac']:.0%} cancelled after 3 chunks, {a['bad_frac']:.0%} bad inputs); hung = no answer "
        f"within {a['hang_after']:.0f} s.",
        "",
        "| outcome | " + " | ".join(OUTCOMES) + " | lost |",
        "|---|" + "---|" * (len(OUTCOMES) + 1),
        "| requests | " + " | ".join(str(t.get(o, 0)) for o in OUTCOMES) + f" | {result['lost']} |",
        "",
        "| server RSS | start of load | middle | end of load | after drain | peak | 2nd-half slope |",
        "|---|---|---|---|---|---|---|",
        f"| MB | {r['start_mb']:.0f} | {r['middle_mb']:.0f} | {r['end_mb']:.0f} | {r['after_drain_mb']:.0f} | "
        f"{r['peak_mb']:.0f} | {r['second_half_slope_mb_per_min']:+.1f} MB/min |",
        "",
        f"After the load: running {result['drained'].get('num_requests_running')}, waiting "
        f"{result['drained'].get('num_requests_waiting')}, KV usage {result['drained'].get('kv_cache_usage_perc')}.",
        "",
        ("**Zero hung, zero lost, KV back to zero.**" if ok else
         f"**NOT clean**: hung {result['hung']}, lost {result['lost']}, KV back to zero: {result['kv_back_to_zero']}."),
        "",
        "503 = queue full (--max-queue-len): load shedding, expected at 2x capacity. 4xx = the bad inputs.",
        "5xx = anything else (should be 0). RSS start is after the capacity warm-up.",
        "",
        "![RSS, KV and outcomes over time](soak.png)",
        "",
        "| t (s) | RSS MB | KV % | running | waiting | in flight | " + " | ".join(OUTCOMES) + " |",
        "|---|---|---|---|---|---|" + "---|" * len(OUTCOMES),
    ]
    for s in result["samples"]:
        kv = "-" if s["kv_usage"] is None else f"{100 * s['kv_usage']:.0f}"
        lines.append(f"| {s['t']:.0f} | {s['rss_mb']:.0f} | {kv} | {s['running']} | {s['waiting']} | {s['in_flight']} | "
                     + " | ".join(str(s["outcomes"].get(o, 0)) for o in OUTCOMES) + " |")
    out.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model for the server (default: the server's default)")
    p.add_argument("--duration", type=float, default=240.0, help="seconds of load (default 240)")
    p.add_argument("--rate", type=float, default=None, help="requests/s (default: 2x the measured capacity)")
    p.add_argument("--capacity-seconds", type=float, default=30.0, help="length of the capacity probe")
    p.add_argument("--interval", type=float, default=5.0, help="seconds per recorded interval")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-queue-len", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--max-tokens", type=int, default=48, help="outputs of 8 .. this many tokens")
    p.add_argument("--max-prompt-words", type=int, default=400)
    p.add_argument("--cancel-frac", type=float, default=0.2)
    p.add_argument("--bad-frac", type=float, default=0.05)
    p.add_argument("--hang-after", type=float, default=None,
                   help="seconds without an answer = hung (default: 3x the time a full queue and batch take "
                        "at the measured capacity, at least 120)")
    p.add_argument("--launcher", default=None,
                   help="command that takes `serve ...` instead of `python -m inferlab.cli` (a profiler, say)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {"PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory(prefix="inferlab-soak-") as tmp, \
            served(server_argv(args, port), base, Path(tmp) / "server.log", env=env) as server:
        capacity = asyncio.run(measure_capacity(base, args, args.capacity_seconds))
        rate = args.rate or max(2 * capacity, 0.2)
        if args.hang_after is None:  # a full queue ahead of it and a full batch beside it, three times over
            args.hang_after = max(120.0, 3 * (args.max_num_seqs + args.max_queue_len) / max(capacity, 0.05))
        print(f"capacity {capacity:.2f} req/s; offering {rate:.2f} req/s for {args.duration:.0f} s", flush=True)
        samples, load, end = asyncio.run(soak(base, server.proc.pid, args, rate))
    totals = Counter(o for _, o in load.done)
    drained = end["drained"]
    result = {
        "command": "benchmarks/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "capacity_rps": capacity,
        "rate_rps": rate,
        "sent": load.sent,
        "totals": dict(totals),
        "hung": totals.get("hung", 0),
        "lost": end["lost"] + load.sent - len(load.done),
        "drained": drained,
        "kv_back_to_zero": drained.get("kv_cache_usage_perc") == 0,
        "rss": rss_summary(samples, args.duration),
        "samples": [vars(s) for s in samples],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(result, indent=1))
    plot(samples, args.out / "soak.png")
    write_report(result, args.out / "soak.md")
    print((args.out / "soak.md").read_text().split("![")[0])
    clean = result["hung"] == 0 and result["lost"] == 0 and result["kv_back_to_zero"] and totals.get("5xx", 0) == 0
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
