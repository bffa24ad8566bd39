"""`inferlab simulate --calibrate-engine`: profile our engine here, fit the step cost, write both.

    inferlab simulate --calibrate-engine --profile-out profile.json --save-cost-model cost.json
    inferlab simulate --calibrate profile.json --num-blocks 1456 --input-len 128 ...   # then use it

Loads the engine (the default model unless --model), runs `engine_profile.ProfileSpec` on it
(about a minute on a quiet 2-core CPU with the default model), records every step through the
engine's `step_observer`, fits `LinearCost` by least squares and prints how well it fits: R²,
and the median and worst relative error per kind of step. It stops there; a simulation is a
separate call, so one profile serves many workloads. torch is imported only on this path.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable

import numpy as np

from inferlab.plan.cost_model import LinearCost, StepSample, fit_linear, save_cost_model, write_profile
from inferlab.plan.engine_profile import ProfileSpec, overhead_summary, profile_engine, step_kind
from inferlab.plan.precision import parse_precision


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("calibrate on this machine (loads the engine; imports torch)")
    g.add_argument("--calibrate-engine", action="store_true",
                   help="time our engine on a short profiling workload, write the profile (--profile-out), "
                        "fit and print the linear cost model, and stop")
    g.add_argument("--profile-out", metavar="PROFILE.json", help="where --calibrate-engine writes the measured steps")
    g.add_argument("--profile-max-batch", type=int, default=32, help="largest decode batch profiled (default 32)")
    g.add_argument("--profile-max-prefill", type=int, default=1024,
                   help="longest prompt profiled in one step (default 1024)")
    g.add_argument("--profile-repeats", type=int, default=1, help="run the profiling workload this many times")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the engine's compute precision (default auto, as `inferlab serve`); its weights' "
                        "storage is --weight-dtype (fp32, bf16, fp16 or int8; default auto, as serve)")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores, as serve)")


# The planner's weight precisions the engine can store its linear layers' weights in.
_ENGINE_WEIGHT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "int8": "int8"}


def engine_weight_dtype(args: argparse.Namespace) -> str:
    """The simulate command's --weight-dtype (the planner's weight precision, shared with the
    roofline so a calibration and a simulation describe the same engine) as the engine's
    LoadConfig.weight_dtype; not given = "auto", as `inferlab serve`."""
    name = getattr(args, "weight_dtype", None)
    if name is None:
        return "auto"
    key = parse_precision(name).name
    if key not in _ENGINE_WEIGHT_DTYPES:
        raise ValueError(
            f"--calibrate-engine runs our engine, which stores weights as fp32, bf16, fp16 or int8, not {name!r}"
        )
    return _ENGINE_WEIGHT_DTYPES[key]


def spec_from_args(args: argparse.Namespace) -> ProfileSpec:
    return ProfileSpec.sized(args.profile_max_batch, args.profile_max_prefill, repeats=args.profile_repeats,
                             seed=args.seed)


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> int:
    if not args.profile_out:
        raise ValueError("--calibrate-engine needs --profile-out PROFILE.json (where the measured steps go)")
    for flag in ("calibrate", "cost_model", "constant_step_ms"):
        if getattr(args, flag, None) is not None:
            raise ValueError(f"--calibrate-engine measures a new profile; drop --{flag.replace('_', '-')}")
    spec = spec_from_args(args)
    from inferlab.entrypoints.llm import LLM  # torch, only here
    from inferlab.models.precision import dtype_name

    log(f"loading {args.model or 'the default model'} ...")
    llm = LLM(args.model, dtype=args.dtype, weight_dtype=engine_weight_dtype(args), num_threads=args.num_threads,
              max_num_seqs=spec.max_batch, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=spec.max_model_len,
              block_size=args.block_size, enable_prefix_caching=False, seed=args.seed)
    engine = llm.engine
    compute, weights = dtype_name(engine.precision.compute), dtype_name(engine.precision.weights)
    log(f"profiling {engine.model_name} ({compute}, weights {weights}, "
        f"{_threads()} threads): "
        f"{spec.total_prefill_tokens} prompt tokens, decode batches up to {max(r.batch for r in spec.ramps)}")
    t0 = time.perf_counter()
    samples = profile_engine(engine, spec, log=log)
    elapsed = time.perf_counter() - t0
    meta = {
        "model": engine.model_name,
        "dtype": compute,
        "weight_dtype": weights,
        "threads": _threads(),
        "machine": platform.machine(),
        "max_num_batched_tokens": engine.scheduler_config.max_num_batched_tokens,
        "block_size": args.block_size,
        "profile_seconds": elapsed,
        "recorded": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": "inferlab simulate --calibrate-engine",
    }
    write_profile(samples, args.profile_out, meta)
    model = fit_linear(samples, source=str(args.profile_out))
    for line in calibration_report(model, samples):
        log(line)
    log(f"profile of {len(samples)} steps ({elapsed:.0f} s) written to {args.profile_out}; simulate with "
        f"`inferlab simulate --calibrate {args.profile_out} ...`")
    if args.save_cost_model:
        save_cost_model(model, args.save_cost_model)
        log(f"cost model saved to {args.save_cost_model} (or `--cost-model {args.save_cost_model}`)")
    return 0


def calibration_report(model: LinearCost, samples: list[StepSample]) -> list[str]:
    """The fit, its quality overall and per kind of step, and the engine's own overhead."""
    lines = list(model.describe())
    by_kind: dict[str, list[float]] = {}
    for s in samples:
        by_kind.setdefault(step_kind(s), []).append(abs(model.step_time(s.shape) - s.step_time_s) / s.step_time_s)
    for kind in ("prefill", "decode", "mixed"):
        errs = by_kind.get(kind)
        if errs:
            lines.append(f"  {kind:7s} steps: {len(errs):3d}, relative error median {np.median(errs) * 100:.2g}%, "
                         f"max {max(errs) * 100:.2g}%")
    over = overhead_summary(samples)
    if over is not None:
        lines.append(over.describe())
    return lines


def _threads() -> int:
    import torch

    return torch.get_num_threads()
