"""The HTTP server on the fake engine, through the official `openai` SDK and raw HTTP.

Each server binds 127.0.0.1 on a free port inside the test and is stopped at its end.
"""

from __future__ import annotations

import logging
import threading

import httpx
import openai
import pytest
from fake_engine import FakeEngine
from server_harness import ServerThread, metric, scrape, sse_events, wait_until

from inferlab.server.app import ServerSettings, build_app

MSG = [{"role": "user", "content": "Why might a parcel arrive late?"}]


def serve(settings: ServerSettings | None = None, **engine_kw) -> ServerThread:
    holder: dict = {}

    def factory():
        holder["engine"] = FakeEngine(**engine_kw)
        return holder["engine"]

    srv = ServerThread(build_app(factory, settings))
    srv.holder = holder  # type: ignore[attr-defined]
    return srv


@pytest.fixture(scope="module")
def srv():
    with serve(step_delay=0.001) as s:
        s.wait_ready()
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0)


def gauges(srv, headers=None) -> tuple[float, float, float]:
    s = scrape(srv.base_url, headers)
    return (
        metric(s, "vllm:num_requests_running"),
        metric(s, "vllm:num_requests_waiting"),
        metric(s, "vllm:kv_cache_usage_perc"),
    )


def aborted(srv) -> float:
    return metric(scrape(srv.base_url), "vllm:request_success_total", finished_reason="abort")


# ---------------------------------------------------------------------------- the happy paths
def test_chat_completion(client):
    r = client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=7, seed=1)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "fake-model"
    choice = r.choices[0]
    assert choice.message.role == "assistant" and len(choice.message.content) == 7
    assert choice.finish_reason == "length"
    prompt_len = len(b"<user>Why might a parcel arrive late?\n<assistant>")
    assert r.usage.prompt_tokens == prompt_len and r.usage.completion_tokens == 7
    assert r.usage.total_tokens == prompt_len + 7
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    timings = r.model_extra["timings"]
    assert timings["prompt_n"] == prompt_len and timings["predicted_n"] == 7 and timings["cache_n"] == 0
    for key in ("prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_ms", "predicted_per_token_ms",
                "predicted_per_second", "queue_ms"):  # fmt: skip
        assert timings[key] >= 0


