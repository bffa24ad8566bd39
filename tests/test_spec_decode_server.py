"""Speculative decoding behind the OpenAI server: the same text as the offline engine without
drafts, streamed or not; acceptance in `timings` and on /metrics under vLLM's names."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_harness import ServerThread, metric, scrape

from inferlab.bench.server_metrics import parse_metrics, speculative_summary
from inferlab.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig, SpeculativeConfig
from inferlab.engine.llm_engine import LLMEngine
from inferlab.models.testing import make_tiny_hf_model
from inferlab.server.app import ServerSettings, build_app

MSG = [{"role": "user", "content": "one two three four five one two three four five one two three four five"}]
SPEC = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1, adaptive=False)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("spec-srv"), arch="llama")


def config(path, spec: SpeculativeConfig | None) -> EngineConfig:
    return EngineConfig(load=LoadConfig(model=str(path), dtype="float32"),
                        cache=CacheConfig(block_size=16, num_blocks_override=64),
                        scheduler=SchedulerConfig(max_model_len=512), num_threads=1, speculative=spec)


def test_server_with_ngram_drafts(tiny_path):
    from inferlab import LLM, SamplingParams

    offline = LLM(str(tiny_path), dtype="float32", num_kv_blocks=64, max_model_len=512, num_threads=1)
    ref = offline.chat(MSG, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0].text

    app = build_app(lambda: LLMEngine(config(tiny_path, SPEC)), ServerSettings(served_model_names=("tiny",)))
    with ServerThread(app) as srv:
        srv.wait_ready()
        client = openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=40, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert r.choices[0].message.content == ref
        t = r.model_extra["timings"]
        assert t["draft_n"] >= t["draft_n_accepted"] > 0 and t["predicted_n"] == 40
        stream = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=40, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ref
        samples = scrape(srv.base_url)
        drafts = metric(samples, "vllm:spec_decode_num_draft_tokens_total")
        accepted = metric(samples, "vllm:spec_decode_num_accepted_tokens_total")
        assert drafts >= accepted >= 2 * t["draft_n_accepted"] > 0
        assert metric(samples, "vllm:spec_decode_num_drafts_total") > 0
        assert metric(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
        # What `inferlab bench` reads off this /metrics (from a fresh server: the totals are the deltas).
        spec = speculative_summary(parse_metrics(httpx.get(srv.url("/metrics")).text))
        assert spec["acceptance_rate"] == pytest.approx(accepted / drafts)
        assert spec["mean_acceptance_length"] == pytest.approx(
            1 + accepted / metric(samples, "vllm:spec_decode_num_drafts_total"))
        assert len(spec["acceptance_per_position"]) == 4 and spec["acceptance_per_position"][0] > 0
