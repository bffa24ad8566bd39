"""inferlab beside its peers on this machine: the same `inferlab bench` workloads against
`inferlab serve` and each available peer server, one server at a time, and ONE table.

    .venv/bin/python benchmarks/side_by_side.py                        # the full run (estimate printed first)
    .venv/bin/python benchmarks/side_by_side.py --quick                # tiny workloads, 1 repeat: a smoke test
    .venv/bin/python benchmarks/side_by_side.py --dry-run              # the plan, the estimate and the commands only
    .venv/bin/python benchmarks/side_by_side.py \\
        --inferlab-variant 16-bit="--weight-dtype float16" --inferlab-variant 8-bit="--weight-dtype int8" \\
        --sweep --markdown benchmarks/results/side_by_side.md --json benchmarks/results/side_by_side.json

Figures (the issue's targets; same weights, SmolLM2-135M-Instruct, everywhere):
  1. under load: N concurrent streams (default 32 × 1 request), 256-token prompts, 128 tokens out
     (ignore_eos): output tokens/s;
  2. prefill: one 1,024-token prompt: TTFT (ms);
  3. one stream: 128-token prompt, 128 tokens out: decode tokens/s = output tokens over decode time
     = 1000 / median TPOT, TPOT = (E2E − TTFT) / (output tokens − 1), the same for every system
     (1000 / median ITL is shown beside it);
  4. beside, not compared: the decode ceiling that memory bandwidth allows, bandwidth / (weight
     bytes + KV bytes read per step), with the bandwidth measured by `inferlab plan --measure-cpu`
     and inferlab's storage as its server reports it (`GET /server_info`);
  5. with --sweep: output tokens/s and p95 ITL at concurrency 1, 2, 4, ..., 64 (inferlab; peers too
     with --sweep-peers), one PNG.

Peers (set up by ../shared/peers/*.sh, see its README; missing ones are skipped with the command
that sets them up): llama.cpp's llama-server with the Q4_1 GGUF as shipped and with an F16 GGUF,
and vLLM's CPU build. A peer that fails to start shows "failed: reason" in its column.

The package: systems/ (the registry: inferlab, llama_cpp, vllm, one module each), workloads.py
(what runs and which figures are read), measure.py (servers and bench runs), floors.py (the
decode ceiling), report.py (tables, plot, Markdown, JSON), cli.py (flags, plan, main).

How the runs are kept fair on a small shared machine: one server at a time, stopped (its whole
process group) before the next starts; systems in the order A B C … for even repeats and
reversed for odd ones, so a drift in the machine's speed falls on all alike; a fresh --seed for
every bench run, because every server here keeps a prefix cache and repeated prompts would be
cheaper; one unmeasured warm-up after each server start; the load average and the CPU share that
*other* processes took during each run are recorded, with a warning when they are high.
"""
