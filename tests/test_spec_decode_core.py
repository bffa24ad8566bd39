"""Speculative decoding's torch-free parts: the n-gram proposer, greedy verification, the
config's errors, and the scheduler's budget, rollback and prefix-cache rules with drafts."""

from __future__ import annotations

import argparse

import pytest
from engine_factories import EOS, make_request, make_scheduler

from inferlab.config import SpeculativeConfig
from inferlab.engine.engine_args import EngineArgs
from inferlab.engine.kv_cache_manager import hash_block
from inferlab.engine.ngram_proposer import NgramProposer
from inferlab.engine.outputs import ModelRunnerOutput, SchedulerOutput
from inferlab.engine.request import SamplingParams
from inferlab.engine.scheduler import Scheduler
from inferlab.engine.spec_decode import SpecDecodeStats, accept_greedy, position_rows

# ---------------------------------------------------------------- the proposer


def test_proposer_takes_the_longest_suffix_ngram_then_the_most_recent_match():
    p = NgramProposer(3, max_n=3, min_n=1)
    # Suffix [1, 2, 3] occurs at 0 (followed by 7 8 9); [2, 3] alone also at 5 (followed by 5):
    # the longer n-gram wins.
    assert p.propose([1, 2, 3, 7, 8, 9, 2, 3, 5, 0, 1, 2, 3]) == [7, 8, 9]
    # Two matches of the longest n-gram: the most recent one.
    assert p.propose([4, 5, 1, 4, 5, 2, 4, 5]) == [2, 4, 5]


def test_proposer_respects_min_n_and_finds_nothing_without_a_repeat():
    assert NgramProposer(3, max_n=3, min_n=2).propose([1, 2, 3, 4, 1]) == []  # only a 1-gram recurs
    assert NgramProposer(3, max_n=3, min_n=1).propose([1, 2, 3, 4, 1]) == [2, 3, 4]
    assert NgramProposer(3, max_n=3, min_n=1).propose([1, 2, 3, 4]) == []
    assert NgramProposer(3, max_n=3, min_n=1).propose([1]) == []


def test_proposer_copies_over_its_own_drafts_for_a_periodic_tail():
    p = NgramProposer(5, max_n=2, min_n=1)
    assert p.propose([9, 7, 7, 7]) == [7, 7, 7, 7, 7]
    assert p.propose([1, 2, 1, 2]) == [1, 2, 1, 2, 1]


def test_proposer_caps_the_drafts():
    p = NgramProposer(4, max_n=2, min_n=1)
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert p.propose(tokens) == [3, 4, 5, 6]
    assert p.propose(tokens, max_drafts=2) == [3, 4]
    assert p.propose(tokens, max_drafts=0) == []


def test_proposer_matches_on_token_borders_only():
    # Token ids whose bytes contain the pattern's bytes at an offset that is not a token border.
    p = NgramProposer(2, max_n=1, min_n=1)
    a, b = 0x01000000, 0x00000001  # little-endian bytes 00 00 00 01 | 01 00 00 00
    assert p.propose([a, b, 7, 256]) == []  # 256 = 00 01 00 00 lies across the a|b border
    assert p.propose([256, 3, 4, 256]) == [3, 4]


def test_accept_greedy_keeps_the_matching_prefix_and_the_next_target():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept_greedy([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]  # all accepted + the bonus token
    assert accept_greedy([5, 6, 7], [4, 6, 7, 1]) == [4]
    with pytest.raises(ValueError):
        accept_greedy([5, 6], [5, 6])


def test_stats_count_per_position():
    s = SpecDecodeStats()
    s.observe(3, 2)
    s.observe(4, 0)
    s.observe(2, 2)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 9, 4)
    assert s.accepted_per_pos == [2, 2, 0, 0]
    assert s.drafted_per_pos == [3, 3, 2, 1]


# ---------------------------------------------------------------- the config


