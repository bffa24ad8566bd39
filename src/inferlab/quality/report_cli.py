"""`inferlab quant-report`: every weight mode and K/V-cache dtype this machine runs, quality
(PPL, KLD vs a float32 base, same top token) and decode speed from one run, as a markdown
table, a PNG and a JSON document.

    inferlab quant-report [-m MODEL] -f TEXT [-c 512] [--chunks N] [--weight-dtypes a,b] \
        [--kv-cache-dtypes a,b] [--markdown OUT.md] [--png OUT.png] [--json OUT.json]

A sub-command of its own rather than `perplexity --compare`: it builds many engines, not one,
so perplexity's --weight-dtype / --kv-cache-dtype / --kl-divergence* would mean nothing there,
and it adds the speed runs and three outputs that perplexity has no use for.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from inferlab.engine.engine_args import EngineArgs
from inferlab.quality.cli import add_text_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    from inferlab.quality.report_modes import available_modes

    weights, kv = available_modes()
    EngineArgs.add_cli_args(p, only=("model",))
    add_text_arguments(p, "tokens per scoring step (default 2048)")
    p.add_argument("--weight-dtypes", default=None, metavar="A,B",
                   help=f"weight modes, each with auto K/V (default: all this machine runs of {','.join(weights)}; "
                        "none: no weight rows)")
    p.add_argument("--kv-cache-dtypes", default=None, metavar="A,B",
                   help=f"K/V dtypes, each with the default weights (default: all of {','.join(kv)}; none: no K/V rows)")
    p.add_argument("--kld-top-k", type=int, default=1024, help="base log-probs kept per token (default 1024; the rest as one bin)")
    p.add_argument("--streams", type=int, default=32, help="the concurrent decode run's streams (default 32)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="tokens per speed prompt (default 128)")
    p.add_argument("--output-tokens", type=int, default=64, help="tokens decoded per stream (default 64)")
    p.add_argument("--speed-runs", type=int, default=3, help="speed runs per mode, the median is reported (default 3)")
    p.add_argument("--markdown", default=None, metavar="OUT.md", help="write the table here (default: print it)")
    p.add_argument("--png", default=None, metavar="OUT.png", help="write the quality-vs-speed figure here")
    p.add_argument("--json", default=None, metavar="OUT.json", help="write every number here")


def run(args: argparse.Namespace) -> int:
    from inferlab.quality.quant_report import ReportSettings, json_ready, measure
    from inferlab.quality.report_modes import available_modes, parse_list, plan_modes
    from inferlab.quality.report_render import markdown, plot
    from inferlab.quality.report_speed import SpeedSettings

    offered_w, offered_kv = available_modes()
    weight_modes = parse_list(args.weight_dtypes, offered_w, "weight dtype")
    kv_modes = parse_list(args.kv_cache_dtypes, offered_kv, "K/V cache dtype")
    if args.ctx_size < 4 or args.batch_size < 1 or args.kld_top_k < 1:
        raise ValueError("-c must be >= 4, -b >= 1 and --kld-top-k >= 1")
    if not Path(args.file).is_file():
        raise FileNotFoundError(f"no text file {args.file}")
    speed = SpeedSettings(args.streams, args.prompt_tokens, args.output_tokens, args.speed_runs)
    modes, skipped = plan_modes(weight_modes, kv_modes, args.model)
    print(f"quant-report: {len(modes)} modes ({', '.join(m.label for m in modes)})"
          + (f"; skipped: {'; '.join(f'{s.label} ({s.reason})' for s in skipped)}" if skipped else ""), file=sys.stderr)
    settings = ReportSettings(args.model, args.file, args.ctx_size, args.chunks, args.batch_size, args.kld_top_k,
                              args.threads, speed=speed)
    doc = measure(settings, modes, skipped)
    doc["command"] = "inferlab quant-report " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["quant-report"] else [])
    text = markdown(doc)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text, encoding="utf-8")
        print(f"quant-report: wrote {args.markdown}", file=sys.stderr)
    else:
        print(text)
    if args.png:
        print(f"quant-report: wrote {plot(doc, args.png)}", file=sys.stderr)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(json_ready(doc), indent=1) + "\n", encoding="utf-8")
        print(f"quant-report: wrote {args.json}", file=sys.stderr)
    return 0
