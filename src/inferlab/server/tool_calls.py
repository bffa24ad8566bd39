"""Tool calls: a chat request's `tools` and `tool_choice`, and the model's text back as OpenAI's
`tool_calls`.

- `tool_choice` "none": the tools are not shown to the model and nothing is parsed;
- "auto" (the default with tools): the tools go through the model's chat template (`tools=`),
  and its answer is parsed in the model's own format: Hermes / Qwen2.5 / Qwen3
  (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around them)
  or Llama 3's JSON (`{"name": ..., "parameters": {...}}`, `;`-separated, the whole answer);
- "required" and a named function: the answer is forced by structured outputs, so its
  arguments always validate against the function's `parameters` schema: a named function's
  answer *is* its arguments object (streamed as argument deltas as it is written), "required"'s
  is a JSON array of `{"name", "parameters"}` (vLLM's design).

A chat template that never mentions `tools` (SmolLM2's ChatML) would drop them silently: the
tools then go into a system message in the Hermes format, and the Hermes parser reads the answer.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from inferlab.engine.request import StructuredOutputsParams
from inferlab.server.protocol import bad_request
from inferlab.server.reasoning import partial_suffix

PARSERS = ("auto", "hermes", "llama3_json")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolRequest:
    """What one chat request asks about tools, checked (400s name the field)."""

    tools: list[dict[str, Any]]  # OpenAI's [{"type": "function", "function": {...}}], for the template
    choice: str  # "none" | "auto" | "required" | "function"
    name: str | None = None  # the function tool_choice names
    parallel: bool = True

    @property
    def functions(self) -> dict[str, dict[str, Any]]:
        return {t["function"]["name"]: t["function"] for t in self.tools}

    @property
    def rendered(self) -> bool:
        return self.choice != "none"

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that forces a call ("required", a named function), else None."""
        if self.choice == "function":
            assert self.name is not None
            return StructuredOutputsParams(json=_canonical(_parameters(self.functions[self.name])), source="tool_choice")
        if self.choice == "required":
            one = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                    "properties": {"name": {"const": n}, "parameters": _parameters(f)}}
                   for n, f in self.functions.items()]  # fmt: skip
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": one[0] if len(one) == 1 else {"anyOf": one}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=_canonical(schema), source="tools")
        return None


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def _canonical(schema: Any) -> str:
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


def tool_request(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolRequest | None:
    """The request's tools checked, or None when it sends none (tool_choice "none"/"auto" alone
    is neutral; anything else without tools is a 400)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of {'type': 'function', 'function': {...}}", param="tools")
    seen: set[str] = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
                              param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise bad_request(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}",
                              param="tools")
        if name in seen:
            raise bad_request(f"tools[{i}]: the function name {name!r} is used twice", param="tools")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
    tools = [{**t, "type": "function"} for t in tools]
    if tool_choice is None or tool_choice == "auto":
        return ToolRequest(tools, "auto", parallel=parallel_tool_calls is not False)
    if tool_choice in ("none", "required"):
        return ToolRequest(tools, tool_choice, parallel=parallel_tool_calls is not False)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in seen:
            raise bad_request(f"tool_choice names the function {name!r}, which is not in tools ({sorted(seen)})",
                              param="tool_choice")
        return ToolRequest(tools, "function", name=name)
    raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                      f"{{'name': ...}}}}, got {tool_choice!r}", param="tool_choice")


def choose_parser(setting: str, chat_template: str | None) -> str:
    """--tool-call-parser: as given, or for 'auto' from the model's template (Llama 3's
    ipython / python_tag conventions, else Hermes, the format most templates use)."""
    if setting != "auto":
        return setting
    t = chat_template or ""
    if "<|python_tag|>" in t or ("ipython" in t and "<tool_call>" not in t):
        return "llama3_json"
    return "hermes"


def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in (chat_template or "")


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The tools for a template that cannot show them, as a Hermes-format system message."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call functions. Their signatures are listed inside <tools></tools>:\n<tools>\n" + listing
            + "\n</tools>\nTo call one, answer with a JSON object holding the function name and its arguments "
            'inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call>")


# ---- reading the answer ------------------------------------------------------------------------

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _call_from(obj: Any) -> ToolCall | None:
    """{"name": ..., "arguments" | "parameters": {...}} → a ToolCall, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except json.JSONDecodeError:
            return None
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for m in _HERMES.finditer(text):
        try:
            call = _call_from(json.loads(m.group(1)))
        except json.JSONDecodeError:
            call = None
        if call is None:
            continue  # not a call after all: left in the content
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>") :].lstrip()
    if not body.startswith("{"):
        return text, []
    calls: list[ToolCall] = []
    dec = json.JSONDecoder()
    i = 0
    while i < len(body):
        try:
            obj, end = dec.raw_decode(body, i)
        except json.JSONDecodeError:
            return text, []
        call = _call_from(obj)
        if call is None:
            return text, []
        calls.append(call)
        i = end
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
    return None, calls


