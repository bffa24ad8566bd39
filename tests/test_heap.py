"""HeapTrimmer: the engine hands freed C-heap pages back when it goes idle and, while busy, at
most once per interval (a fake clock and a spy stand in for time and malloc_trim)."""

from __future__ import annotations

import pytest

from inferlab import LLM, SamplingParams
from inferlab.engine.heap import HeapTrimmer, _libc_malloc_trim
from inferlab.models.testing import make_tiny_hf_model


class Spy:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, pad: int) -> int:
        assert pad == 0
        self.calls += 1
        return 1


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_trims_when_idle_and_at_most_once_per_interval_when_busy():
    spy, clock = Spy(), Clock()
    trimmer = HeapTrimmer(5.0, trim=spy, clock=clock)
    for _ in range(100):  # busy steps within one interval: no trim
        clock.now += 0.04
        assert not trimmer.after_step(idle=False)
    clock.now += 1.0  # 5 s since the start
    assert trimmer.after_step(idle=False) and spy.calls == 1
    assert not trimmer.after_step(idle=False)
    assert trimmer.after_step(idle=True) and spy.calls == 2  # idle: at once, whatever the interval


def test_none_turns_it_off_and_bad_intervals_are_refused():
    spy = Spy()
    trimmer = HeapTrimmer(None, trim=spy)
    assert not trimmer.enabled
    assert not trimmer.after_step(idle=True) and spy.calls == 0
    with pytest.raises(ValueError, match="heap_trim_interval_s"):
        HeapTrimmer(-1.0)


def test_glibc_malloc_trim_is_found_and_runs():
    trim = _libc_malloc_trim()
    if trim is None:
        pytest.skip("this C library has no malloc_trim")
    assert trim(0) in (0, 1)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("heap"), arch="llama")


def test_the_engine_trims_once_its_requests_are_done(tiny_path):
    llm = LLM(str(tiny_path), dtype="float32", num_kv_blocks=64, max_model_len=128, heap_trim_interval_s=3600.0)
    spy = Spy()
    llm.engine.heap_trimmer._trim = spy
    prompts = [[5 + i] * (3 + 7 * i) for i in range(6)]  # six prompt lengths: six activation sizes
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 5 for o in outs)
    assert spy.calls == 1  # busy steps within the interval: none; the step that drained the engine: one
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))
    assert spy.calls == 2


def test_off_means_no_trim_in_the_engine(tiny_path):
    llm = LLM(str(tiny_path), dtype="float32", num_kv_blocks=64, max_model_len=128, heap_trim_interval_s=None)
    llm.engine.heap_trimmer._trim = spy = Spy()
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
    assert spy.calls == 0


def test_a_step_never_waits_for_the_trim(tiny_path):
    """`step` returns its outputs untrimmed; its driver calls `trim_heap` after passing them on."""
    llm = LLM(str(tiny_path), dtype="float32", num_kv_blocks=64, max_model_len=128, heap_trim_interval_s=3600.0)
    llm.engine.heap_trimmer._trim = spy = Spy()
    llm.engine.add_request("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert spy.calls == 0
    assert llm.engine.trim_heap() and spy.calls == 1
