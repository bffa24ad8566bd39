"""KL divergence of a model Q from a base model's distribution, token by token, and the
statistics llama.cpp's `llama-perplexity --kl-divergence` prints, computed their way.

The base keeps, per scored token, its top-K log-probs (ids and values), the log of the mass
outside them, and the logprob of the actual token (see base_file.py for why not whole rows).
KLD(base || Q) is then taken over K + 1 bins, the top K and "the rest":

    sum_k p_k (log p_k - log q_k) + P_rest (log P_rest - log Q_rest)

which is the exact KL divergence when K covers the vocabulary and, by the log-sum inequality,
a lower bound otherwise (the gap is what the tail's shape adds; see benchmarks/results/perplexity.md).

The statistics follow llama-perplexity: mean ± the standard error of the mean (0 with 10
values or fewer), percentiles by linear interpolation over the sorted values, ln(PPL(Q)/PPL(base))
with the covariance of the two NLLs, RMS of Δp = p_Q(token) - p_base(token), and how often both
models' most likely token is the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class BaseRows:
    """The base model's view of some scored tokens (one row each)."""

    top_ids: np.ndarray  # int32 [n, K], most likely first
    top_logprobs: np.ndarray  # float32 [n, K]
    rest_logprob: np.ndarray  # float32 [n]: log of the mass outside the top K (-inf: none)
    nll: np.ndarray  # float32 [n]: -log p_base(actual token)

    def rows(self, start: int, stop: int) -> BaseRows:
        return BaseRows(self.top_ids[start:stop], self.top_logprobs[start:stop], self.rest_logprob[start:stop],
                        self.nll[start:stop])

    @staticmethod
    def concat(parts: list[BaseRows]) -> BaseRows:
        return BaseRows(*(np.concatenate([getattr(p, k) for p in parts])
                          for k in ("top_ids", "top_logprobs", "rest_logprob", "nll")))


def base_rows(rows: np.ndarray, targets: np.ndarray, top_k: int) -> BaseRows:
    """Summarize whole log-softmax rows [n, V] (float32) to what the base file keeps."""
    n, vocab = rows.shape
    k = min(top_k, vocab)
    if k == vocab:
        ids = np.argsort(-rows, axis=1, kind="stable")
    else:
        ids = np.argpartition(-rows, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(rows, ids, 1), axis=1, kind="stable")
        ids = np.take_along_axis(ids, order, 1)
    top = np.take_along_axis(rows, ids, 1)
    rest = np.full(n, -np.inf, dtype=np.float32)
    if k < vocab:
        masked = rows.astype(np.float64, copy=True)
        np.put_along_axis(masked, ids, -np.inf, 1)
        m = masked.max(axis=1, keepdims=True)
        rest = (m[:, 0] + np.log(np.exp(masked - m).sum(axis=1))).astype(np.float32)
    nll = -rows[np.arange(n), targets]
    return BaseRows(ids.astype(np.int32), top.astype(np.float32), rest, nll.astype(np.float32))


@dataclass
class TokenStats:
    """Per scored token: KLD(base || Q), Δp, both NLLs, and whether the top tokens agree."""

    kld: np.ndarray
    p_diff: np.ndarray
    nll: np.ndarray
    nll_base: np.ndarray
    same_top: np.ndarray  # bool


