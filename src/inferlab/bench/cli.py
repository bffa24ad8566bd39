"""`inferlab bench`: load-test an OpenAI-compatible server and report latency, throughput,
goodput and cost. Flags follow `vllm bench serve` where it has one (its spellings are
accepted as aliases), so a vLLM command line runs here nearly unchanged.

This module only turns flags into the configs of the other bench modules and wires them
together; it imports no torch.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shlex
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from inferlab.bench.arrivals import LoadSpec
from inferlab.bench.client import EndpointConfig, ServerInfo, fetch_server_info, normalize_base_url
from inferlab.bench.datasets import DATASETS, DEFAULT_OUTPUT_LEN, Dataset, DatasetSpec, load_dataset, summarize_lengths
from inferlab.bench.metrics import (
    LATENCY_METRICS,
    SLO,
    RunSummary,
    parse_metric_names,
    parse_numbers,
    parse_percentiles,
    parse_slo,
    summarize,
)
from inferlab.bench.progress import LiveProgress
from inferlab.bench.report import ReportContext, RunReport, build_report, print_terminal, render_markdown, write_json
from inferlab.bench.runner import RunResult, fill_output_tokens, run_load, warm_up
from inferlab.bench.sweep import SaturationRule, SweepPlan, parse_sweep, run_sweep
from inferlab.bench.tokens import TextTokenizer, TokenizerSource

WARMUP_SEED_OFFSET = 1_000_003  # warm-up prompts differ from measured ones (no prefix-cache help)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    g.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="completions: the prompt counts exactly --input-len tokens (default); chat: the server applies its chat template")
    g.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds before an unfinished request counts as a timeout (default 600)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer for exact prompt lengths: a HF directory, tokenizer.json or a .gguf (default: the server's /tokenize, else the default model's)")

    g = p.add_argument_group("prompts")
    g.add_argument("--dataset", "--dataset-name", dest="dataset", choices=DATASETS, default="random")
    g.add_argument("--dataset-path", default=None, help="JSONL file (one {\"prompt\"|\"messages\", \"output_len\"?} a line) or ShareGPT JSON")
    g.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=1024, help="prompt tokens (random; default 1024)")
    g.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=None,
                   help=f"max_tokens per request (default {DEFAULT_OUTPUT_LEN}; jsonl/sharegpt: the file's own)")
    g.add_argument("--range-ratio", "--random-range-ratio", dest="range_ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from [n(1-r), n(1+r)] (default 0: fixed)")
    g.add_argument("--prefix-len", "--random-prefix-len", dest="prefix_len", type=int, default=0,
                   help="tokens of a shared prefix (system prompt) in front of every prompt")
    g.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes, prompts spread evenly over them")
    g.add_argument("--num-prompts", type=int, default=1000, help="requests per load level (default 1000)")
    g.add_argument("--disable-shuffle", action="store_true", help="jsonl/sharegpt: keep the file's order (default: shuffled with --seed)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true", help="ask the server to generate exactly max_tokens")

    g = p.add_argument_group("load")
    g.add_argument("--max-concurrency", type=int, default=None, help="at most N requests in flight (closed loop without --request-rate)")
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson arrivals (default inf: all at once)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier, >1 steadier")
    g.add_argument("--warmup", "--num-warmups", dest="warmup", type=int, default=0, help="requests sent first and left out of the results")
    g.add_argument("--concurrency-levels", default=None, help="e.g. 1,32: run each concurrency and compare them side by side")
    g.add_argument("--sweep", default=None,
                   help="rate:1,2,4 | concurrency:1,8,32 | rate | concurrency (double from 1 until saturation)")
    g.add_argument("--scrape-metrics", action="store_true", help="poll the server's Prometheus /metrics (queue, KV usage) during each level")
    g.add_argument("--scrape-interval", type=float, default=0.5, help="seconds between /metrics polls (default 0.5)")

    g = p.add_argument_group("metrics and reports")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000")
    g.add_argument("--slo-target", type=float, default=0.9, help="SLO attainment for DistServe goodput over a sweep (default 0.9)")
    g.add_argument("--percentile-metrics", default=",".join(LATENCY_METRICS), help="which latencies get percentiles (default ttft,tpot,itl,e2el)")
    g.add_argument("--metric-percentiles", default="50,90,95,99", help="percentiles to report (default 50,90,95,99)")
    g.add_argument("--usd-per-hour", type=float, default=None, help="machine price, for cost per million tokens")
    g.add_argument("--result-file", default=None, help="write the JSON report here")
    g.add_argument("--markdown", default=None, help="write a Markdown report here")
    g.add_argument("--plot-dir", default=None, help="write PNG figures (latency CDFs; sweep curves) here")
    g.add_argument("--label", default=None, help="a name for this run in reports (default: the model)")
    g.add_argument("--no-progress", action="store_true", help="no live progress bar")


def _plan(args: argparse.Namespace) -> tuple[str, SweepPlan | None]:
    """The run's mode and, for several levels, the plan; conflicting flags → ValueError."""
    if args.sweep and args.concurrency_levels:
        raise ValueError("use --sweep or --concurrency-levels, not both")
    if args.concurrency_levels:
        if args.max_concurrency is not None:
            raise ValueError("--concurrency-levels sets the concurrency; drop --max-concurrency")
        levels = parse_numbers(args.concurrency_levels, "--concurrency-levels", integer=True)
        return "concurrency-levels", SweepPlan("concurrency", levels=levels, stop_at_saturation=False)
    if args.sweep:
        plan = parse_sweep(args.sweep)
        if plan.kind == "rate" and math.isfinite(args.request_rate):
            raise ValueError("--sweep rate sets the request rate; drop --request-rate")
        if plan.kind == "concurrency" and args.max_concurrency is not None:
            raise ValueError("--sweep concurrency sets the concurrency; drop --max-concurrency")
        return "sweep", plan
    return "single", None


