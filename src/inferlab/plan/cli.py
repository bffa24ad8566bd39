"""`inferlab plan`: memory, speed and cost on paper, every figure labelled with its kind.

    inferlab plan --model llama-3.1-8b --hardware h100 --input-len 8192 --output-len 256
    inferlab plan --compare-cited course-001          # the course's worked service, with ratios
    inferlab plan --model M --hardware H --compare bench.json   # predicted vs measured
    inferlab plan --model M --hardware H --fleet --request-rate 10 --goodput ttft:1000 tpot:50 \\
        --usd-per-hour 3 [--markdown-out plan.md]   # GPUs, $/hour, goodput: colocated vs disaggregated

No torch is imported unless --measure-cpu asks for a measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from inferlab.plan.args import add_common_arguments, plan_inputs, resolve_hardware, resolve_model
from inferlab.plan.cited import SCENARIOS, cited_scenario
from inferlab.plan.compare import ComparisonRow, compare_figures, compare_plan_to_bench, load_bench_runs
from inferlab.plan.planner import build_plan


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p)
    c = p.add_argument_group("comparisons")
    c.add_argument("--compare", metavar="BENCH.json",
                   help="an inferlab bench (or simulate) report: predicted against measured, a ratio per figure; "
                        "lengths and concurrency default to the report's")
    c.add_argument("--compare-cited", metavar="KEY", choices=sorted(SCENARIOS),
                   help=f"the course's worked figures ({', '.join(sorted(SCENARIOS))}); fills in the scenario's "
                        "model, hardware and workload unless given")
    f = p.add_argument_group("a fleet plan (--fleet): GPUs, cost and goodput at --request-rate under an SLO, "
                             "computed then simulated, colocated and with prefill/decode pools")
    f.add_argument("--fleet", action="store_true", help="plan a fleet (needs --request-rate, --goodput, --usd-per-hour)")
    f.add_argument("--goodput", nargs="*", default=None, metavar="KEY:MS", help="the SLO, e.g. ttft:1000 tpot:50")
    f.add_argument("--attainment", type=float, default=0.95, help="share of requests in SLO (default 0.95)")
    f.add_argument("--kv-transfer-gbps", type=float, default=100.0,
                   help="each prefill GPU's link to the decode pool, Gbit/s (default 100)")
    f.add_argument("--kv-transfer-latency-ms", type=float, default=0.0, help="fixed time per transfer (default 0)")
    f.add_argument("--fleet-prompts", type=int, default=400, help="simulated requests per fleet run (default 400)")
    f.add_argument("--max-num-batched-tokens", type=int, default=8192, help="per step, each GPU (default 8192)")
    f.add_argument("--markdown-out", default=None, help="also write the plan here as Markdown")


def run(args: argparse.Namespace) -> int:
    log = (lambda s: print(s, file=sys.stderr)) if args.json else print
    scenario = cited_scenario(args.compare_cited) if args.compare_cited else None
    if scenario is not None:
        _fill_from_scenario(args, scenario)
    model = resolve_model(args)
    hardware = resolve_hardware(args, log=log)
    if args.fleet:
        return _run_fleet(args, model, hardware)

    out: dict[str, Any] = {}
    comparisons: list[tuple[str, list[ComparisonRow], list[str]]] = []
    bench_runs = load_bench_runs(args.compare) if args.compare else []
    load_given = args.concurrency is not None or args.request_rate is not None
    if bench_runs:
        # Lengths (and, below, each run's concurrency) from the report unless given.
        first = bench_runs[0]
        args.input_len = first.input_len if args.input_len is None else args.input_len
        args.output_len = first.output_len if args.output_len is None else args.output_len
        if args.concurrency is None and args.request_rate is None:
            args.concurrency = first.max_concurrency
            if first.max_concurrency is None:
                args.request_rate = first.request_rate
    base = plan_inputs(args, model, hardware)
    plan = build_plan(base)
    out["plan"] = plan.to_dict()

    if scenario is not None:
        rows: list[ComparisonRow] = []
        plans = {None: plan}
        for fig, conc in scenario.figures:
            if conc not in plans:
                plans[conc] = build_plan(plan_inputs(args, model, hardware, concurrency=conc))
            rows.extend(compare_figures(plans[conc], [fig]))
        comparisons.append((f"{scenario.key}: {scenario.description}", rows, list(scenario.notes)))

    for i, brun in enumerate(bench_runs):
        bplan = plan
        if i > 0 and not load_given and (brun.max_concurrency, brun.request_rate) != (bench_runs[0].max_concurrency,
                                                                   bench_runs[0].request_rate):
            conc = brun.max_concurrency
            bplan = build_plan(plan_inputs(args, model, hardware, concurrency=conc,
                                           request_rate=None if conc is not None else brun.request_rate))
        rows = compare_plan_to_bench(bplan, brun)
        notes = [] if rows else ["the report has none of the compared metrics"]
        comparisons.append((f"predicted vs {brun.kind}: {brun.label}", rows, notes))

    if args.json:
        out["comparisons"] = [{"title": t, "rows": [r.to_dict() for r in rows], "notes": n}
                              for t, rows, n in comparisons]
        print(json.dumps(out, indent=1, default=str))
        return 0
    from inferlab.plan.render import print_comparison, print_plan

    print_plan(plan)
    for title, rows, notes in comparisons:
        print_comparison(rows, title, notes=notes)
    return 0


def _fill_from_scenario(args: argparse.Namespace, s) -> None:
    """The scenario's inputs, where the user gave none."""
    if not args.model:
        args.model = s.model
    if not (args.hardware or args.hardware_file or args.measure_cpu):
        args.hardware = s.hardware
    for name, value in (("input_len", s.input_len), ("output_len", s.output_len),
                        ("weight_dtype", s.weight_precision), ("usd_per_hour", s.usd_per_hour)):
        if getattr(args, name) is None:
            setattr(args, name, value)


