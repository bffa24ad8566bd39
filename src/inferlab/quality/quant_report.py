"""The quantization report's measuring: every precision mode's quality and speed in one run.

The float32 base (`--dtype float32`: weights, compute and K/V in float32) is scored first and its
distribution over the scored tokens kept in memory, summarized as a KL-divergence base file
would be (kld.base_rows, top-K + a rest bin), so every other mode is compared with the same
numbers (base and modes on the same machine, the same text, the same chunks).

The chunks are scored the way generated tokens are computed, not the way a long prompt is: in
pieces of `piece` tokens (the scheduler's long_prefill_token_threshold) small enough that a
step's rows (chunks per step x piece) stay under kernels/linear.py's MKL_MIN_ROWS, so every
linear runs the decode-size kernels (w8a8's int8-quantized x, vdpbf16ps) rather than the
prefill GEMM (oneDNN bf16 on converted tiles), and every piece after the first attends over K/V
read back from the cache in its dtype. Prefilled in one step, a chunk attends over its fresh
float32 K/V and multiplies through the GEMM: every K/V dtype then scored the same, and w8a8 the
same as int8 (measured). Each mode's engine is built, scores the chunks (perplexity, KLD vs the
base, same top token) and is freed before the next one is built; then the modes take turns at
the decode speed test (report_speed.alternated_speeds), so only one model is in memory at a
time. The result is a plain JSON-ready document; rendering is report_render.py's job.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from inferlab.kernels.linear import MKL_MIN_ROWS
from inferlab.quality.kld import BaseRows, KldAccumulator, KldSummary, base_rows, token_stats
from inferlab.quality.perplexity import Chunking, make_chunks
from inferlab.quality.report_modes import Mode, Skipped
from inferlab.quality.report_speed import Speed, SpeedSettings, alternated_speeds
from inferlab.quality.scoring import score_chunks


@dataclass(frozen=True)
class ReportSettings:
    model: str | None
    text_path: str
    n_ctx: int = 512
    chunks: int = -1
    batch_size: int = 2048  # tokens per scoring step: batch_size // n_ctx chunks at once
    kld_top_k: int = 1024
    threads: int | None = None
    block_size: int = 16
    speed: SpeedSettings = field(default_factory=SpeedSettings)

    @property
    def chunks_per_step(self) -> int:
        """Chunks scored side by side (batch_size / n_ctx, as llama-perplexity), each one piece per step."""
        return max(1, min(self.batch_size // self.n_ctx, MKL_MIN_ROWS - 1))

    @property
    def piece(self) -> int:
        """Prompt tokens per chunk per step: chunks_per_step pieces under MKL_MIN_ROWS rows, and at
        most half a chunk (the scored half then always reads the cache)."""
        return max(1, min(self.n_ctx // 2, (MKL_MIN_ROWS - 1) // self.chunks_per_step))


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """The CPU, our kernels' variant and flags, threads and the load average (a loaded machine's
    speeds are not a quiet one's)."""
    from inferlab.kernels.build import kernel_info

    info = kernel_info()
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "kernels": info.variant, "kernels_line": info.describe(), "cpu_flags": list(info.cpu_flags),
            "torch": torch.__version__, "python": platform.python_version(),
            "load_average_start": [round(x, 2) for x in os.getloadavg()]}


def kv_bytes_per_token(runner) -> float:
    """K/V bytes per token slot: the runner's own figure where it has one (scales included), else
    the bytes of the pool it allocated (tensors, or cache objects with .nbytes) over its slots."""
    reported = getattr(runner, "kv_bytes_per_token", None)
    if isinstance(reported, (int, float)):
        return float(reported)

    def nbytes(x) -> int:
        if isinstance(x, (list, tuple)):
            return sum(nbytes(y) for y in x)
        return int(getattr(x, "nbytes", 0))

    return nbytes(runner.kv_caches) / (runner.num_blocks * runner.block_size)