def test_config_parses_json_and_dicts():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, '
                                '"prompt_lookup_min": 1}')
    assert c == SpeculativeConfig("ngram", 5, 3, 1)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).num_speculative_tokens == 2
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    engine = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 3}).create_engine_config()
    assert engine.speculative == SpeculativeConfig("ngram", 3)
    assert EngineArgs().create_engine_config().speculative is None


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 17}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": "4"}', "num_speculative_tokens"),
        ('{"method": "medusa", "num_speculative_tokens": 4}', "unknown method 'medusa'"),
        ('{"method": "ngram", "num_speculative_tokens": 4', "not valid JSON"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_maxx": 3}', "prompt_lookup_maxx"),
        ('{"method": "ngram"}', "needs num_speculative_tokens"),
        ('{"num_speculative_tokens": 4}', "needs a method"),
        ('[4]', "JSON object"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2, "prompt_lookup_min": 3}',
         "prompt_lookup_min"),
        ('{"method": "suffix", "num_speculative_tokens": 17}', "num_speculative_tokens"),
        ('{"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 1.5}',
         "suffix_decoding_min_token_prob"),
        ('{"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 0}',
         "suffix_decoding_max_tree_depth"),
        ('{"method": "suffix", "num_speculative_tokens": 4, "prompt_lookup_max": 3}', "'prompt_lookup_max' not read"),
        ('{"method": "draft_model", "num_speculative_tokens": 0, "model": "m"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "adaptive": "yes"}', "adaptive"),
    ],
)
def test_config_errors_name_the_problem(spec, message):
    with pytest.raises(ValueError, match="speculative_config") as e:
        EngineArgs(speculative_config=spec).create_engine_config()
    assert message in str(e.value)


def test_the_flag_reaches_the_engine_config():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 6}'])
    assert EngineArgs.from_cli_args(args).create_engine_config().speculative == SpeculativeConfig("ngram", 6)


# ---------------------------------------------------------------- the scheduler with drafts

SPEC = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1, adaptive=False)
PROMPT = [10, 11, 12, 13, 14, 10, 11, 12]  # after a sampled 13, the 3-gram [11, 12, 13] recurs: drafts 14 10 11 12


def spec_scheduler(**kw) -> Scheduler:
    kw.setdefault("block_size", 4)
    return make_scheduler(speculative_config=SPEC, **kw)


def prefill(sched: Scheduler, request, first: int = 13) -> None:
    sched.add_request(request)
    so = sched.schedule()
    assert so.scheduled[0].num_draft_tokens == 0  # a prefill carries no drafts
    sched.update_from_output(so, ModelRunnerOutput([request.request_id], [first]))


def verify(sched: Scheduler, so: SchedulerOutput, yields: dict[str, list[int]]):
    """A runner's answer: for each request with drafts, the tokens its verification yields."""
    ids = [s.request_id for s in so.scheduled if s.sample]
    out = ModelRunnerOutput(ids, [yields[r][0] if r in yields else 7 for r in ids], spec_token_ids=yields)
    core = sched.update_from_output(so, out)
    sched.kv_cache_manager.block_pool.check_integrity()
    return {c.request_id: c for c in core}


