"""xgrammar against llguidance, the two grammar engines vLLM and SGLang use, on what our engine
would pay for structured outputs, and the mask's share of a real 32-stream decode step:

- **compile**: one JSON schema into a grammar the matcher can run (a request pays it once at
  admission; the engine caches it by schema), cold, median of several runs on fresh compilers;
- **mask per step at 32 streams**: fill the next-token bitmask of 32 matchers (each part-way
  through a different valid answer) and apply it to float32 logits [32, vocab], then advance
  every matcher by its next token: the work a decode step adds. The fill is timed both ways
  each library offers (a Python loop of one-matcher calls, and its own threaded batch call),
  the apply both ways too (the library's CPU kernel where it has one, and inferlab's branch-free
  apply, engine/structured_outputs.py's `apply_bitmask`, what the sampler runs);
- **engine** (`--engine`): whole `engine.step()` wall times of `--streams` requests decoding on
  the engine (the default model unless --model) without a grammar and with three that never end
  (free letters; a JSON schema's objects, as `response_format` compiles them; a JSON-like regex
  with strings of a custom class, llguidance's slowest masks), alternated run by run after a
  warm-up round; the mask's cost as a share of the plain step, and the sampler's mask stage
  (fill + apply) timed on its own.

Libraries alternate run by run; medians are printed. The tokenizer is the default model's
(SmolLM2, vocab 49,152) when its GGUF is given or cached, else the tests' tiny BPE padded to
--vocab. Run it on a quiet machine; the figure for the issue's must-show (<= 10% of the step)
in under 3 minutes:

    timeout 180 .venv/bin/python benchmarks/structured_outputs_bench.py --engine --runs 5

(`--engine-only` skips the library table; `--model PATH.gguf` picks the model; a smoke run:
`--engine-only --runs 1 --streams 4 --engine-tokens 8`.)

(xgrammar is not an inferlab dependency: install it next to llguidance to compare,
`pip install --no-deps xgrammar apache-tvm-ffi`: its own requirements pull triton in.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from inferlab.engine.structured_outputs import GrammarMasker, apply_bitmask

MASKER = GrammarMasker()  # apply_bitmask's buffers, kept across calls as the sampler keeps them

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address", "active"],
    "additionalProperties": False,
}


def answers(n: int) -> list[str]:
    """n different valid instances of SCHEMA (what 32 streams would be writing)."""
    roles = SCHEMA["properties"]["role"]["enum"]
    out = []
    for i in range(n):
        doc = {"name": f"User number {i} of the benchmark", "age": (7 * i) % 121, "role": roles[i % 3],
               "score": i * 1.25, "tags": [f"t{j}" for j in range(i % 4)],
               "address": {"city": f"City {i}", "zip": f"{10000 + i:05d}"}, "active": i % 2 == 0}
        out.append(json.dumps(doc, separators=(",", ":")))
    return out


def median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1000.0


def load_tokenizer(model: str | None, vocab: int) -> tuple[Any, int]:
    """(transformers tokenizer, logits vocabulary size)."""
    from inferlab.models.registry import resolve_model
    from inferlab.tokenizer import Tokenizer

    try:
        resolved = resolve_model(model)
        tok = Tokenizer.from_gguf(resolved.path) if resolved.format == "gguf" else Tokenizer.from_pretrained_dir(resolved.path)
        return tok._hf, max(vocab, tok.vocab_size)
    except Exception as e:  # noqa: BLE001 - no default model here: the tiny tokenizer
        print(f"(default model unavailable: {e}; the tiny tokenizer padded to {vocab})")
        import tempfile

        from transformers import AutoTokenizer

        from inferlab.models.testing import save_tiny_tokenizer

        d = save_tiny_tokenizer(tempfile.mkdtemp())
        return AutoTokenizer.from_pretrained(str(d)), vocab


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf: Any, vocab: int):
        import xgrammar as xgr

        self.xgr = xgr
        t0 = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.setup_s = time.perf_counter() - t0
        self.batch = xgr.BatchGrammarMatcher()

    def compile(self) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def fill_loop(self, ms: list[Any], bitmask: torch.Tensor) -> None:
        for i, m in enumerate(ms):
            m.fill_next_token_bitmask(bitmask, i)

    def fill_batch(self, ms: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, bitmask)

    def apply_own(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf: Any, vocab: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.llgt = llguidance.torch
        t0 = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
        self.setup_s = time.perf_counter() - t0
        self.executor = llguidance.LLExecutor()

    def compile(self) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
        m = self.llg.LLMatcher(self.tok, grammar)  # the lexer is built here
        if m.is_error():
            raise RuntimeError(m.get_error())
        m.compute_bitmask()  # and the first mask is where the rest of the work is done
        return grammar

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        return [self.llg.LLMatcher(self.tok, compiled) for _ in range(n)]

    def fill_loop(self, ms: list[Any], bitmask: torch.Tensor) -> None:
        for i, m in enumerate(ms):
            self.llgt.fill_next_token_bitmask(m, bitmask, i)

    def fill_batch(self, ms: list[Any], bitmask: torch.Tensor) -> None:
        self.llgt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], bitmask)

    def apply_own(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        apply_bitmask(logits, bitmask, masker=MASKER)  # its own is a torch.compile kernel: none on a plain CPU

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)


def run_once(lib: Any, hf: Any, vocab: int, streams: int, steps: int, fill: str, apply: str) -> tuple[float, float, float]:
    """(compile s, median fill ms, median apply ms) for one fresh compile and `steps` decode steps."""
    t0 = time.perf_counter()
    compiled = lib.compile()
    compile_s = time.perf_counter() - t0
    eos = hf.eos_token_id
    texts = [hf.encode(a, add_special_tokens=False) + [eos] for a in answers(streams)]
    ms = lib.matchers(compiled, streams)
    for m, toks in zip(ms, texts):  # start part-way in, at different points
        for t in toks[: len(toks) // 4]:
            assert lib.accept(m, t)
    pos = [len(t) // 4 for t in texts]
    bitmask = torch.full((streams, (vocab + 31) // 32), -1, dtype=torch.int32)
    logits = torch.randn(streams, vocab)
    fills, applies = [], []
    fill_fn: Callable = lib.fill_batch if fill == "batch" else lib.fill_loop
    for _ in range(steps):
        if any(p >= len(t) - 1 for p, t in zip(pos, texts)):
            break
        t0 = time.perf_counter()
        fill_fn(ms, bitmask)
        t1 = time.perf_counter()
        work = logits.clone()
        t2 = time.perf_counter()
        (lib.apply_own if apply == "own" else (lambda lg, bm: apply_bitmask(lg, bm, masker=MASKER)))(work, bitmask)
        t3 = time.perf_counter()
        for i, m in enumerate(ms):
            tok = texts[i][pos[i]]
            assert bool(work[i, tok] > float("-inf")), f"{lib.name}: the mask refused a valid token"
            assert lib.accept(m, tok)
            pos[i] += 1
        fills.append(t1 - t0)
        applies.append(t3 - t2)
    return compile_s, median_ms(fills), median_ms(applies)


# Grammars whose only end is a DEL character (which no model writes), so all the streams decode
# for the whole run, one kind of mask each: letters allow ~2/3 of the vocabulary interleaved with
# the rest (free text); `json-schema` is SCHEMA's objects one after another, each through
# llguidance's JSON-schema compiler with the server's JSON options (what `response_format`
# gets: keys and punctuation forced, strings bounded by maxLength, enums, integer ranges); the
# JSON-like regex mixes forced keys with strings of a custom class and bounded length,
# `[a-z ]{1,20}`, llguidance's slowest kind of mask (its slices, precomputed token sets of JSON
# string characters, do not cover such a class, so every count walks the token list again).
def engine_grammars() -> dict[str, Any]:
    """name -> the request's StructuredOutputsParams."""
    from inferlab.engine.request import StructuredOutputsParams
    from inferlab.engine.structured_outputs import JSON_OPTIONS

    schema = json.dumps({**SCHEMA, "x-guidance": JSON_OPTIONS})
    return {
        "letters": StructuredOutputsParams(regex="[a-z ]+\x7f"),
        "json-schema": StructuredOutputsParams(grammar=f'start: (obj ", ")+ "\\u007f"\nobj: %json {schema}'),
        "json-like": StructuredOutputsParams(
            regex=r'\[(\{"name": "[a-z ]{1,20}", "age": [0-9]{1,2}, "ok": (true|false)\}, )+' + "\x7f"),
    }


