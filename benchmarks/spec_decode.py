"""Speculative decoding (n-gram prompt lookup) against plain decoding, one stream, one process.

Two engines on the same model (speculation off / on) take turns on each workload, so machine
load drifts over both alike; prints, per workload, the median one-stream decode tokens/s of
each (first token to last: the part speculation changes), the median of each turn's ratio, the mean accepted length
(tokens per verification step), the acceptance rate and accepted drafts per position, whether
the greedy token ids were identical, and the load average. Workloads: a copy-heavy chat prompt
("repeat this text"), an edit of a given text, and plain chat.

    .venv/bin/python benchmarks/spec_decode.py [--model PATH] [--k 4] [--max-n 4] [--min-n 2] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from inferlab import LLM, SamplingParams

TEXT = ("The committee met on Tuesday to review the budget for the new library. After a long discussion, the members "
        "agreed to fund the children's reading room, to repair the roof before winter, and to extend the opening "
        "hours on weekends. The treasurer will publish the final figures next month.")
WORKLOADS = {
    "copy": f"Repeat this text exactly, word for word:\n\n{TEXT}",
    "edit": f"Rewrite this text with every 'the' in capital letters, changing nothing else:\n\n{TEXT}",
    "chat": "Tell me about the history of Rome, from its founding to the fall of the Western Empire.",
}


def one(llm: LLM, prompt: str, params: SamplingParams) -> tuple[float, list[int], dict]:
    out = llm.chat([{"role": "user", "content": prompt}], params, use_prefix_cache=False)[0]
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    tps = (n - 1) / (m.last_token_time - m.first_token_time) if n > 1 else 0.0
    return tps, out.outputs[0].token_ids, m.timings()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-n", type=int, default=4, help="prompt_lookup_max")
    ap.add_argument("--min-n", type=int, default=2, help="prompt_lookup_min")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    ap.add_argument("--json", action="store_true", help="also print the rows as one JSON line")
    args = ap.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.max_n,
            "prompt_lookup_min": args.min_n}
    base, fast = LLM(args.model), LLM(args.model, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    load0 = os.getloadavg()[0]
    rows = []
    for name in args.workloads.split(","):
        prompt = WORKLOADS[name]
        one(base, prompt, params), one(fast, prompt, params)  # warm-up, both
        before = fast.engine.get_stats()
        t_base, t_spec, same, draft_n, accepted = [], [], True, 0, 0
        for _ in range(args.runs):
            tb, ids_b, _ = one(base, prompt, params)
            ts, ids_s, timings = one(fast, prompt, params)
            t_base.append(tb)
            t_spec.append(ts)
            same &= ids_b == ids_s
            draft_n += timings.get("draft_n", 0)
            accepted += timings.get("draft_n_accepted", 0)
        after = fast.engine.get_stats()
        drafts = after.spec_num_drafts - before.spec_num_drafts
        per_pos = [a - (before.spec_accepted_per_pos[j] if j < len(before.spec_accepted_per_pos) else 0)
                   for j, a in enumerate(after.spec_accepted_per_pos)]
        rows.append({
            "workload": name, "tokens": len(ids_s), "base_tok_s": statistics.median(t_base),
            "spec_tok_s": statistics.median(t_spec),
            # The median of each turn's own ratio: a turn's two runs are seconds apart, so a load
            # that drifts over the whole run cancels more than in the ratio of medians.
            "ratio": statistics.median(s / b for s, b in zip(t_spec, t_base)),
            "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0,
            "acceptance_rate": accepted / draft_n if draft_n else 0.0, "accepted_per_pos": per_pos,
            "identical": same,
        })
        print(f"  {name}: base {rows[-1]['base_tok_s']:.1f} tok/s, ngram {rows[-1]['spec_tok_s']:.1f} tok/s", flush=True)
    load1 = os.getloadavg()[0]
    print(f"speculative_config {json.dumps(spec)}; medians of {args.runs}; load average {load0:.1f} -> {load1:.1f} "
          f"on {os.cpu_count()} CPUs")
    print(f"{'workload':8} {'out':>4} {'base tok/s':>10} {'ngram tok/s':>11} {'ratio':>6} {'accepted len':>12} "
          f"{'accept rate':>11}  identical  accepted per position")
    for r in rows:
        print(f"{r['workload']:8} {r['tokens']:>4} {r['base_tok_s']:>10.1f} {r['spec_tok_s']:>11.1f} {r['ratio']:>6.2f} "
              f"{r['mean_accepted_length']:>12.2f} {r['acceptance_rate']:>11.2f}  {str(r['identical']):9}  "
              f"{r['accepted_per_pos']}")
    if args.json:
        print(json.dumps({"spec": spec, "load": [load0, load1], "rows": rows}))


if __name__ == "__main__":
    main()
