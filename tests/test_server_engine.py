"""The server on the real engine: a tiny random model in Hugging Face format (fast), and the
default SmolLM2-135M-Instruct GGUF (slow: marked)."""

from __future__ import annotations

import dataclasses

import httpx
import openai
import pytest
import torch
from server_harness import ServerThread, metric, scrape, sse_events, wait_until

from inferlab.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig
from inferlab.engine.llm_engine import LLMEngine
from inferlab.models.testing import load_reference_model, make_tiny_hf_model
from inferlab.server.app import ServerSettings, build_app

MSG = [{"role": "user", "content": "Hello, world! How are you today?"}]


def tiny_config(path, **sched) -> EngineConfig:
    return EngineConfig(
        load=LoadConfig(model=str(path), dtype="float32"),
        cache=CacheConfig(block_size=16, num_blocks_override=64),
        scheduler=SchedulerConfig(max_model_len=sched.pop("max_model_len", 512), **sched),
        num_threads=1,
    )


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("srv-tiny"), arch="llama")


@pytest.fixture(scope="module")
def srv(tiny_path):
    config = tiny_config(tiny_path)
    with ServerThread(build_app(lambda: LLMEngine(config), ServerSettings(served_model_names=("tiny",)))) as s:
        s.wait_ready()
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0)


