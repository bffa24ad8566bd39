"""Our result beside a vLLM result file, key by key."""

from __future__ import annotations

import pytest

from inferlab.bench.compare import compare_with_vllm, render_comparison


def test_compare_lines_up_shared_keys_and_relative_differences():
    ours = {"runs": [{"summary": {"failed": 1, "incomplete": 1, "timeout": 0, "completed": 98,
                                  "output_throughput": 110.0, "mean_ttft_ms": 50.0, "p99_itl_ms": None}}]}
    theirs = {"failed": 2, "completed": 98, "output_throughput": 100.0, "mean_ttft_ms": 40.0, "p99_itl_ms": 9.0}
    rows = {r.key: r for r in compare_with_vllm(ours, theirs)}
    assert rows["failed (all not completed)"].rel_diff == 0.0
    assert rows["output_throughput"].rel_diff == pytest.approx(0.10)
    assert rows["mean_ttft_ms"].rel_diff == pytest.approx(0.25)
    assert rows["p99_itl_ms"].rel_diff is None and rows["total_input_tokens"].theirs is None
    text = render_comparison(list(rows.values()))
    assert "| output_throughput | 110.00 | 100.00 | +10.0% |" in text
