"""Tenants: who a bearer key belongs to, that tenant's limits and its prefix-cache namespace.

    --api-keys FILE   {"tenants": [{"name": "team-a", "keys": ["..."], "max_concurrent": 4,
                                    "requests_per_minute": 600, "tokens_per_minute": 200000,
                                    "max_tokens": 2048, "max_prompt_tokens": 8192,
                                    "cache_group": "shared-docs"}]}
    --api-key KEY     one anonymous tenant ("default", no limits), as before
    neither           open access: everyone is that anonymous tenant

Every limit is optional; a tenant's prefix cache is its own (its name is the cache salt) unless
tenants name the same `cache_group`. The file is checked whole at start: a malformed file, an
unknown field, a limit <= 0, a duplicate tenant name or a key listed twice (in one tenant or
across two) is a `TenantFileError` naming the line, so `inferlab serve` refuses to start.

Keys are kept only as SHA-256 digests and looked up by digest: the time a lookup takes depends
on the digest of what the client sent, not on how much of a real key it guessed, and no key is
ever in a repr, a log line or an error message.
"""

from __future__ import annotations

import hashlib
import json
import json.decoder
import json.scanner
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

ANONYMOUS = "default"  # the tenant of --api-key and of open access
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # safe as a metric label, a log word, a salt


class TenantFileError(ValueError):
    """The keys file cannot be used; the message is one line, `FILE:LINE[:COL]: what`."""


@dataclass(frozen=True)
class TenantLimits:
    """Per-tenant caps; None = no cap."""

    max_concurrent: int | None = None  # requests in flight at once
    requests_per_minute: int | None = None  # token bucket, burst = one minute's worth
    tokens_per_minute: int | None = None  # prompt + completion tokens, same bucket shape
    max_tokens: int | None = None  # completion tokens per request (the default when absent)
    max_prompt_tokens: int | None = None  # prompt tokens per prompt


@dataclass(frozen=True)
class Tenant:
    name: str
    limits: TenantLimits = TenantLimits()
    cache_salt: str | None = None  # None: the anonymous namespace (the request's own salt only)

    def request_salt(self, requested: str | None) -> str | None:
        """The salt the engine gets: the tenant's, then the request's own `cache_salt` (which can
        split a tenant's cache further but never reach another tenant's)."""
        if self.cache_salt is None:
            return requested
        return self.cache_salt if requested is None else f"{self.cache_salt}|{requested}"


@dataclass(frozen=True)
class TenantTable:
    """Tenants and the digests of their keys; `authenticate` maps a bearer token to its tenant."""

    tenants: tuple[Tenant, ...]
    by_digest: Mapping[bytes, Tenant] = field(default_factory=lambda: MappingProxyType({}), repr=False)

    @property
    def requires_key(self) -> bool:
        return bool(self.by_digest)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tenants)

    def authenticate(self, token: str | None) -> Tenant | None:
        """The tenant owning `token`; None if it is no key of ours. Open access: the anonymous one."""
        if not self.by_digest:
            return self.tenants[0]
        if not token:
            return None
        return self.by_digest.get(digest(token))

    @classmethod
    def open_access(cls) -> TenantTable:
        return cls((Tenant(ANONYMOUS),))

    @classmethod
    def single_key(cls, key: str) -> TenantTable:
        tenant = Tenant(ANONYMOUS)
        return cls((tenant,), MappingProxyType({digest(key): tenant}))

    @classmethod
    def of(cls, api_key: str | None, tenants: TenantTable | None) -> TenantTable:
        """A tenants file's table, one key's, or open access (a key and a file: ValueError)."""
        if tenants is not None and api_key:
            raise ValueError("give either an API key or a tenants file (--api-key or --api-keys), not both")
        if tenants is not None:
            return tenants
        return cls.single_key(api_key) if api_key else cls.open_access()


def keys_from_args(api_key: str | None, api_keys_file: str | None) -> tuple[str | None, TenantTable | None]:
    """--api-key (else INFERLAB_API_KEY) or --api-keys FILE, for `serve` and `router` alike (a bad
    file: one line naming the line, exit 2)."""
    api_key = api_key or os.environ.get("INFERLAB_API_KEY") or None
    if api_keys_file is None:
        return api_key, None
    if api_key is not None:
        raise ValueError("--api-keys and --api-key (or INFERLAB_API_KEY) both give keys: use one")
    return None, load_tenants(api_keys_file)


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


# ------------------------------------------------------------------------------------ the file
class _TenantSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: StrictStr = Field(pattern=NAME_PATTERN)
    keys: list[StrictStr] = Field(min_length=1)
    max_concurrent: StrictInt | None = Field(default=None, gt=0)
    requests_per_minute: StrictInt | None = Field(default=None, gt=0)
    tokens_per_minute: StrictInt | None = Field(default=None, gt=0)
    max_tokens: StrictInt | None = Field(default=None, gt=0)
    max_prompt_tokens: StrictInt | None = Field(default=None, gt=0)
    cache_group: StrictStr | None = Field(default=None, pattern=NAME_PATTERN)


class _KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: list[_TenantSpec] = Field(min_length=1)


class _Str(str):
    """A JSON string value and where it starts in the file."""

    pos: int


class _Obj(dict):
    """A JSON object and its span in the file."""

    pos: int
    end: int


class _DuplicateField(Exception):
    def __init__(self, name: str):
        self.name = name


