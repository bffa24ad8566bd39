"""benchmarks/spec_decode.py: the paired measure's rows from several processes merge exactly."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from inferlab.engine.outputs import SchedulerOutput

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from spec_decode import Stepped, decode_ratio, merge_processes, prompt_share, rates, ratio_interval, step_once  # noqa: E402


def _row(method: str, turns: list[float], seconds: tuple[float, float], counts: dict, identical: bool = True,
         prompt_seconds: tuple[float, float] = (0.0, 0.0)) -> dict:
    base_s, spec_s = seconds
    return {"workload": "copy", "streams": 32, "method": method, "base_tokens": 100, "spec_tokens": 100,
            "base_tok_s": 100 / base_s, "spec_tok_s": 100 / spec_s, "ratio": sorted(turns)[len(turns) // 2],
            "turn_ratios": turns, "total_ratio": base_s / spec_s, "base_seconds": base_s, "spec_seconds": spec_s,
            "base_steps": 10, "spec_steps": 8, "base_prompt_seconds": prompt_seconds[0],
            "spec_prompt_seconds": prompt_seconds[1], **rates(counts), "identical": identical}


def _counts(drafts: int, accepted_per_pos: list[int], drafted_per_pos: list[int]) -> dict:
    return {"drafts": drafts, "draft_tokens": sum(drafted_per_pos), "accepted": sum(accepted_per_pos),
            "accepted_per_pos": accepted_per_pos, "drafted_per_pos": drafted_per_pos}


def test_turns_are_pooled_and_counts_summed() -> None:
    one = _row("ngram", [0.97, 0.98, 0.99], (1.0, 1.0), _counts(4, [4, 3], [4, 4]))
    two = _row("ngram", [1.04, 1.05, 1.06], (1.0, 0.5), _counts(6, [6, 6, 2], [6, 6, 6]), identical=False)
    (merged,) = merge_processes([[one], [two]])
    assert merged["ratio"] == pytest.approx((0.99 + 1.04) / 2)  # the median of all six turns, not of two medians
    assert merged["process_ratios"] == [0.98, 1.05]
    assert merged["total_ratio"] == pytest.approx((200 / 1.5) / (200 / 2.0))
    assert (merged["base_tokens"], merged["base_steps"], merged["spec_steps"]) == (200, 20, 16)
    # Acceptance from the summed counts: position 3 only ever drafted in the second process.
    assert merged["drafted_steps"] == 10
    assert merged["accept_per_pos"] == pytest.approx([10 / 10, 9 / 10, 2 / 6])
    assert merged["mean_accepted_length"] == pytest.approx(1 + 21 / 10)
    assert merged["acceptance_rate"] == pytest.approx(21 / 26)
    assert merged["identical"] is False  # one process's tokens differed


def test_prompt_steps_are_told_apart_from_the_decode_steps() -> None:
    """A step that carries prompt tokens (a row of more than 1 + its drafts) counts in
    prompt_seconds too; a decode step with drafts does not. Merged rows sum them, and the decode
    ratio compares only the rest: here the methods' prompt steps differ by noise alone."""

    def step_of(rows: list[tuple[int, int]]) -> SchedulerOutput:
        return SchedulerOutput([type("S", (), {"token_ids": [0] * n, "num_draft_tokens": d})() for n, d in rows], 0)

    class Engine:
        step_observer = None

        def __init__(self, steps: list[list[tuple[int, int]]]) -> None:
            self.steps = steps

        def has_unfinished_requests(self) -> bool:
            return bool(self.steps)

        def step(self) -> list:
            self.step_observer(step_of(self.steps.pop(0)), None)
            return []

        def trim_heap(self) -> None:
            pass

    eng = Engine([[(100, 0), (1, 0)], [(1, 0), (3, 2)], [(1, 0), (1, 0)]])  # a prompt chunk, drafts, plain
    run = Stepped(type("L", (), {"engine": eng})(), ["a", "b"])
    for _ in range(3):
        step_once(run)
    assert run.steps == 3 and run.prompt_steps == 1 and 0 < run.prompt_seconds < run.seconds
    assert eng.step_observer is None  # handed back
    one = _row("suffix", [0.95], (10.0, 10.5), _counts(0, [], []), prompt_seconds=(6.0, 6.5))
    two = _row("suffix", [1.0], (10.0, 10.0), _counts(0, [], []), prompt_seconds=(6.0, 6.0))
    (merged,) = merge_processes([[one], [two]])
    assert (merged["base_prompt_seconds"], merged["spec_prompt_seconds"]) == (12.0, 12.5)
    assert decode_ratio(merged) == pytest.approx(1.0)  # 8 s of decode steps each
    assert prompt_share(merged) == pytest.approx(0.6)


def test_rows_of_different_cells_stay_apart() -> None:
    rows = [_row(m, [1.0], (1.0, 1.0), _counts(0, [], [])) for m in ("control", "suffix")]
    merged = merge_processes([rows, rows])
    assert [r["method"] for r in merged] == ["control", "suffix"]
    assert all(r["process_ratios"] == [1.0, 1.0] and r["drafted_steps"] == 0 for r in merged)


def test_interval_resamples_processes_not_turns() -> None:
    # Two processes whose turns agree within each but not between: placement moves a whole
    # process, so the interval must span both processes' levels, not shrink with the turn count.
    groups = [[0.98] * 6, [1.02] * 6]
    mean, lo, hi = ratio_interval(groups)
    assert mean == pytest.approx(math.sqrt(0.98 * 1.02))
    assert lo == pytest.approx(0.98) and hi == pytest.approx(1.02)
    # The same twelve turns taken one by one: a much narrower interval.
    _, lo_t, hi_t = ratio_interval([[x] for g in groups for x in g])
    assert lo < lo_t < mean < hi_t < hi
    assert ratio_interval(groups) == (mean, lo, hi)  # seeded
    with pytest.raises(ValueError):
        ratio_interval([[]])


def test_merged_rows_carry_their_interval_over_processes() -> None:
    one = _row("suffix", [0.99, 1.00, 0.98], (1.0, 1.0), _counts(0, [], []))
    two = _row("suffix", [1.01, 1.00, 1.02], (1.0, 1.0), _counts(0, [], []))
    (merged,) = merge_processes([[one], [two]])
    lo, hi = merged["interval_95"]
    assert merged["interval_over"] == "processes"
    assert lo < merged["geo_mean_ratio"] < hi
    assert merged["geo_mean_ratio"] == pytest.approx(math.exp(sum(math.log(x) for x in [0.99, 1.0, 0.98, 1.01, 1.0, 1.02]) / 6))


def test_vllm_streams_without_vllm_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import signal

    import spec_decode

    monkeypatch.setattr(sys, "argv", ["spec_decode.py", "--vllm-streams", "1"])
    old = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as exit_:
            spec_decode.main()
    finally:
        signal.signal(signal.SIGTERM, old)  # main's unwind_on_sigterm, not left to the rest of the run
    assert exit_.value.code == 2
    assert "--vllm-streams says where vLLM's pair runs: give --vllm too" in capsys.readouterr().err
