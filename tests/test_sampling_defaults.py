"""The sampling defaults a request gets (request > override > the model's file > the family
default), the model's own context length, logit_bias and allowed_token_ids in the sampler, and
/props and /version; on the fake engine, on plain rows, and on a tiny real model."""

from __future__ import annotations

import json

import gguf
import httpx
import pytest
import torch
from fake_engine import FakeEngine
from server_harness import ServerThread

from inferlab import __version__
from inferlab.engine.engine_args import EngineArgs
from inferlab.engine.engine_core import resolve_max_model_len
from inferlab.engine.generation_config import (
    LLAMA_CPP_DEFAULTS,
    OPENAI_DEFAULTS,
    SamplingDefaults,
    parse_override,
    read_gguf_sampling,
    read_hf_sampling,
    resolve_sampling_defaults,
)
from inferlab.engine.outputs import ScheduledRequest
from inferlab.engine.request import SamplingParams
from inferlab.engine.sampler import Sampler
from inferlab.models.testing import make_tiny_hf_model
from inferlab.server.app import ServerSettings, build_app
from inferlab.server.protocol import ApiError, ChatCompletionRequest

MSG = [{"role": "user", "content": "hi"}]

# ------------------------------------------------------------------ resolution order


def test_a_gguf_without_sampling_keys_gets_llama_cpps_defaults_and_a_hf_model_openais():
    gg = resolve_sampling_defaults("model", {}, "gguf", is_gguf=True)
    assert gg.values() == LLAMA_CPP_DEFAULTS == {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05,
                                                 "repetition_penalty": 1.0}  # fmt: skip
    assert set(gg.source.values()) == {"llama.cpp"}
    hf = resolve_sampling_defaults("model", {}, "generation_config.json", is_gguf=False)
    assert hf.values() == OPENAI_DEFAULTS and set(hf.source.values()) == {"openai"}


def test_the_models_values_beat_the_family_default_and_the_override_beats_both():
    d = resolve_sampling_defaults("model", {"temperature": 0.6, "top_p": 0.9}, "gguf", is_gguf=True,
                                  override={"top_p": 0.5})  # fmt: skip
    assert (d.temperature, d.top_p, d.top_k, d.min_p) == (0.6, 0.5, 40, 0.05)
    assert d.source == {"temperature": "gguf", "top_p": "override", "top_k": "llama.cpp", "min_p": "llama.cpp",
                        "repetition_penalty": "llama.cpp"}  # fmt: skip


def test_openai_mode_skips_the_models_file_and_llama_cpp_but_keeps_the_override():
    d = resolve_sampling_defaults("openai", {"temperature": 0.6}, "gguf", is_gguf=True, override={"top_k": 5})
    assert (d.temperature, d.top_p, d.top_k, d.min_p) == (1.0, 1.0, 5, 0.0)
    assert d.source["temperature"] == "openai" and d.source["top_k"] == "override"


def test_the_requests_value_beats_every_default():
    d = resolve_sampling_defaults("model", {"temperature": 0.6}, "gguf", is_gguf=True, override={"top_k": 5})
    p = ChatCompletionRequest(messages=MSG, temperature=0.0, top_k=3).to_sampling_params(d)
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.0, 3, 0.95, 0.05)
    q = ChatCompletionRequest(messages=MSG).to_sampling_params(d)
    assert (q.temperature, q.top_k, q.top_p, q.min_p) == (0.6, 5, 0.95, 0.05)
    neutral = ChatCompletionRequest(messages=MSG).to_sampling_params()  # no engine defaults: OpenAI's
    assert (neutral.temperature, neutral.top_p, neutral.top_k, neutral.min_p) == (1.0, 1.0, 0, 0.0)


@pytest.mark.parametrize("text,needle", [('{"temprature": 1}', "temprature"), ("[1]", "JSON object"),
                                         ("{nope", "not valid JSON"), ('{"top_k": 1.5}', "integer")])  # fmt: skip
def test_a_bad_override_is_refused_naming_the_problem(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_override(text)


def test_an_out_of_range_default_fails_at_load_naming_its_source():
    with pytest.raises(ValueError, match=r"top_p.*generation_config.json"):
        resolve_sampling_defaults("model", {"top_p": 0.0}, "generation_config.json", is_gguf=False)


def test_the_engine_args_carry_the_flags():
    import argparse

    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    args = p.parse_args(["--sampling-defaults", "openai", "--override-generation-config", '{"temperature": 0.2}'])
    cfg = EngineArgs.from_cli_args(args).create_engine_config()
    assert cfg.sampling_defaults == "openai" and cfg.override_generation_config == {"temperature": 0.2}
    assert cfg.scheduler.max_model_len is None  # the model's, resolved at load
    with pytest.raises(ValueError, match="sampling_defaults"):
        EngineArgs(sampling_defaults="vllm").create_engine_config()


# ------------------------------------------------------------------ the model's files


def test_generation_config_json_is_read(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "eos_token_id": 2, "max_length": 99}))
    assert read_hf_sampling(tmp_path) == {"temperature": 0.7, "top_k": 20, "top_p": 0.8}
    assert read_hf_sampling(tmp_path / "missing") == {}


