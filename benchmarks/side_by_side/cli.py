"""The command line: flags, what will run and how long it should take, then run and report."""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import unwind_on_sigterm

import side_by_side
from side_by_side.floors import decode_floors, measure_bandwidth
from side_by_side.measure import Session, run_series
from side_by_side.report import (
    Outcome,
    header_lines,
    main_table,
    plot_sweep,
    spread_table,
    sweep_table,
    versions,
    write_json,
    write_markdown,
)
from side_by_side.systems import DEFAULT_PEERS, PEERS, Paths, System, inferlab_systems, peer_systems
from side_by_side.workloads import Workload, sweep_workloads, table_workloads

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PEERS_DIR = REPO.parent / "shared" / "peers"
DEFAULT_PEERS_ROOT = Path("/tmp/peers")
DEFAULT_PLOT = REPO / "benchmarks" / "results" / "concurrency_sweep.png"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=side_by_side.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("systems")
    g.add_argument("--inferlab-args", default="", help="flags for every `inferlab serve`, e.g. \"--weight-dtype int8\"")
    g.add_argument("--inferlab-variant", action="append", default=[], metavar="NAME=ARGS",
                   help="an inferlab column with its own serve flags, e.g. 16-bit=\"--weight-dtype float16\" (repeat)")
    g.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                   help=f"comma list of {', '.join(PEERS)}, or 'none' (default: {','.join(DEFAULT_PEERS)})")
    g.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's --dtype (default bfloat16)")
    g.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR,
                   help=f"the peers' scripts (default {DEFAULT_PEERS_DIR})")
    g.add_argument("--peers-root", type=Path, default=DEFAULT_PEERS_ROOT,
                   help=f"where the set-up scripts put the peers (default {DEFAULT_PEERS_ROOT})")
    g.add_argument("--setup", action="store_true", help="run the peers' set-up scripts for missing peers (minutes)")

    w = p.add_argument_group("workloads (defaults: the issue's targets)")
    w.add_argument("--workloads", default="load,prefill,stream",
                   help="which of load,prefill,stream to run (default all; '' with --sweep: the sweep only)")
    w.add_argument("--load-streams", type=int, default=32, help="concurrent streams under load (default 32)")
    w.add_argument("--load-prompts", type=int, default=None, help="requests in the load run (default: one per stream)")
    w.add_argument("--load-input-len", type=int, default=256, help="(default 256)")
    w.add_argument("--load-output-len", type=int, default=128, help="(default 128)")
    w.add_argument("--prefill-len", type=int, default=1024, help="the long prompt's tokens (default 1024)")
    w.add_argument("--prefill-output-len", type=int, default=1,
                   help="tokens generated after the long prompt (default 1)")
    w.add_argument("--prefill-prompts", type=int, default=1, help="long prompts per run, one at a time (default 1)")
    w.add_argument("--stream-input-len", type=int, default=128, help="one stream's prompt (default 128)")
    w.add_argument("--stream-output-len", type=int, default=128, help="one stream's output tokens (default 128)")
    w.add_argument("--repeats", type=int, default=3, help="runs of every workload per system; medians (default 3)")
    w.add_argument("--seed", type=int, default=1000, help="first seed; every run takes the next one")
    w.add_argument("--tokenizer", default=None,
                   help="tokenizer for exact prompt lengths, the same for all (default: the default model's GGUF)")
    w.add_argument("--warmup-requests", type=int, default=1,
                   help="unmeasured short requests per slot (at most 2 slots) after each server start (default 1)")
    w.add_argument("--quick", action="store_true",
                   help="smoke test: 4 prompts, 16 output tokens, 1 repeat, sweep levels 1,2")

    s = p.add_argument_group("concurrency sweep")
    s.add_argument("--sweep", action="store_true", help="also run the concurrency sweep and plot it")
    s.add_argument("--sweep-peers", action="store_true", help="sweep the peers too (default: inferlab only)")
    s.add_argument("--sweep-levels", default="1,2,4,8,16,32,64", help="concurrencies (default 1,2,4,8,16,32,64)")
    s.add_argument("--sweep-input-len", type=int, default=256, help="(default 256)")
    s.add_argument("--sweep-output-len", type=int, default=128, help="(default 128)")
    s.add_argument("--sweep-prompts-per-client", type=int, default=1, help="requests per level = this × concurrency")
    s.add_argument("--sweep-repeats", type=int, default=1, help="runs per level; medians (default 1)")
    s.add_argument("--plot", type=Path, default=DEFAULT_PLOT, help=f"the sweep's PNG (default {DEFAULT_PLOT})")

    o = p.add_argument_group("output and the machine")
    o.add_argument("--markdown", type=Path, default=None, help="write the table, versions, commands and every run here")
    o.add_argument("--json", type=Path, default=None, help="write the raw numbers here")
    o.add_argument("--work-dir", type=Path, default=None, help="keep bench reports and server logs here")
    o.add_argument("--hardware-file", default=None,
                   help="a profile from `inferlab plan --measure-cpu` (skip measuring)")
    o.add_argument("--no-floor", action="store_true", help="no bandwidth measurement, no decode ceiling")
    o.add_argument("--warn-load", type=float, default=1.25,
                   help="warn when the 1-minute load average before a run exceeds this × cores (default 1.25)")
    o.add_argument("--warn-other", type=float, default=0.10,
                   help="warn when other processes took more than this share of the CPU during a run (default 0.10)")
    o.add_argument("--wait-quiet", type=float, default=0.0,
                   help="before each run, wait up to this many seconds for other processes to go quiet "
                        "(default 0: measure at once and warn)")
    o.add_argument("--inferlab-timeout", type=float, default=300.0, help="seconds for inferlab serve to be ready")
    o.add_argument("--peer-timeout", type=float, default=120.0, help="seconds for llama-server to be ready")
    o.add_argument("--vllm-timeout", type=float, default=600.0, help="seconds for vLLM to be ready")
    o.add_argument("--bench-timeout", type=float, default=1800.0, help="seconds one bench run may take")
    o.add_argument("--dry-run", action="store_true", help="print the plan, the estimate and the commands; run nothing")
    args = p.parse_args(argv)

    if args.quick:  # tiny sizes, except where a flag was given
        for k, v in dict(load_streams=4, load_input_len=64, load_output_len=16, prefill_len=256, stream_input_len=32,
                         stream_output_len=16, repeats=1, sweep_levels="1,2", sweep_input_len=32,
                         sweep_output_len=16).items():
            if getattr(args, k) == p.get_default(k):
                setattr(args, k, v)
    args.workloads = [x.strip() for x in args.workloads.split(",") if x.strip()]
    bad = set(args.workloads) - {"load", "prefill", "stream"}
    if bad:
        raise ValueError(f"--workloads takes load, prefill, stream; got {sorted(bad)}")
    try:
        args.sweep_levels = [int(x) for x in args.sweep_levels.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--sweep-levels takes a comma list of integers, got {args.sweep_levels!r}") from None
    args.peers = [] if args.peers.strip() in ("", "none") else [x.strip() for x in args.peers.split(",")]
    for name in ("repeats", "load_streams", "prefill_len", "prefill_prompts", "stream_input_len", "stream_output_len",
                 "load_input_len", "load_output_len", "sweep_repeats", "sweep_prompts_per_client"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if any(c < 1 for c in args.sweep_levels) or (args.sweep and not args.sweep_levels):
        raise ValueError("--sweep-levels must be integers >= 1")
    if not args.workloads and not args.sweep:
        raise ValueError("nothing to run: give --workloads or --sweep")
    return args



@dataclass
class Plan:
    """What this invocation will run: the columns, the workloads, and the peers it cannot run."""

    ours: list[System]
    peers: list[System]  # ready to run
    absent: list[System]  # missing, each with the command that sets it up
    workloads: list[Workload]
    sweeps: list[Workload]
    sweep_systems: list[System]
    setup_notes: list[str]
    gguf: Path
    paths: Paths

    @property
    def columns(self) -> list[System]:
        return [*self.ours, *self.peers]

    @property
    def skipped(self) -> dict[str, str]:
        return {s.name: s.missing or "" for s in self.absent}


def make_plan(args: argparse.Namespace) -> Plan:
    """Systems and workloads from the flags; every sizing error is a ValueError now, not after half an hour."""
    from inferlab.models.registry import resolve_model

    gguf = resolve_model(None).path  # inferlab's default model: the Q4_1 GGUF llama.cpp serves as shipped
    args.tokenizer = args.tokenizer or str(gguf)
    paths = Paths(args.peers_dir, args.peers_root, gguf)
    notes: list[str] = []
    ours: list[System] = list(inferlab_systems(args, gguf))
    all_peers = peer_systems(args.peers, paths, args, notes)
    peers = [s for s in all_peers if s.missing is None]
    workloads = table_workloads(args)
    sweeps = sweep_workloads(args) if args.sweep else []
    for s in (*ours, *peers):
        s.slot_groups(workloads)
        s.slot_groups(sweeps)
    return Plan(ours, peers, [s for s in all_peers if s.missing is not None], workloads, sweeps,
                [*ours, *(peers if args.sweep_peers else [])], notes, gguf, paths)


def series_seconds(systems: Sequence[System], workloads: Sequence[Workload], repeats: int, warmup: bool) -> float:
    return repeats * sum(s.seconds(workloads, warmup) for s in systems)


def estimate_seconds(plan: Plan, args: argparse.Namespace, repeats: int | None = None) -> tuple[float, float]:
    """(table, sweep) seconds from the assumed speeds."""
    warm = bool(args.warmup_requests)
    return (series_seconds(plan.columns, plan.workloads, args.repeats if repeats is None else repeats, warm),
            series_seconds(plan.sweep_systems, plan.sweeps, args.sweep_repeats, warm))


def print_plan(plan: Plan, args: argparse.Namespace) -> float:
    """What will run, what is skipped and why, and how long it should take (printed before anything starts)."""
    print(f"Systems: {', '.join(s.name for s in plan.columns)}")
    for s in plan.absent:
        print(f"SKIPPED {s.name}: {s.missing}")
    for n in plan.setup_notes:
        print(n)
    for w in plan.workloads:
        print(f"workload {w.key}: {w.describe()}, {args.repeats} repeat(s)")
    if plan.sweeps:
        print(f"sweep: concurrency {','.join(map(str, args.sweep_levels))} for "
              f"{', '.join(s.name for s in plan.sweep_systems)}, {args.sweep_repeats} repeat(s)")
    table_s, sweep_s = estimate_seconds(plan, args)
    total = table_s + sweep_s + (0 if args.no_floor or args.hardware_file else 15)
    per = ", ".join(f"{s.name} {s.seconds(plan.workloads, bool(args.warmup_requests)) / 60:.1f}"
                    for s in plan.columns) if plan.workloads else ""
    print(f"Estimated duration: ~{total / 60:.0f} min (table {table_s / 60:.0f} min, sweep {sweep_s / 60:.0f} min; "
          "from assumed speeds: the rates in side_by_side/systems/)" + (f"; minutes per repeat: {per}" if per else ""),
          flush=True)
    if args.dry_run:
        for s in plan.columns:
            for slots, group in s.slot_groups(plan.workloads) + s.slot_groups(plan.sweeps):
                print(f"  {s.name}, {slots} slot(s), {', '.join(w.key for w in group)}: {s.server(0, slots).shown()}")
    return total


def execute(plan: Plan, session: Session) -> dict[str, Any] | None:
    """Bandwidth, then the table's series, then the sweep; Ctrl-C keeps what was measured. Returns
    the hardware profile (None without one)."""
    args, hw = session.args, None
    try:
        if not args.no_floor:
            hw = measure_bandwidth(session, str(plan.gguf))
        if plan.workloads:
            run_series(session, plan.columns, plan.workloads, args.repeats, "table",
                       lambda n: estimate_seconds(plan, args, n)[0])
        if plan.sweeps:
            run_series(session, plan.sweep_systems, plan.sweeps, args.sweep_repeats, "sweep",
                       lambda n: series_seconds(plan.sweep_systems, plan.sweeps, n, bool(args.warmup_requests)))
    except KeyboardInterrupt:
        session.warn("interrupted: the table has what was measured so far")
    return hw


def report(plan: Plan, session: Session, hw: dict[str, Any] | None, times: dict[str, Any]) -> None:
    """The table (and sweep) on the terminal; Markdown, JSON and the PNG where asked."""
    args = session.args
    stream = next((w for w in plan.workloads if w.key == "stream"), None)
    names = [s.name for s in plan.columns]
    floors = decode_floors(plan.columns, hw, stream, session.server_info) if hw and stream else []
    has_table = bool(plan.workloads)
    out = Outcome(
        **times,
        versions=versions(plan.paths, plan.columns),
        table=main_table(session, plan.ours, plan.peers, plan.workloads, floors, plan.skipped) if has_table else [],
        spread=spread_table(session, names, plan.workloads, plan.skipped) if has_table and args.repeats > 1 else [],
        sweep=sweep_table(session, plan.sweep_systems, args.sweep_levels) if plan.sweeps else [],
        floors=floors,
        hw=hw,
        problems=([f"skipped {s.name}: {s.missing}" for s in plan.absent]
                  + [f"failed {n}: {why}" for n, why in session.failed.items()] + session.warnings),
        plot=plot_sweep(session, plan.sweep_systems, args.sweep_levels, args.plot) if plan.sweeps else None,
    )
    print()
    if out.table:
        print("\n".join([*header_lines(args, plan.columns, out.versions["machine"]), "", *out.table]))
    if out.floors:
        print(f"\n(decode ceiling from {out.bandwidth})")
    if out.sweep:
        print("\n" + "\n".join(out.sweep))
    if out.plot:
        print(f"\nsweep plot: {out.plot}")
    for line in out.problems[: len(out.problems) - len(session.warnings)]:
        print(f"- {line}")
    if session.warnings:
        print(f"- {len(session.warnings)} warning(s) about the machine or the runs: see above"
              + (" and the Markdown" if args.markdown else ""))
    print(f"\ntook {out.elapsed_s / 60:.1f} min (estimated {out.estimate_s / 60:.0f})")
    if args.markdown:
        write_markdown(args.markdown, plan.columns, session, out)
        print(f"written to {args.markdown}")
    if args.json:
        write_json(args.json, plan, session, out)
        print(f"written to {args.json}")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        plan = make_plan(args)
    except ValueError as e:
        print(f"side_by_side.py: {e}", file=sys.stderr)
        return 2
    estimate = print_plan(plan, args)
    if args.dry_run:
        return 0
    unwind_on_sigterm()
    with contextlib.ExitStack() as stack:
        if args.work_dir is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="side_by_side-")))
        else:
            work = args.work_dir
            work.mkdir(parents=True, exist_ok=True)
        session = Session(args, work, args.tokenizer)
        session.notes += plan.setup_notes
        started, t0 = time.strftime("%Y-%m-%d %H:%M:%S %Z"), time.monotonic()
        hw = execute(plan, session)
        times = dict(started=started, finished=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                     elapsed_s=time.monotonic() - t0, estimate_s=estimate)
        report(plan, session, hw, times)
        if args.work_dir:
            print(f"bench reports and server logs in {work}")
    return 0

