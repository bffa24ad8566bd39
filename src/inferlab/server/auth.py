"""Bearer-key authentication for the inference and tokenizer routes.

`/health` is always public (load balancers probe it without secrets); `/metrics` is guarded unless
the server runs with --metrics-public (Prometheus scrapers often carry no key).
"""

from __future__ import annotations

import secrets

from fastapi import Request

from inferlab.server.protocol import ApiError


class ApiKeyGuard:
    """A FastAPI dependency: passes when no key is configured or the request carries it."""

    def __init__(self, api_key: str | None):
        self._key = api_key.encode() if api_key else None

    @property
    def enabled(self) -> bool:
        return self._key is not None

    async def __call__(self, request: Request) -> None:
        if self._key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        # compare_digest: the time taken must not reveal how much of a guessed key was right.
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self._key):
            raise ApiError(
                401,
                "invalid or missing API key: send it as 'Authorization: Bearer <key>'",
                "authentication_error",
                headers={"WWW-Authenticate": "Bearer"},
            )
