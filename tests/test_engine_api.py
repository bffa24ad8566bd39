"""The offline API: sampling options, stop rules, n > 1, logprobs, timings and bad input."""

from __future__ import annotations

import pytest

from inferlab import LLM, SamplingParams
from inferlab.engine.errors import ContextLengthError
from inferlab.models.testing import make_tiny_hf_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("api"), arch="llama")
    return LLM(str(path), dtype="float32", num_kv_blocks=512, max_model_len=256)


PROMPT = list(range(20, 60))


def test_max_tokens_and_length_finish(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    c = out.outputs[0]
    assert len(c.token_ids) == 7 and c.finish_reason == "length"
    t = out.metrics.timings()
    assert t["predicted_n"] == 7 and t["prompt_n"] == len(PROMPT) and t["prompt_ms"] > 0
    assert out.metrics.queue_ms >= 0


def test_seed_reproducible_whatever_the_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=123, ignore_eos=True)
    alone = llm.generate(PROMPT, p)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    batch = llm.generate([list(range(5, 30)), PROMPT, list(range(70, 75))], [noise, p, noise])
    assert batch[1].outputs[0].token_ids == alone
    other = llm.generate(PROMPT, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=124, ignore_eos=True))
    assert other[0].outputs[0].token_ids != alone


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    k1 = llm.generate(PROMPT, SamplingParams(temperature=1.5, top_k=1, max_tokens=8, ignore_eos=True))[0]
    assert k1.outputs[0].token_ids == greedy.outputs[0].token_ids
    tiny_p = llm.generate(PROMPT, SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=8, ignore_eos=True))[0]
    assert tiny_p.outputs[0].token_ids == greedy.outputs[0].token_ids
    min_p = llm.generate(PROMPT, SamplingParams(temperature=1.5, min_p=1.0, max_tokens=8, ignore_eos=True))[0]
    assert min_p.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_n_greater_than_one(llm):
    out = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=5, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=5, ignore_eos=True))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_stop_token_ids_and_stop_strings(llm):
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop_tok = greedy.token_ids[4]
    first = greedy.token_ids.index(stop_tok)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok], ignore_eos=True))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop_tok
    assert c.token_ids == greedy.token_ids[: first + 1]

    # A stop string taken from the middle of the greedy text ends the text right before it.
    text = greedy.text
    cut = next(i for i in range(len(text) // 2, len(text) - 3) if text[i : i + 3].strip())
    stop = text[cut : cut + 3]
    assert len(text) >= 8 and stop.strip(), f"the tiny model's text is too short to test stop strings: {text!r}"
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[: text.index(stop)]
    kept = llm.generate(
        PROMPT,
        SamplingParams(temperature=0, max_tokens=12, stop=[stop], include_stop_str_in_output=True, ignore_eos=True),
    )[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_penalties_change_the_output(llm):
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0].token_ids
    pen = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, frequency_penalty=2.0, presence_penalty=2.0, ignore_eos=True))[0]
    rep = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, repetition_penalty=5.0, ignore_eos=True))[0]
    assert len(set(base)) < len(base), "the greedy reply must repeat a token for penalties to act on"
    assert pen.outputs[0].token_ids != base and len(set(pen.outputs[0].token_ids)) >= len(set(base))
    assert rep.outputs[0].token_ids != base


def test_logprobs(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, logprobs=4, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 3
    for tok, (chosen, top) in zip(out.token_ids, out.logprobs):
        assert chosen.token_id == tok and chosen.rank == 1 and chosen.logprob <= 0
        assert len(top) == 4 and top[0].token_id == tok
        assert [t.logprob for t in top] == sorted([t.logprob for t in top], reverse=True)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.5}, "temperature"),
        ({"n": 0}, "n must"),
        ({"min_p": 2.0}, "min_p"),
    ],
)
def test_bad_sampling_params(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**kwargs)


def test_prompt_too_long_is_rejected_and_engine_keeps_going(llm):
    with pytest.raises(ContextLengthError, match="context window"):
        llm.generate(list(range(5, 255)), SamplingParams(max_tokens=50))
    with pytest.raises(ValueError):
        llm.generate([10**9], SamplingParams(max_tokens=5))
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.get_stats().kv_cache_usage == 0.0


def test_abort_frees_blocks_while_others_run(llm):
    eng = llm.engine
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    eng.add_request("keep", PROMPT, p)
    eng.add_request("drop", list(range(100, 180)), p)
    eng.step()
    eng.step()
    assert eng.get_stats().kv_cache_usage > 0
    eng.abort_request("drop")
    finished = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o
    assert finished["drop"].outputs[0].finish_reason == "abort"
    assert finished["keep"].outputs[0].finish_reason == "length"
    assert len(finished["keep"].outputs[0].token_ids) == 30
    assert eng.get_stats().kv_cache_usage == 0.0


def test_the_engine_warms_up_before_it_is_handed_out(tmp_path, monkeypatch):
    """The first request must not pay for kernel builds or first-touch: one short request runs
    inside the constructor, and leaves no trace (no cached prefix, no counted query)."""
    from inferlab.config import CacheConfig, EngineConfig, LoadConfig
    from inferlab.engine.llm_engine import LLMEngine

    steps = []
    real_step = LLMEngine.step
    monkeypatch.setattr(LLMEngine, "step", lambda self: steps.append(1) or real_step(self))
    path = make_tiny_hf_model(tmp_path, arch="llama")
    engine = LLMEngine(EngineConfig(load=LoadConfig(model=str(path), dtype="float32"),
                                    cache=CacheConfig(num_blocks_override=64)))  # fmt: skip
    assert len(steps) >= 3  # a prefill and decode steps ran before the constructor returned
    stats = engine.get_stats()
    assert (stats.prefix_cache_queries, stats.kv_cache_usage, stats.num_running) == (0, 0.0, 0)
    assert engine.scheduler.kv_cache_manager.block_pool.cached_blocks == {}
    assert engine.output_processor.requests == {} and not engine.has_unfinished_requests()
