"""Rejection sampling against a draft distribution (Leviathan et al. 2023, Chen et al. 2023): the
verification for drafts sampled from a draft model's q (the one-hot case, n-gram and suffix
drafts and argmax drafts, is engine/spec_decode.py's sample-and-compare).

Draft x_j (sampled from q_j) is kept with probability min(1, p_j(x_j) / q_j(x_j)); at the first
rejection the token is drawn from the residual max(0, p_j - q_j), renormalised, and the step
ends; if every draft is kept, a bonus token is drawn from p_k. Each output token is then
distributed as p exactly: P(x) = q(x)·min(1, p/q) + (1 - Σ min(p, q))·max(0, p - q)(x)/Σ max(0, p - q) = p(x).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inferlab.engine.sampler import inverse_cdf


def rejection_sample(p: torch.Tensor, q: torch.Tensor, drafts: Sequence[int], u_accept: torch.Tensor,
                     u_resample: torch.Tensor) -> list[int]:
    """p: [k + 1, V] the target's distributions (row j after drafts 0..j-1); q: [k, V] the
    draft's, drafts[j] sampled from q[j]; one uniform per draft to accept and per row to
    resample. The tokens the step yields: the kept drafts, then a residual or bonus token."""
    k = len(drafts)
    out: list[int] = []
    for j in range(k):
        x = drafts[j]
        px, qx = float(p[j, x]), float(q[j, x])
        if qx > 0 and float(u_accept[j]) * qx < px:  # u < p / q, without dividing
            out.append(x)
            continue
        residual = residual_of(p[j], q[j])
        out.append(int(inverse_cdf(residual.unsqueeze(0), u_resample[j : j + 1])[0]))
        return out
    out.append(int(inverse_cdf(p[k].unsqueeze(0), u_resample[k : k + 1])[0]))
    return out


def residual_of(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) (unnormalised: inverse_cdf normalises); p itself where p <= q everywhere
    (then a rejection has probability 0, reached only by rounding)."""
    r = (p - q).clamp_min(0)
    return r if float(r.sum()) > 0 else p
