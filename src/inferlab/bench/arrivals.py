"""When each request is released: a closed loop of N clients, or an open loop at a request
rate with Poisson (burstiness 1) or gamma-distributed gaps, optionally capped in concurrency.

The schedule is computed up front from a seeded generator so that two runs with the same
seed send at the same offsets; the sender only sleeps until each offset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LoadSpec:
    """One load level.

    - `request_rate=inf`, `max_concurrency=N`: closed loop, N requests in flight at all times.
    - `request_rate=R`: open loop, R requests/s on average; gaps ~ Gamma(shape=burstiness,
      scale=1/(R·burstiness)), so the mean gap is 1/R and the gaps' coefficient of variation is
      1/√burstiness (1 = Poisson, < 1 burstier, > 1 more even; inf = evenly spaced).
    - both: open loop whose released requests wait for one of N slots.
    """

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")

    @property
    def label(self) -> str:
        parts = []
        if math.isfinite(self.request_rate):
            parts.append(f"rate {self.request_rate:g}/s")
            if self.burstiness != 1.0:
                parts.append(f"burstiness {self.burstiness:g}")
        if self.max_concurrency is not None:
            parts.append(f"concurrency {self.max_concurrency}")
        return ", ".join(parts) or "all at once"

    def to_dict(self) -> dict:
        return {
            "request_rate": self.request_rate if math.isfinite(self.request_rate) else "inf",
            "burstiness": self.burstiness,
            "max_concurrency": self.max_concurrency,
        }


def inter_arrival_gaps(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """n gaps in seconds: zeros at an infinite rate, 1/rate at infinite burstiness, else gamma."""
    if n <= 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        return np.full(n, 1.0 / rate)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_offsets(n: int, load: LoadSpec, seed: int = 0) -> np.ndarray:
    """Release time of each of n requests, seconds after the start; the first goes at 0."""
    if n <= 0:
        return np.zeros(0)
    gaps = inter_arrival_gaps(n - 1, load.request_rate, load.burstiness, np.random.default_rng(seed))
    return np.concatenate([[0.0], np.cumsum(gaps)])
