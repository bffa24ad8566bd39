"""How much the KL-divergence base file's top-K truncation changes the KLD, measured.

Scores the first --chunks chunks of a text with two models on our engine (whole log-softmax
rows), then the mean KLD(base || Q) three ways: exact over the whole vocabulary; over the
top K + one "rest" bin (our base file, for several K); and llama-perplexity's (only base
log-probs above -16 summed, no rest bin). Run:

    PYTHONPATH=src python benchmarks/kld_topk.py BASE.gguf Q.gguf TEXT [--chunks 4]
"""

from __future__ import annotations

import argparse

import numpy as np

from inferlab.entrypoints.llm import LLM
from inferlab.quality.kld import base_rows, token_stats
from inferlab.quality.perplexity import make_chunks
from inferlab.quality.scoring import score_chunks


def rows_of(model: str, text: str, n_ctx: int, chunks: int) -> tuple[np.ndarray, np.ndarray]:
    llm = LLM(model, dtype="float32", max_model_len=n_ctx + 1, max_num_batched_tokens=chunks * n_ctx, max_num_seqs=chunks,
              enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    chunking, cs = make_chunks(tok.encode(text), n_ctx, chunks, tok.bos_token_id if tok.add_bos_token else None)
    scores = list(score_chunks(llm, cs, chunking, chunks, whole_rows=True))
    return np.concatenate([s.rows for s in scores]), np.concatenate([s.targets for s in scores])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("base")
    p.add_argument("q")
    p.add_argument("text")
    p.add_argument("-c", type=int, default=512)
    p.add_argument("--chunks", type=int, default=4)
    args = p.parse_args()
    text = open(args.text, encoding="utf-8").read()
    rb, targets = rows_of(args.base, text, args.c, args.chunks)
    rq, _ = rows_of(args.q, text, args.c, args.chunks)
    pb = np.exp(rb.astype(np.float64))
    exact = (pb * (rb.astype(np.float64) - rq)).sum(1)
    keep = rb > -16.0
    llama_way = np.where(keep, pb * (rb.astype(np.float64) - rq), 0.0).sum(1)
    print(f"{rb.shape[0]} scored tokens, vocab {rb.shape[1]}; base entries above -16 per token: "
          f"mean {keep.sum(1).mean():.0f}, max {keep.sum(1).max()}")
    print(f"exact KLD                          : {exact.mean():.6f}")
    print(f"llama-perplexity's (-16 cut-off)   : {llama_way.mean():.6f} ({100 * (llama_way.mean() / exact.mean() - 1):+.2f}%)")
    for k in (64, 256, 1024, 4096):
        b = base_rows(rb, targets, k)
        kld = token_stats(rq, targets, b).kld
        mass = np.exp(b.rest_logprob.astype(np.float64))
        print(f"top {k:5d} + rest bin (mean tail {mass.mean():.2e}): {kld.mean():.6f} "
              f"({100 * (kld.mean() / exact.mean() - 1):+.2f}%), {8 * k / 1024:.1f} KiB per token")


if __name__ == "__main__":
    main()