def real_prefix_hashes(request, block_size: int) -> set[int]:
    tokens = request.all_token_ids
    hashes, parent = set(), None
    for i in range(len(tokens) // block_size):
        parent = hash_block(parent, tuple(tokens[i * block_size : (i + 1) * block_size]))
        hashes.add(parent)
    return hashes


def test_a_decode_carries_drafts_and_rejected_ones_are_rolled_back():
    sched = spec_scheduler()
    r = make_request("r", PROMPT, max_tokens=32)
    prefill(sched, r)
    so = sched.schedule()
    (s,) = so.scheduled
    assert (s.token_ids, s.start_pos, s.num_draft_tokens, s.sample) == ([13, 14, 10, 11, 12], 8, 4, True)
    assert so.num_scheduled_tokens == 5
    assert r.num_computed_tokens == 13  # advanced at schedule time by all 5
    core = verify(sched, so, {"r": [14, 10, 99]})  # two drafts accepted, then the target's 99
    assert core["r"].new_token_ids == [14, 10, 99]
    assert (core["r"].num_draft_tokens, core["r"].num_accepted_tokens) == (4, 2)
    assert r.output_token_ids == [13, 14, 10, 99]
    # Positions 0..10 hold accepted K/V; 11 (99) is computed next step: 11 computed, 3 blocks.
    assert r.num_computed_tokens == 11 == r.num_tokens - 1
    assert len(sched.kv_cache_manager.get_block_ids("r")) == 3
    assert len(sched.kv_cache_manager.req_to_blocks["r"]) == 3
    stats = sched.get_stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (1, 4, 2)
    assert stats.spec_accepted_per_pos == (1, 1, 0, 0)


def test_no_block_holding_a_draft_enters_the_prefix_cache():
    sched = spec_scheduler()
    r = make_request("r", PROMPT, max_tokens=32)
    prefill(sched, r)
    pool = sched.kv_cache_manager.block_pool
    for yields in ([14, 77], [5, 6], [8], [1, 2, 3]):
        so = sched.schedule()
        s = so.scheduled[0]
        # Every cached block is a block of real tokens, also while the drafts are in flight.
        assert set(pool.cached_blocks) <= real_prefix_hashes(r, 4)
        if s.num_draft_tokens:
            yields = (s.draft_token_ids[: len(yields) - 1] + yields[-1:])[: s.num_draft_tokens + 1]
            verify(sched, so, {"r": yields})
        else:
            verify(sched, so, {})
        assert set(pool.cached_blocks) <= real_prefix_hashes(r, 4)
        assert r.num_computed_tokens == r.num_tokens - 1


def test_drafts_are_trimmed_to_the_budget_max_tokens_the_context_window_and_the_reply_end():
    for kw, req_kw, want in (
        (dict(max_num_batched_tokens=3), {}, 2),  # 1 + 2 drafts fill the budget of 3
        ({}, dict(max_tokens=3), 1),  # 1 out; this step may yield at most 2 more
        (dict(max_model_len=11), {}, 1),  # 9 tokens; at most 2 more fit the window of 11
        ({}, dict(stop_token_ids=[11]), 2),  # 14 10, not the stop token 11 and what follows it
    ):
        sched = spec_scheduler(**kw)
        r = make_request("r", PROMPT, **{"max_tokens": 32, **req_kw})
        sched.add_request(r)
        while r.num_tokens < 9 or r.num_computed_tokens < 8:  # the (maybe chunked) prefill
            so = sched.schedule()
            sched.update_from_output(so, ModelRunnerOutput([s.request_id for s in so.scheduled if s.sample],
                                                           [13] * sum(s.sample for s in so.scheduled)))
        so = sched.schedule()
        assert so.scheduled[0].num_draft_tokens == want, kw
        assert so.num_scheduled_tokens == 1 + want <= sched.config.max_num_batched_tokens


def test_the_budget_is_shared_with_other_requests():
    sched = spec_scheduler(max_num_batched_tokens=8)
    r = make_request("r", PROMPT, max_tokens=32)
    prefill(sched, r)
    sched.add_request(make_request("q", num_prompt_tokens=20, first_token=500))
    so = sched.schedule()
    by_id = {s.request_id: s for s in so.scheduled}
    assert by_id["r"].num_draft_tokens == 4
    assert len(by_id["q"].token_ids) == 3  # what the 5 tokens of r leave of 8
    assert so.num_scheduled_tokens == 8


@pytest.mark.parametrize("params", [dict(temperature=0.8), dict(temperature=0.0, repetition_penalty=1.2),
                                    dict(temperature=0.0, min_tokens=5)])
def test_drafts_for_sampled_penalised_and_min_tokens_requests(params):
    """Verification samples each position as decoding one at a time would (rejection
    sampling), so these get drafts too: their rows see the drafts before them as output."""
    sched = spec_scheduler()
    r = make_request("r", PROMPT, max_tokens=32)
    r.sampling_params = SamplingParams(max_tokens=32, **params)
    prefill(sched, r)
    so = sched.schedule()
    s = so.scheduled[0]
    assert s.num_draft_tokens == 4
    rows = position_rows(s)
    assert [len(v.output_token_ids) for v in rows] == [1, 2, 3, 4, 5]
    assert rows[3].output_token_ids == s.output_token_ids + s.draft_token_ids[:3]


def test_drafts_end_before_a_stop_token_which_the_step_still_samples():
    sched = spec_scheduler()
    r = make_request("r", PROMPT, max_tokens=32, stop_token_ids=[10])
    prefill(sched, r)
    so = sched.schedule()
    assert so.scheduled[0].draft_token_ids == [14]  # not 14 10 11 12: nothing after 10 is ever kept
    core = verify(sched, so, {"r": [14, 10]})  # 14 accepted; the row after it samples the stop token
    assert core["r"].new_token_ids == [14, 10]
    assert core["r"].finish_reason == "stop" and core["r"].stop_reason == 10
    assert r.output_token_ids == [13, 14, 10]
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks


def test_eos_as_the_correction_token_finishes():
    sched = spec_scheduler()
    r = make_request("r", PROMPT, max_tokens=32)
    prefill(sched, r)
    core = verify(sched, sched.schedule(), {"r": [14, EOS]})
    assert core["r"].new_token_ids == [14, EOS] and core["r"].finish_reason == "stop"


def test_drafts_never_preempt_anyone():
    # 3 blocks of 4: the 8-token prompt and its first output fit; 4 drafts would need a 4th block.
    sched = spec_scheduler(num_blocks=3)
    r = make_request("r", PROMPT, max_tokens=32)
    prefill(sched, r)
    so = sched.schedule()
    assert so.scheduled[0].num_draft_tokens == 3  # 1 + 3 fill the 3 blocks exactly (positions 8..11)
    verify(sched, so, {"r": [14, 10, 11, 12]})
    assert r.num_computed_tokens == 12 and r.num_tokens == 13
    so = sched.schedule()  # position 12 needs a 4th block: none, and no one else to preempt but r
    assert so.is_empty or so.scheduled[0].num_draft_tokens == 0
    assert sched.num_preemptions <= 1


# ---------------------------------------------------------------- /metrics


def test_metrics_under_vllms_names():
    from inferlab.engine.outputs import SchedulerStats
    from inferlab.server.metrics import ServerMetrics

    class Engine:
        model_name = "m"
        max_model_len = 64
        speculative_config = SPEC

        def get_stats(self):
            return SchedulerStats()

    m = ServerMetrics()
    m.on_ready(Engine())
    m.on_stats(SchedulerStats(spec_num_drafts=3, spec_num_draft_tokens=9, spec_num_accepted_tokens=4,
                              spec_accepted_per_pos=(2, 2, 0, 0)))
    m.on_stats(SchedulerStats(spec_num_drafts=4, spec_num_draft_tokens=13, spec_num_accepted_tokens=5,
                              spec_accepted_per_pos=(3, 2, 0, 0)))
    text = m.render().decode()
    labels = 'engine="0",model_name="m"'
    assert f"vllm:spec_decode_num_drafts_total{{{labels}}} 4.0" in text
    assert f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} 13.0" in text
    assert f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} 5.0" in text
    assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="0"}} 3.0' in text
    assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="3"}} 0.0' in text

    class Plain(Engine):
        speculative_config = None

    plain = ServerMetrics()
    plain.on_ready(Plain())
    assert "spec_decode" not in plain.render().decode()


