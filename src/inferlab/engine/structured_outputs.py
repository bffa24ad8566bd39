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
- **per step**: the sampler fills one bitmask row per constrained row and applies them in one
  pass (`mask_logits`); the scheduler advances each matcher with the token it appends
  (`Grammar.accept`) and ends the request when the grammar is complete.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import torch

from inferlab.engine.request import StructuredOutputsParams

# JSON as `json.dumps` writes it (one space after ',' and ':'), no other whitespace: a model can
# never stall in runs of spaces or newlines, which flexible whitespace allows.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled constraints kept (LRU)

_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
_NEG_INF = torch.tensor(float("-inf"))


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

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 words, bit j of word w = token 32w + j)."""
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())


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


def mask_logits(logits: torch.Tensor, rows: list[int], grammars: list[Grammar]) -> torch.Tensor:
    """logits with every token grammar k forbids at -inf in row rows[k] (in place when every row
    is constrained, else on the gathered rows): one bitmask fill per matcher, one apply."""
    vocab = logits.shape[1]
    bitmask = torch.empty((len(rows), (vocab + 31) // 32), dtype=torch.int32)
    for k, g in enumerate(grammars):
        g.fill(bitmask, k)
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        apply_bitmask(logits, bitmask)
        return logits
    idx = torch.tensor(rows)
    sub = logits.index_select(0, idx)
    apply_bitmask(sub, bitmask)
    logits.index_copy_(0, idx, sub)
    return logits


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits[i, j] = -inf where bit j of bitmask row i is 0, in place: the words seen as bytes
    (little-endian: byte b of word w holds tokens 32w + 8b ..), each byte against its eight bits."""
    keep = torch.bitwise_and(bitmask.view(torch.uint8).unsqueeze(-1), _BITS).view(bitmask.shape[0], -1)
    torch.where(keep[:, : logits.shape[1]].bool(), logits, _NEG_INF, out=logits)
