"""A bounded soak on loopback: the real (tiny) engine behind the server, overloaded with Poisson
arrivals, streams cancelled after three chunks and bad inputs. Every request gets an answer
(nothing hung, nothing lost, no 5xx), the KV blocks come back, and memory stays flat after a
warm-up round. benchmarks/soak.py is the longer version, with a plot, on the default model."""

from __future__ import annotations

import asyncio
import collections
import random

import httpx
import psutil
import pytest
from server_harness import ServerThread, metric, scrape, wait_until

from inferlab.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig
from inferlab.engine.llm_engine import LLMEngine
from inferlab.models.testing import make_tiny_hf_model
from inferlab.server.app import ServerSettings, build_app

ROUNDS, PER_ROUND = 3, 120


async def _one(client: httpx.AsyncClient, rng: random.Random, i: int) -> str:
    kind = rng.random()
    if kind < 0.05:  # bad input: a 4xx with an error body, never a 5xx
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": -3})
        return "4xx" if 400 <= r.status_code < 500 and r.json()["error"]["message"] else f"bad:{r.status_code}"
    body = {"prompt": " ".join(f"w{rng.randrange(500)}" for _ in range(rng.randrange(4, 60))),
            "max_tokens": rng.randrange(4, 24), "temperature": 1.0, "seed": i, "stream": kind < 0.6}  # fmt: skip
    if not body["stream"]:
        r = await client.post("/v1/completions", json=body)
        return {200: "ok", 503: "503"}.get(r.status_code, f"{r.status_code}")
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {503: "503"}.get(r.status_code, f"{r.status_code}")
        chunks = 0
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if kind < 0.25 and chunks == 3:  # the client goes away mid-stream
                    return "cancelled"
            if line == "data: [DONE]":
                return "ok"
    return "lost"


async def _round(base: str, rng: random.Random, start: int) -> collections.Counter:
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(60.0)) as client:
        tasks = []
        for i in range(PER_ROUND):
            tasks.append(asyncio.create_task(_one(client, rng, start + i)))
            await asyncio.sleep(rng.expovariate(400.0))  # Poisson arrivals, well above capacity
        try:
            return collections.Counter(await asyncio.gather(*tasks))
        except httpx.TimeoutException:
            pytest.fail("a request hung (no answer within 60 s)")


def test_overload_with_cancellations_and_bad_inputs_loses_nothing(tmp_path):
    path = make_tiny_hf_model(tmp_path, arch="llama")
    config = EngineConfig(load=LoadConfig(model=str(path), dtype="float32"),
                          cache=CacheConfig(block_size=16, num_blocks_override=48),
                          scheduler=SchedulerConfig(max_model_len=256, max_num_seqs=8), num_threads=1)  # fmt: skip
    app = build_app(lambda: LLMEngine(config), ServerSettings(max_queue_len=8))
    rng = random.Random(0)
    proc = psutil.Process()
    rss: list[int] = []
    totals: collections.Counter = collections.Counter()
    with ServerThread(app) as srv:
        srv.wait_ready()
        engine = app.state.llm.engine
        for k in range(ROUNDS):
            outcomes = asyncio.run(_round(srv.base_url, rng, k * PER_ROUND))
            totals += outcomes
            wait_until(lambda: metric(scrape(srv.base_url), "vllm:kv_cache_usage_perc") == 0
                       and not engine.has_unfinished_requests(), what="the server to drain")  # fmt: skip
            assert engine.output_processor.requests == {} and engine.scheduler.requests == {}
            assert app.state.llm.num_in_flight == 0
            rss.append(proc.memory_info().rss)
    assert sum(totals.values()) == ROUNDS * PER_ROUND
    assert set(totals) <= {"ok", "cancelled", "4xx", "503"}, totals  # no 5xx, nothing lost
    assert totals["ok"] > 0 and totals["cancelled"] > 0 and totals["4xx"] > 0, totals
    assert rss[-1] - rss[0] < 48 << 20, [r >> 20 for r in rss]  # flat after the warm-up round
