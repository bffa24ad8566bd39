"""`ResolvedPrecision`: every precision decision of one engine, made once.

The settings (`LoadConfig.dtype` / `weight_dtype`, `CacheConfig.cache_dtype`) may say "auto",
and what "auto" means depends on the device, on which of our CPU kernels loaded (kernels/build.py's
one decision per process) and on whether the CPU computes bf16 natively. `resolve_precision`
answers all of it in one place; the engine logs the answer in one line, hands the frozen object to
the loader, the runner and the decoder (none of which decides again) and reports it at
`GET /server_info`, where the benchmarks read it instead of guessing from the flags they passed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferlab.config import WEIGHT_DTYPES, CacheConfig, LoadConfig, ModelConfig
from inferlab.kernels import build as kernels_build
from inferlab.kernels.int4 import INT4
from inferlab.kernels.linear import MKL_MIN_ROWS, W16_MKL_MIN_ROWS
from inferlab.models.kv_cache import kv_bytes_per_token

__all__ = ["ResolvedPrecision", "cpu_has_native_bf16", "dtype_name", "resolve_precision"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_WEIGHT_DTYPES = {**_DTYPES, "int8": torch.int8, "w8a8": torch.int8, "int4": INT4}
_KV_DTYPES = {**_DTYPES, "int8": torch.int8}  # int8: codes with per-(token, KV head) scales, models/kv_cache.py


@dataclass(frozen=True)
class ResolvedPrecision:
    """What one engine stores and computes in, every "auto" answered (see `resolve_precision`)."""

    compute: torch.dtype  # activations, norms, the residual stream
    weights: torch.dtype  # how the linear layers' weights are stored (int4.INT4: 4-bit groups, kernels/int4.py)
    weight_mode: str  # the weight_dtype setting resolved: "float16", "int8" (weight-only), "w8a8", "int4", ...
    kv_cache: torch.dtype  # how K and V are stored (torch.int8: codes + a float32 scale per token and KV head)
    kernel: kernels_build.KernelInfo  # this process's kernels (variant "avx512" | "avx2" | "none", and why)
    # Our kernels run this model: float32 activations on the CPU where they loaded (the fused
    # layer, the whole-step decode kernel, the weight-only linears' kernels).
    uses_kernels: bool
    # bf16 weights multiplied in bf16 with float32 sums (vdpbf16ps on the avx512 variant).
    bf16_products: bool
    # Prefill attention multiplies in bf16 (our flash attention, vdpbf16ps; models/attention.py):
    # beside bf16 products, and beside w8a8, whose int8 x is coarser than bf16's rounding (in
    # float32, torch's attention was half of a 1,024-token w8a8 prefill on Zen 5).
    bf16_attention: bool
    device: str
    reasons: tuple[str, ...] = ()  # why a setting is not on the fastest path, one sentence each

    @property
    def int8_activations(self) -> bool:
        """int8 weights multiply int8-quantized activations (w8a8), not float32 ones (weight-only int8)."""
        return self.weight_mode == "w8a8"

    @property
    def prefill_attention(self) -> str:
        """Which prefill attention the model runs (models/attention.py): our flash attention with
        "bfloat16" products (`bf16_attention`), ours in "float32" wherever else our kernels run the
        model (oneDNN's float32 micro-kernel: ~1.7x torch's attention at 1,024 tokens, and continuing
        chunks read the paged cache in place), else "torch" (SDPA)."""
        if self.bf16_attention:
            return "bfloat16"
        return "float32" if self.uses_kernels else "torch"

    @property
    def bf16_decode_attention(self) -> bool:
        """Decode attention multiplies in bf16 (vdpbf16ps, kernels/csrc/attention.h): beside bf16
        prefill attention, over a bfloat16 cache (`--kv-cache-dtype bfloat16`), so q, K, P and V
        are rounded as the prefill rounds them; over any other cache in float32. "auto" K/V stays
        float16: with bf16 K/V SmolLM2's default mode parted from float32's greedy tokens at a
        0.003-nat near-tie within 16 tokens (float16: the same 16 on the reference prompts), for
        ~2-3% of a decode step at 8-32 streams on a Zen 4."""
        return self.bf16_attention and self.kv_cache == torch.bfloat16

    @property
    def decode_step_max_rows(self) -> int:
        """Decode-only steps of fewer rows run every layer in one DecoderStep call (the decode step);
        from this many on, per operator (prefill-size GEMMs). 16-bit weights: W16_MKL_MIN_ROWS,
        where our 16-bit products still beat the GEMMs, so that speculative verification at 32
        streams (4 drafts: up to 160 rows) multiplies as a plain decode step does, the same bits
        per row. Measured on a Zen 4, decode steps of N sequences of ~260 tokens, the decode step
        against the operators, alternated: bf16 panels at 96 rows 117.3 / 123.2 ms, 160 rows 181.0 /
        227.2, 256 rows 319.0 / 339.3; float16 on the avx2 variant (torch held to AVX2 too) at 160 rows
        301.6 / 339.3. Other weights: MKL_MIN_ROWS (w8a8 at 160 rows 132.6 / 135.8 and at 256 272.3 /
        261.0, int4 at 160 318.3 / 301.9: no gain shown)."""
        return W16_MKL_MIN_ROWS if self.weights in (torch.float16, torch.bfloat16) else MKL_MIN_ROWS

    @property
    def products(self) -> str:
        """The dtype the matrix products multiply in (their sums are float32 on our kernels)."""
        if self.int8_activations:
            return "int8"
        return "bfloat16" if self.bf16_products else dtype_name(self.compute)

    def kv_bytes_per_token(self, model: ModelConfig) -> int:
        """K and V of one token in every layer of `model`, as stored (int8: with their scales)."""
        return kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, self.kv_cache)

    def as_dict(self, model: ModelConfig | None = None) -> dict[str, object]:
        """Plain values for a JSON report (GET /server_info), with K/V bytes per token of `model`."""
        d: dict[str, object] = {
            "compute": dtype_name(self.compute), "weights": dtype_name(self.weights), "weight_mode": self.weight_mode,
            "kv_cache": dtype_name(self.kv_cache), "int8_activations": self.int8_activations,
            "products": self.products, "bf16_products": self.bf16_products,
            "bf16_attention": self.bf16_attention, "prefill_attention": self.prefill_attention,
            "bf16_decode_attention": self.bf16_decode_attention, "decode_step_max_rows": self.decode_step_max_rows,
            "kernel_variant": self.kernel.variant,
            "uses_kernels": self.uses_kernels, "device": self.device, "reasons": list(self.reasons),
        }
        if model is not None:
            d["kv_bytes_per_token"] = self.kv_bytes_per_token(model)
        return d

    def describe(self, model: ModelConfig | None = None) -> str:
        """One line for the start-up log."""
        path = f"our {self.kernel.variant} kernels" if self.uses_kernels else "plain torch"
        kv = dtype_name(self.kv_cache) + (f" ({self.kv_bytes_per_token(model):,} bytes per token)" if model else "")
        line = (f"precision: compute {dtype_name(self.compute)}, weights {self.weight_mode} ({path}, "
                f"{self.products} products), K/V {kv}, on {self.device}")
        return line + "".join(f"; {r}" for r in self.reasons)


def resolve_precision(
    load: LoadConfig,
    cache: CacheConfig | None = None,
    *,
    kernel: kernels_build.KernelInfo | None = None,
    native_bf16: bool | None = None,
) -> ResolvedPrecision:
    """The precision `load` and `cache` ask for on this machine; ValueError for a pair it cannot
    run (w8a8 without our kernels' integer dot product, weights wider than the compute dtype).

    `kernel` (default: this process's, built on first use, so the compile happens at start-up and
    never under a request) and `native_bf16` (default: what oneDNN reports, asked only when it
    matters) stand in for the machine in tests.

    compute, dtype "auto": on a CPU where our kernels load, float32, the kernels' activations; the
    weights are then 16-bit, so a decode step still reads half of float32's bytes, and on
    AVX512-BF16 the products run in bf16 (vdpbf16ps, oneDNN) with float32 sums. Measured on Zen 5
    the one-call decode step beat bf16 F.linear per operator; see kernels/linear.py. Without the
    kernels: bfloat16 where the CPU has native bf16 (AVX512-BF16 / AMX), else float32 (on an
    AVX2-only CPU bf16 products are emulated, measured 4-50x slower). A GPU: bfloat16, else float16.

    weights, weight_dtype "auto": when dtype was "auto" and our kernels load (compute float32),
    the kernel variant's 16-bit type (KernelInfo.auto_weight_dtype): bfloat16 on AVX512-BF16,
    whose products vdpbf16ps and oneDNN run at 2-5x float32's rate; float16 on AVX2, where both
    are widened to float32 anyway and float16 keeps 3 more mantissa bits (weights sit well inside
    its range). A decode step reads every weight once, and 16 bits are half the bytes. Otherwise
    the compute dtype, so an explicit dtype="float32" (the exact-match tests) keeps float32 weights,
    and without the kernels nothing is slower than before. Weights are never stored wider than
    they are computed in.

    K/V, cache_dtype "auto": float16 where "auto" weights are 16-bit: decode attention reads every
    cached K and V once per step, and at 32 sequences of ~300 tokens that was ~18% of a step in
    float32. Otherwise the compute dtype, so dtype="float32" keeps a float32 cache.
    """
    cache = cache or CacheConfig()
    kernel = kernels_build.kernel_info() if kernel is None else kernel
    device = torch.device(load.device).type
    reasons: list[str] = []
    if not kernel.available:
        reasons.append(f"no CPU kernels ({kernel.reason})")
    elif kernel.reason:
        reasons.append(f"kernels {kernel.variant} ({kernel.reason})")

    if load.dtype != "auto":
        compute = _DTYPES[load.dtype]  # a name LoadConfig has checked
    elif device == "cuda":
        compute = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    elif device == "cpu" and kernel.available:
        compute = torch.float32
    else:
        native = cpu_has_native_bf16() if native_bf16 is None else native_bf16
        compute = torch.bfloat16 if native else torch.float32
        if device == "cpu":
            reasons.append(f"dtype auto computes in {dtype_name(compute)} without our kernels "
                           + ("(the CPU has native bf16)" if native else "(no native bf16 on this CPU)"))
    uses_kernels = compute == torch.float32 and device == "cpu" and kernel.available
    if device == "cpu" and kernel.available and not uses_kernels:
        reasons.append(f"compute {dtype_name(compute)}: our kernels take float32 activations, so plain torch runs")
    # "auto" storage is 16-bit where compute is float32 only because our kernels load.
    auto_16bit = load.dtype == "auto" and uses_kernels

    if load.weight_dtype == "auto":
        weight_mode = kernel.auto_weight_dtype if auto_16bit else dtype_name(compute)
    else:
        weight_mode = load.weight_dtype
    if weight_mode == "w8a8" and not kernel.int8_dot:
        have = [w for w in WEIGHT_DTYPES if w != "w8a8"]
        raise ValueError(f"weight_dtype w8a8 needs the integer dot product of our kernels (avx512 or avx2 variant); "
                         f"this machine's kernels are {kernel.variant}: use one of {', '.join(have)}")
    weights = _WEIGHT_DTYPES[weight_mode]  # a name LoadConfig has checked
    if weights.itemsize > compute.itemsize:
        raise ValueError(f"weight_dtype {load.weight_dtype} is wider than the compute dtype {dtype_name(compute)}: "
                         "store weights in the compute dtype or in fewer bits")
    if weights != compute and not uses_kernels:
        reasons.append(f"{weight_mode} weights with {dtype_name(compute)} compute: no kernel, dequantized per call")

    if cache.cache_dtype == "auto":
        kv = torch.float16 if auto_16bit else compute
    else:
        kv = _KV_DTYPES[cache.cache_dtype]
    bf16_products = weights == torch.bfloat16 and uses_kernels and kernel.bf16_dot
    bf16_attention = uses_kernels and kernel.bf16_dot and (bf16_products or weight_mode == "w8a8")
    return ResolvedPrecision(compute, weights, weight_mode, kv, kernel, uses_kernels, bf16_products, bf16_attention,
                             load.device, tuple(reasons))


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN computes bf16 natively here (AVX512-BF16 / AMX), not emulated."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def dtype_name(dtype: torch.dtype) -> str:
    """"torch.bfloat16" -> "bfloat16": the name the flags and the logs use."""
    return "int4" if dtype == INT4 else str(dtype).removeprefix("torch.")
