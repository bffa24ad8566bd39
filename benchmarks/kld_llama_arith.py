"""Why llama-perplexity's Q4_1 KLD is higher than ours: its activations are rounded too.

llama.cpp's CPU dot products round the activations to the weight's partner type first: to
float16 against F16 weights, to 8-bit blocks of 32 (Q8_1 / Q8_0: a float16 scale per block)
against Q4_1 and Q8_0 weights. Our engine (--dtype float32) multiplies float32 activations by the dequantized
weights. This wraps every linear of our model (layers and lm_head) with that rounding, F16 file
as the base and Q4_1 file as Q, and prints the exact mean KLD with and without it.

    PYTHONPATH=src python benchmarks/kld_llama_arith.py F16.gguf Q4_1.gguf TEXT [--chunks 8]
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import torch

from inferlab.entrypoints.llm import LLM
from inferlab.quality.kld import mean_and_error
from inferlab.quality.perplexity import make_chunks
from inferlab.quality.scoring import score_chunks


def round_f16(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()


def round_q8_blocks(x: torch.Tensor) -> torch.Tensor:
    """Blocks of 32 along the last dimension: scale = amax / 127 (stored as float16), round(x / scale)."""
    shape = x.shape
    b = x.reshape(-1, 32)
    d = (b.abs().amax(dim=1, keepdim=True) / 127.0).half().float()
    q = torch.where(d > 0, torch.round(b / d.clamp_min(1e-30)), torch.zeros_like(b)).clamp(-127, 127)
    return (q * d).reshape(shape)


class Rounded:
    """A linear whose input is rounded first; everything else (rows(), nbytes) passes through."""

    def __init__(self, inner, rounding):
        self.inner, self.rounding = inner, rounding

    def __call__(self, x):
        return self.inner(self.rounding(x))

    def __getattr__(self, name):
        return getattr(self.inner, name)


def patch(llm: LLM, layer_round, head_round) -> None:
    model = llm.engine.runner.model
    for i, layer in enumerate(model.layers):
        model.layers[i] = dataclasses.replace(layer, **{n: Rounded(getattr(layer, n), layer_round)
                                                        for n in ("qkv", "o", "gate_up", "down")})
    model.lm_head = Rounded(model.lm_head, head_round)


def rows(model: str, text: str, n_ctx: int, chunks: int, rounding: tuple | None) -> np.ndarray:
    llm = LLM(model, dtype="float32", max_model_len=n_ctx + 1, max_num_batched_tokens=2048, max_num_seqs=4, enable_prefix_caching=False)
    if rounding is not None:
        patch(llm, *rounding)
    tok = llm.get_tokenizer()
    chunking, cs = make_chunks(tok.encode(text), n_ctx, chunks, None)
    return np.concatenate([s.rows for s in score_chunks(llm, cs, chunking, 4, whole_rows=True)])


def kld(rb: np.ndarray, rq: np.ndarray) -> tuple[float, float]:
    k = (np.exp(rb.astype(np.float64)) * (rb.astype(np.float64) - rq)).sum(1)
    return mean_and_error(k)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("f16")
    p.add_argument("q4_1")
    p.add_argument("text")
    p.add_argument("--chunks", type=int, default=8)
    args = p.parse_args()
    text = open(args.text, encoding="utf-8").read()
    base = rows(args.f16, text, 512, args.chunks, None)
    q = rows(args.q4_1, text, 512, args.chunks, None)
    print(f"ours as is (float32 activations)          : KLD {kld(base, q)[0]:.6f} +/- {kld(base, q)[1]:.6f}")
    del q
    base_r = rows(args.f16, text, 512, args.chunks, (round_f16, round_f16))
    print(f"F16 base with float16-rounded activations : KLD vs ours as is {kld(base, base_r)[0]:.6f}")
    q_r = rows(args.q4_1, text, 512, args.chunks, (round_q8_blocks, round_q8_blocks))
    m, e = kld(base_r, q_r)
    print(f"both rounded as llama.cpp's CPU path does  : KLD {m:.6f} +/- {e:.6f}")


if __name__ == "__main__":
    main()
