"""Structured outputs: a request's JSON schema, regex, choice or grammar as a token mask per step.

The grammar engine is llguidance (chosen over xgrammar by benchmarks/structured_outputs_bench.py:
a schema compiles in ~15-20 ms against ~1 s, since llguidance derives masks lazily from a
lexer where xgrammar precomputes them over the whole vocabulary; at 32 streams both fill their
masks in a small share of a decode step; and it installs as one 3 MB wheel with no
dependencies, where xgrammar requires triton, useless on a CPU). Three stages, each where it
costs least:

- **compile** (`GrammarCompiler.compile`): the grammar text checked and a fresh matcher built
  (the lexer), once per distinct constraint (an LRU cache keyed by `StructuredOutputsParams.key`).
  The server calls it on a worker thread before the request reaches the engine, so a new
  schema never stalls a step, and an invalid one is a 400 naming the problem;
- **per sequence** (`GrammarCompiler.matcher`): a copy of the cached fresh matcher, one per
  sequence (n > 1 children each have their own), cheap;
- **per step** (`GrammarMasker`): the sampler has every constrained row's bitmask filled into a
  buffer kept across steps and applies them in place to those logits rows, branch-free
  (`apply_bitmask`), a request with speculative drafts one mask per draft position (its matcher
  taken through the drafts and rolled back); the scheduler advances each matcher with the
  tokens it appends (`Grammar.accept`) and ends the request when the grammar is complete.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from inferlab.engine.request import StructuredOutputsParams

# JSON as `json.dumps` writes it (one space after ',' and ':'), no other whitespace: a model can
# never stall in runs of spaces or newlines, which flexible whitespace allows.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled constraints kept (LRU)

# Row k of the table: byte value k as eight float32 limits, +inf where its bit is set (the token
# allowed: min(x, +inf) is x itself), -inf where it is not (min(x, -inf) is -inf).
_LIMITS = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, np.inf, -np.inf).astype(np.float32)
# The limits are expanded a few rows at a time into a buffer of about this size, which stays in
# a core's L2 (a whole [32, 49,152] float32 batch at once is 6 MB, read back from memory).
_CHUNK_BYTES = 1 << 19


class Grammar:
    """One sequence's matcher: where its text is in the grammar."""

    __slots__ = ("_m",)

    def __init__(self, matcher: Any):
        self._m = matcher

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar refuses it."""
        return bool(self._m.consume_token(token))

    def is_terminated(self) -> bool:
        """The grammar is complete (its stop token taken, or nothing more can follow)."""
        return bool(self._m.is_stopped())

    @property
    def matcher(self) -> Any:
        """The llguidance matcher itself (GrammarMasker fills many in one call)."""
        return self._m


class GrammarCompiler:
    """Constraints → matchers for one tokenizer. Thread-safe: the server compiles on worker
    threads while the engine thread makes matchers from the cache."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...] = ()):
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._llg_tokenizer: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def _tokenizer(self) -> Any:
        """llguidance's view of the vocabulary (~1 s to build): made on first use, not at start."""
        with self._lock:
            if self._llg_tokenizer is None:
                import llguidance.hf

                self._llg_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab_size, eos_token=self._eos or None)
            return self._llg_tokenizer

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The constraint's fresh matcher (cached); ValueError naming the problem if it is invalid."""
        key = params.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        import llguidance

        tok = self._tokenizer()
        grammar = grammar_text(params)
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{params.source}: {_clean(matcher.get_error())}")
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, params: StructuredOutputsParams) -> Grammar:
        """A new sequence's matcher for `params` (compiled now unless it is cached)."""
        return Grammar(self.compile(params).deep_copy())


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for a constraint; ValueError for one that is not even well formed."""
    import llguidance

    src = params.source
    if params.json is not None or params.json_object:
        text = params.json if params.json is not None else '{"type": "object"}'
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{src}: the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"{src}: a JSON schema must be an object, got {type(schema).__name__}")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
        except ValueError as e:
            raise ValueError(f"{src}: invalid JSON schema: {e}") from None
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    assert params.grammar is not None
    try:
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or llama.cpp's GBNF
    except ValueError as e:
        raise ValueError(f"{src}: {e}") from None


def _clean(message: str) -> str:
    return " ".join(message.split())[:500]


class GrammarMasker:
    """The sampler's per-step mask work, with its buffers kept across steps: each constrained
    row's bitmask filled by its matcher, then applied to the logits in place (our kernel's
    apply_bitmask_ where the kernels run, else one branch-free numpy pass per run of adjacent
    rows). Rows without a grammar cost nothing."""

    def __init__(self, kernel: bool = False) -> None:
        # kernel: apply through our CPU kernels' apply_bitmask_ (the engine's backends decided
        # they run here: the fused sampler's flag), else `apply_bitmask` below, the definition.
        self.kernel = kernel
        self._bitmask = torch.empty((0, 0), dtype=torch.int32)
        self._scratch = np.empty((0, 0, 8), dtype=np.float32)

    def __call__(self, logits: torch.Tensor, rows: list[int], grammars: list[Grammar],
                 drafts: list[Sequence[int]] | None = None) -> None:
        """Set logits[rows[k], j] to -inf for every token j that grammars[k] forbids next (with
        `drafts`, see `fill`)."""
        bitmask = self.fill(grammars, logits.shape[1], drafts)
        if self.kernel and logits.dtype == torch.float32 and logits.is_contiguous() and logits.device.type == "cpu":
            torch.ops.inferlab.apply_bitmask_(logits, bitmask, torch.tensor(rows, dtype=torch.long))
        else:
            apply_bitmask(logits, bitmask, rows, self)

    def fill(self, grammars: list[Grammar], vocab: int, drafts: list[Sequence[int]] | None = None) -> torch.Tensor:
        """[len(grammars), ceil(vocab / 32)] int32 bitmask, row k grammars[k]'s (a view of the
        buffer: valid until the next call). Bit j of word w allows token 32w + j.

        Speculative decoding: where drafts[k] holds a request's d drafts, rows k + 1 .. k + d are
        its targets after each of them (the same grammar), and get the matcher's masks after
        drafts[k][:1], [:2], ...: the matcher takes the drafts it accepts, one at a time, and is
        rolled back after. From the first draft it refuses (or a draft that completes it) on,
        the rows repeat the last mask: verification never reads them, since the target there
        cannot be that draft (it is masked out), or the request ends at the completing one.

        One matcher at a time on the calling thread: llguidance's threaded batch call
        (LLExecutor) has to wake its pool threads first, and on two cores still busy (the forward
        pass's threads, other processes) they wait for one: on a loaded 2-core machine its
        median fill at 16 streams was ~20x this loop's."""
        n, words = len(grammars), (vocab + 31) // 32
        if self._bitmask.shape[0] < n or self._bitmask.shape[1] != words:
            self._bitmask = torch.empty((max(n, self._bitmask.shape[0]), words), dtype=torch.int32)
        bitmask = self._bitmask[:n]
        base, row_bytes = bitmask.data_ptr(), words * 4
        k = 0
        while k < n:  # every row written: nothing is left from an earlier step
            m = grammars[k].matcher
            m.unsafe_compute_mask_ptr(base + k * row_bytes, row_bytes)
            tokens = list(drafts[k]) if drafts is not None else []
            if tokens:
                valid, taken = m.validate_tokens(tokens), 0
                for j in range(1, len(tokens) + 1):
                    if taken == j - 1 < valid and not m.is_stopped():
                        taken += m.consume_token(tokens[j - 1])
                    if taken == j and not m.is_stopped():
                        m.unsafe_compute_mask_ptr(base + (k + j) * row_bytes, row_bytes)
                    else:
                        bitmask[k + j] = bitmask[k + j - 1]
                if taken:
                    m.rollback(taken)
            k += 1 + len(tokens)
        return bitmask

    def scratch(self, rows: int, words: int) -> np.ndarray:
        """A [rows, 4 * words, 8] float32 buffer for apply_bitmask, reused across steps."""
        if self._scratch.shape[0] < rows or self._scratch.shape[1] != 4 * words:
            self._scratch = np.empty((rows, 4 * words, 8), dtype=np.float32)
        return self._scratch[:rows]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None,
                  masker: GrammarMasker | None = None) -> None:
    """logits[rows[k], j] = -inf where bit j of bitmask[k] is 0 (rows: 0 .. len(bitmask) - 1
    when None), in place; every other value is left exactly as it is. logits: float32 on the CPU.

    Branch-free, so its cost does not depend on the mask: each byte of a word (little-endian:
    byte b of word w holds tokens 32w + 8b ..) looks up its eight limits (+inf allowed, -inf
    forbidden), and the row takes the elementwise minimum with them. A select per token
    (torch.where, numpy's putmask) branches, and costs several times more where allowed and
    forbidden tokens interleave, as they do for free text inside a grammar. A NaN logit stays
    NaN either way."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu":
        raise ValueError(f"grammar masks apply to float32 CPU logits, got {logits.dtype} on {logits.device}")
    n, words = bitmask.shape
    vocab = logits.shape[1]
    if rows is None:
        rows = list(range(n))
    lg = logits.numpy()
    codes = bitmask.numpy().view(np.uint8)  # [n, 4 * words]
    chunk = max(1, _CHUNK_BYTES // (words * 128))
    scratch = (masker or GrammarMasker()).scratch(min(chunk, n), words)
    k = 0
    while k < n:  # one run of adjacent rows at a time: row views, no gather or scatter
        first, end = rows[k], k + 1
        while end < n and rows[end] == first + end - k:
            end += 1
        for a in range(k, end, chunk):
            m = min(chunk, end - a)
            limits = scratch[:m]
            np.take(_LIMITS, codes[a : a + m], axis=0, out=limits, mode="wrap")
            dst = lg[first + a - k : first + a - k + m]
            np.minimum(dst, limits.reshape(m, -1)[:, :vocab], out=dst)
        k = end
