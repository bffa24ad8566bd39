"""Arrival schedules: Poisson and gamma statistics over many seeded samples."""

from __future__ import annotations

import math

import numpy as np
import pytest

from inferlab.bench.arrivals import LoadSpec, arrival_offsets

N = 20_001


def gaps(load: LoadSpec, seed: int = 7) -> np.ndarray:
    return np.diff(arrival_offsets(N, load, seed))


def test_poisson_mean_gap_is_one_over_rate_and_cv_is_one():
    g = gaps(LoadSpec(request_rate=4.0))
    assert g.size == N - 1
    assert g.mean() == pytest.approx(0.25, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_the_coefficient_of_variation(burstiness):
    g = gaps(LoadSpec(request_rate=10.0, burstiness=burstiness))
    assert g.mean() == pytest.approx(0.1, rel=0.05)
    assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_first_request_goes_at_zero_and_times_increase():
    t = arrival_offsets(100, LoadSpec(request_rate=5.0), seed=1)
    assert t[0] == 0.0
    assert np.all(np.diff(t) >= 0)


def test_seeded_schedules_repeat_and_differ_by_seed():
    a = arrival_offsets(50, LoadSpec(request_rate=2.0), seed=3)
    b = arrival_offsets(50, LoadSpec(request_rate=2.0), seed=3)
    c = arrival_offsets(50, LoadSpec(request_rate=2.0), seed=4)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_infinite_rate_sends_everything_at_once_and_infinite_burstiness_evenly():
    assert np.all(arrival_offsets(10, LoadSpec(max_concurrency=2)) == 0.0)
    even = arrival_offsets(5, LoadSpec(request_rate=2.0, burstiness=math.inf))
    assert even.tolist() == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0])


def test_bad_load_is_a_value_error():
    with pytest.raises(ValueError, match="request-rate"):
        LoadSpec(request_rate=0)
    with pytest.raises(ValueError, match="burstiness"):
        LoadSpec(request_rate=1, burstiness=0)
    with pytest.raises(ValueError, match="max-concurrency"):
        LoadSpec(max_concurrency=0)


def test_labels():
    assert LoadSpec(max_concurrency=32).label == "concurrency 32"
    assert LoadSpec(request_rate=4, burstiness=0.5).label == "rate 4/s, burstiness 0.5"
