"""The course's own worked figures, as 'cited' `Figure`s with the scenario they belong to, so
`inferlab plan --compare-cited KEY` can set the same scenario up and print the ratios.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inferlab.plan.figures import Figure


@dataclass(frozen=True)
class CitedScenario:
    key: str
    description: str
    model: str
    hardware: str
    input_len: int
    output_len: int
    figures: list[tuple[Figure, int | None]]  # (cited figure, concurrency it was at; None = plan's default)
    weight_precision: str | None = None
    usd_per_hour: float | None = None
    notes: list[str] = field(default_factory=list)


_SEED001_SRC = ("course page 'What Inference Engineering Is' (seeds/001): computed by the course from a "
                "published measurement; Llama-3.1-8B, one H100 80GB, 8,192-token prompts, 256-token replies")
_SEED000_SRC = ("course page 'Introduction' (seeds/000): llama.cpp build 12110, Qwen3-0.6B-Q8_0.gguf on an "
                "RTX 4090 rented at $0.89/hour, measured by the course")


def _c(name: str, value: float, unit: str, source: str, *assumptions: str) -> Figure:
    return Figure(name, value, unit, "cited", list(assumptions), source)


SCENARIOS: dict[str, CitedScenario] = {
    "course-001": CitedScenario(
        key="course-001",
        description="Llama-3.1-8B on one H100 SXM 80GB, 8,192-token prompts, 256-token replies",
        model="llama-3.1-8b",
        hardware="h100-sxm-80gb",
        input_len=8192,
        output_len=256,
        figures=[
            (_c("decode_tokens_per_s_single", 147, "tokens/s", _SEED001_SRC, "one request at a time"), None),
            (_c("max_sequences", 50, "sequences", _SEED001_SRC, "'as many conversations as its memory will hold'"),
             None),
            (_c("per_user_tokens_per_s", 41, "tokens/s", _SEED001_SRC, "at ~50 concurrent"), None),
            (_c("total_tokens_per_s", 2031, "tokens/s", _SEED001_SRC, "at ~50 concurrent"), None),
        ],
    ),
    "course-000": CitedScenario(
        key="course-000",
        description="Qwen3-0.6B Q8_0 with llama.cpp on one RTX 4090 at $0.89/hour",
        model="qwen3-0.6b",
        hardware="rtx-4090",
        input_len=128,
        output_len=128,
        weight_precision="q8_0",
        usd_per_hour=0.89,
        notes=["the page gives no prompt/reply lengths for its speed runs: 128/128 assumed here"],
        figures=[
            (_c("weight_bytes", 610 * 2**20, "bytes", _SEED000_SRC, "the file's size (610 MiB), metadata included"),
             None),
            (_c("decode_tokens_per_s_single", 586, "tokens/s", _SEED000_SRC, "one request at a time"), 1),
            (_c("cost_per_million_tokens_single", 0.42, "USD", _SEED000_SRC, "586 tokens/s at $0.89/hour"), 1),
            (_c("total_tokens_per_s", 4854, "tokens/s", _SEED000_SRC, "32 at once"), 32),
            (_c("per_user_tokens_per_s", 152, "tokens/s", _SEED000_SRC, "32 at once"), 32),
            (_c("cost_per_million_tokens", 0.05, "USD", _SEED000_SRC, "4,854 tokens/s at $0.89/hour"), 32),
        ],
    ),
}


def cited_scenario(key: str) -> CitedScenario:
    if key not in SCENARIOS:
        raise ValueError(f"no cited scenario {key!r}; known: {', '.join(SCENARIOS)}")
    return SCENARIOS[key]