def test_max_completion_tokens_wins_and_model_may_be_omitted(srv):
    r = httpx.post(srv.url("/v1/chat/completions"), json={"messages": MSG, "max_tokens": 9, "max_completion_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def test_chat_stream_with_usage(srv, client):
    stream = client.chat.completions.create(
        model="fake-model", messages=MSG, max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert len(text) == 6
    assert [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason] == ["length"]
    # The raw wire format ends with [DONE]; without include_usage no usage chunk is sent.
    with httpx.stream("POST", srv.url("/v1/chat/completions"), json={"messages": MSG, "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r))
    assert events[-1] == "[DONE]"
    assert all(e["choices"] for e in events[:-1]) and "usage" not in events[-2]


def test_continuous_usage_stats(srv):
    body = {"messages": MSG, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    with httpx.stream("POST", srv.url("/v1/chat/completions"), json=body) as r:
        events = [e for e in sse_events(r) if e != "[DONE]"]
    content = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert content and all(e["usage"]["completion_tokens"] >= 1 for e in content)


def test_completions_prompt_forms(client):
    r = client.completions.create(model="fake-model", prompt="abc", max_tokens=4)
    assert r.object == "text_completion" and len(r.choices) == 1 and len(r.choices[0].text) == 4
    assert r.usage.prompt_tokens == 3
    r = client.completions.create(model="fake-model", prompt=["ab", "cdef"], max_tokens=2)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.prompt_tokens == 6 and r.usage.completion_tokens == 4
    r = client.completions.create(model="fake-model", prompt=[70, 71, 72], max_tokens=2)
    assert r.usage.prompt_tokens == 3
    r = client.completions.create(model="fake-model", prompt=[[70, 71], [72]], max_tokens=2, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.usage.prompt_tokens == 3


def test_completions_stream(client):
    chunks = list(client.completions.create(model="fake-model", prompt="abc", max_tokens=5, stream=True))
    assert "".join(c.choices[0].text for c in chunks) and chunks[-1].choices[0].finish_reason == "length"
    assert len("".join(c.choices[0].text for c in chunks)) == 5


def test_n_and_seed(client):
    a = client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=16, seed=42, n=2, temperature=1.0)
    b = client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=16, seed=42, n=2, temperature=1.0)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content != a.choices[1].message.content
    assert a.usage.completion_tokens == 32
    c = client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=16, seed=43)
    assert c.choices[0].message.content != a.choices[0].message.content


def test_n_streamed(client):
    chunks = list(client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=5, n=2, stream=True))
    texts = {0: "", 1: ""}
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
    assert len(texts[0]) == 5 and len(texts[1]) == 5


def test_stop_strings(client):
    kw = dict(model="fake-model", messages=MSG, max_tokens=60, seed=5)
    full = client.chat.completions.create(**kw).choices[0].message.content
    stop = full[10:12]
    cut = full.index(stop)
    r = client.chat.completions.create(**kw, stop=[stop])
    assert r.choices[0].message.content == full[:cut] and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(**kw, stop=stop, extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].message.content == full[: cut + len(stop)]
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stop=[stop], stream=True) if c.choices
    )
    assert streamed == full[:cut]


def test_logprobs(client):
    r = client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=3, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and len(content[0].top_logprobs) == 2
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert content[0].bytes == list(content[0].token.encode())
    r = client.completions.create(model="fake-model", prompt="ab", max_tokens=3, logprobs=1)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset == [0, 1, 2] and len(lp.top_logprobs) == 3


def test_unknown_fields_are_ignored(srv):
    body = {"messages": MSG, "max_tokens": 2, "user": "u1", "some_vendor_field": {"x": 1}, "ignore_eos": True,
            "min_tokens": 1, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "presence_penalty": 0.5,
            "frequency_penalty": 0.5, "stop_token_ids": [2], "cache_salt": "tenant-a"}  # fmt: skip
    r = httpx.post(srv.url("/v1/chat/completions"), json=body)
    assert r.status_code == 200, r.text


def test_prefix_cache_and_cache_prompt(srv):
    long = [{"role": "user", "content": "a long shared question " * 4}]
    httpx.post(srv.url("/v1/chat/completions"), json={"messages": long, "max_tokens": 1})
    r = httpx.post(srv.url("/v1/chat/completions"), json={"messages": long, "max_tokens": 1}).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert r["timings"]["cache_n"] == r["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert r["timings"]["prompt_n"] == r["usage"]["prompt_tokens"] - r["timings"]["cache_n"]
    r = httpx.post(srv.url("/v1/chat/completions"), json={"messages": long, "max_tokens": 1, "cache_prompt": False})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    r = httpx.post(srv.url("/v1/chat/completions"), json={"messages": long, "max_tokens": 1, "cache_salt": "other"})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_models_health_tokenize(srv):
    models = httpx.get(srv.url("/v1/models")).json()
    assert models["data"][0]["id"] == "fake-model" and models["data"][0]["max_model_len"] == 256
    assert httpx.get(srv.url("/health")).json() == {"status": "ok"}
    r = httpx.post(srv.url("/tokenize"), json={"prompt": "hey", "return_token_strs": True}).json()
    assert r == {"count": 3, "max_model_len": 256, "tokens": [107, 104, 124], "token_strs": ["h", "e", "y"]}
    r = httpx.post(srv.url("/tokenize"), json={"messages": [{"role": "user", "content": "x"}]}).json()
    assert r["count"] == len("<user>x\n<assistant>") and "token_strs" not in r
    assert httpx.post(srv.url("/detokenize"), json={"tokens": [107, 104, 124]}).json() == {"prompt": "hey"}


# ---------------------------------------------------------------------------- errors
def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    return err


def test_bad_inputs_get_their_status_while_another_request_streams(srv):
    result: dict = {}

    def background():
        body = {"messages": MSG, "max_tokens": 150, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", srv.url("/v1/chat/completions"), json=body, timeout=60) as r:
            result["events"] = list(sse_events(r))

    engine = srv.holder["engine"]
    engine.step_delay = 0.01
    t = threading.Thread(target=background)
    t.start()
    try:
        wait_until(lambda: gauges(srv)[0] == 1, what="the background request to run")
        url = srv.url("/v1/chat/completions")
        assert "JSON" in _error(httpx.post(url, content=b'{"messages": [', headers={"content-type": "application/json"}), 400)["message"]
        assert _error(httpx.post(url, json=["not", "an", "object"]), 400)
        assert _error(httpx.post(url, json={"messages": "hi"}), 400)["param"] == "messages"
        assert _error(httpx.post(url, json={}), 400)["param"] == "messages"
        assert _error(httpx.post(url, json={"messages": MSG, "max_tokens": "many"}), 400)["param"] == "max_tokens"
        assert _error(httpx.post(url, json={"messages": MSG, "temperature": -1}), 400)["param"] == "temperature"
        assert _error(httpx.post(url, json={"messages": MSG, "top_p": 0}), 400)["param"] == "top_p"
        assert _error(httpx.post(url, json={"messages": MSG, "top_logprobs": 3}), 400)["param"] == "top_logprobs"
        assert _error(httpx.post(url, json={"messages": [{"role": "wizard", "content": "x"}]}), 400)["param"] == "messages"
        err = _error(httpx.post(url, json={"messages": MSG, "max_tokens": 250}), 400)
        assert err["n_ctx"] == 256 and err["n_prompt_tokens"] == 49 and "43" in err["message"]
        assert _error(httpx.post(url, json={"messages": MSG, "model": "gpt-9"}), 404)["param"] == "model"
        comp = srv.url("/v1/completions")
        assert _error(httpx.post(comp, json={"prompt": []}), 400)
        assert _error(httpx.post(comp, json={"prompt": [[1, 2], []]}), 400)
        assert _error(httpx.post(comp, json={"prompt": [99999]}), 400)
        assert _error(httpx.post(comp, json={"prompt": "x", "logprobs": 50}), 400)["param"] == "logprobs"
        assert _error(httpx.post(srv.url("/detokenize"), json={"tokens": "abc"}), 400)
        assert _error(httpx.post(srv.url("/tokenize"), json={}), 400)
        assert _error(httpx.get(srv.url("/v1/nothing-here")), 404)
        with httpx.stream("POST", url, json={"messages": MSG, "max_tokens": 250, "stream": True}) as r:
            assert r.status_code == 400  # refused before streaming: a real status, not an SSE error
    finally:
        t.join(60)
        engine.step_delay = 0.001
    events = result["events"]
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 150


def test_sdk_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=1000)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)


# ---------------------------------------------------------------------------- cancellation
def test_disconnected_stream_frees_its_blocks():
    with serve(step_delay=0.02) as srv:
        srv.wait_ready()
        assert gauges(srv) == (0, 0, 0)
        body = {"messages": MSG, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", srv.url("/v1/chat/completions"), json=body) as r:
            events = sse_events(r)
            got = [next(events) for _ in range(3)]  # role chunk and two tokens: decoding now
            assert got[-1]["choices"][0]["delta"]["content"]
            assert gauges(srv)[0] == 1 and gauges(srv)[2] > 0
        wait_until(lambda: gauges(srv) == (0, 0, 0), what="running and KV usage back to 0")
        assert aborted(srv) == 1
        assert metric(scrape(srv.base_url), "vllm:request_success_total", finished_reason="length") == 0


def test_disconnect_while_waiting_for_the_first_token():
    with serve(step_delay=0.02, max_num_seqs=1) as srv:
        srv.wait_ready()
        result: dict = {}

        def first():
            body = {"messages": MSG, "max_tokens": 100, "stream": True}
            with httpx.stream("POST", srv.url("/v1/chat/completions"), json=body, timeout=60) as r:
                result["events"] = list(sse_events(r))

        t = threading.Thread(target=first)
        t.start()
        wait_until(lambda: gauges(srv)[0] == 1, what="the first request to run")
        with httpx.stream("POST", srv.url("/v1/chat/completions"), json={"messages": MSG, "stream": True}) as r:
            events = sse_events(r)  # keep a reference: closing the iterator would close the response
            assert next(events)["choices"][0]["delta"]["role"] == "assistant"
            wait_until(lambda: gauges(srv)[1] == 1, what="the second request to wait")
        wait_until(lambda: gauges(srv)[1] == 0, what="the waiting request to be dropped")
        assert aborted(srv) == 1 and gauges(srv)[0] == 1  # the first one is still decoding
        t.join(60)
        assert result["events"][-1] == "[DONE]"


def test_disconnected_non_streaming_client_is_aborted():
    with serve(step_delay=0.02) as srv:
        srv.wait_ready()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url("/v1/chat/completions"), json={"messages": MSG, "max_tokens": 200}, timeout=0.5)
        wait_until(lambda: gauges(srv) == (0, 0, 0), what="the abandoned request to be aborted")
        assert aborted(srv) == 1


# ---------------------------------------------------------------------------- admission
def test_full_queue_answers_503_then_recovers():
    settings = ServerSettings(max_queue_len=1)
    with serve(settings, step_delay=0.02, max_num_seqs=1) as srv:
        srv.wait_ready()
        url = srv.url("/v1/chat/completions")
        body = {"messages": MSG, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", url, json=body) as a:
            a_events = sse_events(a)  # keep references: closing the iterators would close the responses
            next(a_events)
            wait_until(lambda: gauges(srv)[0] == 1, what="A running")
            with httpx.stream("POST", url, json=body) as b:
                b_events = sse_events(b)
                next(b_events)
                wait_until(lambda: gauges(srv)[1] == 1, what="B waiting")
                r = httpx.post(url, json={"messages": MSG, "max_tokens": 2})
                err = _error(r, 503)
                assert int(r.headers["retry-after"]) >= 1 and "busy" in err["message"]
                assert next(a_events)["choices"]  # A is still being served
        wait_until(lambda: gauges(srv) == (0, 0, 0), what="the queue to drain")
        r = httpx.post(url, json={"messages": MSG, "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_deadline():
    with serve(ServerSettings(request_timeout=0.3), step_delay=0.02) as srv:
        srv.wait_ready()
        url = srv.url("/v1/chat/completions")
        err = _error(httpx.post(url, json={"messages": MSG, "max_tokens": 200}), 504)
        assert "deadline" in err["message"]
        with httpx.stream("POST", url, json={"messages": MSG, "max_tokens": 200, "stream": True}) as r:
            assert r.status_code == 200
            events = list(sse_events(r))
        assert events[-1] == "[DONE]" and "deadline" in events[-2]["error"]["message"]
        assert events[-2]["error"]["code"] == 504
        wait_until(lambda: gauges(srv) == (0, 0, 0), what="timed-out requests freed")
        # a request may ask for a shorter deadline, and a short request is untouched
        assert httpx.post(url, json={"messages": MSG, "max_tokens": 2}).status_code == 200


def test_engine_failure_fails_the_batch_and_the_server_keeps_serving():
    with serve(step_delay=0.005) as srv:
        srv.wait_ready()
        engine = srv.holder["engine"]
        url = srv.url("/v1/chat/completions")
        engine.fail_next_steps = 1
        err = _error(httpx.post(url, json={"messages": MSG, "max_tokens": 5}), 500)
        assert "injected" in err["message"]
        engine.fail_next_steps = 1
        with httpx.stream("POST", url, json={"messages": MSG, "max_tokens": 5, "stream": True}) as r:
            events = list(sse_events(r))
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 500
        assert httpx.post(url, json={"messages": MSG, "max_tokens": 5}).status_code == 200
        assert httpx.get(srv.url("/health")).status_code == 200


def test_health_is_503_while_loading():
    gate = threading.Event()
    with serve(load_gate=gate) as srv:
        r = httpx.get(srv.url("/health"))
        assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model"
        r = httpx.post(srv.url("/v1/chat/completions"), json={"messages": MSG})
        assert _error(r, 503) and "retry-after" in r.headers
        assert _error(httpx.get(srv.url("/v1/models")), 503)
        gate.set()
        srv.wait_ready()
        assert httpx.get(srv.url("/health")).json() == {"status": "ok"}


def test_failed_load_is_reported_by_health():
    def broken():
        raise FileNotFoundError("no model at nowhere.gguf")

    with ServerThread(build_app(broken)) as srv:
        wait_until(lambda: srv.app.state.llm.load_error is not None, what="the load to fail")
        r = httpx.get(srv.url("/health"))
        assert r.status_code == 503 and "nowhere.gguf" in r.json()["error"]["message"]
        assert httpx.post(srv.url("/v1/chat/completions"), json={"messages": MSG}).status_code == 503


# ---------------------------------------------------------------------------- auth
@pytest.mark.parametrize("metrics_public", [False, True])
def test_api_key(metrics_public):
    with serve(ServerSettings(api_key="sekret", metrics_public=metrics_public)) as srv:
        srv.wait_ready()
        good = {"Authorization": "Bearer sekret"}
        for method, path, body in [
            ("POST", "/v1/chat/completions", {"messages": MSG, "max_tokens": 1}),
            ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
            ("GET", "/v1/models", None),
            ("POST", "/tokenize", {"prompt": "x"}),
            ("POST", "/detokenize", {"tokens": [70]}),
        ]:
            assert _error(httpx.request(method, srv.url(path), json=body), 401)["type"] == "authentication_error"
            r = httpx.request(method, srv.url(path), json=body, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert httpx.request(method, srv.url(path), json=body, headers=good).status_code == 200
        assert httpx.get(srv.url("/health")).status_code == 200
        assert httpx.get(srv.url("/metrics")).status_code == (200 if metrics_public else 401)
        assert httpx.get(srv.url("/metrics"), headers=good).status_code == 200
        sdk = openai.OpenAI(base_url=srv.url("/v1"), api_key="sekret", max_retries=0)
        assert sdk.chat.completions.create(model="fake-model", messages=MSG, max_tokens=1).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url("/v1"), api_key="nope", max_retries=0).models.list()


def test_served_model_name_alias():
    with serve(ServerSettings(served_model_names=("qwen3-0.6b", "other"))) as srv:
        srv.wait_ready()
        ids = [m["id"] for m in httpx.get(srv.url("/v1/models")).json()["data"]]
        assert ids == ["qwen3-0.6b", "other"]
        r = httpx.post(srv.url("/v1/chat/completions"), json={"messages": MSG, "max_tokens": 1, "model": "other"})
        assert r.json()["model"] == "other"
        r = httpx.post(srv.url("/v1/chat/completions"), json={"messages": MSG, "max_tokens": 1})
        assert r.json()["model"] == "qwen3-0.6b"
        assert httpx.post(srv.url("/v1/chat/completions"), json={"messages": MSG, "model": "fake-model"}).status_code == 404
        assert 'model_name="qwen3-0.6b"' in httpx.get(srv.url("/metrics")).text


# ---------------------------------------------------------------------------- metrics and logs
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": ["0.001", "0.005", "2560.0"],
    "vllm:inter_token_latency_seconds": ["0.01", "0.025", "80.0"],
    "vllm:request_time_per_output_token_seconds": ["0.01", "80.0"],
    "vllm:e2e_request_latency_seconds": ["0.3", "0.8", "7680.0"],
    "vllm:request_queue_time_seconds": ["0.3", "7680.0"],
    "vllm:request_prefill_time_seconds": ["0.3", "7680.0"],
    "vllm:request_decode_time_seconds": ["0.3", "7680.0"],
    "vllm:request_prompt_tokens": ["1.0", "2.0", "5.0", "200.0"],
    "vllm:request_generation_tokens": ["1.0", "200.0"],
}


def test_metrics_use_vllm_names_types_and_buckets():
    with serve(step_delay=0.001) as srv:
        srv.wait_ready()
        httpx.post(srv.url("/v1/chat/completions"), json={"messages": MSG, "max_tokens": 5})
        httpx.post(srv.url("/v1/completions"), json={"prompt": "abc", "max_tokens": 20, "stop": ["a", "b", "c"], "seed": 1})
        r = httpx.get(srv.url("/metrics"))
        assert r.headers["content-type"].startswith("text/plain")
        text = r.text
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "cache_config_info"):
            assert f"# TYPE vllm:{name} gauge" in text
        for name in ("prompt_tokens", "generation_tokens", "request_success", "num_preemptions",
                     "prefix_cache_queries", "prefix_cache_hits"):  # fmt: skip
            assert f"# TYPE vllm:{name}_total counter" in text or f"# TYPE vllm:{name} counter" in text
        for name, les in VLLM_BUCKETS.items():
            assert f"# TYPE {name} histogram" in text
            for le in les:
                assert f'{name}_bucket{{engine="0",le="{le}",model_name="fake-model"}}' in text, (name, le)
        s = scrape(srv.base_url)
        assert metric(s, "vllm:cache_config_info", block_size="4", num_gpu_blocks="64") == 1
        assert metric(s, "vllm:request_success_total", finished_reason="length") >= 1
        assert metric(s, "vllm:request_success_total", finished_reason="stop") == 1
        assert metric(s, "vllm:e2e_request_latency_seconds_count") == 2
        assert metric(s, "vllm:time_to_first_token_seconds_count") == 2
        assert metric(s, "vllm:request_prompt_tokens_sum") == 49 + 3
        out_tokens = metric(s, "vllm:request_generation_tokens_sum")
        assert metric(s, "vllm:generation_tokens_total") == out_tokens and out_tokens >= 6
        assert metric(s, "vllm:prompt_tokens_total") == 52
        assert metric(s, "vllm:prefix_cache_queries_total") == 52
        assert metric(s, "vllm:inter_token_latency_seconds_count") >= 4
        for name in VLLM_BUCKETS:  # every sample carries the model and engine labels
            assert metric(s, f"{name}_count", model_name="fake-model", engine="0") >= 1 or "time_per" in name


def test_one_log_line_per_request_without_the_prompt(caplog):
    with serve(step_delay=0.001) as srv:
        srv.wait_ready()
        caplog.set_level(logging.INFO, logger="inferlab.server")
        secret = "my secret prompt text"
        r = httpx.post(srv.url("/v1/chat/completions"), json={"messages": [{"role": "user", "content": secret}], "max_tokens": 3})
        rid = r.json()["id"]
        httpx.post(srv.url("/v1/chat/completions"), json={"messages": MSG, "max_tokens": 1000})  # rejected
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "inferlab.server"]
    mine = [line for line in lines if rid in line]
    assert len(mine) == 1
    assert "status=ok" in mine[0] and "completion_tokens=3" in mine[0] and "ttft_ms=" in mine[0]
    assert not any(secret in line for line in lines)
    assert any("rejected 400" in line for line in lines)


def test_log_prompts_flag(caplog):
    with serve(ServerSettings(log_prompts=True)) as srv:
        srv.wait_ready()
        caplog.set_level(logging.INFO, logger="inferlab.server")
        httpx.post(srv.url("/v1/chat/completions"), json={"messages": [{"role": "user", "content": "visible words"}], "max_tokens": 1})
    assert any("visible words" in rec.getMessage() for rec in caplog.records if rec.name == "inferlab.server")
