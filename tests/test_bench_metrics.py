"""Metric arithmetic on hand-made request records: every expected number is worked out by hand."""

from __future__ import annotations

import math

import pytest

from inferlab.bench.metrics import (
    SLO,
    Distribution,
    cost_per_million,
    distserve_goodput,
    parse_metric_names,
    parse_percentiles,
    parse_slo,
    percentile_key,
    summarize,
)
from inferlab.bench.records import RequestRecord, RequestStatus


def rec(
    chunks: list[tuple[float, int]],
    end: float,
    out: int | None = None,
    prompt: int = 10,
    status: RequestStatus = RequestStatus.OK,
    send: float = 0.0,
) -> RequestRecord:
    """A record sent at `send` whose content chunks arrived at (time, tokens)."""
    return RequestRecord(
        index=0,
        status=status,
        error="" if status is RequestStatus.OK else "boom",
        send_time=send,
        end_time=end,
        chunk_times=[t for t, _ in chunks],
        chunk_tokens=[k for _, k in chunks],
        prompt_tokens=prompt,
        output_tokens=out if out is not None else sum(k for _, k in chunks),
    )


def test_ttft_tpot_and_itl_follow_vllm_definitions_with_multi_token_chunks():
    # send 0; chunks at 0.1 (1 tok), 0.2 (1 tok), 0.5 (3 toks); [DONE] at 0.5; 5 tokens
    r = rec([(0.1, 1), (0.2, 1), (0.5, 3)], end=0.5)
    assert r.ttft == pytest.approx(0.1)
    assert r.e2e == pytest.approx(0.5)
    assert r.tpot == pytest.approx((0.5 - 0.1) / (5 - 1))  # 0.1
    # gap 0.1 for one token, then gap 0.3 shared by three tokens: four per-token gaps of 0.1
    assert r.itls == pytest.approx([0.1, 0.1, 0.1, 0.1])


def test_tpot_is_undefined_for_one_token_and_itl_empty():
    r = rec([(0.3, 1)], end=0.35)
    assert r.tpot is None
    assert r.itls == []
    assert r.ttft == pytest.approx(0.3)


def test_percentiles_use_numpy_linear_interpolation():
    d = Distribution.of([0.010, 0.020, 0.030, 0.040, 0.100], (50, 90, 99))
    assert d.count == 5
    assert d.mean == pytest.approx(40.0)
    assert d.median == pytest.approx(30.0)
    assert d.std == pytest.approx(math.sqrt(1000.0))  # population std: (900+400+100+0+3600)/5
    assert d.percentiles[50.0] == pytest.approx(30.0)
    assert d.percentiles[90.0] == pytest.approx(76.0)  # rank 3.6: 40 + 0.6 × 60
    assert d.percentiles[99.0] == pytest.approx(97.6)  # rank 3.96: 40 + 0.96 × 60
    assert Distribution.of([], (50,)) is None


def test_summary_counts_throughput_and_goodput():
    records = [
        rec([(0.1, 1), (0.12, 1), (0.14, 1)], end=0.14),  # ttft 100 ms, tpot 20 ms: good
        rec([(0.6, 1), (0.62, 1)], end=0.62),  # ttft 600 ms: misses ttft:500
        rec([(0.1, 1), (0.16, 1), (0.22, 1)], end=0.22),  # tpot 60 ms: misses tpot:50
        rec([], end=0.3, status=RequestStatus.FAILED),  # not completed
        rec([(0.2, 1)], end=0.2),  # one token: tpot counts as 0, good
        rec([(0.1, 1)], end=0.4, status=RequestStatus.INCOMPLETE),
        rec([], end=1.0, status=RequestStatus.TIMEOUT),
    ]
    s = summarize(records, duration_s=2.0, slo=parse_slo(["ttft:500", "tpot:50"]), max_concurrency=4)
    assert (s.num_requests, s.completed, s.failed, s.incomplete, s.timeout) == (7, 4, 1, 1, 1)
    assert s.errored == 3
    assert s.total_output_tokens == 3 + 2 + 3 + 1  # completed requests only
    assert s.total_input_tokens == 4 * 10
    assert s.request_throughput == pytest.approx(4 / 2.0)
    assert s.output_throughput == pytest.approx(9 / 2.0)
    assert s.total_token_throughput == pytest.approx(49 / 2.0)
    assert s.per_client_output_throughput == pytest.approx(4.5 / 4)
    assert s.good_requests == 2
    assert s.request_goodput == pytest.approx(2 / 2.0)
    assert s.slo_attainment == pytest.approx(2 / 7)
    assert s.latency["ttft"].count == 4
    assert s.latency["tpot"].count == 3  # the one-token answer has no TPOT
    assert s.latency["itl"].count == 2 + 1 + 2
    assert s.errors == {"boom": 3}


