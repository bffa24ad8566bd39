"""`inferlab perplexity`: llama-perplexity's measurement on our engine.

    inferlab perplexity -m MODEL -f TEXT [-c 512] [-b 2048] [--chunks N]
    inferlab perplexity ... --kl-divergence-base base.safetensors                  # save the base
    inferlab perplexity -m OTHER ... --kl-divergence-base base.safetensors --kl-divergence
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from inferlab.engine.engine_args import PRECISION, EngineArgs


def add_text_arguments(p: argparse.ArgumentParser, batch_help: str) -> None:
    """The flags `perplexity` and `quant-report` share: the text, its chunks, the threads."""
    p.add_argument("-f", "--file", required=True, help="the text to score (UTF-8)")
    p.add_argument("-c", "--ctx-size", type=int, default=512, help="tokens per chunk; the second half is scored (default 512)")
    p.add_argument("-b", "--batch-size", type=int, default=2048, help=batch_help)
    p.add_argument("--chunks", type=int, default=-1, help="score at most this many chunks (default: all)")
    p.add_argument("-t", "--threads", type=int, default=None, help="torch threads (default: torch's)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(p, only=PRECISION)
    add_text_arguments(p, "tokens per engine step: b / c chunks at once (default 2048, llama-perplexity's)")
    p.add_argument("--kl-divergence-base", default=None, metavar="FILE",
                   help="without --kl-divergence: save this model's distribution here; with it: read it")
    p.add_argument("--kl-divergence", action="store_true", help="compare with the base in --kl-divergence-base")
    p.add_argument("--kld-top-k", type=int, default=1024,
                   help="log-probs kept per token in a saved base (default 1024; the rest as one bin)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object (progress on stderr)")


def run(args: argparse.Namespace) -> int:
    from inferlab.entrypoints.llm import LLM
    from inferlab.quality.base_file import BaseIdentity, load_base, save_base, tokens_sha256
    from inferlab.quality.kld import KldAccumulator, base_rows, format_summary, token_stats
    from inferlab.quality.perplexity import PerplexityAccumulator, make_chunks
    from inferlab.quality.scoring import score_chunks

    if args.kl_divergence and not args.kl_divergence_base:
        raise ValueError("--kl-divergence needs --kl-divergence-base FILE (the base model's saved distribution)")
    if args.ctx_size < 4 or args.batch_size < 1:
        raise ValueError("-c must be >= 4 and -b >= 1")
    with open(args.file, encoding="utf-8") as f:
        text = f.read()
    t0 = time.perf_counter()
    n_ctx = args.ctx_size
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(
        args, max_model_len=n_ctx + 1, max_num_batched_tokens=max(args.batch_size, n_ctx),
        max_num_seqs=max(1, args.batch_size // n_ctx), enable_prefix_caching=False, num_threads=args.threads))
    tok = llm.get_tokenizer()
    if tok is None:
        raise ValueError("this model has no tokenizer, so it cannot read a text")
    tokens = tok.encode(text, add_special_tokens=True)
    bos = tok.bos_token_id if tok.add_bos_token else None
    chunking, chunks = make_chunks(tokens, n_ctx, args.chunks, bos)
    vocab = llm.engine.model_config.vocab_size
    identity = BaseIdentity(vocab, n_ctx, chunking.n_chunks, tokens_sha256(chunks), llm.engine.model_name)
    base = load_base(args.kl_divergence_base, identity) if args.kl_divergence else None
    saving = args.kl_divergence_base is not None and not args.kl_divergence
    per_step = max(1, args.batch_size // n_ctx)
    t_load = time.perf_counter() - t0
    log = sys.stderr if args.json else sys.stdout
    precision = llm.engine.runner.model.describe_precision()
    print(f"perplexity: {len(tokens)} tokens, {chunking.n_chunks} chunks of {n_ctx}, {chunking.scored_per_chunk} "
          f"scored per chunk, {per_step} chunks per step; {precision}", file=sys.stderr)

    from tqdm import tqdm

    acc, kacc, saved = PerplexityAccumulator(), KldAccumulator(), []
    t1 = time.perf_counter()
    bar = tqdm(total=chunking.n_chunks, unit="chunk", file=sys.stderr, dynamic_ncols=True)
    line: list[str] = []
    for score in score_chunks(llm, chunks, chunking, per_step, whole_rows=base is not None or saving):
        acc.add(score.nll)
        n = score.index + 1
        if base is not None:
            s = chunking.scored_per_chunk
            kacc.add(token_stats(score.rows, score.targets, base.rows(score.index * s, n * s)))
            sm = kacc.summary()
            line.append(f"{n:4d}    {sm.ppl[0]:9.4f} \u00b1 {sm.ppl[1]:9.4f}    {sm.ln_ppl_ratio[0]:10.5f} \u00b1 "
                        f"{sm.ln_ppl_ratio[1]:10.5f}    {sm.kld[0]:10.5f} \u00b1 {sm.kld[1]:10.5f}    "
                        f"{100 * sm.p_diff_rms[0]:6.3f} \u00b1 {100 * sm.p_diff_rms[1]:6.3f} %    "
                        f"{100 * sm.same_top[0]:6.3f} \u00b1 {100 * sm.same_top[1]:6.3f} %")
        else:
            line.append(f"[{n}]{acc.ppl:.4f},")
            if saving:
                saved.append(base_rows(score.rows, score.targets, args.kld_top_k))
        bar.update(1)
        bar.set_postfix_str(f"PPL {acc.ppl:.4f}")
        if n % per_step == 0 or n == chunking.n_chunks:
            if base is not None and n == per_step:
                bar.write("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
                          "              \u0394p RMS            Same top p", file=log)
            bar.write(("\n" if base is not None else "").join(line), file=log)
            line = []
    bar.close()
    t_score = time.perf_counter() - t1
    if saving:
        from inferlab.quality.kld import BaseRows

        save_base(args.kl_divergence_base, identity, BaseRows.concat(saved), args.kld_top_k)
        print(f"perplexity: saved the base distribution (top {args.kld_top_k}) to {args.kl_divergence_base}", file=sys.stderr)
    result = {
        "model": llm.engine.model_name,
        "precision": precision,
        "tokens": len(tokens),
        "n_ctx": n_ctx,
        "chunks": chunking.n_chunks,
        "scored_tokens": acc.count,
        "ppl": acc.ppl,
        "ppl_error": acc.ppl_error,
        "seconds": {"load": round(t_load, 3), "score": round(t_score, 3)},
        "tokens_per_second": round(chunking.n_chunks * n_ctx / t_score, 1),
    }
    if base is not None:
        sm = kacc.summary()
        result["kl_divergence"] = {k: v for k, v in sm.__dict__.items()}
    if args.json:
        json.dump(result, sys.stdout, indent=2, default=float)
        print()
        return 0
    print()
    if base is not None:
        print("\n".join(format_summary(kacc.summary())))
    elif math.isnan(acc.ppl_error):
        print(f"Final estimate: PPL = {acc.ppl:.4f} (no spread to estimate an error from)")
    else:
        print(f"Final estimate: PPL = {acc.ppl:.4f} +/- {acc.ppl_error:.5f}")
    print(f"perplexity: {t_score:.1f} s scoring ({result['tokens_per_second']} tokens/s), {t_load:.1f} s loading",
          file=sys.stderr)
    return 0
