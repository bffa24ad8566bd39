"""Structured outputs on a real model, counted: N answers at temperature 1 against a strict JSON
schema (enums, integer ranges, additionalProperties false), checked by a JSON Schema validator
that is not the grammar engine; and N forced tool calls whose arguments are checked against
their function's parameters. Plain sampling at temperature 1 (top-p 1, no top-k or min-p: not
the model's narrower defaults), so the grammar alone keeps the text valid. Counts, not timings:
fine on a busy machine.

    .venv/bin/python benchmarks/structured_outputs_check.py                 # starts `inferlab serve` (default model)
    .venv/bin/python benchmarks/structured_outputs_check.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import openai
from harness import served

PLAIN = {"top_k": 0, "min_p": 0.0}  # with top_p=1.0: every token the grammar allows may be drawn

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "species": {"type": "string", "enum": ["cat", "dog", "parrot", "hamster"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "vaccinated": {"type": "boolean"},
        "weight_kg": {"type": "number", "minimum": 0, "maximum": 100},
        "toys": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "species", "age", "vaccinated", "weight_kg", "toys"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "function": {
    "name": "book_table", "description": "Book a table at a restaurant",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["restaurant", "people", "time"],
                   "properties": {"restaurant": {"type": "string", "maxLength": 40},
                                  "people": {"type": "integer", "minimum": 1, "maximum": 12},
                                  "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}}}}}  # fmt: skip
OTHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"],
    "additionalProperties": False}}}


def validator(schema: dict):
    try:
        import jsonschema_rs

        v = jsonschema_rs.validator_for(schema)
        return lambda doc: v.is_valid(doc)
    except ImportError:
        import jsonschema

        return lambda doc: jsonschema.Draft202012Validator(schema).is_valid(doc)


def check(client: openai.OpenAI, model: str, n: int, max_tokens: int, only: str | None = None) -> int:
    ok_schema = validator(SCHEMA)
    valid = 0 if only != "tools" else n
    msg = [{"role": "user", "content": "Invent a pet and describe it as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    for i in range(n if only != "tools" else 0):
        r = client.chat.completions.create(model=model, messages=msg, response_format=fmt, temperature=1.0,
                                           top_p=1.0, extra_body=PLAIN, max_tokens=max_tokens, seed=1000 + i)  # fmt: skip
        text = r.choices[0].message.content or ""
        try:
            good = ok_schema(json.loads(text))
        except json.JSONDecodeError:
            good = False
        valid += good
        print(f"  schema {i + 1:2d}: {'valid  ' if good else 'INVALID'} ({r.choices[0].finish_reason}) {text if not good else text[:120]}")
    if only != "tools":
        print(f"schema answers valid: {valid}/{n}")
    if only == "schema":
        return valid + n

    ok_args = validator(TOOL["function"]["parameters"])
    calls_ok = 0
    msg = [{"role": "user", "content": "Book a table for four at Luigi's at half past seven tonight."}]
    for i in range(n):
        choice = {"type": "function", "function": {"name": "book_table"}} if i % 2 == 0 else "required"
        # "required" with one call: a list of parallel calls has no end a 135M model at temperature 1 must reach.
        r = client.chat.completions.create(model=model, messages=msg, tools=[TOOL, OTHER_TOOL], tool_choice=choice,
                                           parallel_tool_calls=False,
                                           temperature=1.0, top_p=1.0, extra_body=PLAIN, max_tokens=max_tokens,
                                           seed=2000 + i)  # fmt: skip
        c = r.choices[0]
        calls = c.message.tool_calls or []
        good = bool(calls) and c.finish_reason == "tool_calls"
        for call in calls:
            try:
                args = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                good = False
                continue
            if call.function.name == "book_table":
                good = good and ok_args(args)
            else:
                good = good and call.function.name == "get_weather" and validator(OTHER_TOOL["function"]["parameters"])(args)
        calls_ok += good
        shown = [(t.function.name, t.function.arguments) for t in calls]
        print(f"  tool {i + 1:2d} ({choice if isinstance(choice, str) else 'named'}): "
              f"{'valid  ' if good else 'INVALID'} ({c.finish_reason}) {shown}")
    print(f"forced tool calls valid: {calls_ok}/{n}")
    return valid + calls_ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default=None, help="a running server's /v1 URL (default: start one)")
    ap.add_argument("--model", default=None, help="the model to serve when starting one (default: the default model)")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("-n", type=int, default=10)
    ap.add_argument("--only", choices=["schema", "tools"], default=None, help="one of the two checks")
    ap.add_argument("--max-tokens", type=int, default=400,
                    help="room for the longest valid answer (at temperature 1 a number may run to many digits)")
    args = ap.parse_args()
    argv = [sys.executable, "-m", "inferlab.cli", "serve", "--port", str(args.port)]
    if args.model:
        argv += ["--model", args.model]
    with (contextlib.nullcontext() if args.base_url  # a running server, or one started here
          else served(argv, f"http://127.0.0.1:{args.port}", Path(tempfile.mkdtemp()) / "server.log")):
        client = openai.OpenAI(base_url=args.base_url or f"http://127.0.0.1:{args.port}/v1", api_key="unused",
                               max_retries=0, timeout=600)  # fmt: skip
        model = client.models.list().data[0].id
        return 0 if check(client, model, args.n, args.max_tokens, args.only) == 2 * args.n else 1


if __name__ == "__main__":
    sys.exit(main())
