"""Serve's custom request router (`RequestRouterConfig(request_router_class=...)`) on our scoring core.

Every handle to the engine deployment (the ingress's) runs one of these; Serve calls
`choose_replicas` per request with the replicas that are up, each carrying the stats its
`record_routing_stats()` returned (every `request_routing_stats_period_s`, set to ~1 s by
`launch.py`). The request's prompt tokens travel in the call's `route` keyword.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from inferlab.ray_serve.scoring import Candidate, Scorer


class InferlabRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, policy: str = "cache-aware", **kwargs: Any) -> None:
        self.scorer = Scorer(policy_name=policy)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:  # fmt: skip
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # all full: back off, do not spin
        route = pending_request.kwargs.get("route") if pending_request is not None else None
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        cands = [Candidate(name, dict(r.routing_stats or {}), self.replica_queue_len_cache.get(r.replica_id) or 0)
                 for name, r in by_name.items()]  # fmt: skip
        return [[by_name[n]] for n in self.scorer.rank(route, cands)]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.scorer.forget(replica_id.unique_id)
