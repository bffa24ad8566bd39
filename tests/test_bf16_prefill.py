"""The avx512 variant's bf16 prefill path: silu_mul and add_rms_norm_ in bf16, and every product's
output passed on in bf16 through a prefill-sized step: the same roundings as through float32
(bitwise), fewer conversions.
"""

from __future__ import annotations

import pytest
import torch

from inferlab import SamplingParams
from inferlab.config import CacheConfig, LoadConfig
from inferlab.engine.model_runner import ModelRunner
from inferlab.engine.outputs import ScheduledRequest
from inferlab.kernels import build
from inferlab.models import decoder
from inferlab.models.decoder import DecoderModel
from inferlab.models.dummy_loader import load_dummy
from inferlab.models.precision import resolve_precision
from inferlab.models.testing import tiny_model_config

pytestmark = pytest.mark.skipif(
    not build.kernel_info().bf16_dot,
    reason=f"needs the avx512 kernel variant (AVX512_BF16); this CPU runs {build.kernel_info().variant}")


def test_silu_mul_in_bf16_is_float32_rounded_once():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 2 * 200, generator=g) * 3).bfloat16()
    got = torch.ops.inferlab.silu_mul(x)
    assert got.dtype == torch.bfloat16
    want = torch.ops.inferlab.silu_mul(x.float()).bfloat16()
    assert torch.equal(got, want)


def test_add_rms_norm_takes_and_gives_bf16():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, 96, generator=g)
    r = torch.randn(20, 96, generator=g).bfloat16()
    w = torch.rand(96, generator=g) + 0.5
    ops = torch.ops.inferlab
    x1, x2 = x.clone(), x.clone()
    got = ops.add_rms_norm_(x1, r, w, 1e-5, True)
    want = ops.add_rms_norm_(x2, r.float(), w, 1e-5)
    assert got.dtype == torch.bfloat16 and torch.equal(x1, x2)
    assert torch.equal(got, want.bfloat16())


def test_bf16_step_gives_the_float32_path_bits(monkeypatch):
    """A 200-token prefill with bf16 weights: hidden states bitwise equal with the bf16 path on
    and off (off: MKL_MIN_ROWS out of reach, so the step converts around every operator), once the
    float32 path's o, gate/up and down outputs are rounded to bf16 as the bf16 path passes them on
    (x is rounded to bf16 inside every product either way: the panels' kernel); on the amx
    variant SiLU(gate) * up comes from the tiles in the bf16 path, the same bits."""
    cfg = tiny_model_config("llama", hidden_size=128, intermediate_size=384)
    cache = CacheConfig(block_size=16, num_blocks_override=32)
    runner = ModelRunner(cfg, load_dummy(cfg, torch.float32).weights,
                         resolve_precision(LoadConfig(dtype="float32", weight_dtype="bfloat16"), cache), cache)
    model: DecoderModel = runner.model
    assert model.bf16_products
    req = ScheduledRequest("r", list(range(3, 203)), 0, list(range(1, 14)), True, SamplingParams(), [], [])
    ids, positions, meta, _ = runner._prepare([], [req])
    ran: list[bool] = []
    real = model.layers[0].o.product_bf16  # (gate/up may go through product_silu_bf16: the amx variant)

    def spy(x):
        ran.append(True)
        return real(x)

    monkeypatch.setattr(model.layers[0].o, "product_bf16", spy)
    on = model.forward(ids, positions, runner.kv_caches, meta)
    assert ran  # the bf16 path ran
    monkeypatch.setattr(decoder, "MKL_MIN_ROWS", 10**9)
    for layer in model.layers:
        for lin in (layer.o, layer.gate_up, layer.down):
            monkeypatch.setattr(lin, "kernel", lambda x, real=lin.kernel: real(x).bfloat16().float())
    ran.clear()
    off = model.forward(ids, positions, runner.kv_caches, meta)
    assert not ran
    assert torch.equal(on, off)