def _check_lengths(dataset: Dataset, info: ServerInfo) -> None:
    """Prompts that cannot fit the model's context window would only come back as 400s."""
    if info.max_model_len is None:
        return
    for r in dataset.requests:
        if r.prompt_len is not None and r.output_len is not None and r.prompt_len + r.output_len > info.max_model_len:
            raise ValueError(
                f"a prompt of {r.prompt_len} tokens plus {r.output_len} output tokens exceeds the model's "
                f"context of {info.max_model_len} tokens; lower --input-len/--output-len"
            )


def _command_line(args: argparse.Namespace) -> str:
    """`inferlab bench` plus every flag that differs from its default: the run, reproducible,
    whatever entry point started it (API key left out)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    words = ["inferlab", "bench"]
    for action in parser._actions:  # argparse keeps its options here; there is no public accessor
        if not action.option_strings or action.dest in ("api_key",):
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default and action.dest != "base_url":
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            words.append(flag)
        elif isinstance(value, list):
            words += [flag, *map(str, value)]
        else:
            words += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return shlex.join(words)


def _config(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as given, for the report (API key redacted, inf spelled out)."""
    out = {}
    for k, v in vars(args).items():
        if k in ("command",) or callable(v):
            continue
        if k == "api_key" and v:
            v = "***"
        if isinstance(v, float) and not math.isfinite(v):
            v = str(v)
        out[k] = v
    return out


def run(args: argparse.Namespace) -> int:
    base_url = normalize_base_url(args.base_url)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    mode, plan = _plan(args)
    spec = DatasetSpec(
        name=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, prefix_len=args.prefix_len, num_prefixes=args.num_prefixes,
        path=args.dataset_path, seed=args.seed, shuffle=not args.disable_shuffle,
    )
    base_load = LoadSpec(request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency)
    slo = parse_slo(args.goodput)
    percentiles = parse_percentiles(args.metric_percentiles)
    metric_names = parse_metric_names(args.percentile_metrics)
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.usd_per_hour is not None and not args.usd_per_hour > 0:
        raise ValueError(f"--usd-per-hour must be > 0, got {args.usd_per_hour}")
    if not 0 < args.slo_target <= 1:
        raise ValueError(f"--slo-target must be in (0, 1], got {args.slo_target}")
    if not args.scrape_interval > 0:
        raise ValueError(f"--scrape-interval must be > 0, got {args.scrape_interval}")

    info = fetch_server_info(base_url, api_key, args.model, timeout_s=min(args.timeout, 30.0))
    cfg = EndpointConfig(base_url=base_url, model=info.model, endpoint=args.endpoint, api_key=api_key,
                         timeout_s=args.timeout, ignore_eos=args.ignore_eos)
    tokens = TokenizerSource(args.tokenizer, base_url, info.model, api_key)
    try:
        if args.tokenizer:
            tokens.get()  # a bad --tokenizer fails now, not after the warm-up

        def dataset(seed: int, n: int) -> Dataset:
            ds = load_dataset(replace(spec, seed=seed, num_prompts=n), tokens.get)
            if cfg.endpoint != "chat" and any(r.messages is not None for r in ds.requests):
                raise ValueError("the dataset holds chat conversations (messages); use --endpoint chat")
            _check_lengths(ds, info)
            return ds

        first = dataset(spec.seed, spec.num_prompts)  # fail on bad data before sending anything
        setup = _Setup(cfg=cfg, base_load=base_load, plan=plan, slo=slo, percentiles=percentiles,
                       metric_names=metric_names, first=first, dataset=dataset, tokens=tokens)
        runs, sweep_doc, notes = asyncio.run(_execute(args, setup))
    finally:
        tokens.close()

    ctx = ReportContext(
        label=args.label or info.model,
        command_line=_command_line(args),
        config=_config(args),
        server={"base_url": base_url, "url": cfg.url, "endpoint": cfg.endpoint, "model": info.model,
                "max_model_len": info.max_model_len},
        dataset={**asdict(spec), "output_len": spec.output_len or (DEFAULT_OUTPUT_LEN if spec.name in ("random", "shared-prefix") else None),
                 "lengths": summarize_lengths(first.requests), "notes": first.notes},
        tokenizer=tokens.loaded.name if tokens.loaded is not None else None,
        mode=mode,
        warmup_requests=args.warmup,
        notes=notes,
    )
    doc = build_report(ctx, runs, sweep_doc)
    print_terminal(doc)
    if args.result_file:
        write_json(doc, args.result_file)
    if args.markdown:
        from pathlib import Path

        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(render_markdown(doc), encoding="utf-8")
    if args.plot_dir:
        from inferlab.bench.plots import write_plots

        write_plots(doc, args.plot_dir)
    return 0 if any(r.summary.completed for r in runs) else 1


