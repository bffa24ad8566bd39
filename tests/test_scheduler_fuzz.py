"""Random schedules with injected failures (hypothesis): the scheduler and block pool keep their
invariants, and no chunk ever attends over K/V that was not written for its own tokens.

A fake KV store records the token each slot holds. A step that runs writes its chunks' tokens;
a step that fails leaves garbage in the same slots (a half-done forward pass) and is discarded
(`Scheduler.discard_step`, what `LLMEngine.step` does when the runner raises). Aborts arrive
between steps, waiting or running. Every scheduled chunk checks that each position before it
(computed earlier, or a prefix-cache hit) holds its own token: a poisoned prefix cache fails here.
"""

from __future__ import annotations

import random

from engine_factories import make_runner_output, make_scheduler, shared_prefix_requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferlab.engine.request import RequestStatus

GARBAGE = -1
B = 4


def _check_and_write(sched, out, by_id, kv_store, value_of, check: bool = True) -> None:
    for s in out.scheduled:
        r = by_id[s.request_id]
        end = s.start_pos + len(s.token_ids)
        assert s.token_ids == r.all_token_ids[s.start_pos : end]
        assert len(s.block_ids) * B >= end
        for p in range(s.start_pos if check else 0):
            assert kv_store.get(s.block_ids[p // B] * B + p % B) == r.all_token_ids[p], (s.request_id, p)
        for p, tok in zip(range(s.start_pos, end), s.token_ids, strict=True):
            kv_store[s.block_ids[p // B] * B + p % B] = value_of(tok)


@settings(max_examples=60, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(
    seed=st.integers(0, 2**31),
    fail_p=st.sampled_from([0.0, 0.05, 0.25]),
    abort_p=st.sampled_from([0.0, 0.03, 0.15]),
    num_blocks=st.integers(8, 24),
    caching=st.booleans(),
)
def test_random_schedules_with_failures_and_aborts(seed, fail_p, abort_p, num_blocks, caching):
    rng = random.Random(seed)
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32, block_size=B,
                           num_blocks=num_blocks, enable_prefix_caching=caching)  # fmt: skip
    pool = sched.kv_cache_manager.block_pool
    reqs = shared_prefix_requests(rng, 16, prefix_len=20, max_tail=5, max_tokens=8)
    by_id = {r.request_id: r for r in reqs}
    kv_store: dict[int, int] = {}
    pending = list(reqs)
    aborted: set[str] = set()
    for _ in range(3000):
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if not pending and not sched.has_unfinished_requests():
            break
        live = list(sched.requests)
        if live and rng.random() < abort_p:
            victim = rng.choice(live)
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        out = sched.schedule()
        assert out.num_scheduled_tokens <= 16 and len(sched.running) <= 4
        if out.scheduled and rng.random() < fail_p:
            # What the step reads is checked as if it ran (its own outputs are thrown away,
            # including what a request read from a block another wrote in the same step);
            # then the slots it wrote are left holding garbage, as a half-done pass would.
            _check_and_write(sched, out, by_id, kv_store, lambda tok: tok)
            _check_and_write(sched, out, by_id, kv_store, lambda tok: GARBAGE, check=False)
            sched.discard_step(out)
        else:
            _check_and_write(sched, out, by_id, kv_store, lambda tok: tok)
            sched.update_from_output(out, make_runner_output(out, tokens=7))
        pool.check_integrity()
        held = sum(len(b) for b in sched.kv_cache_manager.req_to_blocks.values())
        assert pool.num_blocks - pool.num_free_blocks <= held  # no block leaks out of the tables
    else:
        raise AssertionError("workload did not finish")
    for r in reqs:
        if r.request_id in aborted:
            assert r.status is RequestStatus.FINISHED_ABORTED
        else:
            assert r.status is RequestStatus.FINISHED_LENGTH
            assert r.num_output_tokens == r.sampling_params.max_tokens
    assert sched.kv_cache_manager.req_to_blocks == {}
    assert pool.num_free_blocks == pool.num_blocks  # every block back
