"""Runs one load level: releases the requests on their schedule, holds the concurrency cap,
collects the records, optionally scrapes the server's /metrics meanwhile.

The clock for throughput starts at the first send and stops at the last answer (vLLM's
benchmark duration), so warm-up requests, sent before, never count.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from inferlab.bench.arrivals import LoadSpec, arrival_offsets
from inferlab.bench.client import EndpointConfig, send_request, tls_verify
from inferlab.bench.datasets import SampleRequest
from inferlab.bench.records import RequestRecord
from inferlab.bench.server_metrics import MetricsScraper, ServerMetricsSummary
from inferlab.bench.tokens import TextTokenizer

# Called after each request finishes: (finished so far, total, the record).
ProgressFn = Callable[[int, int, RequestRecord], None]


@dataclass
class RunResult:
    """One load level's raw outcome."""

    load: LoadSpec
    records: list[RequestRecord]
    duration_s: float  # first send → last answer
    start_time: float  # perf_counter at the first send (per-request times in reports are relative to it)
    server_metrics: ServerMetricsSummary | None = None


def make_http_client(cfg: EndpointConfig) -> httpx.AsyncClient:
    """One connection pool for a run: no cap on connections (the concurrency cap is ours to hold),
    per-read timeouts as long as the request timeout (the total is enforced per request)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(cfg.timeout_s, connect=min(cfg.timeout_s, 30.0)),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        verify=tls_verify(cfg.base_url),
    )


async def run_load(
    requests: Sequence[SampleRequest],
    cfg: EndpointConfig,
    load: LoadSpec,
    *,
    seed: int = 0,
    scrape_metrics: bool = False,
    scrape_interval_s: float = 0.5,
    progress: ProgressFn | None = None,
) -> RunResult:
    """Send `requests` under `load` and return every record, in dataset order."""
    offsets = arrival_offsets(len(requests), load, seed)
    sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    records: list[RequestRecord | None] = [None] * len(requests)
    finished = 0

    async with make_http_client(cfg) as http:

        async def one(i: int, release_at: float) -> None:
            nonlocal finished
            delay = release_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem if sem is not None else contextlib.nullcontext():
                rec = await send_request(http, cfg, requests[i], i)
            records[i] = rec
            finished += 1
            if progress is not None:
                progress(finished, len(requests), rec)

        auth = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        scraper = MetricsScraper(http, cfg.base_url, scrape_interval_s, auth) if scrape_metrics else None
        async with scraper if scraper is not None else contextlib.nullcontext():
            start = time.perf_counter()
            await asyncio.gather(*(one(i, start + float(offsets[i])) for i in range(len(requests))))
    done = [r for r in records if r is not None]
    first_send = min((r.send_time for r in done), default=start)
    last_end = max((r.end_time for r in done), default=first_send)
    return RunResult(
        load=load,
        records=done,
        duration_s=max(0.0, last_end - first_send),
        start_time=first_send,
        server_metrics=scraper.summary() if scraper is not None else None,
    )


async def warm_up(requests: Sequence[SampleRequest], cfg: EndpointConfig, concurrency: int | None) -> list[RequestRecord]:
    """Send the warm-up requests (their results are thrown away): first-call costs stay out of the numbers."""
    if not requests:
        return []
    result = await run_load(requests, cfg, LoadSpec(max_concurrency=concurrency))
    return result.records


def fill_output_tokens(records: Sequence[RequestRecord], tokenizer: TextTokenizer | None) -> None:
    """Count output tokens where the server sent no usage: the tokenizer on the text, else one per chunk."""
    for r in records:
        if r.output_tokens is not None:
            continue
        if tokenizer is not None and r.text:
            r.output_tokens, r.output_tokens_source = len(tokenizer.encode(r.text)), "tokenizer"
        else:
            r.output_tokens, r.output_tokens_source = sum(r.chunk_tokens), "chunks"
