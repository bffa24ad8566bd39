"""Active health checks: each replica's /health, then (once, and after every restart) its
/server_info and (each round) its /metrics and its KV events, every `interval_s`, all replicas
at once.

KV events are polled (`GET /kv_events?after=SEQ`, a snapshot first and after any gap or
restart; kv_sync.py keeps the order); a replica that answers 404 publishes none and is
routed on speculative entries alone until it restarts.

A refused connection or a non-200 /health takes a replica out at once (no traffic before it is
ready again); a probe that times out does so only `timeouts_to_fail` times in a row, since a
replica busy with a long prefill can answer slowly and still be serving.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import httpx

from inferlab.router.fleet import Fleet
from inferlab.router.kv_sync import BadFeed, parse_page, parse_snapshot
from inferlab.router.replica import ReplicaInfo, ReplicaMetrics

logger = logging.getLogger("inferlab.router")

_GAUGES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
           "vllm:kv_cache_usage_perc": "kv_usage"}  # fmt: skip
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)")


def parse_replica_metrics(text: str, now: float) -> ReplicaMetrics:
    """The load gauges of a replica's Prometheus text (summed over label sets)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:num_requests_") and not line.startswith("vllm:kv_cache_usage_perc"):
            continue
        m = _SAMPLE.match(line)
        if m and m.group(1) in _GAUGES:
            try:
                found[_GAUGES[m.group(1)]] = found.get(_GAUGES[m.group(1)], 0.0) + float(m.group(2))
            except ValueError:
                continue
    return ReplicaMetrics(now, found.get("running", 0.0), found.get("waiting", 0.0), found.get("kv_usage"))


def parse_server_info(body: Any) -> ReplicaInfo:
    body = body if isinstance(body, dict) else {}
    kv = body.get("kv_cache") or {}
    return ReplicaInfo(
        block_size=int(kv.get("block_size") or 16),
        prefix_caching=bool(kv.get("prefix_caching", True)),
        num_blocks=int(kv["num_blocks"]) if kv.get("num_blocks") else None,
        max_num_seqs=int(body["max_num_seqs"]) if body.get("max_num_seqs") else None,
        known=True,
    )


class Prober:
    def __init__(self, fleet: Fleet, client: httpx.AsyncClient, *, interval_s: float = 0.5, timeout_s: float = 2.0,
                 headers: dict[str, str] | None = None, timeouts_to_fail: int = 3, kv_events: bool = True,
                 kv_page: int = 2000, kv_pages_per_round: int = 8):  # fmt: skip
        self.fleet = fleet
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.headers = headers or {}
        self.timeouts_to_fail = timeouts_to_fail
        self.kv_events = kv_events
        self.kv_page = kv_page
        self.kv_pages_per_round = kv_pages_per_round
        self._timeouts: dict[str, int] = {}
        self.rounds = 0

    async def run(self) -> None:
        while True:
            await self.round()
            await asyncio.sleep(self.interval_s)

    async def round(self) -> None:
        await asyncio.gather(*(self.probe(name) for name in self.fleet.replicas))
        self.rounds += 1

    async def probe(self, name: str) -> None:
        r = self.fleet.replicas[name]
        try:
            health = await self.client.get(name + "/health", timeout=self.timeout_s)
        except httpx.TimeoutException as e:
            self._timeouts[name] = self._timeouts.get(name, 0) + 1
            if self._timeouts[name] >= self.timeouts_to_fail:
                self._fail(name, f"/health timed out: {e!r}")
            return
        except httpx.HTTPError as e:
            self._fail(name, f"/health: {type(e).__name__}: {e}")
            return
        self._timeouts[name] = 0
        if health.status_code != 200:
            self._fail(name, f"/health answered {health.status_code}")
            return
        info = None
        if not r.health.ready or not r.state.info.known:
            info = await self._server_info(name)
        metrics = None
        try:
            m = await self.client.get(name + "/metrics", headers=self.headers, timeout=self.timeout_s)
            if m.status_code == 200:
                metrics = parse_replica_metrics(m.text, self.fleet.clock())
        except httpx.HTTPError:
            pass  # the last report ages into "unknown"
        was_ready = r.health.ready
        self.fleet.probe_ok(name, metrics, info)
        if not was_ready:
            logger.info("replica %s is ready", name)
            r.kv.supported = None  # (re)started: perhaps another version, ask again
        if self.kv_events and r.state.info.prefix_caching:
            await self.follow_kv_events(name)

    async def follow_kv_events(self, name: str) -> None:
        """Bring the replica's confirmed index entries up to its latest KV event."""
        kv = self.fleet.replicas[name].kv
        if kv.supported is False:
            return
        try:
            for _ in range(self.kv_pages_per_round):
                if not kv.synced:
                    resp = await self.client.get(name + "/kv_events/snapshot", headers=self.headers, timeout=self.timeout_s)
                    if resp.status_code in (401, 403, 404):
                        kv.supported = False
                        why = "publishes no KV events" if resp.status_code == 404 else \
                            f"refuses the router's key for /kv_events (HTTP {resp.status_code}; see --backend-api-key)"
                        logger.warning("replica %s %s: speculative prefix entries only", name, why)
                        return
                    if resp.status_code != 200:
                        return
                    kv.apply_snapshot(parse_snapshot(resp.json()))
                    kv.supported = True
                resp = await self.client.get(name + "/kv_events", params={"after": kv.seq, "limit": self.kv_page},
                                             headers=self.headers, timeout=self.timeout_s)  # fmt: skip
                if resp.status_code != 200:
                    return
                page = parse_page(resp.json())
                if kv.apply_page(page) and len(page.events) < self.kv_page:
                    return
        except (httpx.HTTPError, BadFeed, ValueError) as e:
            kv.reset()  # whatever we missed, a snapshot will cover
            logger.debug("KV events from %s: %s", name, e)

    async def _server_info(self, name: str) -> ReplicaInfo | None:
        try:
            resp = await self.client.get(name + "/server_info", headers=self.headers, timeout=self.timeout_s)
            if resp.status_code == 200:
                return parse_server_info(resp.json())
        except (httpx.HTTPError, ValueError):
            pass
        return None  # not an inferlab replica (or no key): the defaults

    def _fail(self, name: str, error: str) -> None:
        if self.fleet.replicas[name].health.ready:
            logger.warning("replica %s is down: %s", name, error)
        self.fleet.probe_failed(name)