def _parse_with_positions(text: str) -> Any:
    """json.loads, but string values and objects remember their offsets (for error lines), and
    an object with the same field twice is an error rather than last-one-wins."""
    decoder = json.JSONDecoder()
    plain_string = decoder.parse_string
    plain_object = decoder.parse_object

    def parse_string(s: str, end: int, strict: bool = True) -> tuple[str, int]:
        value, new_end = plain_string(s, end, strict)
        out = _Str(value)
        out.pos = end - 1
        return out, new_end

    def pairs(items: list[tuple[str, Any]]) -> dict:
        seen: dict = {}
        for k, v in items:
            if k in seen:
                raise _DuplicateField(k)
            seen[k] = v
        return seen

    def parse_object(s_and_end: tuple[str, int], strict: bool, scan_once: Any, hook: Any, _pairs: Any, memo: Any = None):
        start = s_and_end[1] - 1
        try:
            obj, end = plain_object(s_and_end, strict, scan_once, hook, pairs, memo)
        except _DuplicateField as e:
            raise json.JSONDecodeError(f"the field {e.name!r} appears twice in this object", s_and_end[0], start) from None
        out = _Obj(obj)
        out.pos, out.end = start, end
        return out, end

    decoder.parse_string = parse_string  # type: ignore[assignment]
    decoder.parse_object = parse_object  # type: ignore[assignment]
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # the pure-Python scanner calls the two above
    return decoder.decode(text)


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def load_tenants(path: str | Path) -> TenantTable:
    """The tenants of a keys file (see the module docstring); `TenantFileError` if it is unusable."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        data = _parse_with_positions(text)
    except json.JSONDecodeError as e:
        raise TenantFileError(f"{path}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None
    try:
        spec = _KeysFile.model_validate(data)
    except ValidationError as e:
        raise TenantFileError(_describe(path, text, data, e)) from None

    tenants: list[Tenant] = []
    by_digest: dict[bytes, tuple[Tenant, int]] = {}
    names: dict[str, int] = {}
    for i, t in enumerate(spec.tenants):
        raw = data["tenants"][i]
        line = _line(text, raw.pos)
        if t.name in names:
            raise TenantFileError(f"{path}:{line}: a second tenant named {t.name!r} (the first is on line {names[t.name]})")
        names[t.name] = line
        salt = f"group:{t.cache_group}" if t.cache_group is not None else f"tenant:{t.name}"
        limits = TenantLimits(**{f: getattr(t, f) for f in TenantLimits.__dataclass_fields__})
        tenant = Tenant(t.name, limits, salt)
        tenants.append(tenant)
        for j, key in enumerate(t.keys):
            key_line = _line(text, raw["keys"][j].pos)
            if not key.strip() or any(c.isspace() for c in key):
                raise TenantFileError(f"{path}:{key_line}: tenant {t.name!r} has a key that is empty or holds whitespace")
            d = digest(key)
            if d in by_digest:
                other, other_line = by_digest[d]
                if other is tenant:
                    raise TenantFileError(f"{path}:{key_line}: tenant {t.name!r} lists the same key twice (lines {other_line} and {key_line})")
                raise TenantFileError(
                    f"{path}:{key_line}: tenant {t.name!r} has a key that tenant {other.name!r} already has (line {other_line}); "
                    "a key must belong to one tenant"
                )
            by_digest[d] = (tenant, key_line)
    return TenantTable(tuple(tenants), MappingProxyType({d: t for d, (t, _) in by_digest.items()}))


def _describe(path: Path, text: str, data: Any, e: ValidationError) -> str:
    """The first schema problem as one line: where (line, tenant), which field, what is wrong.
    Never the offending value: it may be a key."""
    first = e.errors()[0]
    loc = list(first.get("loc", ()))
    kind = first.get("type", "")
    # Walk the parsed data along the error's path: the innermost object or string gives the line.
    node: Any = data
    pos = 0
    tenant: Any = None
    for depth, part in enumerate(loc):
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            break
        if isinstance(node, _Obj | _Str):
            pos = node.pos
        if depth == 1 and loc[0] == "tenants" and isinstance(node, _Obj):
            tenant = node
    field_name = str(loc[-1]) if loc else ""
    if tenant is not None and len(loc) >= 3 and not isinstance(node, _Str):
        # a number or a field that is not allowed: find `"field":` in the tenant's own text
        m = re.compile(r'(?<!\\)"' + re.escape(str(loc[2])) + r'"\s*:').search(text, tenant.pos, tenant.end)
        if m:
            pos = m.start()
    where = f"{path}:{_line(text, pos)}: "
    if tenant is not None:
        name = tenant.get("name")
        where += f"tenant {name!r}: " if isinstance(name, str) else f"tenants[{loc[1]}]: "
    if kind == "extra_forbidden":
        known = ", ".join(_TenantSpec.model_fields if tenant is not None else _KeysFile.model_fields)
        return f"{where}unknown field {field_name!r} (known: {known})"
    if kind == "missing":
        return f"{where}the field {field_name!r} is required"
    name = ".".join(str(p) for p in (loc[2:] if tenant is not None else loc))
    if kind == "greater_than":
        return f"{where}{name} must be a positive integer (omit it for no limit)"
    return f"{where}{name or 'the file'}: {first.get('msg', 'invalid value')}"