def test_chat_matches_the_offline_engine(srv, client, tiny_path):
    from inferlab import LLM, SamplingParams

    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    offline = LLM(str(tiny_path), dtype="float32", num_kv_blocks=64, max_model_len=512)
    out = offline.chat(MSG, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert r.choices[0].message.content == out.outputs[0].text
    assert r.usage.prompt_tokens == len(out.prompt_token_ids)
    t = r.model_extra["timings"]
    assert t["predicted_n"] == 8 and t["prompt_n"] + t["cache_n"] == r.usage.prompt_tokens


def test_stream_equals_non_stream(client):
    kw = dict(model="tiny", messages=MSG, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert chunks[-1].usage.completion_tokens == 12


def test_seeded_sampling_is_reproducible_and_n_works(client):
    kw = dict(model="tiny", prompt="The quick brown fox", max_tokens=10, temperature=1.0, seed=7, n=2,
              extra_body={"ignore_eos": True})  # fmt: skip
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 2
    assert a.usage.completion_tokens == 20


def test_stop_string(client):
    kw = dict(model="tiny", prompt="Hello, world!", max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    stop = full[5:8]
    r = client.completions.create(**kw, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_context_overflow_and_tokenize(srv):
    r = httpx.post(srv.url("/v1/completions"), json={"prompt": "Hello", "max_tokens": 600})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["n_ctx"] == 512 and err["n_prompt_tokens"] >= 1 and "600" in err["message"]
    tok = httpx.post(srv.url("/tokenize"), json={"messages": MSG, "return_token_strs": True}).json()
    assert tok["max_model_len"] == 512 and tok["count"] == len(tok["tokens"]) == len(tok["token_strs"])
    back = httpx.post(srv.url("/detokenize"), json={"tokens": tok["tokens"]}).json()["prompt"]
    assert "Hello, world!" in back and "<|im_start|>" in back


def test_prefix_cache_reuse_and_cache_prompt_false(srv):
    body = {"messages": [{"role": "user", "content": "The scheduler batches requests; " * 4}], "max_tokens": 1}
    httpx.post(srv.url("/v1/chat/completions"), json=body)
    r = httpx.post(srv.url("/v1/chat/completions"), json=body).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 and r["timings"]["cache_n"] >= 16
    r = httpx.post(srv.url("/v1/chat/completions"), json={**body, "cache_prompt": False}).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    s = scrape(srv.base_url)
    assert metric(s, "vllm:prefix_cache_hits_total") >= 16
    assert metric(s, "vllm:cache_config_info", block_size="16", num_gpu_blocks="64") == 1


def test_lm_eval_loglikelihood_request(srv, tiny_path):
    """lm-eval's local-completions scoring: token-id prompts, echo, logprobs 1, max_tokens 1 (or
    0). Each prompt token's logprob must be a full forward's (transformers' own model): a server
    that ignored echo would hand back only the generated token's, and lm-eval would score chance.
    The second prompt shares the first's 32-token prefix (two cached blocks it must not use)."""
    g = torch.Generator().manual_seed(21)
    shared = torch.randint(3, 250, (32,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 250, (9,), generator=g).tolist(), shared + [7, 8, 9]]
    ref = load_reference_model(tiny_path)
    body = {"model": "tiny", "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    r = httpx.post(srv.url("/v1/completions"), json=body, timeout=60)
    assert r.status_code == 200, r.text
    scored = httpx.post(srv.url("/v1/completions"), json={**body, "max_tokens": 0}, timeout=60).json()
    for prompt, choice, alone in zip(prompts, r.json()["choices"], scored["choices"]):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        with torch.no_grad():
            ref_lp = torch.log_softmax(ref(torch.tensor([prompt])).logits[0].float(), dim=-1)
        for p in range(1, len(prompt)):
            want = float(ref_lp[p - 1, prompt[p]])
            assert abs(lp["token_logprobs"][p] - want) <= 1e-4 * max(1.0, abs(want)), p
            top = lp["top_logprobs"][p]
            assert 1 <= len(top) <= 2 and max(top.values()) >= lp["token_logprobs"][p]
            if prompt[p] == int(ref_lp[p - 1].argmax()):  # lm-eval's is_greedy
                assert max(top.values()) == lp["token_logprobs"][p]
        # max_tokens 0: the same prompt entries, and nothing else.
        assert alone["finish_reason"] == "length"
        assert alone["logprobs"]["token_logprobs"] == lp["token_logprobs"][:-1]
        assert alone["text"] == choice["text"][: len(alone["text"])]
    assert scored["usage"]["completion_tokens"] == 0
    # vLLM's prompt_logprobs agree with the echoed entries.
    plp = httpx.post(srv.url("/v1/completions"), json={"prompt": prompts[1], "max_tokens": 1, "prompt_logprobs": 1}).json()
    entries = plp["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompts[1])
    want = scored["choices"][1]["logprobs"]["token_logprobs"]
    assert [e[str(t)]["logprob"] for e, t in zip(entries[1:], prompts[1][1:])] == want[1:]


def test_tokenizer_info_on_the_real_tokenizer(srv):
    info = httpx.get(srv.url("/tokenizer_info")).json()
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] == "<|im_start|>"
    assert "<|im_start|>" in info["chat_template"] and info["model_max_length"] == 512
    assert info["tokenizer_class"] and "vocab_file" not in info and "name_or_path" not in info
    # lm-eval's remote tokenizer encodes the eos token through /tokenize to find its id.
    ids = httpx.post(srv.url("/tokenize"), json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert ids["tokens"] == [2]


def test_disconnect_frees_blocks_on_the_real_engine(srv):
    def gauges():
        s = scrape(srv.base_url)
        return metric(s, "vllm:num_requests_running"), metric(s, "vllm:kv_cache_usage_perc")

    wait_until(lambda: gauges() == (0, 0), what="an idle engine")
    before = metric(scrape(srv.base_url), "vllm:request_success_total", finished_reason="abort")
    body = {"prompt": "Once upon a time", "max_tokens": 480, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", srv.url("/v1/completions"), json=body) as r:
        events = sse_events(r)
        next(events)
        next(events)
    wait_until(lambda: gauges() == (0, 0), what="the aborted request's blocks to be freed")
    s = scrape(srv.base_url)
    assert metric(s, "vllm:request_success_total", finished_reason="abort") == before + 1


def test_a_retry_after_a_failed_step_is_not_served_unwritten_cache(tiny_path):
    """Issue 13, finding 2: the step fails (500); the same prompt sent again must compute its
    K/V afresh (no cached tokens) and answer what a fresh engine answers."""
    from inferlab import LLM, SamplingParams

    armed = {"fail": 1}

    def factory():
        engine = LLMEngine(tiny_config(tiny_path))
        execute = engine.runner.execute

        def flaky(scheduler_output):
            if armed["fail"] > 0:
                armed["fail"] -= 1
                raise RuntimeError("injected runner failure")
            return execute(scheduler_output)

        engine.runner.execute = flaky
        return engine

    prompt = "The scheduler batches requests under one token budget. " * 3
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with ServerThread(build_app(factory)) as srv:
        srv.wait_ready()
        r = httpx.post(srv.url("/v1/completions"), json=body)
        assert r.status_code == 500 and r.json()["error"]["message"]
        r = httpx.post(srv.url("/v1/completions"), json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["usage"]["prompt_tokens"] > 32  # at least two full blocks could have hit
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    offline = LLM(str(tiny_path), dtype="float32", num_kv_blocks=64, max_model_len=512)
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert data["choices"][0]["text"] == want.outputs[0].text


def _flaky_engine_server(tiny_path, patch):
    """A server on the real tiny engine; `patch(engine)` arms a fault once it is built."""
    holder = {}

    def factory():
        holder["engine"] = engine = LLMEngine(tiny_config(tiny_path))
        patch(engine)
        return engine

    srv = ServerThread(build_app(factory))
    srv.holder = holder  # type: ignore[attr-defined]
    return srv


def _idle_and_clean(srv) -> None:
    engine = srv.holder["engine"]
    wait_until(lambda: metric(scrape(srv.base_url), "vllm:kv_cache_usage_perc") == 0, what="blocks freed")
    wait_until(lambda: not engine.has_unfinished_requests(), what="engine idle")
    assert engine.output_processor.requests == {} and engine.scheduler.requests == {}


def test_a_tokenizer_that_raises_is_a_500_with_an_error_body_and_nothing_is_lost(tiny_path):
    armed = {"encode": 1, "decode": 0}

    def patch(engine):
        tok = engine.tokenizer
        encode, make_detok = tok.encode, engine.output_processor._make_detok

        def bad_encode(*a, **kw):
            if armed["encode"] > 0:
                armed["encode"] -= 1
                raise RuntimeError("injected tokenizer failure")
            return encode(*a, **kw)

        class BadDetok:  # raises on its first update: a failure inside the engine step
            def __init__(self, inner):
                self.inner = inner

            def __getattr__(self, name):
                if name == "update" and armed["decode"] > 0:
                    armed["decode"] -= 1
                    raise RuntimeError("injected detokenizer failure")
                return getattr(self.inner, name)

        tok.encode = bad_encode
        engine.output_processor._make_detok = lambda *a: BadDetok(make_detok(*a))

    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with _flaky_engine_server(tiny_path, patch) as srv:
        srv.wait_ready()
        r = httpx.post(srv.url("/v1/completions"), json=body)
        assert r.status_code == 500 and "injected tokenizer failure" in r.json()["error"]["message"]
        armed["decode"] = 1
        r = httpx.post(srv.url("/v1/completions"), json=body)
        assert r.status_code == 500 and r.json()["error"]["message"]
        _idle_and_clean(srv)
        r = httpx.post(srv.url("/v1/completions"), json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
        assert httpx.get(srv.url("/health")).json() == {"status": "ok"}


def test_a_disconnect_during_a_long_prefill_frees_everything(tiny_path):
    import threading

    left = threading.Event()
    seen = {"steps": 0}

    def patch(engine):
        engine.scheduler.config = dataclasses.replace(
            engine.scheduler.config, max_num_batched_tokens=32, long_prefill_token_threshold=32)
        execute = engine.runner.execute

        def held(so):  # the second prefill chunk waits until the client has gone
            seen["steps"] += 1
            if seen["steps"] == 2:
                left.wait(30)
            return execute(so)

        engine.runner.execute = held

    prompt = "The scheduler batches requests under one token budget. " * 10  # ~290 tokens
    with _flaky_engine_server(tiny_path, patch) as srv:
        srv.wait_ready()
        llm = srv.app.state.llm
        real_abort = llm.abort

        def abort_then_release(request_id: str) -> None:
            real_abort(request_id)  # queued: the engine drops the request before its next step
            left.set()  # only now does the held step finish, however late the server noticed

        llm.abort = abort_then_release
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url("/v1/completions"), json={"prompt": prompt, "max_tokens": 4}, timeout=0.5)
        assert left.wait(30), "the server never aborted the request of the client that left"
        _idle_and_clean(srv)
        assert 2 <= seen["steps"] < 280 // 32  # it left in the middle of the prefill
        assert metric(scrape(srv.base_url), "vllm:request_success_total", finished_reason="abort") == 1
        r = httpx.post(srv.url("/v1/completions"), json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200


@pytest.mark.slow
def test_the_course_request_on_the_default_model():
    """The course's request.json, sent to `inferlab serve`'s default model."""
    config = EngineConfig(load=LoadConfig(model=None), scheduler=SchedulerConfig(max_model_len=2048))
    with ServerThread(build_app(lambda: LLMEngine(config))) as srv:
        srv.wait_ready(300)
        body = {
            "messages": [{"role": "user", "content": "In one sentence, why might a parcel arrive a day late?"}],
            "max_tokens": 60,
            "cache_prompt": False,
        }
        r = httpx.post(srv.url("/v1/chat/completions"), json=body, timeout=300)
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["choices"][0]["message"]["content"].strip()
        assert data["usage"]["prompt_tokens"] > 13 and data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        t = data["timings"]
        assert t["cache_n"] == 0 and t["prompt_n"] == data["usage"]["prompt_tokens"]
        assert t["predicted_n"] == data["usage"]["completion_tokens"] and t["predicted_per_second"] > 0
        assert httpx.get(srv.url("/v1/models")).json()["data"][0]["id"] == "SmolLM2-135M-Instruct"


def test_server_info_reports_the_engines_decisions(srv):
    info = httpx.get(srv.url("/server_info")).json()
    assert info["served_model_names"] == ["tiny"] and info["max_model_len"] == 512
    p = info["precision"]
    assert (p["compute"], p["weights"], p["kv_cache"]) == ("float32", "float32", "float32")  # tiny_config: float32
    assert p["summary"].startswith("weights float32")
    kv = dict(info["kv_cache"])
    per_token = kv.pop("bytes_per_token")  # float32 K and V of every layer: 2 x 4 bytes per head_dim value
    assert kv == {"num_blocks": 64, "block_size": 16, "dtype": "float32", "prefix_caching": True}
    assert per_token > 0 and per_token % 8 == 0
    assert info["kernels"]["variant"] in ("amx", "avx512", "avx2", "none") and "cpu_flags" in info["kernels"]
    # The engine's one ResolvedPrecision, beside the keys above: the same K/V bytes and kernels.
    assert p["kv_bytes_per_token"] == per_token and p["kernel_variant"] == info["kernels"]["variant"]
    assert (p["weight_mode"], p["products"], p["int8_activations"], p["device"]) == ("float32", "float32", False, "cpu")
    assert p["uses_kernels"] == info["kernels"]["available"] and isinstance(p["reasons"], list)