def engine_share(model: str | None, streams: int, tokens: int, runs: int) -> None:
    """The mask's share of a real decode step: `streams` requests decoding `tokens` tokens each on
    the engine without a grammar and with each of engine_grammars(), alternated run by run (the
    order reversed every other run), after one warm-up round. A step is the whole `engine.step()`
    wall time (schedule, forward pass, sampler with the mask, matchers advanced, outputs), counted
    when all `streams` requests decode in it; the figure is the median over runs of each run's
    median step. The mask stage inside the sampler (fill + apply) is timed on its own too."""
    from inferlab import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=streams)
    engine = llm.engine
    steps: list[float] = []
    full = [False]
    engine.step_observer = lambda so, ro: full.__setitem__(0, len(so.scheduled) == streams and all(
        len(s.token_ids) == 1 for s in so.scheduled))
    step = engine.step

    def timed_step():  # type: ignore[no-untyped-def]
        full[0] = False
        t0 = time.perf_counter()
        out = step()
        if full[0]:
            steps.append(time.perf_counter() - t0)
        return out

    engine.step = timed_step  # type: ignore[method-assign]
    mask_times: list[float] = []
    masker = engine.runner.sampler.grammar_masks

    def timed_masker(*args: Any) -> None:
        t0 = time.perf_counter()
        masker(*args)
        mask_times.append(time.perf_counter() - t0)

    engine.runner.sampler.grammar_masks = timed_masker  # type: ignore[assignment]
    prompts = [f"Write a short story about the number {i}." for i in range(streams)]
    grammars = engine_grammars()
    names = ["plain", *grammars]
    results: dict[str, list[float]] = {n: [] for n in names}
    masks: dict[str, list[float]] = {n: [] for n in grammars}
    print(f"\nengine: {streams} streams x {tokens} tokens, {runs} runs after a warm-up round", flush=True)
    for r in range(runs + 1):  # round 0 warms up (first compile, buffers, caches) and is dropped
        for name in names if r % 2 else names[::-1]:
            steps.clear()
            mask_times.clear()
            so = grammars.get(name)
            params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=1, structured_outputs=so)
            outs = llm.generate(prompts, params)
            if r == 0:
                continue
            if so is not None:
                assert all(o.outputs[0].finish_reason == "length" for o in outs), "a grammar ended a stream early"
                masks[name].append(statistics.median(mask_times) * 1000)
            results[name].append(statistics.median(steps) * 1000)
            # As it goes, so that a run cut short by a timeout still shows what it measured.
            print(f"  run {r} {name}: median step {results[name][-1]:.2f} ms over {len(steps)} steps"
                  + (f", fill + apply {masks[name][-1]:.2f} ms" if so is not None else ""), flush=True)
    plain = statistics.median(results["plain"])
    print(f"\nengine, {streams} streams x {tokens} tokens, temperature 1, {runs} runs alternated "
          f"(median of per-run median whole steps; torch threads {torch.get_num_threads()}):")
    print(f"  plain: {plain:.2f} ms a step (runs: {', '.join(f'{x:.2f}' for x in results['plain'])})")
    for name in grammars:
        m = statistics.median(results[name])
        print(f"  {name}: {m:.2f} ms a step (runs: {', '.join(f'{x:.2f}' for x in results[name])}): "
              f"the mask costs {m - plain:.2f} ms = {(m - plain) / plain:.1%} of the plain step; "
              f"fill + apply alone {statistics.median(masks[name]):.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF or HF folder for the tokenizer (default: the default model)")
    ap.add_argument("--vocab", type=int, default=49152, help="logits width when the tiny tokenizer stands in")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed per run")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--engine", action="store_true",
                    help="also time whole decode steps on the engine (the model given, or the default), with and without a grammar")
    ap.add_argument("--engine-tokens", type=int, default=64)
    ap.add_argument("--engine-only", action="store_true", help="only the engine figures (implies --engine)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.engine_only:
        engine_share(args.model, args.streams, args.engine_tokens, args.runs)
        return
    hf, vocab = load_tokenizer(args.model, args.vocab)
    libs = []
    for cls in (XGrammar, LLGuidance):
        try:
            libs.append(cls(hf, vocab))
        except ImportError as e:
            print(f"{cls.name}: not installed ({e})")
    for lib in libs:
        print(f"{lib.name}: tokenizer setup {lib.setup_s * 1000:.0f} ms (once per server)")
    modes = [("loop", "own"), ("batch", "own"), ("batch", "inferlab")]
    results: dict[tuple[str, str, str], list[tuple[float, float, float]]] = {}
    for _ in range(args.runs):
        for lib in libs:  # alternated run by run
            for fill, apply in modes:
                results.setdefault((lib.name, fill, apply), []).append(
                    run_once(lib, hf, vocab, args.streams, args.steps, fill, apply))
    print(f"\nvocab {vocab}, {args.streams} streams, {args.runs} runs x {args.steps} steps (medians)")
    print(f"{'library':<11} {'fill':<6} {'apply':<6} {'compile ms':>10} {'fill ms':>8} {'apply ms':>8} {'mask/step ms':>12}")
    for (name, fill, apply), rs in results.items():
        c = statistics.median(r[0] for r in rs) * 1000
        f = statistics.median(r[1] for r in rs)
        a = statistics.median(r[2] for r in rs)
        print(f"{name:<11} {fill:<6} {apply:<6} {c:>10.1f} {f:>8.2f} {a:>8.2f} {f + a:>12.2f}")
    if args.engine:
        engine_share(args.model, args.streams, args.engine_tokens, args.runs)


if __name__ == "__main__":
    main()