@dataclass
class Delta:
    """What one step adds to a streamed choice: content text and/or tool-call pieces in
    OpenAI's delta shape ({"index", "id", "type", "function": {"name", "arguments"}})."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ToolOutput:
    """How one request's answers become tool calls (one per request; `stream()` per choice)."""

    def __init__(self, request: ToolRequest, parser: str):
        self.request = request
        self.parser = parser

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a whole answer."""
        r = self.request
        if r.choice == "function":
            assert r.name is not None
            return None, [ToolCall(r.name, text)]
        if r.choice == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text, []  # cut short by max_tokens: what there is, as text
            calls = [c for c in (_call_from(i) for i in items) if c is not None]
            return (None, calls) if calls else (text, [])
        return parse_hermes(text) if self.parser == "hermes" else parse_llama3_json(text)

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """One streamed choice: text deltas in, content and tool-call deltas out. Text that might
    be the start of a call is held back until it is known (the tag, Llama 3's leading '{');
    a call goes out whole once its closing tag is seen, a named function's arguments as written."""

    def __init__(self, out: ToolOutput):
        self.out = out
        self.buffer = ""
        self.inside = False
        self.mode = "undecided"  # llama3_json: "content" or "calls" once the first character is seen
        self.num_calls = 0

    def _call_delta(self, call: ToolCall) -> dict[str, Any]:
        d = {"index": self.num_calls, **call.as_dict()}
        self.num_calls += 1
        return d

    def feed(self, text: str) -> Delta:
        r = self.out.request
        if r.choice == "function":
            assert r.name is not None
            if self.num_calls == 0:
                head = self._call_delta(ToolCall(r.name, text))
                return Delta(tool_calls=[head])
            return Delta(tool_calls=[{"index": 0, "function": {"arguments": text}}] if text else [])
        self.buffer += text
        if r.choice == "required":
            return Delta()
        if self.out.parser == "llama3_json":
            if self.mode == "undecided" and self.buffer.strip():
                first = self.buffer.lstrip()
                self.mode = "calls" if first.startswith("{") or first.startswith("<|python_tag|>") else "content"
            if self.mode == "content":
                out, self.buffer = self.buffer, ""
                return Delta(content=out)
            return Delta()
        return Delta(*self._hermes())

    def _hermes(self) -> tuple[str, list[dict[str, Any]]]:
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            if not self.inside:
                at = self.buffer.find(OPEN)
                if at < 0:
                    keep = partial_suffix(self.buffer, OPEN)
                    content.append(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                content.append(self.buffer[:at])
                self.buffer = self.buffer[at + len(OPEN) :]
                self.inside = True
            else:
                at = self.buffer.find(CLOSE)
                if at < 0:
                    break
                body, self.buffer = self.buffer[:at], self.buffer[at + len(CLOSE) :]
                self.inside = False
                try:
                    call = _call_from(json.loads(body))
                except json.JSONDecodeError:
                    call = None
                if call is None:
                    content.append(OPEN + body + CLOSE)
                else:
                    calls.append(self._call_delta(call))
        return "".join(content), calls

    def finish(self) -> Delta:
        """The answer is complete: what was held back, as content or calls."""
        r = self.out.request
        if r.choice == "function":
            return Delta()
        rest, self.buffer = self.buffer, ""
        if r.choice == "required" or self.out.parser == "llama3_json" or self.inside:
            text = (OPEN if self.inside else "") + rest
            content, calls = (self.out.extract(rest) if not self.inside else parse_hermes(text))
            return Delta(content=content or "", tool_calls=[self._call_delta(c) for c in calls])
        return Delta(content=rest)


def message_for_template(m: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI message as chat templates read it: tool calls' arguments as objects (Qwen's and
    Llama's templates write them with tojson), the tool result's id and name kept."""
    out = dict(m)
    calls = out.get("tool_calls")
    if calls:
        fixed = []
        for c in calls:
            fn = dict(c["function"]) if isinstance(c.get("function"), dict) else {}
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    fn["arguments"] = json.loads(args)
                except json.JSONDecodeError:
                    pass
            fixed.append({**c, "function": fn})
        out["tool_calls"] = fixed
    return out
