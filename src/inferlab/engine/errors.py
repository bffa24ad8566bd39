"""Errors the engine raises for bad requests; the server maps them to HTTP statuses."""

from __future__ import annotations


class ContextLengthError(ValueError):
    """prompt + max_tokens exceeds the context window (HTTP 400)."""

    def __init__(self, n_prompt_tokens: int, max_tokens: int | None, n_ctx: int):
        self.n_prompt_tokens = n_prompt_tokens
        self.max_tokens = max_tokens
        self.n_ctx = n_ctx
        if max_tokens is None or n_prompt_tokens >= n_ctx:
            over = n_prompt_tokens - n_ctx + 1
            msg = (
                f"the prompt has {n_prompt_tokens} tokens, which leaves no room to generate in the "
                f"context window of {n_ctx} tokens ({over} tokens too many)"
            )
        else:
            over = n_prompt_tokens + max_tokens - n_ctx
            msg = (
                f"this request asks for {n_prompt_tokens + max_tokens} tokens ({n_prompt_tokens} in the prompt + "
                f"{max_tokens} max_tokens), but the context window is {n_ctx} tokens: {over} too many; "
                "shorten the prompt or lower max_tokens"
            )
        super().__init__(msg)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a bug or a fatal error); the server reports 503 on /health."""