def test_gguf_general_sampling_keys_are_read(tmp_path):
    path = tmp_path / "meta.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_float32("general.sampling.temp", 0.25)
    w.add_int32("general.sampling.top_k", 12)
    w.add_float32("general.sampling.min_p", 0.5)
    w.add_float32("general.sampling.penalty_repeat", 1.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert read_gguf_sampling(gguf.GGUFReader(str(path))) == {"temperature": 0.25, "top_k": 12, "min_p": 0.5,
                                                              "repetition_penalty": 1.5}  # fmt: skip


# ------------------------------------------------------------------ context length


def test_max_model_len_is_the_models_capped_by_the_pool():
    assert resolve_max_model_len(None, 8192, 46592) == 8192  # SmolLM2-135M with 1 GiB of KV
    assert resolve_max_model_len(None, 8192, 4096) == 4096  # a request of that length must fit
    assert resolve_max_model_len(1024, 8192, 46592) == 1024  # asked
    assert resolve_max_model_len(16384, 8192, 46592) == 8192  # no more than the model's


# ------------------------------------------------------------------ the sampler


def rows_for(params: list[SamplingParams]) -> list[ScheduledRequest]:
    return [ScheduledRequest(f"r{i}", [1], 0, [0], True, p, [1, 2], []) for i, p in enumerate(params)]


def test_logit_bias_forces_and_bans_tokens_in_one_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    best = logits.argmax(dim=-1)
    params = [
        SamplingParams(temperature=0, logit_bias={7: 100.0}),  # forced
        SamplingParams(temperature=0, logit_bias={int(best[1]): -100.0}),  # its greedy token banned
        SamplingParams(temperature=0),  # untouched
        SamplingParams(temperature=1.0, top_k=40, logit_bias={"9": 100}),  # a string id, as JSON sends it
    ]
    out = Sampler(seed=0)(logits.clone(), rows_for(params)).token_ids
    assert out[0] == 7 and out[1] != int(best[1]) and out[2] == int(best[2]) and out[3] == 9
    assert out[1] == int(logits[1].topk(2).indices[1])  # the next best


def test_allowed_token_ids_restrict_sampling():
    logits = torch.zeros(3, 50)
    logits[:, 0] = 50.0  # token 0 would win every draw
    params = [SamplingParams(temperature=1.0, allowed_token_ids=[3, 4, 5]) for _ in range(2)]
    params.append(SamplingParams(temperature=1.0))
    sampler = Sampler(seed=0)
    seen = set()
    for _ in range(30):
        out = sampler(logits.clone(), rows_for(params)).token_ids
        seen.update(out[:2])
        assert out[2] == 0
    assert seen <= {3, 4, 5} and len(seen) > 1


def test_bad_token_constraints_are_value_errors_naming_the_field():
    with pytest.raises(ValueError, match="^logit_bias"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="^logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match="^allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="^logit_bias has token id 50"):
        SamplingParams(logit_bias={50: 1.0}).check_vocab(50)
    with pytest.raises(ValueError, match="^allowed_token_ids"):
        SamplingParams(allowed_token_ids=[1, 60]).check_vocab(50)


# ------------------------------------------------------------------ the server (fake engine)


@pytest.fixture(scope="module")
def fake_srv():
    with ServerThread(build_app(lambda: FakeEngine(max_model_len=256), ServerSettings(served_model_names=("alias",)))) as s:
        s.wait_ready()
        yield s


def test_version_and_props_on_the_fake_engine(fake_srv):
    assert httpx.get(fake_srv.url("/version")).json() == {"version": __version__}
    p = httpx.get(fake_srv.url("/props")).json()
    assert p["default_generation_settings"]["n_ctx"] == 256 == p["n_ctx"]
    assert p["default_generation_settings"]["params"]["temperature"] == 1.0  # a fake engine has no defaults: OpenAI's
    assert p["total_slots"] == 4 and p["model_alias"] == "alias" and p["model"] == "fake-model"
    assert p["sampling_defaults"]["source"]["temperature"] == "openai"
    assert p["chat_template"] and p["eos_token"] == "</s>"


def test_a_bias_outside_the_vocabulary_is_a_400_naming_it(fake_srv):
    r = httpx.post(fake_srv.url("/v1/chat/completions"), json={"messages": MSG, "logit_bias": {"999": 5}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    assert "999" in r.json()["error"]["message"] and "vocabulary" in r.json()["error"]["message"]


def test_the_server_applies_the_engines_defaults(fake_srv):
    """The defaults reach both routes through one place (OpenAIServing.sampling_params)."""
    serving = fake_srv.app.state.serving
    engine = fake_srv.app.state.llm.engine
    engine.sampling_defaults = SamplingDefaults(temperature=0.3, top_k=7)
    try:
        p = serving.sampling_params(ChatCompletionRequest(messages=MSG, top_k=2))
        assert (p.temperature, p.top_k) == (0.3, 2)
        with pytest.raises(ApiError) as e:
            serving.sampling_params(ChatCompletionRequest(messages=MSG, allowed_token_ids=[10**6]))
        assert e.value.param == "allowed_token_ids"
    finally:
        del engine.sampling_defaults


# ------------------------------------------------------------------ a tiny real model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = make_tiny_hf_model(tmp_path_factory.mktemp("gen-tiny"), arch="llama")
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.3, "top_k": 7}))
    return d


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir):
    from inferlab import LLM

    return LLM(str(tiny_dir), dtype="float32", num_kv_blocks=64, num_threads=1)


