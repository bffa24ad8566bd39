"""`load_model`: pick the weight loader for a LoadConfig and hand back HF-named tensors.

Formats sit behind one small table (`LOADERS`) so a new format is a new entry, not a new
branch in the runner.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from inferlab.config import WEIGHT_DTYPES, CacheConfig, LoadConfig
from inferlab.kernels import build as kernels_build
from inferlab.kernels.int4 import INT4
from inferlab.models.dummy_loader import load_dummy
from inferlab.models.gguf_loader import load_gguf
from inferlab.models.hf_loader import load_hf_dir
from inferlab.models.loaded import LoadedModel
from inferlab.models.registry import detect_format, resolve_model

__all__ = ["LOADERS", "LoadedModel", "int8_activations", "load_model", "resolve_dtype", "resolve_kv_dtype",
           "resolve_weight_dtype"]

# format -> loader(path, dtype, name)
LOADERS: dict[str, Callable[[Path, torch.dtype, str], LoadedModel]] = {
    "gguf": load_gguf,
    "hf": load_hf_dir,
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: str | torch.device = "cpu") -> torch.dtype:
    """LoadConfig.dtype -> torch dtype (of activations, norms, the residual stream).

    "auto" on a CPU where our kernels load (kernels/build.py's one decision): float32, the
    kernels' activations; the weights are then 16-bit (resolve_weight_dtype), so a decode step
    still reads half of float32's bytes, and on AVX512-BF16 the products run in bf16
    (vdpbf16ps, oneDNN) with float32 sums. Measured on Zen 5 the one-call decode step beat bf16
    F.linear per operator; see kernels/linear.py. Without the kernels: bfloat16 where the CPU
    has native bf16 (AVX512-BF16 / AMX, as oneDNN reports), else float32 (on an AVX2-only CPU
    bf16 products are emulated, measured 4-50x slower). A GPU: bfloat16, else float16."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, not {dtype!r}")
        return _DTYPES[dtype]
    if torch.device(device).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if torch.device(device).type == "cpu" and kernels_build.available():
        return torch.float32
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


_WEIGHT_DTYPES = {**_DTYPES, "int8": torch.int8, "w8a8": torch.int8, "int4": INT4}
_KV_DTYPES = {**_DTYPES, "int8": torch.int8}  # int8: codes with per-(token, KV head) scales, models/kv_cache.py


def _auto_16bit(load_config: LoadConfig) -> bool:
    """dtype "auto" computes in float32 on this CPU because our kernels load: what is stored
    (weights, K/V) is then 16-bit, converted in registers."""
    return (
        load_config.dtype == "auto"
        and resolve_dtype(load_config.dtype, load_config.device) == torch.float32
        and torch.device(load_config.device).type == "cpu"
        and kernels_build.available()
    )


def resolve_kv_dtype(load_config: LoadConfig, cache_config: CacheConfig) -> torch.dtype:
    """CacheConfig.cache_dtype -> the K/V cache's dtype. "auto": float16 where "auto" weights are
    float16 (see resolve_weight_dtype): decode attention reads every cached K and V once per
    step, and at 32 sequences of ~300 tokens that was ~18% of a step in float32. Otherwise the
    compute dtype, so dtype="float32" keeps a float32 cache (the exact-match tests). "int8":
    torch.int8, int8 codes with one float32 scale per token and KV head (every reader and writer
    of the cache takes its format from this one dtype)."""
    if cache_config.cache_dtype == "auto":
        return torch.float16 if _auto_16bit(load_config) else resolve_dtype(load_config.dtype, load_config.device)
    return _KV_DTYPES[cache_config.cache_dtype]


