"""The quantization report's outputs from its document (quant_report.measure): a markdown
table and a PNG of quality against one-stream decode speed (matplotlib, headless Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLUMNS = ("mode", "weights", "K/V", "PPL", "ΔPPL", "KLD mean", "KLD 99%", "same top-1", "weight MB",
           "K/V B/token", "decode tok/s, 1 stream", "decode tok/s, {n} streams")


def _pm(value: float | None, error: float | None, digits: int) -> str:
    if value is None:
        return "–"
    if error is None or error != error:
        return f"{value:.{digits}f}"
    return f"{value:.{digits}f} ± {error:.{digits}f}"


def _z(x: float, digits: int) -> float:
    """-0.0000001 shows as 0.000000, not -0.000000 (the base against itself)."""
    return 0.0 if abs(x) < 0.5 * 10**-digits else x


def table_rows(doc: dict[str, Any]) -> list[list[str]]:
    """One list of cells per measured row, in COLUMNS' order."""
    out = []
    for r in doc["rows"]:
        out.append([r["label"], r["weights"], r["kv"], _pm(r["ppl"], r["ppl_error"], 4),
                    f"{_z(r['ppl_change_pct'], 3):+.3f}%", _pm(_z(r["kld_mean"], 6), r["kld_mean_error"], 6),
                    f"{_z(r['kld_p99'], 5):.5f}",
                    f"{r['same_top_pct']:.2f}%", f"{r['weight_bytes'] / 1e6:.1f}", f"{r['kv_bytes_per_token']:.0f}",
                    f"{r['decode_tps_1']:.1f}", f"{r['decode_tps_n']:.1f}"])
    return out


def same_scores(doc: dict[str, Any]) -> list[str]:
    """A line for each pair of rows with the same weights and different K/V that score alike (PPL
    and mean KLD equal): a reader would otherwise take one of them for a stale or mislabelled row."""
    rows, out = doc["rows"], []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if a["weights"] == b["weights"] and a["kv"] != b["kv"] and (a["ppl"], a["kld_mean"]) == (b["ppl"], b["kld_mean"]):
                out.append(
                    f"- {a['label']} and {b['label']} score alike (PPL {a['ppl']:.4f}, KLD {a['kld_mean']:.6f}): the "
                    "pieces attend over K and V read back from the cache, and where prefill attention multiplies in "
                    "bf16 (the avx512 variant, beside bf16 or w8a8 weights) both are rounded to bf16 for the "
                    f"products, so a {a['kv']} and a {b['kv']} cache give the same products. Decode steps' "
                    "attention reads them as stored: their speeds differ.")
    return out


def markdown(doc: dict[str, Any]) -> str:
    m, t, sp = doc["machine"], doc["text"], doc["speed_settings"]
    la0, la1 = (" ".join(f"{x:.2f}" for x in m[k]) for k in ("load_average_start", "load_average_end"))
    lines = [
        f"# Quantization report: {doc['model']}",
        "",
        f"Made {doc['created']} by `{doc.get('command', 'inferlab quant-report')}`.",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads; load average "
        f"{la0} at the start, {la1} at the end (a loaded machine's speeds are lower than a quiet one's).",
        f"- Kernels: {m['kernels_line']}.",
        f"- Text: `{t['path']}` (sha256 `{t['sha256'][:12]}…`), {t['tokens']:,} tokens, {t['chunks']} chunks of "
        f"{t['n_ctx']}, {t['scored_tokens']:,} scored tokens (llama-perplexity's method), {t['chunks_per_step']} "
        f"chunks per step in pieces of {t.get('piece_tokens', '?')} tokens: decode-size steps that read K/V "
        f"back from the cache, as generated tokens are computed (quant_report.py).",
        f"- Quality against the float32 base (`--dtype float32`) of the same run; its distribution kept as the "
        f"top {t['kld_top_k']} log-probs + the rest (so KLD is a lower bound, see perplexity.md). ΔPPL: "
        f"PPL / PPL(base) − 1.",
        f"- Speed: offline engine, greedy, fixed prompts of {sp['prompt_tokens']} tokens, {sp['output_tokens']} "
        f"out; decode tokens/s after the first token, medians of {sp['runs']} rounds in which the modes take "
        f"turns (each round builds every mode's engine in turn, the order reversed every other round); the "
        f"{sp['streams']} streams are prefilled together, before the timed span.",
        "",
        "| " + " | ".join(c.format(n=sp["streams"]) for c in COLUMNS) + " |",
        "|" + "|".join("---" if i < 3 else "---:" for i in range(len(COLUMNS))) + "|",
    ]
    lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(doc)]
    alike = same_scores(doc)
    if alike:
        lines += ["", *alike]
    lines += ["", "Kernel paths (`describe_precision`):", ""]
    lines += [f"- {r['label']}: {r['precision']}" for r in doc["rows"]]
    if doc["skipped"]:
        lines += ["", "Skipped:", ""]
        lines += [f"- {s['label']}: {s['reason']}" for s in doc["skipped"]]
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: str | Path) -> Path:
    """Mean KLD (log axis) and ΔPPL % against one-stream decode tokens/s, one labelled point per
    mode. The base's KLD (~0, itself) sits on the axis floor, drawn hollow."""
    from inferlab.bench.plots import pyplot

    plt = pyplot()

    rows = doc["rows"]
    x = [r["decode_tps_1"] for r in rows]
    positive = [r["kld_mean"] for r in rows if r["kld_mean"] > 0 and r["kind"] != "base"]
    floor = min(positive) / 10 if positive else 1e-6
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, key, title in ((axes[0], "kld_mean", "mean KLD vs the float32 base (log)"),
                           (axes[1], "ppl_change_pct", "ΔPPL vs the float32 base (%)")):
        for i, (r, xi) in enumerate(zip(rows, x)):
            y = r[key]
            on_floor = key == "kld_mean" and (r["kind"] == "base" or y <= floor)
            y = floor if on_floor else y
            ax.plot([xi], [y], "o", mfc="none" if on_floor else None, ms=8,
                    color="grey" if r["kind"] == "base" else ("tab:blue" if r["kind"] == "weights" else "tab:orange"))
            ax.annotate(r["label"], (xi, y), textcoords="offset points", xytext=(5, 5 if i % 2 else -11), fontsize=8)
        if key == "kld_mean":
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("decode tokens/s, one stream")
        ax.grid(True, alpha=0.3)
    la = doc["machine"]["load_average_start"][0]
    fig.suptitle(f"{doc['model']}: quality against speed ({doc['machine']['kernels']} kernels, "
                 f"{doc['text']['scored_tokens']:,} scored tokens, load average {la:.1f})")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