def test_fuzz_invariants_with_drafts():
    """Random prompts over a small vocabulary (n-grams recur), a small pool (preemption), random
    verdicts: the pool stays consistent, every cached block is a block of real tokens, and a
    decoding request has computed all its tokens but the last."""
    import random

    rng = random.Random(5)
    accepted = rejected = preempted = 0
    for trial in range(20):
        block = rng.choice([2, 4, 8])
        # A pool of at least one request's 64 tokens (the engine caps max_model_len to it).
        sched = spec_scheduler(block_size=block, num_blocks=rng.randrange(64 // block, 64 // block + 16),
                               max_num_batched_tokens=rng.randrange(8, 40), max_model_len=64)
        reqs = []
        for i in range(rng.randrange(1, 6)):
            prompt = [rng.randrange(3, 9) for _ in range(rng.randrange(2, 20))]
            reqs.append(make_request(f"{trial}-{i}", prompt, max_tokens=rng.randrange(1, 30),
                                     stop_token_ids=[8] if rng.random() < 0.3 else []))
            sched.add_request(reqs[-1])
        for _ in range(400):
            if not sched.has_unfinished_requests():
                break
            so = sched.schedule()
            assert so.num_scheduled_tokens <= sched.config.max_num_batched_tokens
            yields = {}
            for s in so.scheduled:
                if s.num_draft_tokens:
                    a = rng.randrange(s.num_draft_tokens + 1)
                    yields[s.request_id] = s.draft_token_ids[:a] + [rng.randrange(3, 9)]
            ids = [s.request_id for s in so.scheduled if s.sample]
            sched.update_from_output(so, ModelRunnerOutput(ids, [rng.randrange(3, 9) for _ in ids],
                                                           spec_token_ids=yields))
            pool = sched.kv_cache_manager.block_pool
            pool.check_integrity()
            real: set[int] = set()
            for r in reqs:
                real |= real_prefix_hashes(r, block)
            assert set(pool.cached_blocks) <= real
            for r in sched.running:
                if r.num_output_tokens:
                    # Decoding: all but the last computed; or still in its prompt, or (preempted)
                    # recomputing prompt and output in chunks.
                    limit = r.num_tokens - 1 if r.num_preemptions else r.num_prompt_tokens
                    assert r.num_computed_tokens == r.num_tokens - 1 or r.num_computed_tokens < limit
                held = len(sched.kv_cache_manager.get_block_ids(r.request_id))
                assert held == -(-r.num_computed_tokens // block) or held * block >= r.num_computed_tokens
        assert not sched.has_unfinished_requests()
        assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks
        for r in reqs:
            assert r.num_output_tokens <= r.sampling_params.max_tokens
        st = sched.get_stats()
        accepted += st.spec_num_accepted_tokens
        rejected += st.spec_num_draft_tokens - st.spec_num_accepted_tokens
        preempted += st.num_preemptions
    assert accepted and rejected and preempted  # the fuzz reached every path
