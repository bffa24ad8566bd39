"""Flags shared by `inferlab plan` and `inferlab simulate`, and turning them into inputs."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from inferlab.plan.hardware import (
    HardwareSpec,
    builtin_hardware,
    builtin_hardware_names,
    load_hardware_file,
    save_hardware_file,
)
from inferlab.plan.model_spec import ModelSpec, builtin_model_names, load_model_spec
from inferlab.plan.planner import PlanInputs, Workload

DEFAULT_INPUT_LEN = 1024
DEFAULT_OUTPUT_LEN = 256
DEFAULT_HARDWARE_CACHE = Path.home() / ".cache" / "inferlab" / "cpu-hardware.json"

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_MULT = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
         "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}


def parse_size(text: str) -> float:
    """'2GiB', '1.5 GB', '512MiB', '1000' -> bytes."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 2GiB, 1.5GB, 512MiB or a number of bytes)")
    return float(m.group(1)) * _MULT[(m.group(2) or "").lower()]


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and hardware")
    g.add_argument("--model", help=f"built-in name ({', '.join(builtin_model_names())}), a config.json, "
                                   "a Hugging Face directory or a .gguf file")
    g.add_argument("--hardware", help=f"built-in device ({', '.join(builtin_hardware_names())})")
    g.add_argument("--hardware-file", help="a hardware profile JSON (e.g. written by --measure-cpu)")
    g.add_argument("--measure-cpu", action="store_true",
                   help="measure this machine's bandwidth and matmul rate (imports torch) and use them")
    g.add_argument("--measure-threads", type=int, default=None, help="threads for --measure-cpu (default: torch's)")
    g.add_argument("--save-hardware", default=None,
                   help=f"where --measure-cpu caches its profile (default {DEFAULT_HARDWARE_CACHE})")
    g.add_argument("--weight-dtype", default=None,
                   help="weight precision: bf16, fp16, fp8, int8, q8_0, q4_0, q4_1, ... (default: as stored)")
    g.add_argument("--kv-dtype", default="bf16", help="KV-cache precision (default bf16)")
    g.add_argument("--compute-dtype", default=None,
                   help="precision the matrix products run in: bf16, fp16, fp32 (default: bf16, except on a "
                        "measured CPU where fp32 measured faster, as the engine's own dtype=auto chooses)")

    w = p.add_argument_group("workload")
    w.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=None,
                   help=f"prompt tokens per request (default {DEFAULT_INPUT_LEN})")
    w.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=None,
                   help=f"output tokens per request (default {DEFAULT_OUTPUT_LEN})")
    w.add_argument("--concurrency", "--max-concurrency", dest="concurrency", type=int, default=None,
                   help="requests in flight at once (closed loop)")
    w.add_argument("--request-rate", type=float, default=None, help="requests per second (Poisson arrivals)")
    w.add_argument("--usd-per-hour", type=float, default=None, help="what the machine costs per hour")

    a = p.add_argument_group("assumptions")
    a.add_argument("--reserve", type=float, default=0.10,
                   help="fraction of device memory kept back for activations and the runtime (default 0.10)")
    a.add_argument("--reserve-bytes", default="0", help="a fixed reserve on top, e.g. 2GiB (default 0)")
    a.add_argument("--memory-efficiency", type=float, default=1.0,
                   help="share of peak bandwidth a step reaches (default 1.0: the roofline's upper bound)")
    a.add_argument("--compute-efficiency", type=float, default=1.0,
                   help="share of peak dense FLOP/s a step reaches (default 1.0)")
    a.add_argument("--step-overhead-ms", type=float, default=0.0, help="fixed time per step (default 0)")
    a.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def resolve_model(args: argparse.Namespace) -> ModelSpec:
    if not args.model:
        raise ValueError("--model is required (a built-in name, a config.json, an HF directory or a .gguf file)")
    return load_model_spec(args.model)


def resolve_hardware(args: argparse.Namespace, log=print) -> HardwareSpec:
    chosen = [x for x in (args.hardware, args.hardware_file, args.measure_cpu or None) if x]
    if len(chosen) > 1:
        raise ValueError("give one of --hardware, --hardware-file or --measure-cpu")
    if args.measure_cpu:
        from inferlab.plan.measure import measure_cpu

        spec = measure_cpu(threads=args.measure_threads)
        path = Path(args.save_hardware) if args.save_hardware else DEFAULT_HARDWARE_CACHE
        path.parent.mkdir(parents=True, exist_ok=True)
        save_hardware_file(spec, path)
        log(f"measured {spec.name}: {spec.memory_bandwidth / 1e9:.1f} GB/s, "
            + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in spec.flops.items())
            + f"; saved to {path} (pass it back with --hardware-file)")
        return spec
    if args.hardware_file:
        return load_hardware_file(args.hardware_file)
    if args.hardware:
        return builtin_hardware(args.hardware)
    raise ValueError("--hardware is required (a built-in device), or --hardware-file, or --measure-cpu")


def plan_inputs(args: argparse.Namespace, model: ModelSpec, hardware: HardwareSpec,
                concurrency: int | None = None, request_rate: float | None = None) -> PlanInputs:
    rate = request_rate if request_rate is not None else args.request_rate
    if rate is not None and math.isinf(rate):
        rate = None
    conc = concurrency if concurrency is not None else args.concurrency
    if conc is not None and rate is not None:
        rate = None  # a capped open loop: the cap is what decides the batch
    workload = Workload(
        input_len=args.input_len if args.input_len is not None else DEFAULT_INPUT_LEN,
        output_len=args.output_len if args.output_len is not None else DEFAULT_OUTPUT_LEN,
        concurrency=conc,
        request_rate=rate,
    )
    return PlanInputs(
        model=model,
        hardware=hardware,
        workload=workload,
        weight_precision=args.weight_dtype,
        kv_precision=args.kv_dtype,
        compute_precision=args.compute_dtype or auto_compute_precision(hardware),
        usd_per_hour=args.usd_per_hour,
        reserve_fraction=args.reserve,
        reserve_bytes=parse_size(args.reserve_bytes),
        memory_efficiency=args.memory_efficiency,
        compute_efficiency=args.compute_efficiency,
        step_overhead_s=args.step_overhead_ms / 1000.0,
        block_size=args.block_size,
    )


def auto_compute_precision(hardware: HardwareSpec) -> str:
    """bf16, unless this is a measured CPU whose fp32 products ran faster than bf16 ones (no
    native bf16: the engine then computes in float32 too, see `models.precision.resolve_precision`)."""
    fp32, bf16 = hardware.flops.get("fp32"), hardware.flops.get("bf16")
    if hardware.kind == "measured" and fp32 is not None and (bf16 is None or fp32 > bf16):
        return "fp32"
    return "bf16"
