"""Scheduler driven on the CPU with hand-made runner outputs (vLLM tests/v1/core style)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from engine_factories import (
    EOS,
    FakeClock,
    make_request,
    make_requests,
    make_runner_output,
    make_scheduler,
    scheduled_tokens,
    shared_prefix_requests,
    step,
)

from inferlab.engine.outputs import ModelRunnerOutput
from inferlab.engine.request import RequestStatus

# ---------------------------------------------------------------- token budget and chunking


def test_token_budget_is_respected_and_last_request_is_chunked():
    sched = make_scheduler(max_num_batched_tokens=10)
    reqs = make_requests(3, num_prompt_tokens=6)
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert scheduled_tokens(out) == {"0": 6, "1": 4}
    assert out.num_scheduled_tokens == 10
    assert [s.sample for s in out.scheduled] == [True, False]
    assert reqs[1].num_computed_tokens == 4  # advanced at schedule time
    assert list(sched.waiting) == [reqs[2]]
    assert [r.status for r in reqs] == [RequestStatus.RUNNING, RequestStatus.RUNNING, RequestStatus.WAITING]


def test_chunked_prefill_mixes_with_decodes_and_samples_only_on_last_chunk():
    sched = make_scheduler(max_num_batched_tokens=8)
    r0 = make_request("r0", num_prompt_tokens=4, first_token=1000)
    sched.add_request(r0)
    step(sched, tokens=7)
    assert r0.output_token_ids == [7]

    r1 = make_request("r1", num_prompt_tokens=20, first_token=2000)
    sched.add_request(r1)
    expected = [  # (r1 start, r1 chunk, sample)
        (0, 7, False),
        (7, 7, False),
        (14, 6, True),
    ]
    for k, (start, n, sample) in enumerate(expected):
        out, core = step(sched, tokens=7)
        assert out.num_scheduled_tokens == 1 + n
        decode, chunk = out.scheduled
        assert (decode.request_id, decode.token_ids, decode.start_pos, decode.sample) == ("r0", [7], 4 + k, True)
        assert chunk.request_id == "r1"
        assert (chunk.start_pos, chunk.token_ids, chunk.sample) == (start, list(range(2000 + start, 2000 + start + n)), sample)
        assert [c.request_id for c in core] == (["r0", "r1"] if sample else ["r0"])
    assert r1.output_token_ids == [7]
    assert r1.num_computed_tokens == 20


def test_long_prefill_token_threshold_caps_each_chunk():
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=3)
    r0, r1 = make_requests(2, num_prompt_tokens=8)
    sched.add_request(r0)
    sched.add_request(r1)
    chunks = []
    for _ in range(3):
        out, _ = step(sched)
        chunks.append([(s.request_id, len(s.token_ids), s.sample) for s in out.scheduled])
    assert chunks == [
        [("0", 3, False), ("1", 3, False)],
        [("0", 3, False), ("1", 3, False)],
        [("0", 2, True), ("1", 2, True)],
    ]


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits_fcfs():
    sched = make_scheduler(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    r0 = make_request("0", num_prompt_tokens=10, first_token=1000)
    r1 = make_request("1", num_prompt_tokens=10, first_token=2000)
    r2 = make_request("2", num_prompt_tokens=3, first_token=3000)
    for r in (r0, r1, r2):
        sched.add_request(r)
    out, _ = step(sched)
    assert scheduled_tokens(out) == {"0": 10}  # r2 would fit but must not overtake r1
    out, _ = step(sched)
    assert scheduled_tokens(out) == {"0": 1, "1": 10, "2": 3}


def test_max_num_seqs_is_respected():
    sched = make_scheduler(max_num_seqs=2)
    r0 = make_request("0", max_tokens=1, first_token=1000)
    r1 = make_request("1", first_token=2000)
    r2 = make_request("2", first_token=3000)
    for r in (r0, r1, r2):
        sched.add_request(r)
    out, core = step(sched)
    assert scheduled_tokens(out) == {"0": 8, "1": 8}
    assert core[0].finish_reason == "length"
    out, _ = step(sched)
    assert scheduled_tokens(out) == {"1": 1, "2": 8}
    assert len(sched.running) == 2


def test_max_model_len_caps_generation():
    sched = make_scheduler(max_model_len=10)
    r0 = make_request("0", num_prompt_tokens=8, max_tokens=None)
    sched.add_request(r0)
    _, core = step(sched)
    assert core[0].finish_reason is None
    _, core = step(sched)
    assert (core[0].finish_reason, r0.num_tokens, r0.status) == ("length", 10, RequestStatus.FINISHED_LENGTH)


def test_request_max_model_len_below_the_config_wins():
    sched = make_scheduler(max_model_len=64)
    r0 = make_request("0", num_prompt_tokens=8, max_tokens=None, max_model_len=9)
    sched.add_request(r0)
    _, core = step(sched)
    assert core[0].finish_reason == "length"
    assert r0.output_token_ids == [7]


# ---------------------------------------------------------------- preemption


def test_preemption_when_blocks_run_out_evicts_the_last_running_request():
    # 4 blocks of 4 slots; two 7-token prompts take 2 blocks each.
    sched = make_scheduler(block_size=4, num_blocks=4, enable_prefix_caching=False)
    r0 = make_request("0", num_prompt_tokens=7, first_token=1000)
    r1 = make_request("1", num_prompt_tokens=7, first_token=2000)
    sched.add_request(r0)
    sched.add_request(r1)
    step(sched)  # prefill both: 7 + 7 tokens, 4 blocks
    assert sched.get_stats().kv_cache_usage == 1.0
    step(sched)  # position 7 fits in the second block of each
    assert (r0.num_tokens, r1.num_tokens) == (9, 9)

    out, core = step(sched)  # r0 needs a third block: r1 (the last) is preempted
    assert scheduled_tokens(out) == {"0": 1}
    assert out.preempted_request_ids == {"1"}
    assert (r1.status, r1.num_computed_tokens, r1.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert list(sched.waiting) == [r1]
    assert sched.running == [r0]
    assert sched.get_stats().num_preemptions == 1
    assert [c.request_id for c in core] == ["0"]

    sched.finish_requests("0", RequestStatus.FINISHED_ABORTED)
    out, core = step(sched)  # r1 is recomputed from scratch: prompt and its 2 outputs
    assert out.finished_request_ids == {"0"}
    (s,) = out.scheduled
    assert (s.request_id, s.start_pos, s.sample) == ("1", 0, True)
    assert s.token_ids == list(range(2000, 2007)) + [7, 7]
    assert r1.status is RequestStatus.RUNNING
    assert r1.output_token_ids == [7, 7, 7]
    assert core[0].num_preemptions == 1


def test_preempted_request_reuses_its_own_cached_prefix_when_still_there():
    sched = make_scheduler(block_size=4, num_blocks=4, enable_prefix_caching=True)
    r0 = make_request("0", num_prompt_tokens=7, first_token=1000)
    r1 = make_request("1", num_prompt_tokens=7, first_token=2000)
    sched.add_request(r0)
    sched.add_request(r1)
    step(sched)
    step(sched)
    assert sched.kv_cache_manager.get_block_ids("1") == [2, 3]
    out, _ = step(sched)  # r1 preempted; freed tail first, so r0 takes block 3 and evicts it
    assert out.preempted_request_ids == {"1"}
    assert sched.kv_cache_manager.get_block_ids("0") == [0, 1, 3]
    sched.finish_requests("0", RequestStatus.FINISHED_ABORTED)
    out, _ = step(sched)
    (s,) = out.scheduled
    # Block 2 (r1's first 4 tokens) survived; the rest is recomputed.
    assert (s.start_pos, len(s.token_ids)) == (4, 5)
    assert s.block_ids[0] == 2
    assert r1.num_cached_tokens == 0  # set at the first schedule only


def test_victim_is_the_request_itself_stops_scheduling_running_requests():
    sched = make_scheduler(block_size=4, num_blocks=4, enable_prefix_caching=False)
    r0 = make_request("0", num_prompt_tokens=6, first_token=1000)
    r1 = make_request("1", num_prompt_tokens=7, first_token=2000)
    sched.add_request(r0)
    sched.add_request(r1)
    step(sched)
    step(sched)
    assert (r0.num_tokens, r1.num_tokens) == (8, 9)
    out, _ = step(sched)  # r0 fits its block; r1 needs one, and is itself the last running
    assert scheduled_tokens(out) == {"0": 1}
    assert out.preempted_request_ids == {"1"}
    assert sched.running == [r0]
    assert list(sched.waiting) == [r1]


def test_no_admission_in_a_step_that_preempted():
    # The victim is mid-prefill: after preemption a budget-sized chunk of it (or r2) would fit,
    # but memory is tight, so nothing is admitted this step.
    sched = make_scheduler(
        block_size=4, num_blocks=4, max_num_batched_tokens=8, enable_prefix_caching=False
    )
    r0 = make_request("0", num_prompt_tokens=3, first_token=1000)
    r1 = make_request("1", num_prompt_tokens=40, first_token=2000)
    sched.add_request(r0)
    sched.add_request(r1)
    out, _ = step(sched)
    assert scheduled_tokens(out) == {"0": 3, "1": 5}
    out, _ = step(sched)
    assert scheduled_tokens(out) == {"0": 1, "1": 7}  # r1 at 12 tokens: 3 blocks, none free
    r2 = make_request("2", num_prompt_tokens=1, first_token=3000)
    sched.add_request(r2)
    out, _ = step(sched)  # r0 needs a second block: r1 preempted, 2 blocks stay free
    assert scheduled_tokens(out) == {"0": 1}
    assert out.preempted_request_ids == {"1"}
    assert sched.kv_cache_manager.num_free_blocks == 2
    assert list(sched.waiting) == [r1, r2]  # the preempted request goes to the front
    out, _ = step(sched)  # next step admits again, FCFS
    assert scheduled_tokens(out) == {"0": 1, "1": 7}


# ---------------------------------------------------------------- prefix cache


def test_prefix_hit_on_a_second_request_sharing_a_prefix():
    sched = make_scheduler(block_size=4)
    r0 = make_request("0", num_prompt_tokens=20, first_token=1000)
    sched.add_request(r0)
    step(sched)
    r1 = make_request("1", r0.prompt_token_ids[:16] + [11, 12, 13, 14, 15])
    sched.add_request(r1)
    out, core = step(sched)
    s1 = next(s for s in out.scheduled if s.request_id == "1")
    assert (s1.start_pos, s1.token_ids, s1.sample) == (16, [11, 12, 13, 14, 15], True)
    assert s1.block_ids[:4] == sched.kv_cache_manager.get_block_ids("0")[:4]
    assert (r0.num_cached_tokens, r1.num_cached_tokens) == (0, 16)
    assert next(c for c in core if c.request_id == "1").num_cached_tokens == 16
    stats = sched.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20 + 21, 16)


def test_prefix_hit_within_one_step_on_blocks_scheduled_earlier_in_it():
    # Blocks enter the cache when scheduled: the runner writes K/V for the whole batch
    # before attending, so a later request in the same step may read them.
    sched = make_scheduler(block_size=4)
    r0 = make_request("0", num_prompt_tokens=12, first_token=1000)
    r1 = make_request("1", r0.prompt_token_ids[:8] + [5, 6])
    sched.add_request(r0)
    sched.add_request(r1)
    out = sched.schedule()
    assert scheduled_tokens(out) == {"0": 12, "1": 2}
    assert r1.num_cached_tokens == 8


def test_prefix_caching_disabled_gives_no_hits():
    sched = make_scheduler(block_size=4, enable_prefix_caching=False)
    r0 = make_request("0", num_prompt_tokens=20)
    sched.add_request(r0)
    step(sched)
    r1 = make_request("1", r0.prompt_token_ids)
    sched.add_request(r1)
    out, _ = step(sched)
    assert scheduled_tokens(out) == {"0": 1, "1": 20}
    assert r1.num_cached_tokens == 0


def test_a_request_freed_before_its_step_ran_leaves_no_cached_blocks():
    # Issue 13, finding 2: blocks enter the cache when scheduled; a request aborted before the
    # step that writes them ran must not leave its hashes behind (16 "cached" tokens of K/V
    # that were never computed).
    sched = make_scheduler(block_size=16)
    r0 = make_request("0", num_prompt_tokens=20)
    sched.add_request(r0)
    sched.schedule()  # blocks cached here, the step never runs
    sched.finish_requests("0", RequestStatus.FINISHED_ABORTED)
    again = make_request("again", r0.prompt_token_ids)
    sched.add_request(again)
    out = sched.schedule()
    assert scheduled_tokens(out) == {"again": 20}
    assert again.num_cached_tokens == 0
    kv = sched.kv_cache_manager
    assert [blk.block_id for blk in kv.block_pool.cached_blocks.values()] == kv.get_block_ids("again")[:1]
    kv.block_pool.check_integrity()


def test_a_failed_step_uncaches_its_blocks_and_requeues_its_requests_in_order():
    sched = make_scheduler(block_size=4)
    r0 = make_request("0", num_prompt_tokens=10, first_token=1000)
    sched.add_request(r0)
    step(sched)  # r0's first two blocks are written and cached
    r1 = make_request("1", num_prompt_tokens=9, first_token=2000)
    r2 = make_request("2", r1.prompt_token_ids[:8] + [7, 7])  # hits r1's blocks in the same step
    sched.add_request(r1)
    sched.add_request(r2)
    out = sched.schedule()
    assert r2.num_cached_tokens == 8
    pool = sched.kv_cache_manager.block_pool
    assert len(pool.cached_blocks) == 4
    sched.discard_step(out)  # the runner raised
    assert len(pool.cached_blocks) == 2  # r0's, written by the step that ran, stay
    assert sched.running == [] and [r.request_id for r in sched.waiting] == ["0", "1", "2"]
    assert all(r.num_computed_tokens == 0 for r in (r0, r1, r2))
    assert sched.num_preemptions == 0  # a failure is not a preemption
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_integrity()
    # Stepping on recomputes them; the new request misses the unwritten blocks.
    out, _ = step(sched)
    assert scheduled_tokens(out) == {"0": 3, "1": 9, "2": 2}  # r0 hits its own written prefix
    assert len(pool.cached_blocks) == 4
    pool.check_integrity()


# ---------------------------------------------------------------- finishing


def test_abort_frees_blocks_from_waiting_and_running():
    sched = make_scheduler(max_num_seqs=1)
    r0, r1 = make_requests(2)
    sched.add_request(r0)
    sched.add_request(r1)
    step(sched)
    assert sched.running == [r0] and list(sched.waiting) == [r1]
    assert sched.get_stats().kv_cache_usage > 0
    done = sched.finish_requests(["0", "1", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert done == [r0, r1]
    assert [r.status for r in done] == [RequestStatus.FINISHED_ABORTED] * 2
    assert r0.finished_time is not None
    assert sched.get_stats().kv_cache_usage == 0.0
    assert not sched.has_unfinished_requests()
    assert "0" not in sched.requests
    assert sched.finish_requests(["0"], RequestStatus.FINISHED_ABORTED) == []
    out = sched.schedule()
    assert out.is_empty
    assert out.finished_request_ids == {"0", "1"}
    assert sched.schedule().finished_request_ids == set()  # reported once
    sched.kv_cache_manager.block_pool.check_integrity()


def test_runner_output_for_a_request_aborted_meanwhile_is_ignored():
    sched = make_scheduler()
    r0 = make_request("0")
    sched.add_request(r0)
    out = sched.schedule()
    sched.finish_requests("0", RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, make_runner_output(out)) == []
    assert r0.output_token_ids == []


def test_finish_requests_needs_a_finished_status():
    sched = make_scheduler()
    with pytest.raises(ValueError, match="finished status"):
        sched.finish_requests("0", RequestStatus.RUNNING)


def test_a_prompt_that_fills_the_context_window_is_refused_at_add_request():
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match="16 tokens: no room to generate within its context window of 16"):
        sched.add_request(make_request("full", num_prompt_tokens=16))
    with pytest.raises(ValueError, match="context window of 8"):
        sched.add_request(make_request("own", num_prompt_tokens=8, max_model_len=8))
    assert not sched.has_unfinished_requests()
    sched.add_request(make_request("fits", num_prompt_tokens=15))


def test_duplicate_request_id_is_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("0"))
    with pytest.raises(ValueError, match="already in the scheduler"):
        sched.add_request(make_request("0"))


def run_to_end(sched, tokens: list[int]):
    """Feed `tokens` one per step; returns the last EngineCoreOutput."""
    last = None
    for t in tokens:
        _, core = step(sched, tokens=t)
        (last,) = core
        if last.finish_reason is not None:
            break
    return last


def test_max_tokens_finishes_with_length():
    sched = make_scheduler()
    r0 = make_request("0", max_tokens=3)
    sched.add_request(r0)
    last = run_to_end(sched, [5, 6, 7, 8])
    assert (last.finish_reason, last.stop_reason, last.new_token_ids) == ("length", None, [7])
    assert r0.output_token_ids == [5, 6, 7]
    assert sched.running == [] and sched.get_stats().kv_cache_usage == 0.0


def test_eos_finishes_with_stop_and_no_stop_reason():
    sched = make_scheduler()
    r0 = make_request("0", max_tokens=10)
    sched.add_request(r0)
    last = run_to_end(sched, [5, EOS, 6])
    assert (last.finish_reason, last.stop_reason) == ("stop", None)
    assert r0.output_token_ids == [5, EOS]
    assert r0.status is RequestStatus.FINISHED_STOPPED


def test_ignore_eos_keeps_going_until_max_tokens():
    sched = make_scheduler()
    r0 = make_request("0", max_tokens=3, ignore_eos=True)
    sched.add_request(r0)
    last = run_to_end(sched, [EOS, EOS, EOS, EOS])
    assert last.finish_reason == "length"
    assert r0.output_token_ids == [EOS, EOS, EOS]


def test_min_tokens_suppresses_eos_and_stop_tokens():
    sched = make_scheduler()
    r0 = make_request("0", max_tokens=10, min_tokens=3, stop_token_ids=[42])
    sched.add_request(r0)
    last = run_to_end(sched, [EOS, 42, EOS, 9])
    assert (last.finish_reason, last.stop_reason) == ("stop", None)
    assert r0.output_token_ids == [EOS, 42, EOS]


def test_stop_token_id_finishes_with_it_as_stop_reason():
    sched = make_scheduler()
    r0 = make_request("0", max_tokens=10, stop_token_ids=[42, 43])
    sched.add_request(r0)
    last = run_to_end(sched, [5, 43, 6])
    assert (last.finish_reason, last.stop_reason) == ("stop", 43)
    assert r0.stop_reason == 43


def test_stop_token_id_stops_even_with_ignore_eos():
    sched = make_scheduler()
    r0 = make_request("0", max_tokens=10, ignore_eos=True, stop_token_ids=[EOS])
    sched.add_request(r0)
    last = run_to_end(sched, [5, EOS])
    assert (last.finish_reason, last.stop_reason) == ("stop", EOS)


def test_finished_request_is_reported_to_the_runner_next_step():
    sched = make_scheduler()
    sched.add_request(make_request("0", max_tokens=1))
    out, core = step(sched)
    assert core[0].finish_reason == "length"
    assert sched.schedule().finished_request_ids == {"0"}


# ---------------------------------------------------------------- outputs, timings, stats


def test_timings_and_core_output_fields():
    clock = FakeClock(100.0)
    sched = make_scheduler(clock=clock)
    r0 = make_request("0", max_tokens=2)
    sched.add_request(r0)
    clock.advance(1.0)
    out = sched.schedule()
    clock.advance(0.5)
    (c,) = sched.update_from_output(
        out, ModelRunnerOutput(request_ids=["0"], sampled_token_ids=[9], logprobs=[None])
    )
    assert (c.request_id, c.new_token_ids, c.new_logprobs, c.finish_reason) == ("0", [9], None, None)
    assert (c.first_scheduled_time, c.first_token_time, c.last_token_time) == (101.0, 101.5, 101.5)
    clock.advance(0.25)
    _, (c,) = step(sched)
    assert (c.first_token_time, c.last_token_time, c.finish_reason) == (101.5, 101.75, "length")
    assert r0.finished_time == 101.75


def test_scheduled_request_carries_references_and_params():
    sched = make_scheduler()
    r0 = make_request("0")
    sched.add_request(r0)
    (s,) = sched.schedule().scheduled
    assert s.prompt_token_ids is r0.prompt_token_ids
    assert s.output_token_ids is r0.output_token_ids
    assert s.sampling_params is r0.sampling_params
    assert s.eos_token_ids == (EOS,)
    assert s.block_ids is sched.kv_cache_manager.get_block_ids("0")


def test_get_stats_snapshot():
    sched = make_scheduler(max_num_seqs=1, block_size=4, num_blocks=10)
    for r in make_requests(3, num_prompt_tokens=8):
        sched.add_request(r)
    step(sched)
    stats = sched.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_blocks, stats.block_size) == (1, 2, 10, 4)
    # 8 computed tokens → 2 of 10 blocks; the sampled 9th gets its slot when it is scheduled.
    assert stats.kv_cache_usage == pytest.approx(0.2)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions) == (8, 0, 0)


# ---------------------------------------------------------------- whole-run invariants


def test_random_workload_keeps_invariants_and_kv_contents_right():
    """Drive many requests (shared prefixes, preemptions) to the end with a fake KV store:
    every slot a step writes records its token, and every scheduled chunk checks that the
    slots of all positions before it (computed or prefix hits) hold its own tokens."""
    rng = random.Random(0)
    b = 4
    sched = make_scheduler(
        max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=b, num_blocks=16
    )
    reqs = shared_prefix_requests(rng, 24, prefix_len=24, max_tail=6, max_tokens=12)
    kv_store: dict[int, int] = {}
    pending = list(reqs)
    for _ in range(2000):
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if not pending and not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        assert out.num_scheduled_tokens <= 16
        assert len(sched.running) <= 4
        for s in out.scheduled:
            r = next(x for x in reqs if x.request_id == s.request_id)
            end = s.start_pos + len(s.token_ids)
            assert s.token_ids == r.all_token_ids[s.start_pos : end]
            assert len(s.block_ids) * b >= end
            for p in range(s.start_pos):
                assert kv_store[s.block_ids[p // b] * b + p % b] == r.all_token_ids[p], (s.request_id, p)
            for p, tok in zip(range(s.start_pos, end), s.token_ids, strict=True):
                kv_store[s.block_ids[p // b] * b + p % b] = tok
        sched.update_from_output(out, make_runner_output(out, tokens=7))
        sched.kv_cache_manager.block_pool.check_integrity()
    else:
        pytest.fail("workload did not finish")
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in reqs)
    assert sched.get_stats().kv_cache_usage == 0.0
    assert sched.get_stats().prefix_cache_hits > 0
    assert sched.get_stats().num_preemptions > 0


def test_bookkeeping_core_imports_no_torch():
    # The planner's simulator and these tests drive the real classes without torch.
    code = (
        "import sys, inferlab.engine.scheduler, inferlab.engine.kv_cache_manager, inferlab.engine.block_pool; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
