"""What the web UI tests share: a tiny-model server (optionally paced, so an answer is still
streaming when a test presses stop) and a bench result document."""

from __future__ import annotations

import time

from inferlab.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig
from inferlab.engine.llm_engine import LLMEngine
from inferlab.server.app import ServerSettings, build_app


def tiny_engine_config(path) -> EngineConfig:
    return EngineConfig(
        load=LoadConfig(model=str(path), dtype="float32"),
        cache=CacheConfig(block_size=16, num_blocks_override=64),
        scheduler=SchedulerConfig(max_model_len=512),
        num_threads=1,
    )


class PacedEngine(LLMEngine):
    """The real engine, each step held `pace_s` longer: a tiny model answers in milliseconds,
    too fast for a person (or a test) to press stop mid-answer."""

    pace_s = 0.02

    def step(self):
        if self.has_unfinished_requests():
            time.sleep(self.pace_s)
        return super().step()


def tiny_app(path, *, paced: bool = False, **settings):
    config = tiny_engine_config(path)
    cls = PacedEngine if paced else LLMEngine
    return build_app(lambda: cls(config), ServerSettings(served_model_names=("tiny",), **settings))


def bench_doc() -> dict:
    """A small two-level sweep in the `inferlab bench --json` schema."""
    def run(label: str, conc: int, scale: float) -> dict:
        n = 4
        return {
            "label": label, "load": {"request_rate": None, "burstiness": 1.0, "max_concurrency": conc},
            "summary": {"num_requests": n, "completed": n, "output_throughput": 100.0 * conc, "request_throughput": 2.0 * conc,
                        "median_ttft_ms": 20 * scale, "p99_ttft_ms": 40 * scale, "median_tpot_ms": 5.0, "median_itl_ms": 5.0,
                        "median_e2el_ms": 300.0, "request_goodput": None},
            "server_metrics": None,
            "requests": {"status": ["ok"] * n, "error": [None] * n, "http_status": [200] * n,
                         "send_s": [0.0, 0.1, 0.2, 0.3], "ttft_s": [0.02 * scale * (i + 1) for i in range(n)],
                         "tpot_s": [0.005] * n, "e2e_s": [0.3] * n, "itl_s": [[0.004, 0.005, 0.006]] * n,
                         "input_tokens": [32] * n, "output_tokens": [16] * n, "cached_tokens": [0] * n},
        }  # fmt: skip

    return {"schema": "inferlab.bench/1", "label": "tiny", "created_utc": "2026-12-01T00:00:00+00:00",
            "command_line": "inferlab bench", "config": {}, "server": {"model": "tiny"}, "tokenizer": None,
            "dataset": {}, "versions": {}, "machine": {}, "definitions": {}, "mode": "sweep", "warmup_requests": 0,
            "notes": [], "runs": [run("c=1", 1, 1.0), run("c=8", 8, 3.0)],
            "sweep": {"kind": "concurrency", "levels": [1, 8], "saturated_at": None}}  # fmt: skip
