"""The `inferlab` command: one sub-command per job, each defined next to the code it runs.

Each sub-command module exposes `add_arguments(parser)` and `run(args) -> int`; they are
imported lazily so that `inferlab bench` never pays for importing torch.
User errors (ValueError, FileNotFoundError, ...) print one line and exit 2, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# sub-command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("inferlab.server.cli", "serve a model over an OpenAI-compatible HTTP API"),
    "generate": ("inferlab.entrypoints.generate_cli", "generate a reply offline (a prompt or chat messages)"),
    "tokenize": ("inferlab.entrypoints.tokenize_cli", "print a text's tokens, one `ID -> 'piece'` line each"),
    "perplexity": ("inferlab.quality.cli", "perplexity of a text (llama-perplexity's method), KL divergence from a base model"),
    "quant-report": ("inferlab.quality.report_cli",
                     "every weight mode and K/V dtype this machine runs: PPL, KLD vs float32 and decode speed"),
    "bench": ("inferlab.bench.cli", "load-test an OpenAI-compatible server and report latency, throughput, cost"),
    "plan": ("inferlab.plan.cli", "predict memory, speed and cost on paper"),
    "simulate": ("inferlab.plan.simulate_cli", "simulate the scheduler step by step with a cost model"),
    "router": ("inferlab.router.cli", "route OpenAI requests over several replicas (cache-aware, health, retries)"),
}


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, object | None]:
    parser = argparse.ArgumentParser(prog="inferlab", description="LLM inference engine, server and measuring tools")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    module = None
    for name, (mod_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            module = importlib.import_module(mod_name)
            module.add_arguments(p)
    return parser, module


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, module = build_parser(argv)
    args = parser.parse_args(argv)
    if module is None:
        parser.print_help()
        return 2
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, NotADirectoryError, PermissionError) as e:
        print(f"inferlab {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
