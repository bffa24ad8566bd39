"""The router's own /metrics: decisions by reason, per-replica in-flight and health, retries,
ejections, outcomes, and the cached tokens it predicted against those the replicas reported."""

from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from inferlab.router.fleet import Fleet

__all__ = ["CONTENT_TYPE_LATEST", "RouterMetrics"]


class RouterMetrics:
    def __init__(self, fleet: Fleet, registry: CollectorRegistry | None = None):
        self.registry = reg = registry if registry is not None else CollectorRegistry()
        self.policy = fleet.policy.name
        self.decisions = Counter("inferlab:router_decisions", "Routing decisions, by policy and reason.",
                                 ["policy", "reason"], registry=reg)  # fmt: skip
        self.requests = Counter("inferlab:router_requests", "Requests answered, by route and outcome.",
                                ["route", "outcome"], registry=reg)  # fmt: skip
        self.retries = Counter("inferlab:router_retries", "Requests sent again to another replica, by the reason.",
                               ["reason"], registry=reg)  # fmt: skip
        self.ejections = Counter("inferlab:router_ejections", "Times a replica's circuit opened.", ["replica"], registry=reg)
        self.predicted_cached = Counter("inferlab:router_predicted_cached_tokens",
                                        "Prompt tokens the router predicted cached on the chosen replica.", registry=reg)  # fmt: skip
        self.actual_cached = Counter("inferlab:router_actual_cached_tokens",
                                     "Cached prompt tokens the replicas reported in usage.", registry=reg)  # fmt: skip
        self.prompt_tokens = Counter("inferlab:router_prompt_tokens", "Prompt tokens the replicas reported in usage.",
                                     registry=reg)  # fmt: skip
        in_flight = Gauge("inferlab:router_replica_in_flight", "Requests the router has in flight on each replica.",
                          ["replica"], registry=reg)  # fmt: skip
        healthy = Gauge("inferlab:router_replica_routable", "1 when a replica may get traffic now.", ["replica"], registry=reg)
        kv_events = Gauge("inferlab:router_kv_events_applied", "KV event records applied to the prefix index, cumulative.",
                          ["replica"], registry=reg)  # fmt: skip
        kv_resyncs = Gauge("inferlab:router_kv_resyncs", "KV snapshots applied (start, gaps, restarts), cumulative.",
                           ["replica"], registry=reg)  # fmt: skip
        indexed = Gauge("inferlab:router_kv_confirmed_blocks", "Blocks a replica's KV events say it holds.",
                        ["replica"], registry=reg)  # fmt: skip
        for name in fleet.replicas:
            in_flight.labels(replica=name).set_function(partial(_in_flight, fleet, name))
            healthy.labels(replica=name).set_function(partial(_routable, fleet, name))
            kv = fleet.replicas[name].kv
            kv_events.labels(replica=name).set_function(partial(getattr, kv, "events"))
            kv_resyncs.labels(replica=name).set_function(partial(getattr, kv, "resyncs"))
            indexed.labels(replica=name).set_function(partial(_confirmed, fleet, name))
            self.ejections.labels(replica=name)

        self.canary_requests = Counter("inferlab:router_canary_requests", "Outcomes judged for the canary, by pool.",
                                       ["pool", "outcome"], registry=reg)  # fmt: skip
        self.canary_rollbacks = Counter("inferlab:router_canary_rollbacks", "Canary rollbacks, by reason.",
                                        ["reason"], registry=reg)  # fmt: skip
        self.canary_weight = Gauge("inferlab:router_canary_weight", "The canary pool's share of new traffic.",
                                   registry=reg)  # fmt: skip

    def decision(self, reason: str, predicted_cached: int) -> None:
        self.decisions.labels(policy=self.policy, reason=reason).inc()
        self.predicted_cached.inc(predicted_cached)

    def usage(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.actual_cached.inc(cached_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _in_flight(fleet: Fleet, name: str) -> float:
    return float(fleet.replicas[name].state.in_flight)


def _routable(fleet: Fleet, name: str) -> float:
    return float(fleet.replicas[name].health.routable(fleet.clock()))


def _confirmed(fleet: Fleet, name: str) -> float:
    return float(fleet.index.num_confirmed(name))