def resolve_weight_dtype(load_config: LoadConfig) -> torch.dtype:
    """LoadConfig.weight_dtype -> the dtype the linear layers' weights are stored in
    (torch.int8: weight-only int8 with one scale per output row; int4.INT4: 4 bits per weight with
    a float16 (d, m) per group of 32, kernels/int4.py; see kernels/linear.py).

    "auto": when dtype was "auto" and our kernels load (compute float32), the kernel variant's
    16-bit type (kernels/build.py KernelInfo.auto_weight_dtype): bfloat16 on AVX512-BF16, whose
    products vdpbf16ps and oneDNN run at 2-5x float32's rate; float16 on AVX2, where both are
    widened to float32 anyway and float16 keeps 3 more mantissa bits (weights sit well inside
    its range). A decode step reads every weight once, and 16 bits are half the bytes. Otherwise the compute dtype, so an explicit
    dtype="float32" (the exact-match tests) still gets float32 weights, and without the kernels
    nothing is slower than before. Weights are never stored wider than they are computed in."""
    compute = resolve_dtype(load_config.dtype, load_config.device)
    if load_config.weight_dtype == "auto":
        return _DTYPES[kernels_build.kernel_info().auto_weight_dtype] if _auto_16bit(load_config) else compute
    if load_config.weight_dtype == "w8a8" and not kernels_build.kernel_info().int8_dot:
        have = [w for w in WEIGHT_DTYPES if w != "w8a8"]
        raise ValueError(f"weight_dtype w8a8 needs the integer dot product of the avx512 kernel variant (VNNI); "
                         f"this machine's kernels are {kernels_build.kernel_info().variant}: use one of {', '.join(have)}")
    stored = _WEIGHT_DTYPES[load_config.weight_dtype]  # a name LoadConfig has checked
    if stored.itemsize > compute.itemsize:
        raise ValueError(
            f"weight_dtype {load_config.weight_dtype} is wider than the compute dtype "
            f"{str(compute).removeprefix('torch.')}: store weights in the compute dtype or in fewer bits"
        )
    return stored


def int8_activations(load_config: LoadConfig) -> bool:
    """Whether int8 weights multiply int8-quantized activations (weight_dtype "w8a8", checked
    by resolve_weight_dtype) rather than float32 ones (weight-only "int8")."""
    return load_config.weight_dtype == "w8a8"


def cpu_has_native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _default_name(path: Path) -> str:
    return path.stem if path.is_file() else path.name


def load_model(
    load_config: LoadConfig,
    model_path: str | Path | None = None,
    name: str = "",
    cache_dir: str | Path | None = None,
) -> LoadedModel:
    """Load the weights `load_config` describes, on `load_config.device`.

    `model_path` is an already-resolved location (a .gguf file or HF directory); without it,
    `load_config.model` goes through the registry (default model, local path or hub id),
    which also supplies the display name. Dummy weights take their shapes from
    `load_config.hf_config_path`, else from `model_path` / `load_config.model` (a config.json
    or a HF directory).
    """
    dtype = resolve_dtype(load_config.dtype, load_config.device)
    if load_config.load_format == "dummy":
        source = load_config.hf_config_path or model_path or load_config.model
        if source is None:
            raise ValueError(
                "dummy weights need a config: pass a config.json path (hf_config_path) or a model directory"
            )
        source = Path(source).expanduser()
        if not source.exists():
            raise FileNotFoundError(f"model path {str(source)!r} does not exist")
        return load_dummy(source, dtype, seed=load_config.seed, device=load_config.device, name=name)

    if model_path is None:
        resolved = resolve_model(load_config.model, cache_dir=cache_dir)
        path, fmt, name = resolved.path, resolved.format, name or resolved.name
    else:
        path = Path(model_path).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"model path {str(path)!r} does not exist")
        fmt, name = detect_format(path), name or _default_name(path)
    if load_config.load_format != "auto" and load_config.load_format != fmt:
        raise ValueError(f"load_format is {load_config.load_format!r} but {path} is a {fmt!r} model")
    if fmt == "gguf" and _WEIGHT_DTYPES.get(load_config.weight_dtype) == INT4:
        loaded = load_gguf(path, dtype, name, keep_int4=True)  # Q4 blocks as they are, no dequantize
    else:
        loaded = LOADERS[fmt](path, dtype, name)
    if torch.device(load_config.device).type != "cpu":
        # One tensor at a time, so the CPU copy of each is freed as soon as it has moved.
        for key in list(loaded.weights):
            loaded.weights[key] = loaded.weights[key].to(load_config.device)
    return loaded
