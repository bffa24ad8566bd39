"""Engine outputs in OpenAI's shapes: usage, logprobs, finish reasons, llama.cpp's timings.

Plain dicts rather than pydantic models: these run once per streamed chunk, on the hot path.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from inferlab.engine.request import PromptLogprobs, RequestOutput, TokenLogprobs

_MIN_LOGPROB = -9999.0  # JSON has no -inf; clients expect a number


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: Any) -> bytes:
    """One Server-Sent Event: `data: {json}` and a blank line."""
    return b"data: " + dumps(obj).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def usage(outputs: list[RequestOutput], echo_only: bool = False) -> dict[str, Any]:
    """OpenAI's usage over all of an HTTP request's engine requests (one per prompt);
    `echo_only` (max_tokens 0): the one token the engine sampled is not part of the answer."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = 0 if echo_only else sum(len(c.token_ids) for o in outputs for c in o.outputs)
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


def completion_logprobs(
    items: list[TokenLogprobs | int], text: TokenText, text_offset: int = 0, prefix: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Legacy completions' `logprobs`: parallel lists tokens / token_logprobs / top_logprobs /
    text_offset. Each top_logprobs dict holds the chosen token and the top k (up to k + 1
    entries, as OpenAI documents). A bare token id (the first prompt token under echo) has
    null logprob and top_logprobs. `prefix` (the echoed prompt's lists) goes first."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for item in items:
        if isinstance(item, int):
            s = text(item)
            token_logprobs.append(None)
            tops.append(None)
        else:
            chosen, top = item
            s = text(chosen.token_id)
            token_logprobs.append(_lp(chosen.logprob))
            entry = {s: _lp(chosen.logprob)}
            for a in top:
                entry.setdefault(text(a.token_id), _lp(a.logprob))
            tops.append(entry)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
    out = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
    if prefix is not None:
        out = {key: prefix[key] + out[key] for key in out}
    return out


def echo_items(prompt_ids: list[int], prompt_logprobs: PromptLogprobs | None, k: int) -> list[TokenLogprobs | int]:
    """The prompt tokens as `completion_logprobs` items: the first as a bare id (nothing
    predicts it), then (the prompt token, its top k by rank) from the engine's prompt logprobs."""
    items: list[TokenLogprobs | int] = [prompt_ids[0]]
    lps = prompt_logprobs or []
    for p in range(1, len(prompt_ids)):
        entry = lps[p] if p < len(lps) else None
        if entry is None:  # cannot happen once the engine has a token out; say so rather than guess
            raise RuntimeError(f"prompt logprob {p} of {len(prompt_ids)} is missing")
        top = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= k), key=lambda lp: lp.rank)
        items.append((entry[prompt_ids[p]], top[:k]))
    return items


def prompt_logprobs_json(prompt_ids: list[int], prompt_logprobs: PromptLogprobs | None, k: int, text: TokenText) -> list[Any]:
    """vLLM's `prompt_logprobs`: None, then {token_id: {logprob, rank, decoded_token}} per prompt
    token (the prompt token and the top k)."""
    out: list[Any] = []
    for p, entry in enumerate(prompt_logprobs or []):
        if entry is None:
            out.append(None)
            continue
        out.append(
            {
                str(tid): {"logprob": _lp(lp.logprob), "rank": lp.rank,
                           "decoded_token": lp.decoded_token if lp.decoded_token is not None else text(tid)}
                for tid, lp in entry.items()
                if tid == prompt_ids[p] or (lp.rank is not None and lp.rank <= k)
            }
        )  # fmt: skip
    return out