@dataclass(frozen=True)
class _Setup:
    """What the flags turned into, handed from `run` to `_execute`."""

    cfg: EndpointConfig
    base_load: LoadSpec
    plan: SweepPlan | None  # None: one level at base_load
    slo: SLO
    percentiles: tuple[float, ...]
    metric_names: tuple[str, ...]
    first: Dataset  # the first level's prompts (built before anything is sent, to fail early)
    dataset: Callable[[int, int], Dataset]  # (seed, n) → fresh prompts for another level or the warm-up
    tokens: TokenizerSource


async def _execute(args: argparse.Namespace, setup: _Setup) -> tuple[list[RunReport], dict | None, list[str]]:
    """Warm up, then run the single level or the sweep; returns (run reports, sweep dict, notes)."""
    notes: list[str] = []
    plan, base_load, cfg = setup.plan, setup.base_load, setup.cfg
    with LiveProgress(enabled=not args.no_progress) as live:
        if args.warmup:
            warm = setup.dataset(args.seed + WARMUP_SEED_OFFSET, args.warmup).requests
            first_level = next(plan.iter_levels()) if plan else None
            conc = int(first_level) if plan and plan.kind == "concurrency" else base_load.max_concurrency
            recs = await warm_up(warm, cfg, conc)
            bad = sum(1 for r in recs if not r.ok)
            notes.append(f"{len(recs)} warm-up request(s) sent first and left out" + (f" ({bad} did not complete)" if bad else ""))

        async def level(k: int, load: LoadSpec) -> tuple[RunResult, RunSummary]:
            ds = setup.first if k == 0 else setup.dataset(args.seed + k, args.num_prompts)
            result = await run_load(
                ds.requests, cfg, load, seed=args.seed + k, scrape_metrics=args.scrape_metrics,
                scrape_interval_s=args.scrape_interval, progress=live.level(load.label, len(ds.requests)),
            )
            fill_output_tokens(result.records, _counting_tokenizer(result, setup.tokens))
            summary = summarize(result.records, result.duration_s, percentiles=setup.percentiles,
                                metrics=setup.metric_names, slo=setup.slo, usd_per_hour=args.usd_per_hour,
                                max_concurrency=load.max_concurrency)
            return result, summary

        if plan is None:
            result, summary = await level(0, base_load)
            return [RunReport(base_load.label, result, summary)], None, notes
        rule = SaturationRule(slo_target=args.slo_target)
        sweep = await run_sweep(plan, base_load, level, rule)
        runs = [RunReport(p.result.load.label, p.result, p.summary) for p in sweep.points]
        if plan.levels is None and not sweep.stopped_early:
            notes.append(f"no saturation within {plan.max_steps} doublings")
        return runs, sweep.to_dict(), notes


def _counting_tokenizer(result: RunResult, tokens: TokenizerSource) -> TextTokenizer | None:
    """A tokenizer only when some answer came without usage (don't load one for nothing)."""
    if all(r.output_tokens is not None for r in result.records):
        return None
    try:
        return tokens.get()
    except (ValueError, FileNotFoundError, OSError):
        return None