def token_stats(rows_q: np.ndarray, targets: np.ndarray, base: BaseRows) -> TokenStats:
    """Compare Q's whole log-softmax rows [n, V] with the base's summary of the same tokens."""
    n = rows_q.shape[0]
    lq = np.take_along_axis(rows_q, base.top_ids.astype(np.int64), 1).astype(np.float64)
    lp = base.top_logprobs.astype(np.float64)
    p = np.exp(lp)
    kld = (p * (lp - lq)).sum(axis=1)
    rest_p = base.rest_logprob.astype(np.float64)
    has_rest = np.isfinite(rest_p)
    if has_rest.any():
        # Q's rest mass as its whole row's total minus its top-K part: float32 rows sum to 1
        # only within ~1e-6, and "1 - top" would put that error into a small rest bin.
        q_all = np.exp(rows_q[has_rest].astype(np.float64)).sum(axis=1)
        q_top = np.exp(lq[has_rest]).sum(axis=1)
        rest_q = np.log(np.clip(q_all - q_top, 1e-300, None))
        r = rest_p[has_rest]
        kld[has_rest] += np.exp(r) * (r - rest_q)
    nll = -rows_q[np.arange(n), targets].astype(np.float64)
    nll_base = base.nll.astype(np.float64)
    p_diff = np.exp(-nll) - np.exp(-nll_base)
    same_top = rows_q.argmax(axis=1) == base.top_ids[:, 0]
    return TokenStats(kld, p_diff, nll, nll_base, same_top)


def mean_and_error(values: np.ndarray) -> tuple[float, float]:
    """Mean and the standard error of the mean, llama-perplexity's way (0 for 10 values or fewer)."""
    n = values.size
    if n < 1:
        return 0.0, 0.0
    mean = float(values.sum() / n)
    var = float((values * values).sum() / n) - mean * mean
    return mean, math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """Linear interpolation between the two nearest ranks of fraction * (n - 1)."""
    if fraction <= 0:
        return float(sorted_values[0])
    if fraction >= 1:
        return float(sorted_values[-1])
    pos = fraction * (sorted_values.size - 1)
    i = int(pos)
    t = pos - i
    return float((1 - t) * sorted_values[i] + t * sorted_values[min(i + 1, sorted_values.size - 1)])


@dataclass
class KldSummary:
    count: int
    ppl: tuple[float, float]
    ppl_base: tuple[float, float]
    cor_ln_ppl: float
    ln_ppl_ratio: tuple[float, float]
    ppl_ratio: tuple[float, float]
    ppl_diff: tuple[float, float]
    kld: tuple[float, float]
    kld_percentiles: dict[str, float]  # "max", "99.9", "99.0", ..., "median", ..., "min"
    p_diff: tuple[float, float]
    p_diff_percentiles: dict[str, float]
    p_diff_rms: tuple[float, float]
    same_top: tuple[float, float]


KLD_LEVELS = (("max", 1.0), ("99.9", 0.999), ("99.0", 0.99), ("95.0", 0.95), ("90.0", 0.9), ("median", None),
              ("10.0", 0.1), ("5.0", 0.05), ("1.0", 0.01), ("0.1", 0.001), ("min", 0.0))
P_DIFF_LEVELS = (("max", 1.0), ("99.9", 0.999), ("99.0", 0.99), ("95.0", 0.95), ("90.0", 0.9), ("75.0", 0.75),
                 ("median", None), ("25.0", 0.25), ("10.0", 0.1), ("5.0", 0.05), ("1.0", 0.01), ("0.1", 0.001),
                 ("min", 0.0))


def _levels(sorted_values: np.ndarray, levels) -> dict[str, float]:
    return {name: float(np.median(sorted_values)) if f is None else percentile(sorted_values, f) for name, f in levels}


