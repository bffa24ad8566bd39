"""Our result beside `vllm bench serve --save-result`'s, key by key, for cross-checking the
load generator itself against the reference one on the same server.

Run both with the same workload, e.g.

    inferlab bench --base-url URL --dataset random --input-len 512 --output-len 128 \\
        --num-prompts 200 --max-concurrency 16 --ignore-eos --result-file ours.json
    vllm bench serve --backend openai --base-url URL --endpoint /v1/completions \\
        --dataset-name random --random-input-len 512 --random-output-len 128 \\
        --num-prompts 200 --max-concurrency 16 --ignore-eos \\
        --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,95,99 \\
        --save-result --result-filename theirs.json

Known, small differences: vLLM's ITL keeps one gap per chunk where we split a multi-token
chunk per token (identical when every chunk carries one token); vLLM's E2E ends at the last
chunk with choices, ours at [DONE]; vLLM's `failed` is our failed + incomplete + timeout.

Against llama.cpp's llama-server (measured with vLLM 0.32.0, see
benchmarks/results/bench_crosscheck.md): llama-server puts the final usage in its last chunk,
which still has `choices` (empty text, finish_reason); vLLM reads usage only from chunks without
choices, so it re-tokenizes the text instead and counts a few percent fewer output tokens (and
one extra, near-zero ITL gap per request). vLLM's aiohttp pool also loses 1-2 requests in 32 to
"Cannot write to closing transport" on llama-server's keep-alive connections;
`--header Connection=close` on vLLM's side avoids it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Keys both results carry with the same meaning.
SHARED_KEYS = (
    "completed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput",
    *(f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "p99")),
)


@dataclass(frozen=True)
class Comparison:
    key: str
    ours: float | None
    theirs: float | None

    @property
    def rel_diff(self) -> float | None:
        """(ours − theirs) / theirs; None when either side lacks the value or theirs is 0."""
        if self.ours is None or self.theirs is None or self.theirs == 0:
            return None
        return (self.ours - self.theirs) / self.theirs


def compare_with_vllm(ours: dict[str, Any], theirs: dict[str, Any], run_index: int = 0) -> list[Comparison]:
    """Rows for every shared key; `ours` is an inferlab.bench/1 document, `theirs` vLLM's result JSON."""
    summary = ours["runs"][run_index]["summary"]
    rows = [Comparison("failed (all not completed)", float(summary["failed"] + summary["incomplete"] + summary["timeout"]),
                       _num(theirs.get("failed")))]
    rows += [Comparison(k, _num(summary.get(k)), _num(theirs.get(k))) for k in SHARED_KEYS]
    return rows


def render_comparison(rows: list[Comparison]) -> str:
    """A Markdown table: key, ours, vLLM's, relative difference."""
    lines = ["| metric | inferlab | vLLM | diff |", "|---|---:|---:|---:|"]
    for r in rows:
        diff = "—" if r.rel_diff is None else f"{100 * r.rel_diff:+.1f}%"
        lines.append(f"| {r.key} | {_fmt(r.ours)} | {_fmt(r.theirs)} | {diff} |")
    return "\n".join(lines)


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) else None


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:,.2f}"
