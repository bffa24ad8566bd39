"""`inferlab serve --replicas N` / `--min-replicas A --max-replicas B`: the deployments on Ray Serve.

On one machine it starts a local Ray cluster itself (no `ray start` step); `--ray-address`
joins an existing one (inferlab must be installed on its nodes). Each engine replica reserves
`--replica-cpus` CPUs (fractions allowed: 0.5 puts two replicas on one core's reservation;
Ray's default is a whole CPU each) and runs that many torch threads unless --num-threads says.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import signal
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inferlab.engine.engine_args import EngineArgs
    from inferlab.server.app import ServerSettings

logger = logging.getLogger("inferlab.ray_serve")
INSTALL = "Ray Serve is not installed: pip install 'inferlab[ray]' (ray[serve]==2.60.0)"
HANDLE_METRICS_ENV = "RAY_SERVE_COLLECT_AUTOSCALING_METRICS_ON_HANDLE"
ROUTING_STATS_PERIOD_S = 1.0  # Serve's default is 10 s: far too old for queue-aware routing


@dataclass(frozen=True)
class ScaleConfig:
    """The replica count (fixed, or autoscaled between min and max) and what each reserves."""

    replicas: int | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    replica_cpus: float = 1.0
    target_queued_tokens: float = 512.0
    downscale_delay_s: float = 10.0
    policy: str = "cache-aware"
    ray_address: str | None = None

    @property
    def autoscale(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    def validate(self) -> ScaleConfig:
        if self.replicas is not None and self.autoscale:
            raise ValueError("give either --replicas or --min-replicas/--max-replicas, not both")
        if self.replicas is not None and self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.autoscale:
            lo, hi = self.min_replicas, self.max_replicas
            if lo is None or hi is None:
                raise ValueError("autoscaling needs both --min-replicas and --max-replicas")
            if lo < 1:
                raise ValueError(f"--min-replicas must be >= 1, got {lo}")
            if hi < lo:
                raise ValueError(f"--max-replicas ({hi}) must be >= --min-replicas ({lo})")
        if not self.replica_cpus > 0:
            raise ValueError(f"--replica-cpus must be > 0, got {self.replica_cpus}")
        if not self.target_queued_tokens > 0:
            raise ValueError(f"--target-queued-tokens must be > 0, got {self.target_queued_tokens}")
        from inferlab.router.policies import POLICIES

        if self.policy not in POLICIES:
            raise ValueError(f"--routing-policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        return self


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas on Ray Serve (pip install 'inferlab[ray]')")
    g.add_argument("--replicas", type=int, default=None, help="serve N engine replicas behind one endpoint (Ray Serve)")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscale: at least this many replicas")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscale: at most this many replicas")
    g.add_argument("--replica-cpus", type=float, default=1.0,
                   help="CPUs each replica reserves in Ray (fractions allowed, e.g. 0.5; default 1)")
    g.add_argument("--target-queued-tokens", type=float, default=512.0,
                   help="autoscale: queued prompt tokens one replica should carry (default 512)")
    g.add_argument("--downscale-delay", type=float, default=10.0, dest="downscale_delay_s",
                   help="autoscale: seconds fewer replicas must be wanted before one is given back (default 10)")
    g.add_argument("--routing-policy", default="cache-aware", dest="routing_policy",
                   help="how Ray's router picks a replica: cache-aware (default), least-load, round-robin, session")
    g.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")


def scale_config(args: argparse.Namespace) -> ScaleConfig | None:
    """The replica settings, or None for one in-process server (no replica flag given)."""
    cfg = ScaleConfig(replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                      replica_cpus=args.replica_cpus, target_queued_tokens=args.target_queued_tokens,
                      downscale_delay_s=args.downscale_delay_s, policy=args.routing_policy,
                      ray_address=args.ray_address)  # fmt: skip
    if cfg.replicas is None and not cfg.autoscale:
        if cfg.ray_address is not None:
            raise ValueError("--ray-address needs --replicas or --min-replicas/--max-replicas")
        return None
    return cfg.validate()


def import_ray() -> tuple[Any, Any]:
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError(INSTALL) from None
    return ray, serve


def engine_options(cfg: ScaleConfig, engine_args: EngineArgs, settings: ServerSettings) -> dict[str, Any]:
    """The engine deployment's Serve options."""
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

    from inferlab.ray_serve.router import InferlabRequestRouter

    seats = engine_args.max_num_seqs + (settings.max_queue_len or 4 * engine_args.max_num_seqs)
    opts: dict[str, Any] = dict(
        name="engine",
        ray_actor_options={"num_cpus": cfg.replica_cpus,
                           "runtime_env": {"env_vars": {HANDLE_METRICS_ENV: os.environ.get(HANDLE_METRICS_ENV, "0")}}},
        max_ongoing_requests=seats,
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_wait_loop_s=1.0,  # drain: wait for ongoing requests, checking every second
        graceful_shutdown_timeout_s=settings.shutdown_timeout,
        request_router_config=RequestRouterConfig(
            request_router_class=InferlabRequestRouter,
            request_router_kwargs={"policy": cfg.policy},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=5.0,
        ),
    )
    if cfg.autoscale:
        opts["autoscaling_config"] = AutoscalingConfig(
            min_replicas=cfg.min_replicas, max_replicas=cfg.max_replicas, initial_replicas=cfg.min_replicas,
            metrics_interval_s=1.0, look_back_period_s=2.0,
            # Serve's own delays (30 s up by default) sit on top of the policy's: up at once,
            # the downscale delay is the policy's (QueuedTokensPolicy).
            upscale_delay_s=1.0, downscale_delay_s=1.0,
            policy=AutoscalingPolicy(policy_function="inferlab.ray_serve.autoscale:QueuedTokensPolicy",
                                     policy_kwargs={"target_queued_tokens": cfg.target_queued_tokens,
                                                    "downscale_delay_s": cfg.downscale_delay_s}),
        )  # fmt: skip
    else:
        opts["num_replicas"] = cfg.replicas
    return opts