def json_ready(x: Any) -> Any:
    """The document with NaN / inf as null (strict JSON) and numpy scalars as plain numbers."""
    if isinstance(x, dict):
        return {k: json_ready(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_ready(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, (str, int)):
        return x
    try:
        f = float(x)
    except (TypeError, ValueError):
        return str(x)
    return f if math.isfinite(f) else None


def _build(mode: Mode, s: ReportSettings):
    from inferlab.entrypoints.llm import LLM

    blocks = lambda tokens: -(-tokens // s.block_size)  # noqa: E731
    need = max(s.chunks_per_step * blocks(s.n_ctx + 1),
               s.speed.streams * blocks(s.speed.prompt_tokens + s.speed.output_tokens + 1))
    return LLM(s.model, dtype=mode.dtype, weight_dtype=mode.weight_dtype, kv_cache_dtype=mode.kv_cache_dtype,
               max_model_len=max(s.n_ctx + 1, s.speed.prompt_tokens + s.speed.output_tokens + 1),
               max_num_batched_tokens=max(s.batch_size, s.n_ctx, s.speed.tokens_per_step),
               max_num_seqs=max(s.chunks_per_step, s.speed.streams), block_size=s.block_size,
               long_prefill_token_threshold=s.piece,  # decode-size steps reading the cache (see above)
               num_kv_blocks=need + 2, enable_prefix_caching=True, num_threads=s.threads)  # scoring never uses it


def _finite(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def _facts(llm) -> dict[str, Any]:
    """What a row says of a mode's built engine (kept once the engine is freed)."""
    model = llm.engine.runner.model
    return {"precision": model.describe_precision(), "weight_bytes": int(model.weight_nbytes),
            "decode_weight_bytes": int(model.decode_weight_nbytes),
            "kv_bytes_per_token": kv_bytes_per_token(llm.engine.runner)}


def _row(mode: Mode, facts: dict[str, Any], summary: KldSummary, speed: Speed, seconds: dict[str, float]) -> dict[str, Any]:
    return {
        "label": mode.label, "kind": mode.kind,
        "engine_args": {"dtype": mode.dtype, "weight_dtype": mode.weight_dtype, "kv_cache_dtype": mode.kv_cache_dtype},
        "compute": mode.compute, "weights": mode.weights, "kv": mode.kv,
        **facts,
        "ppl": summary.ppl[0], "ppl_error": _finite(summary.ppl[1]),
        "ppl_change_pct": 100 * (summary.ppl_ratio[0] - 1), "ppl_change_pct_error": 100 * summary.ppl_ratio[1],
        "kld_mean": summary.kld[0], "kld_mean_error": summary.kld[1],
        "kld_p99": summary.kld_percentiles["99.0"], "kld_median": summary.kld_percentiles["median"],
        "kld_max": summary.kld_percentiles["max"],
        "same_top_pct": 100 * summary.same_top[0], "same_top_pct_error": 100 * summary.same_top[1],
        "p_diff_rms_pct": 100 * summary.p_diff_rms[0],
        "decode_tps_1": speed.one_stream, "decode_tps_n": speed.streams,
        "decode_tps_1_runs": speed.one_stream_runs, "decode_tps_n_runs": speed.streams_runs,
        "kl_divergence": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(summary).items()},
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
    }


def _chunks(llm, text: bytes, s: ReportSettings) -> tuple[Chunking, list[list[int]], dict[str, Any]]:
    """The text's chunks (with the base engine's tokenizer: every mode shares it) and their facts;
    TextTooShortError naming the token counts."""
    tok = llm.get_tokenizer()
    if tok is None:
        raise ValueError("this model has no tokenizer, so it cannot read a text")
    tokens = tok.encode(text.decode("utf-8"), add_special_tokens=True)
    chunking, chunks = make_chunks(tokens, s.n_ctx, s.chunks, tok.bos_token_id if tok.add_bos_token else None)
    facts = {"path": str(s.text_path), "sha256": hashlib.sha256(text).hexdigest(), "tokens": len(tokens),
             "n_ctx": s.n_ctx, "chunks": chunking.n_chunks, "scored_tokens": chunking.n_chunks * chunking.scored_per_chunk,
             "kld_top_k": s.kld_top_k, "chunks_per_step": s.chunks_per_step, "piece_tokens": s.piece}
    return chunking, chunks, facts


def _score(llm, chunking: Chunking, chunks: list[list[int]], s: ReportSettings, base: BaseRows | None,
           on_chunk: Callable[[], object]) -> tuple[KldSummary, BaseRows]:
    """Every chunk's whole rows against the base; without a base (the base's own run) against
    the summary of its own rows, which reads KLD ~0 and 100% same top token: a check of the method."""
    kacc, parts = KldAccumulator(), []
    n = chunking.scored_per_chunk
    for score in score_chunks(llm, chunks, chunking, s.chunks_per_step, whole_rows=True):
        assert score.rows is not None  # whole_rows=True
        if base is None:
            ref = base_rows(score.rows, score.targets, s.kld_top_k)
            parts.append(ref)
        else:
            ref = base.rows(score.index * n, (score.index + 1) * n)
        kacc.add(token_stats(score.rows, score.targets, ref))
        on_chunk()
    return kacc.summary(), base if base is not None else BaseRows.concat(parts)


def measure(settings: ReportSettings, modes: list[Mode], skipped: list[Skipped],
            log: TextIO = sys.stderr) -> dict[str, Any]:
    """Measure every mode (modes[0] must be the float32 base); the report document."""
    from tqdm import tqdm

    if not modes or modes[0].kind != "base":
        raise ValueError("the float32 base must be the first mode")
    s = settings
    text = Path(s.text_path).read_bytes()
    if s.threads:
        torch.set_num_threads(s.threads)  # as every engine will: the header's figure
    machine = machine_info()
    skipped = list(skipped)
    rows: list[dict[str, Any]] = []
    base: BaseRows | None = None
    chunking: Chunking | None = None
    chunks: list[list[int]] = []
    facts: dict[str, Any] = {}
    bar = None
    model_name = ""
    scored: list[tuple[Mode, dict[str, Any], KldSummary, dict[str, float]]] = []  # what the rows need
    for mode in modes:
        t0 = time.perf_counter()
        try:
            llm = _build(mode, s)
        except ValueError as e:  # the loader's refusal of a mode this machine cannot run
            if mode.kind == "base":
                raise
            skipped.append(Skipped(mode.label, str(e)))
            if bar is not None and chunking is not None:
                bar.update(chunking.n_chunks + 2 * s.speed.runs)
            continue
        t_load = time.perf_counter() - t0
        if chunking is None:
            chunking, chunks, facts = _chunks(llm, text, s)
            model_name = llm.engine.model_name
            bar = tqdm(total=len(modes) * (chunking.n_chunks + 2 * s.speed.runs), unit="step", file=log,
                       dynamic_ncols=True)
        assert bar is not None
        bar.set_description(mode.label)
        t1 = time.perf_counter()
        summary, base = _score(llm, chunking, chunks, s, base, bar.update)
        scored.append((mode, _facts(llm), summary, {"load": t_load, "score": time.perf_counter() - t1}))
        bar.write(f"quant-report: {mode.label}: PPL {summary.ppl[0]:.4f}, KLD {summary.kld[0]:.6f}, "
                  f"same top {100 * summary.same_top[0]:.2f}%; {scored[-1][1]['precision']}", file=log)
        del llm  # one model in memory at a time
        gc.collect()
    by_label = {mode.label: mode for mode, *_ in scored}
    speeds, speed_seconds = alternated_speeds(list(by_label), lambda label: _build(by_label[label], s), s.speed,
                                              on_run=bar.update if bar is not None else None)
    for mode, facts_, summary, seconds in scored:
        row = _row(mode, facts_, summary, speeds[mode.label], {**seconds, "speed": speed_seconds[mode.label]})
        rows.append(row)
        if bar is not None:
            bar.write(f"quant-report: {mode.label}: decode {row['decode_tps_1']:.1f} tok/s (1 stream), "
                      f"{row['decode_tps_n']:.1f} ({s.speed.streams} streams)", file=log)
    if bar is not None:
        bar.close()
    machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    return {"report": "inferlab quant-report",
            "created": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "model": model_name, "text": facts, "machine": machine, "speed_settings": asdict(s.speed),
            "rows": rows, "skipped": [asdict(x) for x in skipped]}
