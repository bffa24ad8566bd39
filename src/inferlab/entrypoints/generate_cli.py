"""`inferlab generate`: one reply, offline, from a prompt or chat messages."""

from __future__ import annotations

import argparse
import json
import sys

from inferlab.engine.engine_args import EngineArgs


def add_arguments(p: argparse.ArgumentParser) -> None:
    # --seed here is the sampling seed; the sampling-default flags are serve's: generate's own
    # sampling flags always give every value (greedy by default), so they would change nothing.
    EngineArgs.add_cli_args(p, skip=("seed", "sampling_defaults", "override_generation_config"))
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", default=None, help="the user's message (wrapped in the chat template unless --raw)")
    src.add_argument("--messages", default=None, help='chat messages as JSON: [{"role": "user", "content": "..."}], or @file.json')
    p.add_argument("--raw", action="store_true", help="send --prompt as is, without the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", dest="sampling_seed", type=int, default=None,
                   help="the sampling seed (default: a fresh one)")
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("-n", type=int, default=1, help="number of replies")
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print text, token ids, finish reason, usage and timings as JSON")


def _messages(args: argparse.Namespace) -> list[dict] | None:
    if args.messages is None:
        return None
    text = args.messages
    if text.startswith("@"):
        with open(text[1:], encoding="utf-8") as f:
            text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--messages is not valid JSON: {e}") from None
    if isinstance(data, dict) and "messages" in data:
        data = data["messages"]
    if not isinstance(data, list):
        raise ValueError("--messages must be a JSON list of {role, content} objects")
    return data


# The sampling flags named as SamplingParams' fields (--seed is `sampling_seed`: EngineArgs has a --seed).
_SAMPLING_FLAGS = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "max_tokens", "stop", "ignore_eos", "logprobs")


def run(args: argparse.Namespace) -> int:
    from inferlab.engine.request import SamplingParams

    params = SamplingParams(seed=args.sampling_seed, **{name: getattr(args, name) for name in _SAMPLING_FLAGS})
    messages = _messages(args)
    if messages is None and args.prompt is None:
        args.prompt = "In one sentence, why might a parcel arrive a day late?"
    from inferlab.entrypoints.llm import LLM

    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    try:
        if messages is not None:
            out = llm.chat(messages, params)[0]
        elif args.raw:
            out = llm.generate(args.prompt, params)[0]
        else:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    finally:
        llm.shutdown()
    if args.json:
        from inferlab.server.render import usage

        doc = {
            "model": llm.engine.model_name,
            "prompt_token_ids": out.prompt_token_ids,
            "choices": [
                {
                    "index": c.index,
                    "text": c.text,
                    "token_ids": c.token_ids,
                    "finish_reason": c.finish_reason,
                    "logprobs": [
                        {"token_id": lp.token_id, "logprob": lp.logprob, "top": [(t.token_id, t.logprob) for t in top]}
                        for lp, top in c.logprobs
                    ]
                    if c.logprobs is not None
                    else None,
                }
                for c in out.outputs
            ],
            "usage": usage([out]),
            "timings": out.metrics.timings(),
        }
        json.dump(doc, sys.stdout, indent=2, ensure_ascii=False)
        print()
    else:
        for c in out.outputs:
            if len(out.outputs) > 1:
                print(f"--- reply {c.index} ({c.finish_reason})")
            print(c.text)
    return 0
