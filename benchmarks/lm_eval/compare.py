"""Compare two lm-evaluation-harness runs of the same multiple-choice task, question by question.

    python benchmarks/lm_eval/compare.py RUN_A_SAMPLES.jsonl RUN_B_SAMPLES.jsonl [--names A B]

Prints each run's accuracy, the questions where the chosen answer differs, and the largest
per-choice log-likelihood difference: the figures that say whether two servers score alike.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(path: Path) -> dict[int, dict]:
    return {d["doc_id"]: d for d in map(json.loads, path.read_text().splitlines()) if d}


def loglikelihoods(doc: dict) -> list[float]:
    return [float(r[0]) for r in doc["filtered_resps"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--names", nargs=2, default=["A", "B"])
    args = ap.parse_args(argv)
    a, b = load(args.a), load(args.b)
    if a.keys() != b.keys():
        raise SystemExit(f"the runs scored different questions ({len(a)} vs {len(b)})")
    deltas, differ = [], []
    for i in sorted(a):
        la, lb = loglikelihoods(a[i]), loglikelihoods(b[i])
        deltas += [abs(x - y) for x, y in zip(la, lb, strict=True)]
        if la.index(max(la)) != lb.index(max(lb)):
            differ.append(i)
    na, nb = args.names
    acc = {n: sum(d["acc"] for d in run.values()) / len(run) for n, run in ((na, a), (nb, b))}
    print(f"questions: {len(a)}; accuracy {na} {acc[na]:.3f}, {nb} {acc[nb]:.3f}")
    print(f"questions answered differently: {len(differ)} {differ}")
    deltas.sort()
    print(f"per-choice |Δ log-likelihood| over {len(deltas)} choices: max {deltas[-1]:.4f}, "
          f"median {deltas[len(deltas) // 2]:.4f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
