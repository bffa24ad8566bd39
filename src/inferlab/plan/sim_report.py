"""A simulated run as the bench's own report (schema "inferlab.bench/1"), so `inferlab plan
--compare` and any reader of bench reports treat prediction and measurement alike. The bench's
summarize/build_report do the work; this adds a `simulation` section saying how the numbers
were made, and the scheduler's gauges where a bench run has the server's /metrics.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from typing import Any

from inferlab.bench.metrics import DEFAULT_PERCENTILES, LATENCY_METRICS, summarize
from inferlab.bench.report import ReportContext, RunReport, build_report
from inferlab.bench.runner import RunResult
from inferlab.bench.server_metrics import ServerMetricsSummary
from inferlab.config import CacheConfig, SchedulerConfig
from inferlab.plan.cost_model import StepCostModel
from inferlab.plan.simulator import SimResult, SimWorkload


def simulation_report(
    result: SimResult,
    workload: SimWorkload,
    sched_cfg: SchedulerConfig,
    cache_cfg: CacheConfig,
    cost: StepCostModel,
    *,
    model_name: str,
    hardware_name: str | None = None,
    label: str | None = None,
    percentiles=DEFAULT_PERCENTILES,
    metrics=LATENCY_METRICS,
    slo=None,
    usd_per_hour: float | None = None,
    plan_inputs: dict[str, Any] | None = None,
    speculation: str | None = None,
) -> dict[str, Any]:
    """The bench's JSON document for a simulated run, plus a `simulation` section saying how."""
    records = result.records()
    duration = result.duration_s
    summary = summarize(records, duration, percentiles=percentiles, metrics=metrics, slo=slo,
                        usd_per_hour=usd_per_hour, max_concurrency=workload.max_concurrency)
    load = workload.load
    start = min((r.send_time for r in records), default=0.0)
    run_result = RunResult(load, records, duration, start, server_metrics=_scheduler_gauges(result))
    run_label = label or f"simulated, {load.label}"
    ctx = ReportContext(
        label=run_label,
        command_line=shlex.join(sys.argv),
        config={
            "simulated": True,
            "ignore_eos": workload.eos_probability == 0,
            "scheduler": dataclasses.asdict(sched_cfg),
            "cache": dataclasses.asdict(cache_cfg),
            "num_blocks": result.num_blocks,
        },
        server={"base_url": None, "url": "simulated", "endpoint": None, "model": model_name,
                "max_model_len": sched_cfg.max_model_len},
        dataset={"name": "random", "num_prompts": workload.num_prompts, "input_len": workload.input_len,
                 "output_len": workload.output_len, "range_ratio": 0.0,
                 "prefix_len": workload.shared_prefix_len, "num_prefixes": 1 if workload.shared_prefix_len else 0,
                 "seed": workload.seed, "notes": []},
        tokenizer=None,
        notes=["simulated: the real Scheduler on a virtual clock; step times from a cost model (see 'simulation')"],
    )
    doc = build_report(ctx, [RunReport(run_label, run_result, summary)])
    assumptions = list(cost.describe()) + [
        f"{result.num_blocks} KV blocks of {result.block_size} tokens",
        "dummy token ids; "
        + ("never EOS: every reply runs to its length" if workload.eos_probability == 0
           else f"EOS with probability {workload.eos_probability:g} per token"),
        "no tokenization, HTTP or detokenization time: a token is seen when its step ends"
        + (f"; a request reaches the scheduler {workload.request_latency_s * 1e3:g} ms after it is sent"
           if workload.request_latency_s else ""),
    ] + ([speculation] if speculation else [])
    doc["simulation"] = {
        "kind": "simulated",
        "hardware": hardware_name,
        "cost_model": type(cost).__name__,
        "cost_model_kind": cost.kind,
        "assumptions": assumptions,
        "num_steps": len(result.steps),
        "num_preemptions": result.num_preemptions,
        "max_kv_cache_usage": result.max_kv_cache_usage,
        "plan_inputs": plan_inputs,
    }
    return doc


def _scheduler_gauges(result: SimResult) -> ServerMetricsSummary:
    """The scheduler's own gauges, weighted by step time, in the bench's server-metrics shape."""
    steps = result.steps
    total = sum(s.duration for s in steps)
    gauges: dict[str, dict[str, float]] = {}
    if steps and total > 0:
        for key in ("num_running", "num_waiting", "kv_cache_usage"):
            xs = [getattr(s, key) for s in steps]
            mean = sum(x * s.duration for x, s in zip(xs, steps)) / total
            gauges[key.removeprefix("num_")] = {"mean": mean, "max": float(max(xs))}
    deltas = {
        "prompt_tokens": float(sum(s.num_prefill_tokens for s in steps)),
        "generation_tokens": float(sum(s.num_decode_tokens for s in steps)),
        "preemptions": float(result.num_preemptions),
    }
    if result.spec is not None:  # as the bench reads vllm:spec_decode_* off a server
        spec = result.spec
        deltas |= {"spec_drafts": float(spec.num_drafts), "spec_draft_tokens": float(spec.num_draft_tokens),
                   "spec_accepted_tokens": float(spec.num_accepted_tokens)}
        deltas |= {f"spec_accepted_pos_{j}": float(n) for j, n in enumerate(spec.accepted_per_pos)}
    return ServerMetricsSummary(available=True, note="simulated scheduler state", gauges=gauges,
                                counter_deltas=deltas)