def deploy(cfg: ScaleConfig, engine_args: EngineArgs, settings: ServerSettings, host: str, port: int,
           *, app_name: str = "inferlab") -> Any:  # fmt: skip
    """Start (or join) Ray, start Serve's HTTP proxy on host:port, deploy; the ingress's handle."""
    ray, serve = import_ray()
    from inferlab.ray_serve.ingress import OpenAIIngress
    from inferlab.ray_serve.replica import EngineReplica

    if engine_args.num_threads is None:  # torch threads = the CPUs the replica reserves
        engine_args = dataclasses.replace(engine_args, num_threads=max(1, math.floor(cfg.replica_cpus)))
    # Replicas push their own autoscaling metrics (queued_tokens comes from them); Serve's
    # default collects ongoing requests on the handles instead and then never starts the
    # replicas' pusher, so a custom metric never reaches the policy (Ray 2.60). Read by the
    # controller and the replicas: set before the local cluster starts; a cluster joined with
    # --ray-address needs it in its environment too.
    os.environ.setdefault(HANDLE_METRICS_ENV, "0")
    if not ray.is_initialized():
        ray.init(address=cfg.ray_address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    serve.start(http_options={"host": host, "port": port})
    engine = serve.deployment(EngineReplica, **engine_options(cfg, engine_args, settings))
    ingress = serve.deployment(OpenAIIngress, name="ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=10_000)  # fmt: skip
    return serve.run(ingress.bind(engine.bind(engine_args, settings), engine_args.model), name=app_name,
                     route_prefix="/")  # fmt: skip


def run_replicas(cfg: ScaleConfig, engine_args: EngineArgs, settings: ServerSettings, host: str, port: int) -> int:
    """Serve until SIGTERM / Ctrl-C; then Serve drains the replicas and Ray stops."""
    ray, serve = import_ray()
    engine_args.create_engine_config()  # invalid engine flags fail here, before Ray starts
    stop = threading.Event()
    previous: dict[int, Any] = {}
    try:
        deploy(cfg, engine_args, settings, host, port)
        # After deploy: ray.init installs its own SIGTERM handler (exit at once), which would skip the drain.
        previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
        n = cfg.replicas or f"{cfg.min_replicas}..{cfg.max_replicas}"
        print(f"inferlab serve: {n} replicas on Ray Serve at http://{host}:{port}", flush=True)
        stop.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
    return 0
