"""`inferlab simulate`: the real scheduler on a virtual clock, with a step cost model, writing
the same report as `inferlab bench` so prediction and measurement compare line by line.

    inferlab simulate --model llama-3.1-8b --hardware h100 --input-len 8192 --output-len 256 \\
        --max-concurrency 50 --num-prompts 200 --max-num-seqs 64 --result-file sim.json
    inferlab simulate ... --calibrate profile.json     # cost fitted to our engine's measured steps
    inferlab simulate ... --constant-step-ms 10        # a trivial cost model (hand-checkable)
    inferlab simulate --calibrate-engine --profile-out profile.json   # measure our engine here first
    inferlab simulate ... --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' \
        --spec-acceptance 0.8,0.9                  # drafts kept as measured (bench's per-position acceptance)
    inferlab simulate ... --replicas 16 --router all --shared-prefixes 8 --shared-prefix-len 512
                                                       # a fleet behind the router's own core
    inferlab simulate ... --disaggregate 3:2 --kv-transfer-gbps 100 --goodput ttft:2000 tpot:50 \\
        --usd-per-hour 3 --request-rate 8          # prefill and decode pools vs 5 colocated replicas

The KV cache gets as many blocks as the plan's memory budget allows (or --num-blocks).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from inferlab.bench.metrics import (
    DEFAULT_PERCENTILES,
    LATENCY_METRICS,
    parse_metric_names,
    parse_percentiles,
    parse_slo,
)
from inferlab.bench.report import print_terminal, write_json
from inferlab.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from inferlab.engine.engine_args import EngineArgs
from inferlab.plan import calibrate_cli
from inferlab.plan.args import (
    DEFAULT_INPUT_LEN,
    DEFAULT_OUTPUT_LEN,
    add_common_arguments,
    plan_inputs,
    resolve_hardware,
    resolve_model,
)
from inferlab.plan.cost_model import (
    ConstantCost,
    RooflineCost,
    StepCostModel,
    fit_linear,
    load_cost_model,
    load_profile,
    save_cost_model,
)
from inferlab.plan.roofline import kv_memory_available
from inferlab.plan.sim_report import simulation_report
from inferlab.plan.sim_speculation import parse_acceptance
from inferlab.plan.simulator import SimWorkload, simulate
from inferlab.router.policies import POLICIES


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p)
    s = p.add_argument_group("scheduler (the engine's own flags)")
    EngineArgs.add_cli_args(s, only=("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                                     "long_prefill_token_threshold", "enable_prefix_caching"))
    EngineArgs.add_cli_args(s, only=("speculative_config",))
    s.add_argument("--spec-acceptance", default=None, metavar="A[,A...]",
                   help="with --speculative-config: the chance a draft is kept at each position given the ones "
                        "before it were (as `inferlab bench` reports it per position; the last repeats), e.g. 0.8,0.9")
    s.add_argument("--max-model-len", type=int, default=None, help="default: input + output length")
    s.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks (default: what the plan's memory budget leaves for KV)")

    ld = p.add_argument_group("load (as inferlab bench)")
    ld.add_argument("--num-prompts", type=int, default=100, help="requests to simulate (default 100)")
    ld.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    ld.add_argument("--seed", type=int, default=0)
    ld.add_argument("--request-latency-ms", type=float, default=0.0,
                    help="from a client's send to the scheduler (HTTP, tokenization; default 0). Any value "
                         "above 0 keeps a closed loop's replacement requests out of the step already running, "
                         "as on a real server")
    ld.add_argument("--shared-prefix-len", type=int, default=0, help="prompt tokens every request shares")
    ld.add_argument("--eos-probability", type=float, default=0.0,
                    help="chance each sampled token is EOS (default 0: replies run to --output-len)")

    f = p.add_argument_group("a fleet behind the router (inferlab router's own scoring core)")
    f.add_argument("--replicas", type=int, default=None, help="simulate this many replicas behind the router")
    f.add_argument("--router", default=None, metavar="POLICY[,POLICY...]",
                   help=f"routing policies to compare ({', '.join(POLICIES)}, or all; default all)")
    f.add_argument("--shared-prefixes", type=int, default=1,
                   help="distinct system prompts of --shared-prefix-len tokens, one per request at random (default 1)")
    f.add_argument("--kv-poll-ms", type=float, default=500.0,
                   help="how often the router reads the replicas' KV events (default 500, as its probe interval)")
    f.add_argument("--disaggregate", metavar="P:D", default=None,
                   help="P prefill and D decode replicas, each request's K/V moved between them, compared with "
                        "P + D colocated replicas on the same load (router policy: --router, default least-load)")
    f.add_argument("--kv-transfer-gbps", type=float, default=None,
                   help="with --disaggregate: each prefill replica's link to the decode pool, Gbit/s (required)")
    f.add_argument("--kv-transfer-latency-ms", type=float, default=0.0,
                   help="with --disaggregate: fixed time per transfer on top of bytes / bandwidth (default 0)")

    c = p.add_argument_group("step cost model (default: the plan's roofline)")
    c.add_argument("--calibrate", metavar="PROFILE.json", help="fit a linear cost to measured engine steps")
    c.add_argument("--cost-model", metavar="FILE.json", help="a linear cost model saved by --save-cost-model")
    c.add_argument("--save-cost-model", metavar="FILE.json", help="write the fitted cost model here")
    c.add_argument("--constant-step-ms", type=float, default=None, help="every step takes this long")

    calibrate_cli.add_arguments(p)

    r = p.add_argument_group("report")
    r.add_argument("--result-file", help="write the inferlab.bench/1 JSON report here")
    r.add_argument("--label", default=None)
    r.add_argument("--goodput", nargs="*", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    r.add_argument("--metric-percentiles", default=",".join(f"{p:g}" for p in DEFAULT_PERCENTILES))
    r.add_argument("--percentile-metrics", default=",".join(LATENCY_METRICS))


def _cost_model(args: argparse.Namespace, roofline, log) -> StepCostModel:
    chosen = [x for x in (args.calibrate, args.cost_model, args.constant_step_ms) if x is not None]
    if len(chosen) > 1:
        raise ValueError("give at most one of --calibrate, --cost-model, --constant-step-ms")
    if args.save_cost_model and not args.calibrate:
        raise ValueError("--save-cost-model saves what --calibrate fits; give --calibrate too")
    if args.constant_step_ms is not None:
        return ConstantCost(args.constant_step_ms / 1000.0)
    if args.cost_model:
        return load_cost_model(args.cost_model)
    if args.calibrate:
        model = fit_linear(load_profile(args.calibrate), source=args.calibrate)
        for line in model.describe():
            log(line)
        if args.save_cost_model:
            save_cost_model(model, args.save_cost_model)
            log(f"cost model saved to {args.save_cost_model}")
        return model
    if roofline is None:
        raise ValueError("the roofline cost model needs --hardware (or give --constant-step-ms, --calibrate "
                         "or --cost-model)")
    return RooflineCost(roofline)


def run(args: argparse.Namespace) -> int:
    log = (lambda s: print(s, file=sys.stderr)) if args.json else print
    if args.calibrate_engine:
        return calibrate_cli.run(args, log)
    model = resolve_model(args)
    input_len = args.input_len if args.input_len is not None else DEFAULT_INPUT_LEN
    output_len = args.output_len if args.output_len is not None else DEFAULT_OUTPUT_LEN
    have_hw = bool(args.hardware or args.hardware_file or args.measure_cpu)
    hardware = resolve_hardware(args, log=log) if have_hw else None
    roofline = None
    num_blocks = args.num_blocks
    inputs = None
    if hardware is not None:
        inputs = plan_inputs(args, model, hardware, concurrency=args.concurrency, request_rate=math.inf)
        roofline = inputs.roofline()
        if num_blocks is None:
            free = kv_memory_available(hardware.memory_bytes, roofline.weight_bytes, inputs.reserve_fraction,
                                       inputs.reserve_bytes)
            num_blocks = int(free // (args.block_size * roofline.kv_bytes_per_token))
    if num_blocks is None:
        raise ValueError("without --hardware, give --num-blocks (the KV cache size in blocks)")
    if num_blocks < 1:
        raise ValueError("the weights leave no memory for the KV cache on this hardware")
    cost = _cost_model(args, roofline, log)

    max_model_len = args.max_model_len or input_len + output_len
    sched_cfg = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
    )
    cache_cfg = CacheConfig(block_size=args.block_size, num_blocks_override=num_blocks,
                            enable_prefix_caching=args.enable_prefix_caching)
    rate = args.request_rate if args.request_rate is not None else math.inf
    workload = SimWorkload(
        num_prompts=args.num_prompts, input_len=input_len, output_len=output_len, request_rate=rate,
        burstiness=args.burstiness, max_concurrency=args.concurrency, shared_prefix_len=args.shared_prefix_len,
        vocab_size=model.vocab_size, eos_probability=args.eos_probability, seed=args.seed,
        request_latency_s=args.request_latency_ms / 1000.0,
    )
    spec, acceptance, speculation = _speculation(args)
    if args.disaggregate is not None:
        return _run_disaggregated(args, model, workload, sched_cfg, cache_cfg, num_blocks, cost, log)
    if args.kv_transfer_gbps is not None:
        raise ValueError("--kv-transfer-gbps needs --disaggregate P:D")
    if args.replicas is not None or args.router is not None:
        return _run_fleet(args, workload, sched_cfg, cache_cfg, num_blocks, cost, log)
    if args.shared_prefixes != 1:
        raise ValueError("--shared-prefixes needs a fleet (--replicas N)")
    result = simulate(workload, sched_cfg, cache_cfg, num_blocks, cost, speculative_config=spec, acceptance=acceptance)
    doc = simulation_report(
        result, workload, sched_cfg, cache_cfg, cost,
        model_name=model.name,
        hardware_name=hardware.name if hardware is not None else None,
        label=args.label,
        percentiles=parse_percentiles(args.metric_percentiles),
        metrics=parse_metric_names(args.percentile_metrics),
        slo=parse_slo(args.goodput),
        usd_per_hour=args.usd_per_hour,
        plan_inputs=None if inputs is None else {k: v for k, v in dataclasses.asdict(inputs).items()
                                                  if k not in ("model", "hardware")},
        speculation=speculation,
    )
    if args.result_file:
        write_json(doc, args.result_file)
        log(f"report written to {args.result_file}")
    if args.json:
        print(json.dumps(doc, indent=1, default=str))
    else:
        print_terminal(doc)
        for line in doc["simulation"]["assumptions"]:
            print(f"• simulated: {line}")
    return 0


def _speculation(args: argparse.Namespace) -> tuple[SpeculativeConfig | None, tuple[float, ...], str | None]:
    """--speculative-config and --spec-acceptance: both or neither (one replica only)."""
    spec = SpeculativeConfig.parse(args.speculative_config)
    if spec is None:
        if args.spec_acceptance is not None:
            raise ValueError("--spec-acceptance needs --speculative-config")
        return None, (), None
    if args.disaggregate is not None or args.replicas is not None or args.router is not None:
        raise ValueError("--speculative-config is simulated on one replica (not with --replicas, --router or --disaggregate)")
    if args.spec_acceptance is None:
        raise ValueError("--speculative-config needs --spec-acceptance (the chance a draft is kept at each "
                         "position, e.g. 0.8,0.9: what `inferlab bench` reports against a server)")
    acceptance = parse_acceptance(args.spec_acceptance)
    rule = "drafts where the engine's rule expects them to pay" if spec.adaptive else "K drafts every step"
    note = (f"speculative decoding ({spec.method}, K = {spec.num_speculative_tokens}, {rule}): a draft is kept with "
            f"probability {', '.join(f'{a:g}' for a in acceptance)} by position given the ones before it were; "
            "drafts are decode rows of the step; proposing takes no time")
    return spec, acceptance, note


def _write_report(doc: dict, args: argparse.Namespace, log) -> bool:
    """`doc` to --result-file if given, and to stdout as JSON with --json (True: nothing else to print)."""
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1)
        log(f"report written to {args.result_file}")
    if args.json:
        print(json.dumps(doc, indent=1))
    return bool(args.json)


def _policies(text: str | None) -> list[str]:
    if text is None or text.strip() == "all":
        return [p for p in POLICIES]
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in POLICIES]
    if bad or not names:
        raise ValueError(f"--router takes {', '.join(POLICIES)} or all (comma-separated); got {text!r}")
    return names


def _run_fleet(args, workload, sched_cfg, cache_cfg, num_blocks, cost, log) -> int:
    from inferlab.plan.fleet_sim import render_table, simulate_fleet

    replicas = args.replicas if args.replicas is not None else 2
    if args.kv_poll_ms <= 0:
        raise ValueError(f"--kv-poll-ms must be > 0, got {args.kv_poll_ms}")
    results = [simulate_fleet(workload, sched_cfg, cache_cfg, num_blocks, cost, replicas=replicas, policy=p,
                              num_shared_prefixes=args.shared_prefixes, kv_poll_s=args.kv_poll_ms / 1000.0)
               for p in _policies(args.router)]  # fmt: skip
    doc = {"simulation": "fleet", "replicas": replicas, "num_blocks_per_replica": num_blocks,
           "shared_prefixes": args.shared_prefixes, "shared_prefix_len": workload.shared_prefix_len,
           "policies": {r.policy: {**r.summary(), "requests_per_replica": r.per_replica, "decisions": r.reasons}
                        for r in results}}  # fmt: skip
    if not _write_report(doc, args, log):
        for line in render_table(results, replicas):
            print(line)
        print("• simulated: TTFT and throughput from the step cost model; cached share from the real prefix cache "
              "of each replica; predicted = what the router expected cached when it chose")
    return 0


def _run_disaggregated(args, model, workload, sched_cfg, cache_cfg, num_blocks, cost, log) -> int:
    from inferlab.plan.fleet_sim import (
        Disaggregation,
        KVLink,
        comparison_row,
        parse_disaggregate,
        render_comparison,
        simulate_fleet,
    )
    from inferlab.plan.precision import parse_precision
    from inferlab.plan.roofline import kv_bytes_per_token

    p, d = parse_disaggregate(args.disaggregate)
    if args.kv_transfer_gbps is None:
        raise ValueError("--disaggregate needs --kv-transfer-gbps (each prefill replica's link to the decode pool, "
                         "Gbit/s)")
    if args.replicas is not None and args.replicas != p + d:
        raise ValueError(f"--replicas {args.replicas} is not P + D = {p + d}: the colocated baseline uses as many "
                         "replicas as both pools together (leave --replicas out)")
    policies = _policies(args.router) if args.router is not None else ["least-load"]
    if len(policies) != 1:
        raise ValueError("--disaggregate compares one routing policy: give --router with one name")
    kv_bpt = kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim,
                                parse_precision(args.kv_dtype).bytes_per_element)
    dis = Disaggregation(p, d, KVLink(args.kv_transfer_gbps, args.kv_transfer_latency_ms / 1000.0), kv_bpt)
    slo = parse_slo(args.goodput)
    common = dict(policy=policies[0], num_shared_prefixes=args.shared_prefixes, kv_poll_s=args.kv_poll_ms / 1000.0)
    colo = simulate_fleet(workload, sched_cfg, cache_cfg, num_blocks, cost, replicas=p + d, **common)
    disagg = simulate_fleet(workload, sched_cfg, cache_cfg, num_blocks, cost, replicas=p + d, disaggregation=dis,
                            **common)  # fmt: skip
    rows = [comparison_row(r, slo, args.usd_per_hour) for r in (colo, disagg)]
    xfer_ms = dis.link.busy_time(dis.transfer_bytes(workload.input_len)) * 1e3 + args.kv_transfer_latency_ms
    notes = [
        f"simulated: {workload.num_prompts} requests of {workload.input_len} + {workload.output_len} tokens, "
        f"{workload.load.label}; router policy {policies[0]}; each replica the real scheduler on the step cost model",
        f"computed: K/V per request {dis.transfer_bytes(workload.input_len) / 1e6:,.1f} MB ({kv_bpt:,.0f} bytes/token "
        f"× {workload.input_len}); {xfer_ms:.1f} ms alone at {args.kv_transfer_gbps:g} Gbit/s"
        + (f" + {args.kv_transfer_latency_ms:g} ms latency" if args.kv_transfer_latency_ms else ""),
        "simulated: each prefill replica sends one request's K/V at a time; the first token reaches the client "
        "when its K/V lands; a decode replica admits it at its next step",
        f"goodput: requests per second meeting {slo.describe()}" + ("" if args.usd_per_hour is not None else
                                                                    "; give --usd-per-hour for costs"),
    ]
    doc = {"simulation": "disaggregated", "prefill_replicas": p, "decode_replicas": d,
           "kv_transfer_gbps": args.kv_transfer_gbps, "kv_transfer_latency_ms": args.kv_transfer_latency_ms,
           "kv_bytes_per_token": kv_bpt, "num_blocks_per_replica": num_blocks, "rows": rows, "notes": notes}
    if _write_report(doc, args, log):
        return 0
    for line in render_comparison(rows):
        print(line)
    for line in notes:
        print(f"• {line}")
    return 0
