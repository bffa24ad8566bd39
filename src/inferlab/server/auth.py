"""Bearer-key authentication: which tenant a request belongs to.

`/health` is always public (load balancers probe it without secrets); `/metrics` is guarded unless
the server runs with --metrics-public (Prometheus scrapers often carry no key). Keys are looked up
by digest (`TenantTable.authenticate`), and neither the header nor the key is ever logged.
"""

from __future__ import annotations

from fastapi import Request

from inferlab.server.protocol import ApiError
from inferlab.server.tenants import Tenant, TenantTable


class ApiKeyGuard:
    """A FastAPI dependency returning the request's `Tenant`; 401 for a missing or unknown key
    (open access: every request is the anonymous tenant)."""

    def __init__(self, table: TenantTable):
        self.table = table

    @property
    def enabled(self) -> bool:
        return self.table.requires_key

    async def __call__(self, request: Request) -> Tenant:
        token = None
        if self.table.requires_key:
            scheme, _, value = request.headers.get("authorization", "").partition(" ")
            token = value.strip() if scheme.lower() == "bearer" else None
        tenant = self.table.authenticate(token)
        if tenant is None:
            raise ApiError(
                401,
                "invalid or missing API key: send it as 'Authorization: Bearer <key>'",
                "authentication_error",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return tenant
