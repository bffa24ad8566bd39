"""The workloads every system runs and the figures the table reads from their bench summaries."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Workload:
    """One `inferlab bench` run shape: random prompts of exact length, a closed loop of `concurrency`."""

    key: str  # "load" | "prefill" | "stream" | "sweep-c<N>"
    input_len: int
    output_len: int
    num_prompts: int
    concurrency: int

    @property
    def context(self) -> int:
        return self.input_len + self.output_len

    def describe(self) -> str:
        reqs = "1 request" if self.num_prompts == 1 else f"{self.num_prompts} requests"
        return (f"{self.concurrency} stream{'s' if self.concurrency > 1 else ''}, {reqs}, "
                f"{self.input_len:,} in / {self.output_len} out")


@dataclass(frozen=True)
class Figure:
    """One row of the table: which workload it reads, how, and which direction is better."""

    key: str
    workload: str
    label: str
    value: Callable[[dict[str, Any]], float | None]  # bench summary → the figure
    higher_is_better: bool
    primary: bool = True  # the targets; the others are context


def get(summary: dict[str, Any], key: str) -> float | None:
    v = summary.get(key)
    return float(v) if isinstance(v, (int, float)) else None


def _per_second(ms: float | None, count: float = 1.0) -> float | None:
    return count * 1000.0 / ms if ms else None


def prompt_tokens(s: dict[str, Any]) -> float:
    """Prompt tokens per request as the server counted them."""
    return s["total_input_tokens"] / s["completed"] if s.get("completed") else 0.0


FIGURES = [
    Figure("load_output_tps", "load", "output tok/s", lambda s: get(s, "output_throughput"), True),
    Figure("load_p95_itl_ms", "load", "p95 ITL ms", lambda s: get(s, "p95_itl_ms"), False, primary=False),
    Figure("prefill_ttft_ms", "prefill", "TTFT ms", lambda s: get(s, "median_ttft_ms"), False),
    Figure("prefill_tps", "prefill", "prefill tok/s (prompt tokens / TTFT)",
           lambda s: _per_second(get(s, "median_ttft_ms"), prompt_tokens(s)), True, primary=False),
    Figure("stream_decode_tps", "stream", "decode tok/s (1000 / median TPOT)",
           lambda s: _per_second(get(s, "median_tpot_ms")), True),
    Figure("stream_itl_tps", "stream", "1000 / median ITL", lambda s: _per_second(get(s, "median_itl_ms")), True,
           primary=False),
]


def table_workloads(args: argparse.Namespace) -> list[Workload]:
    """The three comparison workloads, in the order they run on each server (one-slot ones first:
    llama-server needs one slot for the long prompt and is restarted with N slots for the load)."""
    all_ = {
        "stream": Workload("stream", args.stream_input_len, args.stream_output_len, 1, 1),
        "prefill": Workload("prefill", args.prefill_len, args.prefill_output_len, args.prefill_prompts, 1),
        "load": Workload("load", args.load_input_len, args.load_output_len, args.load_prompts or args.load_streams,
                         args.load_streams),
    }
    return [all_[k] for k in ("stream", "prefill", "load") if k in args.workloads]


def sweep_workloads(args: argparse.Namespace) -> list[Workload]:
    return [Workload(f"sweep-c{c}", args.sweep_input_len, args.sweep_output_len, c * args.sweep_prompts_per_client, c)
            for c in args.sweep_levels]


def fmt(x: float | None) -> str:
    """A figure with the digits that matter: 1,234 / 56.7 / 8.9."""
    if x is None:
        return "—"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"
