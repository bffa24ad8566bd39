"""Structured outputs through the OpenAI SDK against a real server and a tiny random model: the
grammar mask alone makes its text valid (a random model writes valid JSON only when every other
token is masked away), plain and streamed, with n > 1, through vLLM's `structured_outputs`
extra too; an invalid schema is a 400 naming the problem."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from server_harness import ServerThread

from inferlab.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig
from inferlab.engine.llm_engine import LLMEngine
from inferlab.models.testing import make_tiny_hf_model
from inferlab.server.app import ServerSettings, build_app

MSG = [{"role": "user", "content": "Describe a colour as JSON."}]


class Answer(BaseModel):
    color: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=99)
    ok: bool
    tag: str = Field(max_length=6)


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["level", "items"],
          "properties": {"level": {"type": "integer", "minimum": 1, "maximum": 5},
                         "items": {"type": "array", "maxItems": 3,
                                   "items": {"type": "string", "enum": ["a", "bb", "ccc"]}}}}  # fmt: skip


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    # The tiny tokenizer spells the tools' JSON in many tokens: room for them.
    path = make_tiny_hf_model(tmp_path_factory.mktemp("so"), arch="llama", max_position_embeddings=2048)
    config = EngineConfig(load=LoadConfig(model=str(path), dtype="float32"),
                          cache=CacheConfig(block_size=16, num_blocks_override=512),
                          scheduler=SchedulerConfig(max_model_len=2048), num_threads=1)  # fmt: skip
    app = build_app(lambda: LLMEngine(config), ServerSettings(served_model_names=("tiny",), reasoning_parser="qwen3"))
    with ServerThread(app) as s:
        s.wait_ready()
        yield s


@pytest.fixture
def client(srv):
    return openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0, timeout=60)


def test_sdk_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model="tiny", messages=MSG, response_format=Answer, temperature=1.0,
                                      max_tokens=120, n=3, seed=7)
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        assert isinstance(c.message.parsed, Answer)  # the SDK validated it against the model
    assert len({c.message.content for c in r.choices}) > 1  # three sequences, three matchers


def test_sdk_stream_with_a_pydantic_model(client):
    with client.chat.completions.stream(model="tiny", messages=MSG, response_format=Answer, temperature=1.0,
                                        max_tokens=120, seed=3) as stream:
        pieces = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(pieces) > 3  # it came in pieces
    assert isinstance(final.choices[0].message.parsed, Answer)
    assert "".join(pieces) == final.choices[0].message.content


def test_json_schema_and_json_object_plain_and_streamed(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "levels", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="tiny", messages=MSG, response_format=fmt, temperature=1.0,
                                       max_tokens=100, n=2)  # fmt: skip
    for c in r.choices:
        doc = json.loads(c.message.content)
        assert set(doc) == {"level", "items"} and 1 <= doc["level"] <= 5
        assert len(doc["items"]) <= 3 and set(doc["items"]) <= {"a", "bb", "ccc"}
    chunks = client.chat.completions.create(model="tiny", messages=MSG, response_format=fmt, temperature=1.0,
                                            max_tokens=100, stream=True, n=2)  # fmt: skip
    texts = ["", ""]
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    for t in texts:
        assert 1 <= json.loads(t)["level"] <= 5
    r = client.chat.completions.create(model="tiny", messages=MSG, response_format={"type": "json_object"},
                                       temperature=0.0, max_tokens=40)  # fmt: skip
    # Greedy on a random model may run out of tokens inside an object; what it wrote is one.
    assert r.choices[0].message.content.startswith("{")


def test_vllm_structured_outputs_extra(client, srv):
    r = client.chat.completions.create(model="tiny", messages=MSG, temperature=1.0, max_tokens=20, n=4,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert {c.message.content for c in r.choices} <= {"yes", "no", "maybe"}
    assert all(c.finish_reason == "stop" for c in r.choices)
    r = client.completions.create(model="tiny", prompt="id:", temperature=1.0, max_tokens=20,
                                  extra_body={"structured_outputs": {"regex": "[a-f]{4}-[0-9]{3}"}})
    text = r.choices[0].text
    assert len(text) == 8 and text[4] == "-" and set(text[:4]) <= set("abcdef") and text[5:].isdigit()
    r = client.completions.create(model="tiny", prompt="n:", temperature=1.0, max_tokens=20,
                                  extra_body={"guided_grammar": 'start: "x" ("y" | "z")'})
    assert r.choices[0].text in ("xy", "xz")


@pytest.mark.parametrize(
    "extra,param,needle",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
         "response_format", "objekt"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"structural_tag": "t"}}, "structured_outputs", "structural_tag"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "both"),
    ],
)
def test_bad_constraints_are_a_400_naming_the_problem(srv, extra, param, needle):
    r = httpx.post(srv.url("/v1/chat/completions"), json={"messages": MSG, "max_tokens": 5, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_grammar_requests_take_drafts_and_keep_the_tokens(tmp_path):
    """With n-gram speculative decoding on, a constrained request drafts too (each draft
    position masked by the grammar's state after the drafts before it) and yields exactly the
    tokens plain greedy decoding gives, valid against its grammar; a request without one beside it."""
    import re

    from inferlab import LLM, SamplingParams
    from inferlab.engine.request import StructuredOutputsParams

    path = make_tiny_hf_model(tmp_path, arch="llama")
    kw = dict(dtype="float32", num_kv_blocks=96, max_model_len=512, num_threads=1)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "adaptive": False}
    prompt = "one two three one two three one two three"
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA))),
              SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex="(one two three )+")),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              # sampled and seeded: rejection sampling draws what decoding one at a time would
              SamplingParams(temperature=1.0, seed=7, max_tokens=40, structured_outputs=StructuredOutputsParams(regex="(one two three )+"))]  # fmt: skip
    plain = LLM(str(path), **kw).generate([prompt] * 4, params)
    outs = LLM(str(path), speculative_config=spec, **kw).generate([prompt] * 4, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert 1 <= json.loads(outs[0].outputs[0].text)["level"] <= 5
    for o in (outs[1], outs[3]):
        assert re.fullmatch("(one two three )*(one two three ?)?", o.outputs[0].text)
    assert all(o.metrics.num_draft_tokens > 0 for o in outs)
    assert outs[1].metrics.num_accepted_tokens > 0  # the regex's text copies the prompt


class Weather(BaseModel):
    city: Literal["Oslo", "Rome", "Lima"]
    days: int = Field(ge=1, le=7)


TOOLS = [openai.pydantic_function_tool(Weather, name="get_weather", description="The forecast"),
         {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": False}}}]  # fmt: skip


def test_forced_tool_calls_validate(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.parse(model="tiny", messages=MSG, tools=TOOLS, tool_choice=named, temperature=1.0,
                                      max_tokens=60, n=2)  # fmt: skip
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        assert isinstance(call.function.parsed_arguments, Weather)  # the SDK validated the arguments
    r = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice="required",
                                       temperature=1.0, max_tokens=80, n=3)  # fmt: skip
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        for call in c.message.tool_calls:
            args = json.loads(call.function.arguments)
            if call.function.name == "get_weather":
                Weather.model_validate(args)
            else:
                assert call.function.name == "get_time" and args["zone"] in ("UTC", "CET")


def test_streamed_tool_call_deltas(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (named, "required"):
        chunks = list(client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice=choice,
                                                     temperature=1.0, max_tokens=80, stream=True))  # fmt: skip
        calls: dict[int, dict] = {}
        for ch in chunks:
            for d in ch.choices[0].delta.tool_calls or [] if ch.choices else []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
                entry["id"] = entry["id"] or d.id
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
        assert calls and all(c["id"] and c["name"] in ("get_weather", "get_time") for c in calls.values())
        for c in calls.values():
            args = json.loads(c["arguments"])
            if c["name"] == "get_weather":
                Weather.model_validate(args)
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    # The SDK's own stream helper puts the calls back together and validates them.
    with client.chat.completions.stream(model="tiny", messages=MSG, tools=TOOLS, tool_choice=named,
                                        temperature=1.0, max_tokens=60) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.tool_calls[0].function.parsed_arguments, Weather)


def test_tool_choice_auto_and_none_answer_in_text(client):
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice=choice,
                                           temperature=0.0, max_tokens=8)  # fmt: skip
        assert r.choices[0].message.content and not r.choices[0].message.tool_calls  # random text: no call in it


@pytest.mark.parametrize(
    "extra,param,needle",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
          "tool_choice": "required"}, "tools", "objekt"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
         "response_format"),
    ],
)
def test_bad_tool_requests_are_a_400(srv, extra, param, needle):
    r = httpx.post(srv.url("/v1/chat/completions"), json={"messages": MSG, "max_tokens": 5, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_reasoning_parser_splits_a_think_block(client):
    """--reasoning-parser qwen3, with the think block forced by a regex (a random model would never write one)."""
    forced = {"structured_outputs": {"regex": "<think>[a-c]{3}</think>(yes|no)"}}
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=30, extra_body=forced)
    m = r.choices[0].message
    assert m.content in ("yes", "no") and len(m.model_extra["reasoning_content"]) == 3
    chunks = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=30, extra_body=forced, stream=True)
    thought = content = ""
    for ch in chunks:
        for c in ch.choices:
            thought += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
    assert content in ("yes", "no") and len(thought) == 3 and "<" not in thought + content