@dataclass
class KldAccumulator:
    """Every scored token's statistics, chunk by chunk."""

    parts: list[TokenStats] = field(default_factory=list)

    def add(self, stats: TokenStats) -> None:
        self.parts.append(stats)

    def _cat(self, name: str) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in self.parts]) if self.parts else np.zeros(0)

    def summary(self) -> KldSummary:
        nll, nll_b = self._cat("nll"), self._cat("nll_base")
        kld, p_diff, same = self._cat("kld"), self._cat("p_diff"), self._cat("same_top")
        n = nll.size
        ln_q, ln_b = mean_and_error(nll), mean_and_error(nll_b)
        cov = (float((nll * nll_b).sum() / n) - float(nll.sum() / n) * float(nll_b.sum() / n)) / (n - 1) if n >= 10 else 0.0
        ppl_q, ppl_b = math.exp(ln_q[0]), math.exp(ln_b[0])
        ratio = ln_q[0] - ln_b[0]
        ratio_err = math.sqrt(max(ln_q[1] ** 2 + ln_b[1] ** 2 - 2 * cov, 0.0))
        ppl_err, ppl_b_err = ppl_q * ln_q[1], ppl_b * ln_b[1]
        diff_err = math.sqrt(max(ppl_err**2 + ppl_b_err**2 - 2 * ppl_q * ppl_b * cov, 0.0))
        mse = mean_and_error(p_diff * p_diff)
        rms = math.sqrt(mse[0])
        top = float(same.sum()) / n
        return KldSummary(
            count=n,
            ppl=(ppl_q, ppl_err),
            ppl_base=(ppl_b, ppl_b_err),
            cor_ln_ppl=cov / (ln_q[1] * ln_b[1]) if ln_q[1] and ln_b[1] else float("nan"),
            ln_ppl_ratio=(ratio, ratio_err),
            ppl_ratio=(math.exp(ratio), math.exp(ratio) * ratio_err),
            ppl_diff=(ppl_q - ppl_b, diff_err),
            kld=mean_and_error(kld),
            kld_percentiles=_levels(np.sort(kld), KLD_LEVELS),
            p_diff=mean_and_error(p_diff),
            p_diff_percentiles=_levels(np.sort(p_diff), P_DIFF_LEVELS),
            p_diff_rms=(rms, 0.5 / rms * mse[1] if rms else 0.0),
            same_top=(top, math.sqrt(top * (1 - top) / (n - 1)) if n > 1 else 0.0),
        )


def format_summary(s: KldSummary) -> list[str]:
    """The lines llama-perplexity prints after a KL-divergence run."""
    pm = "\u00b1"
    out = ["====== Perplexity statistics ======",
           f"Mean PPL(Q)                   : {s.ppl[0]:10.6f} {pm} {s.ppl[1]:10.6f}",
           f"Mean PPL(base)                : {s.ppl_base[0]:10.6f} {pm} {s.ppl_base[1]:10.6f}",
           f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s.cor_ln_ppl:6.2f}%",
           f"Mean ln(PPL(Q)/PPL(base))     : {s.ln_ppl_ratio[0]:10.6f} {pm} {s.ln_ppl_ratio[1]:10.6f}",
           f"Mean PPL(Q)/PPL(base)         : {s.ppl_ratio[0]:10.6f} {pm} {s.ppl_ratio[1]:10.6f}",
           f"Mean PPL(Q)-PPL(base)         : {s.ppl_diff[0]:10.6f} {pm} {s.ppl_diff[1]:10.6f}",
           "",
           "====== KL divergence statistics ======",
           f"Mean    KLD: {s.kld[0]:10.6f} {pm} {s.kld[1]:10.6f}"]
    names = {"max": "Maximum", "median": "Median ", "min": "Minimum"}
    for name, value in s.kld_percentiles.items():
        label = names.get(name) or f"{float(name):4.1f}%  "
        out.append(f"{label} KLD: {value:10.6f}")
    out += ["", "====== Token probability statistics ======",
            f"Mean    \u0394p: {100 * s.p_diff[0]:6.3f} {pm} {100 * s.p_diff[1]:5.3f} %"]
    for name, value in s.p_diff_percentiles.items():
        label = names.get(name) or f"{float(name):4.1f}%  "
        out.append(f"{label} \u0394p: {100 * value:6.3f}%")
    out += [f"RMS \u0394p    : {100 * s.p_diff_rms[0]:6.3f} {pm} {100 * s.p_diff_rms[1]:5.3f} %",
            f"Same top p: {100 * s.same_top[0]:6.3f} {pm} {100 * s.same_top[1]:5.3f} %"]
    return out
