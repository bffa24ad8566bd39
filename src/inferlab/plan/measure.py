"""`--measure-cpu`: time this machine's memory bandwidth and matrix-product rates.

Decode reads every weight once per step, so the number that matters is read bandwidth: we
time a sum over an array much larger than the caches. Prefill is matrix products, so we
time a bf16, a float32 and an int8 product of a 128-row activation by a square weight (the
shape of a small batched step), the int8 one by the fastest library that runs it here
(`_int8_rate`). torch is imported here only, lazily, so that `inferlab plan` without
`--measure-cpu` never pays for it; without torch the bandwidth falls back to numpy and the
matmul rate to numpy float32.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable

from inferlab.plan.hardware import HardwareSpec


def _best_time(fn: Callable[[], object], repeats: int) -> float:
    """Best of `repeats` after one warm-up: the machine's capability, not its noise."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _int8_rate(torch, m: int, k: int, repeats: int) -> tuple[float, str] | None:  # type: ignore[no-untyped-def]
    """The best int8 x int8 product rate a library gives here (ops/s), and which: the rate w8a8's
    products are held against (benchmarks/profile_step.py). Two candidates, the faster kept:
    torch._int_mm (oneDNN; vpdpbusd where the CPU has VNNI, but without it a reference loop:
    1-2 GOP/s on an AVX2 EPYC, a hundredth of its float32 rate) and the quantized linear of
    torch's quantized engine (fbgemm's u8 x s8 GEMM by vpmaddubsw on AVX2, activations held to 7
    bits, as our avx2 kernels' x is). None where neither runs."""
    work = 2.0 * m * k * k
    rates: list[tuple[float, str]] = []
    qa = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    qb = torch.randint(-127, 128, (k, k), dtype=torch.int8)
    try:
        rates.append((work / _best_time(lambda: torch._int_mm(qa, qb), repeats), "torch._int_mm"))
    except (RuntimeError, AttributeError):
        pass
    engines = torch.backends.quantized.supported_engines
    engine = next((e for e in ("x86", "fbgemm", "onednn") if e in engines), None)
    if engine is not None:
        with warnings.catch_warnings():  # quantized tensors are deprecated in torch; measured while they run
            warnings.filterwarnings("ignore", "torch.quantize_per_tensor", UserWarning)
            before = torch.backends.quantized.engine
            try:
                torch.backends.quantized.engine = engine
                w = torch.quantize_per_tensor(torch.randn(k, k), 0.02, 0, torch.qint8)
                packed = torch.ops.quantized.linear_prepack(w, None)
                x = torch.quantize_per_tensor(torch.randn(m, k), 0.05, 128, torch.quint8)
                t = _best_time(lambda: torch.ops.quantized.linear(x, packed, 1.0, 128), repeats)
                rates.append((work / t, f"torch.ops.quantized.linear ({engine} engine)"))
            except (RuntimeError, AttributeError):
                pass
            finally:
                torch.backends.quantized.engine = before
    if not rates:
        return None
    best = max(rates)
    return best[0], f"({m}×{k}) @ ({k}×{k}) by {best[1]}, the faster of " + ", ".join(
        f"{how} {rate / 1e9:.0f} GOP/s" for rate, how in rates)


def total_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 0.0


def measure_cpu(threads: int | None = None, array_mib: int = 512, repeats: int = 5,
                matmul_rows: int = 128, matmul_dim: int = 2048) -> HardwareSpec:
    """Measure bandwidth (bytes/s) and dense FLOP/s here; returns a 'measured' HardwareSpec."""
    if array_mib < 1 or repeats < 1 or matmul_rows < 1 or matmul_dim < 1:
        raise ValueError("measurement sizes and repeats must be >= 1")
    notes: list[str] = []
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency of the package
        torch = None
    if torch is not None and threads:
        torch.set_num_threads(threads)
    used_threads = torch.get_num_threads() if torch is not None else 1

    n = array_mib * (1 << 20) // 4
    if torch is not None:
        x = torch.ones(n, dtype=torch.float32)
        t = _best_time(lambda: x.sum(), repeats)  # noqa: F821 - called before x is deleted
        notes.append(f"bandwidth: torch.sum over a {array_mib} MiB float32 tensor, {used_threads} threads, "
                     f"best of {repeats}")
    else:
        import numpy as np

        x = np.ones(n, dtype=np.float32)
        t = _best_time(lambda: x.sum(), repeats)  # noqa: F821 - called before x is deleted
        notes.append(f"bandwidth: numpy sum over a {array_mib} MiB float32 array, best of {repeats}")
    bandwidth = n * 4 / t
    del x

    flops: dict[str, float] = {}
    m, k = matmul_rows, matmul_dim
    work = 2.0 * m * k * k
    if torch is not None:
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            a = torch.randn(m, k, dtype=dtype)
            b = torch.randn(k, k, dtype=dtype)
            flops[name] = work / _best_time(lambda a=a, b=b: a @ b, repeats)
        int8 = _int8_rate(torch, m, k, repeats)
        if int8 is None:
            notes.append("no int8 matmul rate: neither torch._int_mm nor a quantized linear runs here")
        else:
            flops["int8"] = int8[0]
            notes.append(f"int8 matmul: {int8[1]}")
        notes.append(f"matmul: ({m}×{k}) @ ({k}×{k}) with torch, {used_threads} threads, best of {repeats}")
    else:
        import numpy as np

        a = np.random.rand(m, k).astype(np.float32)
        b = np.random.rand(k, k).astype(np.float32)
        flops["fp32"] = work / _best_time(lambda: a @ b, repeats)
        notes.append(f"matmul: ({m}×{k}) @ ({k}×{k}) float32 with numpy, best of {repeats}")

    return HardwareSpec(
        name=f"this CPU ({os.cpu_count()} cores, {used_threads} threads)",
        memory_bytes=total_memory_bytes(),
        memory_bandwidth=bandwidth,
        flops=flops,
        kind="measured",
        source=f"measured by inferlab plan --measure-cpu on {time.strftime('%Y-%m-%d %H:%M:%S')}",
        notes=notes,
    )