def test_e2el_slo_and_empty_slo():
    records = [rec([(0.1, 1), (0.2, 1)], end=0.3), rec([(0.1, 1), (0.2, 1)], end=1.5)]
    s = summarize(records, 2.0, slo=SLO(e2el_ms=1000))
    assert s.good_requests == 1
    no_slo = summarize(records, 2.0)
    assert no_slo.good_requests is None and no_slo.request_goodput is None and no_slo.slo_attainment is None


def test_cost_per_million_matches_the_course_numbers():
    # $0.89/h: one client at 586 tok/s → $0.42/M; 32 clients at 4,854 tok/s → $0.05/M
    assert round(cost_per_million(0.89, 586), 2) == 0.42
    assert round(cost_per_million(0.89, 4854), 2) == 0.05
    assert cost_per_million(0.89, 586) == pytest.approx(0.89 / (586 * 3600) * 1e6)
    assert cost_per_million(0.89, 0) is None


def test_summary_cost_and_per_client_throughput_for_the_32_client_case():
    # 32 requests of 4854/32 tokens each would be awkward; one record carrying all tokens is enough
    records = [rec([(0.01, 1), (1.0, 4853)], end=1.0, prompt=100)]
    s = summarize(records, 1.0, usd_per_hour=0.89, max_concurrency=32)
    assert s.output_throughput == pytest.approx(4854)
    assert round(s.cost_per_million_output_usd, 2) == 0.05
    assert s.per_client_output_throughput == pytest.approx(151.6875)  # ~152 tok/s each, as the course says
    assert s.cost_per_million_input_usd == pytest.approx(0.89 / (100 * 3600) * 1e6)


def test_to_dict_uses_vllm_style_keys():
    s = summarize([rec([(0.1, 1), (0.2, 1)], end=0.2)], 1.0, percentiles=(99, 99.9))
    d = s.to_dict()
    for key in ("mean_ttft_ms", "median_tpot_ms", "std_itl_ms", "p99_ttft_ms", "p99.9_e2el_ms", "request_throughput"):
        assert key in d
    assert d["mean_ttft_ms"] == pytest.approx(100.0)
    assert percentile_key(95) == "p95" and percentile_key(99.9) == "p99.9"


def test_parse_slo_and_bad_syntax():
    slo = parse_slo(["ttft:500,tpot:50", "e2el:10000"])
    assert (slo.ttft_ms, slo.tpot_ms, slo.e2el_ms) == (500, 50, 10000)
    for bad in (["ttft"], ["latency:5"], ["ttft:fast"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_slo(bad)
    assert parse_slo(None).empty


def test_parse_percentiles_and_metric_names():
    assert parse_percentiles("50, 90,99.9") == (50.0, 90.0, 99.9)
    with pytest.raises(ValueError):
        parse_percentiles("0")
    with pytest.raises(ValueError):
        parse_percentiles("p99")
    assert parse_metric_names("ttft,e2el") == ("ttft", "e2el")
    with pytest.raises(ValueError):
        parse_metric_names("ttft,latency")


def test_distserve_goodput_is_highest_load_meeting_the_target():
    points = [(1.0, 1.0), (2.0, 0.95), (4.0, 0.85), (8.0, 0.92)]
    assert distserve_goodput(points, 0.9) == 2.0  # 8 passes only after 4 failed: noise, not capacity
    assert distserve_goodput(points, 0.8) == 8.0
    assert distserve_goodput([(1.0, 0.5)], 0.9) is None
    with pytest.raises(ValueError):
        distserve_goodput(points, 1.5)


def test_prefix_cache_hits_are_summed_and_flagged_for_random_prompts():
    from inferlab.bench.report import _cache_lines

    a, b, c = rec([(0.1, 1)], end=0.2), rec([(0.1, 1)], end=0.2), rec([(0.1, 1)], end=0.2)
    a.cached_tokens, b.cached_tokens, c.cached_tokens = 48, 0, 0
    s = summarize([a, b, c], 1.0)
    assert (s.cached_prompt_tokens, s.cached_requests) == (48, 1)
    assert s.to_dict()["cached_prompt_tokens"] == 48
    assert summarize([rec([(0.1, 1)], end=0.2)], 1.0).cached_prompt_tokens is None  # server said nothing

    doc = {"dataset": {"name": "random", "prefix_len": 0}, "runs": [{"label": "rate 1/s", "summary": s.to_dict()}]}
    [line] = _cache_lines(doc)
    assert line.startswith("rate 1/s: the server reused 48 of 30 prompt tokens from its prefix cache (1 requests)")
    assert "--seed" in line
    doc["dataset"] = {"name": "shared-prefix", "prefix_len": 64}
    assert "--seed" not in _cache_lines(doc)[0]  # hits are the point of a shared prefix
    doc["runs"][0]["summary"] = summarize([b, c], 1.0).to_dict()
    assert _cache_lines(doc) == []
