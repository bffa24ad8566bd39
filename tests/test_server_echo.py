"""/v1/completions as lm-eval and vLLM use it, on the fake engine: echo, logprobs of the
prompt in OpenAI's legacy shape, max_tokens 0, vLLM's prompt_logprobs, /tokenizer_info, and
a 400 for every known field the server cannot honour.

The fake engine's tokens are bytes (id = byte + 3); its prompt logprobs are -1 - p/100 for the
prompt token at position p, with 'z', 'y', ... as the top tokens at -0.5, -0.6, ...
"""

from __future__ import annotations

import httpx
import openai
import pytest
from fake_engine import FakeEngine
from server_harness import ServerThread, sse_events

from inferlab.server.app import ServerSettings, build_app

LEGACY_KEYS = {"tokens", "token_logprobs", "top_logprobs", "text_offset"}


@pytest.fixture(scope="module")
def srv():
    with ServerThread(build_app(lambda: FakeEngine(step_delay=0.001), ServerSettings())) as s:
        s.wait_ready()
        yield s


def post(srv, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(srv.url(path), json=body, timeout=30)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_with_logprobs_is_openai_legacy_shape(srv):
    body = ok(post(srv, {"prompt": "abc", "max_tokens": 2, "echo": True, "logprobs": 1, "seed": 4}))
    choice = body["choices"][0]
    assert choice["text"].startswith("abc") and len(choice["text"]) == 5
    lp = choice["logprobs"]
    assert set(lp) == LEGACY_KEYS and all(len(v) == 5 for v in lp.values())
    assert lp["tokens"][:3] == ["a", "b", "c"] and "".join(lp["tokens"]) == choice["text"]
    # The first prompt token: null logprob and null top_logprobs; then prompt tokens with their
    # logprob and {the token, the top 1}; then the generated tokens (fake: -0.5).
    assert lp["token_logprobs"][:3] == [None, -1.01, -1.02] and lp["token_logprobs"][3:] == [-0.5, -0.5]
    assert lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][1] == {"b": -1.01, "z": -0.5} and lp["top_logprobs"][2] == {"c": -1.02, "z": -0.5}
    assert all(isinstance(t, dict) and 1 <= len(t) <= 2 for t in lp["top_logprobs"][3:])
    assert lp["text_offset"] == [0, 1, 2, 3, 4]
    assert choice["finish_reason"] == "length" and "prompt_logprobs" not in choice
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 2
    # The SDK reads it as a Completion.
    client = openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0)
    r = client.completions.create(model="fake-model", prompt="abc", max_tokens=2, echo=True, logprobs=1, seed=4)
    assert r.choices[0].text == choice["text"] and r.choices[0].logprobs.token_logprobs[0] is None


