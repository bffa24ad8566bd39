"""`inferlab router`: one OpenAI endpoint in front of several `inferlab serve` replicas.

    inferlab router --backend http://127.0.0.1:8001 --backend http://127.0.0.1:8002
    inferlab router --backend URL --backend URL --policy least-load --port 9000 --api-key secret
    inferlab router --backend URL --backend URL --tokenizer SmolLM2-135M-Instruct   # tokenize locally
    inferlab router --backend URL --canary URL2 --canary-weight 0.1 --api-key secret  # a canary release

Backends that are down at start are reported unhealthy and get traffic once a probe finds them
ready. SIGTERM (or Ctrl-C) stops accepting connections and lets in-flight requests finish.
"""

from __future__ import annotations

import argparse
import logging

from inferlab.router.policies import POLICIES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", action="append", required=True, metavar="URL",
                   help="a replica's base URL (repeat for each replica), e.g. http://127.0.0.1:8001")
    p.add_argument("--policy", default="cache-aware", choices=list(POLICIES),
                   help="cache-aware: lowest predicted TTFT from cached prefix and queue (bounded load); "
                        "least-load: fewest in flight; round-robin; session: sticky per `user` or --session-header")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' from clients (or set INFERLAB_API_KEY); also sent to "
                        "the backends unless --backend-api-key is given")
    p.add_argument("--api-keys", metavar="FILE", default=None,
                   help="the backends' tenants file (inferlab serve --api-keys): clients' keys are checked here and "
                        "passed through, and prompts are hashed with each tenant's cache salt, as the backends do")
    p.add_argument("--backend-api-key", default=None,
                   help="the key to send to the backends (with --api-keys: only on the router's own calls, probes, "
                        "/kv_events and /tokenize; give one tenant's key)")
    p.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    p.add_argument("--tokenizer", default=None, metavar="MODEL",
                   help="tokenize prompts in the router with this model's tokenizer (no round trip); "
                        "default: ask a ready backend's /tokenize")
    p.add_argument("--session-header", default="x-session-id", help="header naming a session (else the body's `user`)")
    p.add_argument("--max-retries", type=int, default=2, help="other replicas tried before the first byte (default 2)")
    p.add_argument("--probe-interval", type=float, default=0.5, help="seconds between health probes (default 0.5)")
    p.add_argument("--prefix-ttl", type=float, default=120.0,
                   help="seconds a routed prompt's blocks are assumed cached on its replica (default 120)")
    p.add_argument("--speculative-ttl", type=float, default=30.0,
                   help="the same for a backend whose KV events the router follows (default 30)")
    p.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                   help="do not follow the backends' GET /kv_events (route on speculative prefix entries only)")
    p.add_argument("--canary", action="append", default=[], metavar="URL[=WEIGHT]",
                   help="a replica of the new version (repeat for more): it gets --canary-weight of the traffic, "
                        "sticky per session, and is rolled back by itself when it does worse than the backends")
    p.add_argument("--canary-weight", type=float, default=None, help="the canary pool's share, 0..1 (default 0.1)")
    p.add_argument("--canary-window", type=float, default=60.0, help="seconds of outcomes judged (default 60)")
    p.add_argument("--canary-min-requests", type=int, default=20,
                   help="outcomes per pool in the window before judging (default 20)")
    p.add_argument("--canary-max-error-delta", type=float, default=0.05,
                   help="roll back when the canary's error rate passes the backends' by this (default 0.05)")
    p.add_argument("--canary-max-ttft-ratio", type=float, default=1.5,
                   help="roll back when the canary's TTFT p95 passes the backends' times this (default 1.5)")
    p.add_argument("--stable-version", default="stable", help="a label for the --backend pool's release")
    p.add_argument("--canary-version", default="canary", help="a label for the --canary pool's release")
    p.add_argument("--admin-key", default=None,
                   help="the key for GET/POST /admin/canary (promote, rollback, set_weight); default: --api-key")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get after SIGTERM")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def settings_from_args(args: argparse.Namespace):
    from inferlab.router.app import RouterSettings, normalize_backend
    from inferlab.router.canary import CanaryConfig
    from inferlab.router.proxy import ProxySettings
    from inferlab.server.tenants import keys_from_args

    backends = tuple(normalize_backend(b) for b in args.backend)
    if len(set(backends)) != len(backends):
        raise ValueError("the same --backend is given twice")
    if args.max_retries < 0:
        raise ValueError(f"--max-retries must be >= 0, got {args.max_retries}")
    if args.probe_interval <= 0 or args.prefix_ttl <= 0 or args.speculative_ttl <= 0:
        raise ValueError("--probe-interval, --prefix-ttl and --speculative-ttl must be > 0")
    canaries, weights = [], set()
    for spec in args.canary:
        url, sep, w = spec.rpartition("=") if "=" in spec.split("//", 1)[-1] else (spec, "", "")
        canaries.append(normalize_backend(url if sep else spec))
        if sep:
            try:
                weights.add(float(w))
            except ValueError:
                raise ValueError(f"--canary {spec!r}: the weight after '=' must be a number") from None
    if args.canary_weight is not None:
        weights.add(args.canary_weight)
    if len(weights) > 1:
        raise ValueError(f"the canary pool has one weight; got {sorted(weights)}")
    if set(canaries) & set(backends) or len(set(canaries)) != len(canaries):
        raise ValueError("a --canary URL is given twice, or also as a --backend")
    if weights and not canaries:
        raise ValueError("--canary-weight needs a --canary URL")
    canary = CanaryConfig(weight=weights.pop() if weights else 0.1, window_s=args.canary_window,
                          min_requests=args.canary_min_requests, max_error_rate_delta=args.canary_max_error_delta,
                          max_ttft_ratio=args.canary_max_ttft_ratio)  # fmt: skip
    api_key, tenants = keys_from_args(args.api_key, args.api_keys)
    return RouterSettings(
        backends=backends,
        policy=args.policy,
        api_key=api_key,
        tenants=tenants,
        backend_api_key=args.backend_api_key,
        metrics_public=args.metrics_public,
        tokenizer=args.tokenizer,
        session_header=args.session_header.lower(),
        probe_interval_s=args.probe_interval,
        metrics_max_age_s=max(2.0, 4 * args.probe_interval),
        prefix_ttl_s=args.prefix_ttl,
        speculative_ttl_s=args.speculative_ttl,
        kv_events=args.kv_events,
        proxy=ProxySettings(max_retries=args.max_retries),
        canaries=tuple(canaries),
        canary=canary,
        versions=(args.stable_version, args.canary_version),
        admin_key=args.admin_key,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from inferlab.router.app import build_router_app
    from inferlab.server.httputil import run_until_sigterm

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_router_app(settings_from_args(args))
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=False, timeout_graceful_shutdown=args.shutdown_timeout,
                                           lifespan="on"))  # fmt: skip
    run_until_sigterm(server)
    return 0
