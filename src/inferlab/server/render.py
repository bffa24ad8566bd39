"""Engine outputs in OpenAI's shapes: usage, logprobs, finish reasons, llama.cpp's timings.

Plain dicts rather than pydantic models: these run once per streamed chunk, on the hot path.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from inferlab.engine.request import RequestOutput, TokenLogprobs

_MIN_LOGPROB = -9999.0  # JSON has no -inf; clients expect a number


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: Any) -> bytes:
    """One Server-Sent Event: `data: {json}` and a blank line."""
    return b"data: " + dumps(obj).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def usage(outputs: list[RequestOutput]) -> dict[str, Any]:
    """OpenAI's usage over all of an HTTP request's engine requests (one per prompt)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.metrics.num_cached_tokens for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def timings(outputs: list[RequestOutput]) -> dict[str, Any] | None:
    """llama.cpp's `timings` (+ queue_ms) for a single-prompt request; None for several prompts."""
    if len(outputs) != 1:
        return None
    out = outputs[0]
    m = out.metrics
    # predicted_n covers all n sequences and prompt_n the whole prompt, whatever the engine counted.
    m = dataclasses.replace(
        m,
        num_generated_tokens=max(m.num_generated_tokens, sum(len(c.token_ids) for c in out.outputs)),
        num_prompt_tokens=m.num_prompt_tokens or len(out.prompt_token_ids),
    )
    return m.timings()


class TokenText:
    """Token id → its text, cached (logprobs name every token, often the same ones)."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 200_000:
                self._cache[token_id] = text
        return text


def _lp(value: float) -> float:
    return value if value > _MIN_LOGPROB else _MIN_LOGPROB


def chat_logprobs(items: list[TokenLogprobs], text: TokenText) -> dict[str, Any]:
    """Chat's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    content = []
    for chosen, top in items:
        s = text(chosen.token_id)
        content.append(
            {
                "token": s,
                "logprob": _lp(chosen.logprob),
                "bytes": list(s.encode("utf-8")),
                "top_logprobs": [
                    {"token": (t := text(a.token_id)), "logprob": _lp(a.logprob), "bytes": list(t.encode("utf-8"))}
                    for a in top
                ],
            }
        )
    return {"content": content}


def completion_logprobs(items: list[TokenLogprobs], text: TokenText, text_offset: int = 0) -> dict[str, Any]:
    """Legacy completions' `logprobs`: parallel lists tokens / token_logprobs / top_logprobs / text_offset."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for chosen, top in items:
        s = text(chosen.token_id)
        tokens.append(s)
        token_logprobs.append(_lp(chosen.logprob))
        tops.append({text(a.token_id): _lp(a.logprob) for a in top})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
