"""Our model's rows against llama-perplexity's own base file (`--kl-divergence-base`), with
llama-perplexity's per-token KLD (base log-probs above -16 summed), to tell the statistics
apart from the two engines' arithmetic: KLD(llama F16 || our F16) is the floor that comes from
the engines alone; KLD(llama F16 || our Q4_1) sits beside llama's own Q4_1 figure.

Their file, as their perplexity.cpp writes it: "_logits_", n_ctx, n_vocab, n_chunk (int32),
the chunks' token ids (int32), then per chunk and scored token a row of 2 * ceil(n_vocab / 2) + 4
uint16: two float32 (scale, min log-prob) and the log-probs quantized as min + scale * q.

    PYTHONPATH=src python benchmarks/kld_vs_llama_base.py MODEL.gguf TEXT llama.kld [--chunks N] [--weight-dtype int4]
"""

from __future__ import annotations

import argparse

import numpy as np

from inferlab.entrypoints.llm import LLM
from inferlab.quality.kld import mean_and_error
from inferlab.quality.perplexity import make_chunks
from inferlab.quality.scoring import score_chunks


def read_llama_base(path: str):
    with open(path, "rb") as f:
        assert f.read(8) == b"_logits_", "not a llama-perplexity logits file"
        n_ctx, n_vocab, n_chunk = np.frombuffer(f.read(12), dtype="<i4")
        tokens = np.frombuffer(f.read(4 * n_chunk * n_ctx), dtype="<i4").reshape(n_chunk, n_ctx)
    nv = 2 * ((n_vocab + 1) // 2) + 4
    rows = np.memmap(path, dtype="<u2", mode="r", offset=20 + 4 * n_chunk * n_ctx)
    per_chunk = n_ctx - 1 - n_ctx // 2
    return int(n_ctx), int(n_vocab), int(n_chunk), tokens, rows.reshape(n_chunk, per_chunk, nv)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("text")
    p.add_argument("llama_base")
    p.add_argument("--chunks", type=int, default=-1)
    p.add_argument("--dtype", default="float32", help="our compute dtype (float32: no activation rounding)")
    p.add_argument("--weight-dtype", default="auto",
                   help="our weight mode (int4 on a Q4_1 file: its codes, x rounded to int8 per 32 as llama.cpp's Q8_1)")
    p.add_argument("--step-tokens", type=int, default=2048,
                   help="tokens per engine step (chunked prefill): below 128 every product runs the decode "
                        "kernels (int4: x rounded to int8 per 32), as generated tokens meet them")
    args = p.parse_args()
    n_ctx, n_vocab, n_chunk, tokens, rows = read_llama_base(args.llama_base)
    n = n_chunk if args.chunks < 0 else min(args.chunks, n_chunk)
    llm = LLM(args.model, dtype=args.dtype, weight_dtype=args.weight_dtype, max_model_len=n_ctx + 1, max_num_batched_tokens=args.step_tokens, max_num_seqs=4,
              enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    chunking, chunks = make_chunks(tok.encode(open(args.text, encoding="utf-8").read()), n_ctx, n,
                                   tok.bos_token_id if tok.add_bos_token else None)
    print(f"token ids equal to llama-perplexity's: {np.array_equal(np.asarray(chunks), tokens[:n])}")
    klds, same = [], []
    for s in score_chunks(llm, chunks, chunking, 4, whole_rows=True):
        raw = np.asarray(rows[s.index])
        head = raw[:, :4].copy().view("<f4")  # two float32 per row
        scale, lo = head[:, 0:1].astype(np.float64), head[:, 1:2].astype(np.float64)
        lb = scale * raw[:, 4 : 4 + n_vocab] + lo
        keep = lb > -16.0
        klds.append(np.where(keep, np.exp(lb) * (lb - s.rows), 0.0).sum(1))
        same.append(s.rows.argmax(1) == lb.argmax(1))
    kld = np.concatenate(klds)
    m, e = mean_and_error(kld)
    print(f"{args.model}: {kld.size} tokens, KLD(llama base || ours) = {m:.6f} +/- {e:.6f}, "
          f"median {np.median(kld):.6f}, same top p {100 * np.concatenate(same).mean():.3f} %")


if __name__ == "__main__":
    main()
