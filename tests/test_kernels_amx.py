"""The amx kernel variant (csrc/amx.h): the panel products run on AMX tiles.
w8a8's (from 2 rows) are the avx512 variant's bits at every row count (exact integer sums, the
same float32 steps after them), down to the engine's tokens and logprobs; bf16's (every row
count, K a whole number of 32-value tiles) hold to the float32 sums' bound and give each row the
same bits at every row count. (SiLU(gate) * up from the tiles, bf16's and w8a8's, is tested with
every variant's in test_kernels_linear.py.) The avx512 variant of the same build runs in a child
process (INFERLAB_KERNELS=avx512). Skipped where this process has no amx variant, naming what is
missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inferlab import LLM, SamplingParams
from inferlab.kernels import build
from inferlab.kernels.linear import WeightOnlyLinear
from inferlab.models.testing import make_tiny_hf_model

_missing = sorted(set(build.VARIANTS["amx"][0]) - build.cpu_flags())
pytestmark = pytest.mark.skipif(
    not build.kernel_info().amx,
    reason=(f"needs the amx kernel variant: this CPU lacks {', '.join(_missing)}" if _missing else
            f"needs the amx kernel variant; this process has {build.kernel_info().variant} "
            f"({build.kernel_info().reason or os.environ.get('INFERLAB_KERNELS', 'auto')})"))

SHAPES = [(37, 576), (960, 576), (50, 1536), (20, 64), (33, 130)]  # 130: K not a whole tile (bf16 stays on vdpbf16ps)
ROWS = [1, 2, 8, 15, 16, 17, 31, 32, 33, 48, 64, 100, 300]


def _in_avx512_child(code: str) -> None:
    env = {**os.environ, "INFERLAB_KERNELS": "avx512"}
    proc = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                           + code], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]


def w8a8_products() -> dict[tuple[int, int, int], torch.Tensor]:
    """Every SHAPES x ROWS w8a8 product (bias, a 30x outlier channel) on this process's kernels."""
    out = {}
    for n, k in SHAPES:
        g = torch.Generator().manual_seed(n * k)
        lin = WeightOnlyLinear(torch.randn(n, k, generator=g) * 0.05, torch.int8, torch.randn(n, generator=g),
                               int8_activations=True)
        for m in ROWS:
            x = torch.randn(m, k, generator=g)
            x[:, 1] *= 30
            out[(n, k, m)] = lin(x)
    return out


def test_w8a8_tiles_give_the_avx512_variants_bits(tmp_path):
    _in_avx512_child(f"import torch, test_kernels_amx as t; from inferlab.kernels import build; "
                     f"assert build.kernel_info().variant == 'avx512'; "
                     f"torch.save(t.w8a8_products(), {str(tmp_path / 'y.pt')!r})")
    theirs, ours = torch.load(tmp_path / "y.pt"), w8a8_products()
    assert ours.keys() == theirs.keys()
    for case, y in ours.items():
        assert torch.equal(y, theirs[case]), case


def bf16_products() -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
    """Per SHAPES case, this process's bf16 products of max(ROWS) rows at once and of one row at a time."""
    out = {}
    for n, k in SHAPES:
        g = torch.Generator().manual_seed(n + k)
        lin = WeightOnlyLinear(torch.randn(n, k, generator=g) * 0.05, torch.bfloat16, torch.randn(n, generator=g))
        x = torch.randn(max(ROWS), k, generator=g)
        out[(n, k)] = lin(x), torch.cat([lin(x[i:i + 1]) for i in range(len(x))])
    return out


def test_bf16_tiles_hold_to_float32_sums_and_give_a_row_one_answer_at_every_row_count(tmp_path):
    _in_avx512_child(f"import torch, test_kernels_amx as t; torch.save(t.bf16_products(), {str(tmp_path / 'y.pt')!r})")
    theirs = torch.load(tmp_path / "y.pt")
    for (n, k), (every, one_by_one) in bf16_products().items():
        g = torch.Generator().manual_seed(n + k)
        lin = WeightOnlyLinear(torch.randn(n, k, generator=g) * 0.05, torch.bfloat16, torch.randn(n, generator=g))
        x = torch.randn(max(ROWS), k, generator=g)
        xb, w = x.bfloat16().double(), lin.dequantized().double()
        want = xb @ w.T + lin.bias.double()
        bound = k * 2.0**-23 * (xb.abs() @ w.abs().T) + 2.0**-22 * want.abs()  # float32 sums over k, then the bias
        assert bool(((every.double() - want).abs() <= bound).all()), (n, k)
        torch.testing.assert_close(one_by_one, every, rtol=0, atol=0, msg=f"{(n, k)} one row at a time")
        for m in ROWS:
            torch.testing.assert_close(lin(x[:m]), every[:m], rtol=0, atol=0, msg=f"{(n, k)} {m} rows")
        if k % 32 == 0:  # the tiles ran: their sums round differently from vdpbf16ps's somewhere
            assert not torch.equal(every, theirs[(n, k)][0]), (n, k)
        else:  # K not a whole number of tiles: vdpbf16ps, the avx512 variant's bits
            torch.testing.assert_close(every, theirs[(n, k)][0], rtol=0, atol=0)


def w8a8_engine_outputs(model_dir: str) -> list:
    """Greedy tokens and logprobs of 20 prompts at once (prefills and decode steps of 16+ rows)
    on this process's kernels: the one-call decode step, the fused operators and plain ones."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (int(n),), generator=g).tolist() for n in torch.randint(2, 60, (20,), generator=g)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    out = []
    for backend in ("step", "fused", "eager"):
        llm = LLM(model_dir, weight_dtype="w8a8", num_kv_blocks=256, decoder_backend=backend)
        for r in llm.generate(prompts, params):
            c = r.outputs[0]
            out.append((c.token_ids, [(t.token_id, t.logprob, [(x.token_id, x.logprob) for x in top])
                                      for t, top in c.logprobs]))
    return out


def test_w8a8_engine_on_tiles_gives_the_avx512_variants_tokens_and_logprobs(tmp_path):
    model = make_tiny_hf_model(tmp_path / "m", arch="llama")
    _in_avx512_child(f"import torch, test_kernels_amx as t; "
                     f"torch.save(t.w8a8_engine_outputs({str(model)!r}), {str(tmp_path / 'o.pt')!r})")
    assert w8a8_engine_outputs(str(model)) == torch.load(tmp_path / "o.pt")