def _run_fleet(args: argparse.Namespace, model, hardware) -> int:
    import shlex

    from inferlab.bench.metrics import parse_slo
    from inferlab.plan.args import DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN
    from inferlab.plan.fleet_plan import FleetSpec, plan_fleet

    if args.request_rate is None:
        raise ValueError("--fleet needs --request-rate (requests per second to plan for)")
    if args.usd_per_hour is None:
        raise ValueError("--fleet needs --usd-per-hour (what one GPU costs per hour)")
    if args.fleet_prompts < 1:
        raise ValueError(f"--fleet-prompts must be >= 1, got {args.fleet_prompts}")
    spec = FleetSpec(
        model, hardware,
        args.input_len if args.input_len is not None else DEFAULT_INPUT_LEN,
        args.output_len if args.output_len is not None else DEFAULT_OUTPUT_LEN,
        args.request_rate, parse_slo(args.goodput), attainment=args.attainment, usd_per_hour=args.usd_per_hour,
        usd_source=f"${args.usd_per_hour:g} per GPU-hour, given", kv_transfer_gbps=args.kv_transfer_gbps,
        kv_transfer_latency_s=args.kv_transfer_latency_ms / 1000.0, memory_efficiency=args.memory_efficiency,
        compute_efficiency=args.compute_efficiency,
        efficiency_notes=(f"bandwidth × {args.memory_efficiency:g}, compute × {args.compute_efficiency:g} of peak "
                          "(--memory-efficiency, --compute-efficiency)",),
        num_prompts=args.fleet_prompts, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
    )  # fmt: skip
    plan = plan_fleet(spec, log=lambda s: print(s, file=sys.stderr))
    if args.json:
        print(json.dumps({"figures": [f.to_dict() for f in plan.figures], "simulated": plan.rows,
                          "chosen": plan.chosen, "assumptions": plan.notes}, indent=1, default=str))
    else:
        text = plan.markdown("inferlab " + shlex.join(sys.argv[1:]))
        print(text)
        if args.markdown_out:
            with open(args.markdown_out, "w", encoding="utf-8") as fh:
                fh.write(text)
    return 0