def test_echo_without_logprobs_and_without_echo(srv):
    plain = ok(post(srv, {"prompt": "abc", "max_tokens": 3, "seed": 2}))["choices"][0]
    echoed = ok(post(srv, {"prompt": "abc", "max_tokens": 3, "seed": 2, "echo": True}))["choices"][0]
    assert echoed["text"] == "abc" + plain["text"] and echoed["logprobs"] is None
    lp = ok(post(srv, {"prompt": "abc", "max_tokens": 3, "seed": 2, "logprobs": 0}))["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3 and None not in lp["token_logprobs"]  # no echo: no prompt entries


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(srv):
    # lm-eval's request: token ids, several prompts, echo, logprobs, max_tokens 0.
    body = ok(post(srv, {"prompt": [[70, 71, 72], [100, 101]], "max_tokens": 0, "echo": True, "logprobs": 1}))
    a, b = body["choices"]
    assert (a["index"], b["index"]) == (0, 1)
    assert a["text"] == "CDE" and b["text"] == "ab"
    assert a["finish_reason"] == "length" and b["finish_reason"] == "length" and a["stop_reason"] is None
    assert a["logprobs"]["tokens"] == ["C", "D", "E"] and a["logprobs"]["token_logprobs"] == [None, -1.01, -1.02]
    assert b["logprobs"]["token_logprobs"] == [None, -1.01] and b["logprobs"]["text_offset"] == [0, 1]
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == 5
    # Without echo, max_tokens 0 is a 400 naming the field.
    r = post(srv, {"prompt": "abc", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_streamed_echo_comes_in_the_first_chunk(srv):
    req = {"prompt": "hello", "max_tokens": 4, "echo": True, "logprobs": 1, "seed": 8}
    whole = ok(post(srv, req))["choices"][0]
    with httpx.stream("POST", srv.url("/v1/completions"), json={**req, "stream": True}, timeout=30) as r:
        chunks = [e for e in sse_events(r) if e != "[DONE]"]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith("hello")
    assert first["logprobs"]["tokens"][:5] == list("hello") and first["logprobs"]["token_logprobs"][0] is None
    texts = "".join(c["choices"][0]["text"] for c in chunks)
    assert texts == whole["text"]
    tokens = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    offsets = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["text_offset"]]
    assert tokens == whole["logprobs"]["tokens"] and offsets == whole["logprobs"]["text_offset"]
    # max_tokens 0: one chunk per choice, the prompt with finish_reason "length".
    with httpx.stream("POST", srv.url("/v1/completions"),
                      json={"prompt": "hey", "max_tokens": 0, "echo": True, "stream": True, "n": 2}, timeout=30) as r:  # fmt: skip
        chunks = [e for e in sse_events(r) if e != "[DONE]"]
    assert sorted((c["choices"][0]["index"], c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks) == [
        (0, "hey", "length"),
        (1, "hey", "length"),
    ]


def test_prompt_logprobs_in_vllm_shape(srv):
    body = ok(post(srv, {"prompt": ["ab", "xyz"], "max_tokens": 1, "prompt_logprobs": 2, "n": 2}))
    assert len(body["choices"]) == 4
    for choice in body["choices"]:
        plp = choice["prompt_logprobs"]
        assert plp[0] is None
        assert choice["logprobs"] is None  # logprobs not asked
    ab = body["choices"][0]["prompt_logprobs"]
    assert ab == [None, {"101": {"logprob": -1.01, "rank": 3, "decoded_token": "b"},
                         "125": {"logprob": -0.5, "rank": 1, "decoded_token": "z"},
                         "124": {"logprob": -0.6, "rank": 2, "decoded_token": "y"}}]  # fmt: skip
    xyz = body["choices"][3]["prompt_logprobs"]
    assert len(xyz) == 3 and xyz[2] == {"125": {"logprob": -0.5, "rank": 1, "decoded_token": "z"},
                                        "124": {"logprob": -0.6, "rank": 2, "decoded_token": "y"}}  # fmt: skip
    # Streamed: the first chunk of each choice carries them.
    with httpx.stream("POST", srv.url("/v1/completions"),
                      json={"prompt": "ab", "max_tokens": 2, "prompt_logprobs": 0, "stream": True}, timeout=30) as r:  # fmt: skip
        chunks = [e for e in sse_events(r) if e != "[DONE]"]
    assert chunks[0]["choices"][0]["prompt_logprobs"] == [None, {"101": {"logprob": -1.01, "rank": 1, "decoded_token": "b"}}]
    assert all("prompt_logprobs" not in c["choices"][0] for c in chunks[1:])


@pytest.mark.parametrize(
    "path,field,value",
    [
        ("/v1/completions", "best_of", 3),
        ("/v1/completions", "suffix", "tail"),
        ("/v1/completions", "bad_words", ["abc"]),
        ("/v1/completions", "priority", 5),
        ("/v1/completions", "typical_p", 0.5),
        ("/v1/completions", "mirostat", 2),
        ("/v1/completions", "use_beam_search", True),
        ("/v1/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
        ("/v1/chat/completions", "echo", True),
        ("/v1/chat/completions", "prompt_logprobs", 1),
        ("/v1/chat/completions", "tool_choice", "required"),
        ("/v1/chat/completions", "chat_template_kwargs", {"tokenize": True}),
        ("/v1/chat/completions", "logit_bias", {"50": -101}),  # out of range
        ("/v1/chat/completions", "logit_bias", {"100000": 1}),  # outside the vocabulary
        ("/v1/chat/completions", "logit_bias", {"x": 1}),
        ("/v1/chat/completions", "allowed_token_ids", [100000]),
        ("/v1/chat/completions", "allowed_token_ids", []),
    ],
)
def test_fields_we_cannot_honour_are_a_400_naming_them(srv, path, field, value):
    base = {"prompt": "abc"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = post(srv, {**base, "max_tokens": 2, field: value}, path)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and err["type"] == "invalid_request_error"
    assert err["code"] == 400


@pytest.mark.parametrize(
    "extra",
    [{"best_of": 1}, {"best_of": 2, "n": 2}, {"suffix": ""}, {"suffix": None}, {"logit_bias": {}},
     {"response_format": {"type": "text"}}, {"tools": []}, {"use_beam_search": False}, {"priority": 0},
     {"tool_choice": "none"}, {"typical_p": 1.0}, {"mirostat": 0}, {"bad_words": []}],  # fmt: skip
)
def test_neutral_values_of_those_fields_are_accepted(srv, extra):
    ok(post(srv, {"prompt": "abc", "max_tokens": 2, **extra}))


def test_tokenizer_info(srv):
    info = ok(httpx.get(srv.url("/tokenizer_info")))
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>" and info["tokenizer_class"] == "FakeTokenizer"
    assert info["model_max_length"] == 256  # the server's context window
    assert "chat_template" in info and "pad_token" in info
