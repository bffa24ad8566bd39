"""Tool calls: the parsers (Hermes / Qwen and Llama 3 JSON, whole and streamed), the request
checks, the tools in the chat template; forced calls end to end are in test_structured_outputs.py."""

from __future__ import annotations

import json

import pytest

from inferlab.server.protocol import ApiError
from inferlab.server.tool_calls import (
    ToolOutput,
    choose_parser,
    parse_hermes,
    parse_llama3_json,
    tool_request,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_hermes_calls_with_text_around_them():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')  # fmt: skip
    content, calls = parse_hermes(text)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    # An unclosed last call (EOS before the tag) still counts; a tag around non-JSON does not.
    assert parse_hermes('<tool_call>{"name": "f", "arguments": {"a": 1}}')[1][0].arguments == '{"a": 1}'
    assert parse_hermes("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert parse_hermes("plain answer") == ("plain answer", [])


def test_llama3_json_calls():
    content, calls = parse_llama3_json('{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}')
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Rome"}
    assert parse_llama3_json('<|python_tag|>{"name": "f", "arguments": {}}')[1][0].name == "f"
    assert parse_llama3_json("The answer is {x}.") == ("The answer is {x}.", [])
    assert parse_llama3_json('{"not": "a call"}') == ('{"not": "a call"}', [])


def _stream(out: ToolOutput, pieces: list[str]) -> tuple[str, list[dict]]:
    s = out.stream()
    content, calls = "", []
    for p in pieces:
        d = s.feed(p)
        content += d.content
        calls += d.tool_calls
    d = s.finish()
    return content + d.content, calls + d.tool_calls


def test_streamed_hermes_holds_back_only_what_may_be_a_tag():
    out = ToolOutput(tool_request([WEATHER], "auto", None), "hermes")
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call> done'
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]  # tags split across deltas
    s = out.stream()
    first = s.feed("Sure. <tool")
    assert first.content == "Sure. " and not first.tool_calls  # "<tool" may begin a tag: held
    content, calls = _stream(out, pieces)
    assert content == "Sure.  done"
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["type"] == "function"
    assert calls[0]["function"]["name"] == "get_weather" and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert _stream(out, ["a < b", " and <tool", "box>"]) == ("a < b and <toolbox>", [])


def test_streamed_forced_calls():
    named = ToolOutput(tool_request([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None), "hermes")
    s = named.stream()
    head = s.feed('{"city": ')
    assert head.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": '} and head.tool_calls[0]["id"]
    assert s.feed('"Oslo"}').tool_calls == [{"index": 0, "function": {"arguments": '"Oslo"}'}}]
    required = ToolOutput(tool_request([WEATHER, TIME], "required", None), "hermes")
    content, calls = _stream(required, ['[{"name": "get_time", ', '"parameters": {}}]'])
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_time"]
    assert [c.name for c in named.extract('{"city": "X"}')[1]] == ["get_weather"]


def test_forcing_grammars():
    named = tool_request([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None).constraint()
    assert json.loads(named.json) == WEATHER["function"]["parameters"]
    req = json.loads(tool_request([WEATHER, TIME], "required", False).constraint().json)
    assert req["type"] == "array" and req["minItems"] == 1 and req["maxItems"] == 1
    assert [o["properties"]["name"]["const"] for o in req["items"]["anyOf"]] == ["get_weather", "get_time"]
    assert tool_request([WEATHER], "auto", None).constraint() is None


@pytest.mark.parametrize(
    "tools,choice,param,needle",
    [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice", "nope"),
        ([WEATHER], "sometimes", "tool_choice", "sometimes"),
        (None, "required", "tool_choice", "needs tools"),
        ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "tools", "bad name!"),
        ([WEATHER, WEATHER], "auto", "tools", "twice"),
        ([{"type": "retrieval"}], "auto", "tools", "tools[0]"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "auto", "tools", "parameters"),
    ],
)
def test_bad_tools_are_a_400(tools, choice, param, needle):
    with pytest.raises(ApiError) as e:
        tool_request(tools, choice, None)
    assert e.value.status == 400 and e.value.param == param and needle in e.value.message


def test_parser_from_the_template():
    assert choose_parser("auto", "{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert choose_parser("auto", "<|start_header_id|>ipython<|end_header_id|> <|python_tag|>") == "llama3_json"
    assert choose_parser("auto", None) == "hermes"
    assert choose_parser("llama3_json", "<tool_call>") == "llama3_json"


def test_tools_reach_the_chat_template(tmp_path):
    """A template that renders tools gets them through transformers' `tools=`; one that does not
    (ChatML) gets them in a system message, so the model sees them either way."""
    from inferlab.models.testing import save_tiny_tokenizer
    from inferlab.server.protocol import ChatMessage
    from inferlab.server.serving import OpenAIServing
    from inferlab.tokenizer import Tokenizer

    d = save_tiny_tokenizer(tmp_path / "plain")
    tok = Tokenizer.from_pretrained_dir(d)
    msgs = [ChatMessage(role="user", content="hi")]
    tools = tool_request([WEATHER], "auto", None)
    text = tok.decode(OpenAIServing._chat_prompt(tok, msgs, True, tools), skip_special_tokens=False)
    assert "<tools>" in text and '"get_weather"' in text and text.index("<tools>") < text.index("hi")
    none = tool_request([WEATHER], "none", None)
    assert "get_weather" not in tok.decode(OpenAIServing._chat_prompt(tok, msgs, True, none), skip_special_tokens=False)

    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
                            "{% for m in messages %}{{ m.role }}: {{ m.content }}"
                            "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}"
                            "{% endfor %}\n{% endfor %}")  # fmt: skip
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_pretrained_dir(d)
    history = msgs + [ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]),
        ChatMessage(role="tool", content="sunny", tool_call_id="call_1")]  # fmt: skip
    text = tok.decode(OpenAIServing._chat_prompt(tok, history, True, tools), skip_special_tokens=False)
    assert text.startswith("TOOLS:get_weather;") and "<tools>" not in text
    assert 'CALL get_weather {"city": "Oslo"}' in text and "tool: sunny" in text  # arguments as an object
