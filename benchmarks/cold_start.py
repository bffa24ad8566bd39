"""Cold start: how long `inferlab serve` takes to be ready from an empty kernel cache, and
whether the first request after /health says ok is as fast as the second.

    .venv/bin/python benchmarks/cold_start.py [--model PATH] [--runs 3] [--markdown FILE]

Each run starts the server with INFERLAB_CACHE pointing at a new empty folder (kernels are
compiled and the GGUF tokenizer converted again; the model file is passed by path, so nothing
is downloaded), waits for /health, then sends the same greedy chat request twice, prefix cache
off, timing each end to end. Then one run with the warm cache, for the start time beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from harness import free_port, served

BODY = {"messages": [{"role": "user", "content": "In one sentence, why might a parcel arrive a day late?"}],
        "max_tokens": 32, "temperature": 0, "ignore_eos": True, "cache_prompt": False}  # fmt: skip


def one_run(model: str, cache: str | None, work: Path, extra: list[str]) -> dict[str, float]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [str(Path(sys.executable).parent / "inferlab"), "serve", "--model", model, "--port", str(port),
            "--log-level", "warning", *extra]  # fmt: skip
    env = {"INFERLAB_CACHE": cache} if cache else {}
    with served(argv, base, work / f"server-{port}.log", env=env) as srv:
        times = []
        for _ in range(2):
            t = time.monotonic()
            r = httpx.post(base + "/v1/chat/completions", json=BODY, timeout=600)
            r.raise_for_status()
            times.append(time.monotonic() - t)
        info = httpx.get(base + "/health", timeout=5).status_code
        assert info == 200, srv.log_path
    return {"ready_s": srv.ready_s, "first_s": times[0], "second_s": times[1], "ratio": times[0] / times[1]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF path (default: the default model, from its cache)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--serve-args", default="", help="extra `inferlab serve` flags, e.g. '--weight-dtype int8'")
    ap.add_argument("--markdown", type=Path, default=None)
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        from inferlab.models.registry import resolve_model

        model = str(resolve_model(None).path)
    extra = args.serve_args.split()
    rows = []
    with tempfile.TemporaryDirectory(prefix="inferlab-cold-") as tmp:
        work = Path(tmp)
        for i in range(args.runs):
            cache = tempfile.mkdtemp(prefix=f"cache{i}-", dir=tmp)
            rows.append(("cold", one_run(model, cache, work, extra)))
            print(f"cold run {i + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in rows[-1][1].items()), flush=True)
        rows.append(("warm", one_run(model, None, work, extra)))
        print("warm run: " + ", ".join(f"{k} {v:.2f}" for k, v in rows[-1][1].items()), flush=True)
    cold = [r for kind, r in rows if kind == "cold"]
    med = {k: statistics.median(r[k] for r in cold) for k in cold[0]}
    lines = [
        "| run | ready (s) | first request (s) | second request (s) | first / second |",
        "|---|---:|---:|---:|---:|",
        *(f"| {kind} | {r['ready_s']:.1f} | {r['first_s']:.3f} | {r['second_s']:.3f} | {r['ratio']:.2f} |" for kind, r in rows),
        f"| cold, median of {len(cold)} | {med['ready_s']:.1f} | {med['first_s']:.3f} | {med['second_s']:.3f} | "
        f"**{med['ratio']:.2f}** |",
    ]
    table = "\n".join(lines)
    print(table)
    load = os.getloadavg()
    if args.markdown:
        args.markdown.write_text(
            f"# Cold start\n\n`.venv/bin/python benchmarks/cold_start.py {' '.join(argv or sys.argv[1:])}`\n\n"
            f"Model {model}; a chat request of 32 greedy tokens, prefix cache off, sent twice after /health "
            f"says ok. Load average at the end {load[0]:.2f}.\n\n{table}\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
