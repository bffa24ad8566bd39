"""A request's prompt as the token ids the replica's engine will see, for the block hashes.

Two sources, chosen by cost:
- local (`--tokenizer MODEL`): the model's own tokenizer and chat template in the router's
  process, ~0.35 ms of router CPU per 400-token chat prompt with SmolLM2's tokenizer (0.6 s to
  load once); no extra round trip and no work on a replica's event loop. Preferred when the
  router has the model's files.
- remote (the default): POST /tokenize to a ready replica, which applies the same template it
  serves with (exact by construction, any model, nothing to install) at the price of one
  loopback round trip per request and a little of that replica's event-loop time.
Token-id prompts need neither. When no source answers, the request is routed without a prefix
(by load), never refused.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from pydantic import ValidationError

from inferlab.server.protocol import ApiError, ChatMessage

logger = logging.getLogger("inferlab.router")


@dataclass(frozen=True)
class PromptSpec:
    """The part of a request body that decides its prompt tokens."""

    kind: str  # "chat" | "text" | "ids"
    messages: tuple[dict[str, str], ...] = ()
    text: str = ""
    ids: tuple[int, ...] = ()
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


def prompt_spec(chat: bool, payload: dict[str, Any]) -> PromptSpec | None:
    """The prompt of a chat or completions body (a completion's first prompt); None when the
    body is malformed (the replica will answer the 4xx itself)."""
    try:
        if chat:
            messages = payload.get("messages")
            if not isinstance(messages, list) or not messages:
                return None
            plain = tuple(ChatMessage.model_validate(m).plain() for m in messages)
            return PromptSpec("chat", messages=plain, add_generation_prompt=payload.get("add_generation_prompt", True) is not False)
        p = payload.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], (list, str)):  # a batch: its first prompt
            p = p[0]
        if isinstance(p, str):
            return PromptSpec("text", text=p, add_special_tokens=payload.get("add_special_tokens", True) is not False)
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return PromptSpec("ids", ids=tuple(p))
    except (ValidationError, ApiError, TypeError, AttributeError):
        return None
    return None


class PromptTokenizer(Protocol):
    async def token_ids(self, spec: PromptSpec, replicas: Sequence[str]) -> list[int] | None: ...


class LocalTokenizer:
    """The model's tokenizer in the router's process."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    @classmethod
    def load(cls, model: str) -> LocalTokenizer:
        from inferlab.models.registry import resolve_model
        from inferlab.tokenizer import Tokenizer

        return cls(Tokenizer.from_path(resolve_model(model).path))

    async def token_ids(self, spec: PromptSpec, replicas: Sequence[str]) -> list[int] | None:
        if spec.kind == "ids":
            return list(spec.ids)
        try:
            if spec.kind == "chat":
                return list(self.tokenizer.apply_chat_template(list(spec.messages),
                                                               add_generation_prompt=spec.add_generation_prompt))  # fmt: skip
            return list(self.tokenizer.encode(spec.text, add_special_tokens=spec.add_special_tokens))
        except Exception as e:  # noqa: BLE001 - a template that rejects these messages: route by load
            logger.debug("local tokenization failed: %s", e)
            return None


class RemoteTokenizer:
    """POST /tokenize to a ready replica (in turn; a second one if the first fails)."""

    def __init__(self, client: httpx.AsyncClient, headers: dict[str, str] | None = None, timeout_s: float = 2.0):
        self.client = client
        self.headers = headers or {}
        self.timeout_s = timeout_s
        self.calls = 0
        self._turn = 0  # rotates the first replica asked, so no one replica tokenizes for all

    async def token_ids(self, spec: PromptSpec, replicas: Sequence[str]) -> list[int] | None:
        if spec.kind == "ids":
            return list(spec.ids)
        if spec.kind == "chat":
            body: dict[str, Any] = {"messages": list(spec.messages), "add_generation_prompt": spec.add_generation_prompt}
        else:
            body = {"prompt": spec.text, "add_special_tokens": spec.add_special_tokens}
        self._turn += 1
        start = self._turn % max(len(replicas), 1)
        for url in [*replicas[start:], *replicas[:start]][:2]:
            self.calls += 1
            try:
                r = await self.client.post(url + "/tokenize", json=body, headers=self.headers, timeout=self.timeout_s)
                if r.status_code == 200:
                    tokens = r.json().get("tokens")
                    if isinstance(tokens, list):
                        return [int(t) for t in tokens]
            except (httpx.HTTPError, ValueError) as e:
                logger.debug("/tokenize on %s failed: %s", url, e)
        return None
