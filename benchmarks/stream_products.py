"""How fast our few-row products stream their weights from memory, against torch.sum over the same
bytes in the same loop: the question behind batch 1's share of its roof (benchmarks/profile_step.py
reads the roof as torch.sum's bandwidth; a decode step of one stream is ~93% products).

    .venv/bin/python benchmarks/stream_products.py [--threads 2] [--rows 1] [--mats 16] [--rounds 9]

Weights: `--mats` matrices of 3072 x 4096 (201 MB of int8 codes, 403 MB of float16 at 16: far beyond
any L3 we meet), each multiplied once per round by `--rows` rows of x: w8a8 through
WeightOnlyLinear (int8 codes in panels, x quantized per 64 values), float16 through the kernels'
linear_w16. Each round times every system once, alternated, and prints the medians (the first
round left out) in GB/s of weight bytes and as a share of torch.sum's rate over a float32 tensor of
the same size. Session 30, AVX2 kind (Zen 3), 2 threads, one row: w8a8 23.1 GB/s against 34.4
(67%), float16 28.2 against 33.3 (85%); session 31, the same host, after w8a8's tile stopped
reading its corrections and prefetched 1 KiB ahead: w8a8 21.1 against 26.9 (79%), float16 24.8
against 27.5 (90%).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=1, help="rows of x (decode streams)")
    ap.add_argument("--mats", type=int, default=16, help="3072 x 4096 weight matrices (12.6 MB each as int8)")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    if min(args.threads, args.rows, args.mats) < 1 or args.rounds < 2:
        ap.error("--threads, --rows and --mats must be >= 1, --rounds >= 2")
    torch.set_num_threads(args.threads)
    from inferlab.kernels import build
    from inferlab.kernels.linear import WeightOnlyLinear

    build.load()
    print(build.kernel_info().describe())
    n, k = 3072, 4096
    torch.manual_seed(0)
    w8 = [WeightOnlyLinear(torch.randn(n, k) * 0.05, torch.int8, None, int8_activations=True) for _ in range(args.mats)]
    h16 = [torch.randn(n, k).half() for _ in range(args.mats)]
    x = torch.randn(args.rows, k)
    bytes8 = n * k * args.mats
    sum8 = torch.ones(bytes8 // 4)  # float32: the same bytes as the int8 codes
    sum16 = torch.ones(bytes8 // 2)  # ... as the float16 weights
    ops = torch.ops.inferlab
    systems = {
        "w8a8 (int8 panels)": (bytes8, lambda: [lin(x) for lin in w8]),
        "torch.sum, int8's bytes": (bytes8, lambda: sum8.sum()),
        "float16 (linear_w16)": (2 * bytes8, lambda: [ops.linear_w16(x, h, None, 256) for h in h16]),
        "torch.sum, float16's bytes": (2 * bytes8, lambda: sum16.sum()),
    }
    rates: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(args.rounds):
        for name, (nbytes, run) in systems.items():
            t0 = time.perf_counter()
            run()
            rates[name].append(nbytes / (time.perf_counter() - t0) / 1e9)
    med = {name: statistics.median(v[1:]) for name, v in rates.items()}
    print(f"{args.rows} row(s), {args.threads} threads, {args.mats} matrices of {n} x {k}, medians of {args.rounds - 1}")
    for name, roof in (("w8a8 (int8 panels)", "torch.sum, int8's bytes"), ("float16 (linear_w16)", "torch.sum, float16's bytes")):
        print(f"  {name:<22} {med[name]:6.1f} GB/s   {roof}: {med[roof]:6.1f} GB/s   share {med[name] / med[roof]:.0%}")


if __name__ == "__main__":
    main()