def test_the_engine_takes_the_models_defaults_and_context(tiny_llm):
    eng = tiny_llm.engine
    assert eng.sampling_defaults.values() == {**OPENAI_DEFAULTS, "temperature": 0.3, "top_k": 7}
    assert eng.sampling_defaults.source["temperature"] == "generation_config.json"
    assert eng.max_model_len == 512  # the tiny model's max_position_embeddings; 64 x 16 = 1024 pool tokens
    p = tiny_llm.get_default_sampling_params()
    assert (p.temperature, p.top_k, p.top_p) == (0.3, 7, 1.0)
    assert eng.info()["sampling_defaults"]["temperature"] == 0.3


def test_the_pool_caps_the_context_and_the_override_applies(tiny_dir):
    from inferlab import LLM

    llm = LLM(str(tiny_dir), dtype="float32", num_kv_blocks=8, num_threads=1,
              override_generation_config={"temperature": 0.9})  # fmt: skip
    assert llm.engine.max_model_len == 8 * 16  # the pool's 128 tokens, below the model's 512
    assert llm.engine.sampling_defaults.temperature == 0.9 and llm.engine.sampling_defaults.top_k == 7


def test_logit_bias_and_allowed_tokens_on_the_tiny_model(tiny_llm):
    prompt = [5, 6, 7, 8]
    greedy = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    first = greedy.outputs[0].token_ids[0]
    banned = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logit_bias={first: -100}))[0]
    assert banned.outputs[0].token_ids[0] != first
    forced = tiny_llm.generate(prompt, SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True,
                                                      logit_bias={42: 100}, seed=1))[0]  # fmt: skip
    assert forced.outputs[0].token_ids == [42] * 4
    allowed = tiny_llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True,
                                                       allowed_token_ids=[100, 101, 102], seed=3))[0]  # fmt: skip
    assert set(allowed.outputs[0].token_ids) <= {100, 101, 102}
    with pytest.raises(ValueError, match="^logit_bias"):
        tiny_llm.generate(prompt, SamplingParams(logit_bias={10**6: 1}))


def test_props_on_the_tiny_engine(tiny_dir):
    from inferlab.engine.llm_engine import LLMEngine

    cfg = EngineArgs(model=str(tiny_dir), dtype="float32", num_kv_blocks=64, num_threads=1).create_engine_config()
    with ServerThread(build_app(lambda: LLMEngine(cfg))) as srv:
        srv.wait_ready()
        p = httpx.get(srv.url("/props")).json()
        assert p["n_ctx"] == 512 and p["default_generation_settings"]["params"]["temperature"] == 0.3
        assert p["default_generation_settings"]["params"]["top_k"] == 7
        assert p["precision"]["compute"] == "float32" and p["kernels"]["variant"] in ("amx", "avx512", "avx2", "none")
        assert p["model_path"] == str(tiny_dir) and p["chat_template"]
        assert httpx.get(srv.url("/server_info")).json()["sampling_defaults"]["source"]["top_k"] == "generation_config.json"


def test_serve_takes_the_sampling_default_flags_and_generate_does_not():
    """generate's own sampling flags give every value, so the defaults' flags would change nothing there."""
    from inferlab.cli import build_parser

    def parse(argv: list[str]):
        return build_parser(argv)[0].parse_args(argv)

    args = parse(["serve", "--override-generation-config", '{"top_k": 3}'])
    assert EngineArgs.from_cli_args(args).create_engine_config().override_generation_config == {"top_k": 3}
    with pytest.raises(SystemExit):
        parse(["generate", "--override-generation-config", "{}"])
