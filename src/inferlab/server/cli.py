"""`inferlab serve`: an OpenAI-compatible HTTP server on the engine.

    inferlab serve                      # the default model on http://127.0.0.1:8000
    inferlab serve --model m.gguf --served-model-name mymodel --port 8080 --api-key secret
    inferlab serve --api-keys keys.json   # tenants: keys, limits, prefix-cache isolation (server/tenants.py)
    inferlab serve --replicas 2 --replica-cpus 1   # several engine replicas on Ray Serve (ray_serve/)
    inferlab serve --simulate profile.json --port 8001   # a simulated replica: no model, no torch (sim_engine.py)

The server listens at once and /health answers 503 while the model loads. SIGTERM (or Ctrl-C)
stops accepting connections, lets in-flight requests finish for up to --shutdown-timeout
seconds, and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading

from inferlab.config import EngineConfig
from inferlab.engine.engine_args import EngineArgs, parse_size
from inferlab.server.limits import HttpLimits
from inferlab.server.reasoning import PARSERS as REASONING_PARSERS
from inferlab.server.tool_calls import PARSERS


def add_arguments(p: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", "--alias", dest="served_model_name", nargs="+", default=None,
                   help="the model name(s) clients use and replies report (default: the model's own name)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on inference routes (or set INFERLAB_API_KEY)")
    p.add_argument("--api-keys", metavar="FILE", default=None,
                   help='tenants and their keys and limits, JSON: {"tenants": [{"name": "team-a", "keys": ["..."], '
                        '"max_concurrent": 4, "requests_per_minute": 600, "tokens_per_minute": 200000, '
                        '"max_tokens": 2048, "max_prompt_tokens": 8192, "cache_group": "..."}]} (limits optional; '
                        'beyond one: 429 + Retry-After); each tenant gets its own prefix cache unless they share a cache_group')
    p.add_argument("--max-request-body-bytes", type=parse_size, default=HttpLimits.max_request_body_bytes,
                   help="larger request bodies get 413 (default 8MiB)")
    p.add_argument("--header-timeout", type=float, default=HttpLimits.header_timeout,
                   help="seconds a client gets to send a request's headers before the connection is closed (default 10)")
    p.add_argument("--body-timeout", type=float, default=HttpLimits.body_timeout,
                   help="seconds a client gets to send a request's body: 408 after (default 60)")
    p.add_argument("--send-timeout", type=float, default=HttpLimits.send_timeout,
                   help="seconds a client that stops reading may block a response before it is closed "
                        "and its request aborted (default 30)")
    p.add_argument("--keep-alive-timeout", type=float, default=HttpLimits.keep_alive_timeout,
                   help="seconds an idle keep-alive connection stays open (default 5)")
    p.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    p.add_argument("--max-queue-len", type=int, default=None,
                   help="requests allowed to wait beyond the --max-num-seqs running ones; beyond it: 503 + "
                        f"Retry-After (default {QUEUE_PER_SEAT} x --max-num-seqs; 0: unbounded)")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may take from arrival before it is aborted (default: none)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                   help="do not serve GET /kv_events (the prefix cache's changes, for `inferlab router`)")
    p.add_argument("--otlp-traces-endpoint", metavar="URL", default=None,
                   help="send each request's trace (queue, prefill chunks, decode, stream) to this OpenTelemetry "
                        "collector over OTLP/HTTP, e.g. http://127.0.0.1:4318 (needs the 'otlp' extra)")
    p.add_argument("--tool-call-parser", choices=PARSERS, default="auto",
                   help="the model's tool-call format, for tool_choice auto: hermes (<tool_call>{json}</tool_call>: "
                        "Hermes, Qwen2.5, Qwen3) or llama3_json (default: from the chat template)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="put a thinking model's <think>...</think> block into the message's reasoning_content "
                        "(Qwen3, DeepSeek-R1; chat_template_kwargs {\"enable_thinking\": false} turns Qwen3's off)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool_choice auto is always on")
    p.add_argument("--simulate", metavar="PROFILE.json", default=None,
                   help="a simulated replica: the real scheduler and prefix cache, steps timed by this step profile "
                        "(inferlab simulate --calibrate-engine --profile-out) or saved cost model, placeholder words "
                        "for tokens; the model's tokenizer only (no weights, no torch), for router tests and benchmarks")
    p.add_argument("--log-prompts", action="store_true", help="include prompt text in the request log lines")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])  # fmt: skip
    from inferlab.ray_serve.launch import add_arguments as add_replica_arguments

    add_replica_arguments(p)


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineArgs.from_cli_args(args).create_engine_config()


# A public server's queue is bounded by default: requests that would wait longer than a few
# rounds of the running batch are better refused at once (503 + Retry-After) than left to time
# out, and an unbounded queue is memory that any client can make us spend.
QUEUE_PER_SEAT = 4


def queue_len(flag: int | None, max_num_seqs: int) -> int | None:
    """--max-queue-len as AsyncLLM takes it: unset → QUEUE_PER_SEAT × max_num_seqs, 0 → None."""
    if flag is None:
        return QUEUE_PER_SEAT * max_num_seqs
    if flag < 0:
        raise ValueError(f"--max-queue-len must be >= 0 (0: unbounded), got {flag}")
    return flag or None


def run(args: argparse.Namespace) -> int:
    from inferlab.ray_serve.launch import scale_config
    from inferlab.server.app import ServerSettings, build_app
    from inferlab.server.tenants import keys_from_args

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    scale = scale_config(args)  # None: one in-process server; bad replica flags fail here
    config = _engine_config(args)  # invalid values raise ValueError before anything starts
    if args.request_timeout is not None and args.request_timeout <= 0:
        raise ValueError(f"--request-timeout must be > 0, got {args.request_timeout}")
    served = tuple(args.served_model_name or ())
    api_key, tenants = keys_from_args(args.api_key, args.api_keys)
    limits = HttpLimits(
        max_request_body_bytes=args.max_request_body_bytes,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        send_timeout=args.send_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
    )
    settings = ServerSettings(
        served_model_names=served,
        api_key=api_key,
        tenants=tenants,
        limits=limits,
        metrics_public=args.metrics_public,
        log_prompts=args.log_prompts,
        max_queue_len=queue_len(args.max_queue_len, config.scheduler.max_num_seqs),
        request_timeout=args.request_timeout,
        shutdown_timeout=args.shutdown_timeout,
        kv_events=args.kv_events,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )

    if args.simulate is not None:
        if scale is not None:
            raise ValueError("--simulate runs one simulated replica; start several on their own ports instead of "
                             "--replicas")
        from inferlab.server.sim_engine import SimulatedEngine, load_step_clock

        cost = load_step_clock(args.simulate)  # a bad file: one line, before anything starts
        app = build_app(lambda: SimulatedEngine(config, cost), settings)
        return run_server(app, args.host, args.port, shutdown_timeout=args.shutdown_timeout, log_level=args.log_level)

    if scale is not None:
        from inferlab.ray_serve.launch import run_replicas

        return run_replicas(scale, EngineArgs.from_cli_args(args), settings, args.host, args.port)

    def make_engine():
        from inferlab.engine.llm_engine import LLMEngine

        return LLMEngine(config)

    app = build_app(make_engine, settings)
    return run_server(app, args.host, args.port, shutdown_timeout=args.shutdown_timeout, log_level=args.log_level)


def run_server(app, host: str, port: int, *, shutdown_timeout: float = 30.0, log_level: str = "info") -> int:
    """Serve `app` (from `build_app`) until SIGTERM/SIGINT; 0 after a clean drain.

    A model that fails to load stops the server: its error is raised (user errors: exit 2)
    or reported with status 1.
    """
    import uvicorn

    from inferlab.server.httputil import run_until_sigterm
    from inferlab.server.limits import uvicorn_options

    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            access_log=False,  # the server logs one line per request itself
            timeout_graceful_shutdown=shutdown_timeout,
            lifespan="on",
            **uvicorn_options(app.state.settings.limits),
        )
    )
    llm = app.state.llm

    def stop_when_load_fails() -> None:
        llm.wait_ready()
        if llm.load_error is not None:
            server.should_exit = True

    threading.Thread(target=stop_when_load_fails, name="inferlab-load-watch", daemon=True).start()
    run_until_sigterm(server)
    if llm.load_error is not None:
        err = llm.load_error
        if isinstance(err, (ValueError, FileNotFoundError, NotADirectoryError, PermissionError)):
            raise err
        print(f"inferlab serve: the model failed to load: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0
