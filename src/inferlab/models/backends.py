"""`Backends`: which code runs the decoder's forward, attention and sampling, chosen once.

Three forward backends and two decode-attention backends are registered below. The engine asks
`select_backends` once (after `resolve_precision`, which says whether our kernels run this model)
and hands the frozen answer to the runner and the decoder, which branch on its fields and decide
nothing again (vLLM's attention selector is the pattern). A backend a setting asks for but this
model or machine cannot run is not an error: the selector takes the fastest correct one and
says why in one line, as the precision resolution does. Tests parametrize over the registry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferlab.config import ATTENTION_BACKENDS, DECODER_BACKENDS, ModelConfig
from inferlab.models.precision import ResolvedPrecision, dtype_name

__all__ = ["ATTENTION", "FORWARD", "Backends", "select_backends"]

# The K/V caches the paged decode-attention kernel (attention.cpp) reads (int8: codes + scales),
# and so the whole-step decode kernel (kernels/csrc/decoder_step.cpp), which runs its tasks.
PAGED_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)


@dataclass(frozen=True)
class ForwardBackend:
    """How the decoder's layers run."""

    name: str
    decode_step: bool  # a decode-only step is one DecoderStep call (every layer in C++)
    fused_layers: bool  # other steps' layers through the fused operators (kernels/csrc/fused.cpp)
    doc: str


@dataclass(frozen=True)
class AttentionBackend:
    """How decode rows attend over the paged cache (prefill attention follows the precision)."""

    name: str
    paged: bool  # our kernel reads K/V through the block tables; else SDPA over gathered, padded contexts
    doc: str


FORWARD = {b.name: b for b in (
    ForwardBackend("step", True, True, "decode-only steps in one kernel call, other steps through fused operators"),
    ForwardBackend("fused", False, True, "every step through fused operators (~9 per layer)"),
    ForwardBackend("eager", False, False, "plain torch operators (~25 per layer): the definition"),
)}
ATTENTION = {b.name: b for b in (
    AttentionBackend("paged", True, "the paged decode-attention kernel"),
    AttentionBackend("sdpa", False, "torch SDPA over contexts gathered from the blocks"),
)}
assert set(FORWARD) | {"auto"} == set(DECODER_BACKENDS) and set(ATTENTION) | {"auto"} == set(ATTENTION_BACKENDS)


@dataclass(frozen=True)
class Backends:
    """The answer for one engine: what each step runs (`select_backends`)."""

    forward: str  # the FORWARD entry chosen
    decode_step: bool
    fused_layers: bool  # False also where the model needs what the fused layer lacks (Qwen3's q/k norms)
    paged_decode: bool  # the ATTENTION entry chosen is "paged"
    fused_sampler: bool  # one sampling kernel call per step (engine/sampler.py), else torch operators
    reasons: tuple[str, ...] = ()  # why a faster backend was not taken, one sentence each

    @property
    def attention(self) -> str:
        return "paged" if self.paged_decode else "sdpa"

    def describe(self) -> str:
        layers = " (eager layers)" if FORWARD[self.forward].fused_layers and not self.fused_layers else ""
        line = (f"backends: forward {self.forward}{layers}, decode attention {self.attention}, "
                f"sampler {'kernel' if self.fused_sampler else 'torch'}")
        return line + "".join(f"; {r}" for r in self.reasons)

    def as_dict(self) -> dict[str, object]:
        return {"forward": self.forward, "decode_step": self.decode_step, "fused_layers": self.fused_layers,
                "decode_attention": self.attention, "fused_sampler": self.fused_sampler, "reasons": list(self.reasons)}


def select_backends(precision: ResolvedPrecision, model: ModelConfig, forward: str = "auto",
                    attention: str = "auto") -> Backends:
    """The fastest backends `precision` and `model` run, or the ones asked for where they can.

    The fused operators and the decode step take float32 activations on the CPU where our
    kernels loaded (`precision.uses_kernels`); the decode step also needs the paged attention
    kernel's block tables and a K/V dtype it reads; the fused layer rotates q and k right after
    the qkv product, which a per-head q/k norm (Qwen3) would have to precede (the decode step
    applies that norm itself).
    """
    reasons: list[str] = []
    kv = precision.kv_cache
    on_cpu = torch.device(precision.device).type == "cpu"
    paged_ok = on_cpu and precision.kernel.available and kv in PAGED_CACHE_DTYPES
    paged = paged_ok and attention != "sdpa"
    if attention == "paged" and not paged_ok:
        reasons.append(f"decode attention sdpa: the paged kernel needs our CPU kernels and one of "
                       f"{', '.join(dtype_name(d) for d in PAGED_CACHE_DTYPES)} K/V")

    name = forward if forward != "auto" else ("step" if precision.uses_kernels else "eager")
    want = FORWARD[name]
    fused = want.fused_layers and precision.uses_kernels and not model.qk_norm
    step = want.decode_step and precision.uses_kernels and paged
    if want.fused_layers and not precision.uses_kernels:
        reasons.append(f"forward {name} runs eager: the fused kernels take float32 activations on the CPU "
                       f"where our kernels load (here: {precision.products} products on {precision.device}, "
                       f"kernels {precision.kernel.variant})")
    elif want.fused_layers and not fused:
        reasons.append("layers eager: the fused layer cannot apply per-head q/k norms")
    if want.decode_step and precision.uses_kernels and not step:
        reasons.append("no decode-step kernel: it runs the paged decode attention, not sdpa")
    return Backends(name, step, fused, paged, on_cpu and precision.kernel.available, tuple(reasons))
