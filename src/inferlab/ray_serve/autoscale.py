"""Autoscaling on queued prompt tokens, not on ongoing requests.

Why tokens: an engine's backlog is the prefill work it has not started, and one 8,000-token
prompt is as much of it as a hundred short ones; a count of requests sees them alike. Each
replica reports `queued_tokens` (record_autoscaling_stats); the policy wants

    desired = ceil(total queued tokens / target_queued_tokens), within [min, max]

scaling up at once, and down one replica at a time only after `downscale_delay_s` during which
every decision wanted fewer (a new replica costs a model load; giving one back on a lull that
lasts one tick is waste). Plain Python on duck-typed Ray objects, so the tests drive it without
a cluster.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

QUEUED_TOKENS = "queued_tokens"


class QueuedTokensPolicy:
    """A class-callable Ray Serve autoscaling policy (Serve instantiates it once, with kwargs)."""

    def __init__(self, target_queued_tokens: float = 512.0, downscale_delay_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        if target_queued_tokens <= 0:
            raise ValueError(f"target_queued_tokens must be > 0, got {target_queued_tokens}")
        self.target = float(target_queued_tokens)
        self.downscale_delay_s = downscale_delay_s
        self.clock = clock
        self._want_fewer_since: float | None = None
        self._last_current: int | None = None
        self.timeline: list[tuple[float, float, int, int]] = []  # (t, queued tokens, current, decided)

    def desired(self, queued_tokens: float, lo: int, hi: int) -> int:
        return max(lo, min(hi, math.ceil(queued_tokens / self.target)))

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        per_replica = (ctx.aggregated_metrics or {}).get(QUEUED_TOKENS, {})
        queued = float(sum(per_replica.values()))
        lo, hi = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        current = ctx.target_num_replicas
        want = self.desired(queued, lo, hi)
        now = self.clock()
        if current != self._last_current:  # the target moved: a new step needs its own delay
            self._want_fewer_since = None
            self._last_current = current
        if want >= current:
            self._want_fewer_since = None
            decided = want
        else:
            if self._want_fewer_since is None:
                self._want_fewer_since = now
            # Once the delay has passed, keep asking for one fewer (Serve wants a decision held
            # for its own downscale delay) until the target moves.
            decided = current - 1 if now - self._want_fewer_since >= self.downscale_delay_s else current
        self.timeline.append((now, queued, current, decided))
        del self.timeline[:-1000]
        state = dict(ctx.policy_state or {})
        state["inferlab"] = {"queued_tokens": queued, "desired": want, "decided": decided}
        return decided, state
