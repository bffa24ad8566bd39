"""The prompts a benchmark sends: random prompts of an exact token length, a shared-prefix
workload, a JSONL file, or a ShareGPT file.

Random prompts follow `vllm bench serve --dataset-name random`: input and output lengths
are drawn uniformly from [⌊n·(1−r)⌋, ⌈n·(1+r)⌉] (r = --range-ratio, 0 = fixed), the prompt
leaves room for the special tokens the server adds (BOS) so that a completions request
counts exactly --input-len, and every prompt is different (no accidental prefix-cache hits).
The text is drawn from common English words rather than the whole vocabulary: any
tokenizer (even a server's /tokenize) round-trips it, and the prompt's content does not
change the cost of serving it, only its length does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from inferlab.bench.tokens import TextTokenizer

DATASETS = ("random", "shared-prefix", "jsonl", "sharegpt")
DEFAULT_INPUT_LEN = 1024
DEFAULT_OUTPUT_LEN = 128

# Plain words whose pieces every common tokenizer round-trips (encode(decode(ids)) == ids).
WORDS = (
    "the of and to in is was for that with as on by at from his her they this had not are but be "
    "have one all were which she their an there been has when who will more no if out so said what "
    "up its about into than them can only other new some could time these two may then do first any "
    "my now such like our over man me even most made after also did many before must through back "
    "years where much your way well down should because each just those people how too little state "
    "good very make world still own see men work long get here between both life being under never "
    "day same another know while last might us great old year off come since against go came right "
    "used take three small house water light river city table window garden music story paper road "
    "morning evening winter summer market letter number group power point money system question"
).split()


@dataclass(frozen=True)
class SampleRequest:
    """One prompt to send and how many tokens to ask for."""

    prompt: str  # the user's text (completions: sent after `system`)
    prompt_len: int | None  # tokens the server will count for a completions request; None = unknown
    output_len: int | None  # max_tokens; None = the server's default
    system: str = ""  # a shared system prompt (chat) / prefix (completions)
    messages: tuple[dict[str, Any], ...] | None = None  # a whole conversation from a file (chat only)


@dataclass(frozen=True)
class DatasetSpec:
    """Which prompts, how many, how long. Validated here so that bad input fails before any request."""

    name: str = "random"
    num_prompts: int = 1000
    input_len: int = DEFAULT_INPUT_LEN
    output_len: int | None = None  # None: DEFAULT_OUTPUT_LEN (random), the file's own (jsonl/sharegpt)
    range_ratio: float = 0.0
    prefix_len: int = 0
    num_prefixes: int = 1
    path: str | None = None
    seed: int = 0
    shuffle: bool = True  # file datasets: shuffle with the seed (as vLLM does); False keeps file order

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}, got {self.name!r}")
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.input_len < 1:
            raise ValueError(f"--input-len must be >= 1, got {self.input_len}")
        if self.output_len is not None and self.output_len < 1:
            raise ValueError(f"--output-len must be >= 1, got {self.output_len}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.prefix_len < 0:
            raise ValueError(f"--prefix-len must be >= 0, got {self.prefix_len}")
        if self.num_prefixes < 1:
            raise ValueError(f"--num-prefixes must be >= 1, got {self.num_prefixes}")
        if self.name == "shared-prefix" and self.prefix_len < 1:
            raise ValueError("--dataset shared-prefix needs --prefix-len N (the shared system prompt's tokens)")
        if self.name in ("jsonl", "sharegpt") and not self.path:
            raise ValueError(f"--dataset {self.name} needs --dataset-path")


@dataclass
class Dataset:
    """The requests to send, plus notes worth printing beside the results."""

    requests: list[SampleRequest]
    notes: list[str] = field(default_factory=list)


def length_range(n: int, ratio: float, minimum: int = 0) -> tuple[int, int]:
    """vLLM's sampling interval for a length: [⌊n·(1−r)⌋, ⌈n·(1+r)⌉], at least `minimum`."""
    return max(minimum, math.floor(n * (1 - ratio))), max(minimum, math.ceil(n * (1 + ratio)))


def load_dataset(spec: DatasetSpec, tokenizer: Callable[[], TextTokenizer]) -> Dataset:
    """Build the requests. `tokenizer` is called only when the dataset needs one."""
    if spec.name in ("random", "shared-prefix"):
        return random_dataset(spec, tokenizer())
    if spec.name == "jsonl":
        return jsonl_dataset(spec, tokenizer)
    return sharegpt_dataset(spec, tokenizer())


class _TextMaker:
    """Texts of an exact token count, built from a pool of word tokens."""

    MAX_TRIES = 10

    def __init__(self, tok: TextTokenizer, rng: np.random.Generator) -> None:
        self.tok, self.rng = tok, rng
        pool = sorted(set(tok.encode(" " + " ".join(WORDS))))
        if len(pool) < 2:
            raise ValueError(f"the tokenizer {tok.name} turns plain English words into fewer than 2 distinct tokens")
        self.pool = np.asarray(pool)
        self.mismatched = 0  # texts whose length could not be made exact (tokens merging at borders)

    def _draw(self, n: int) -> list[int]:
        return self.pool[self.rng.integers(0, len(self.pool), size=n)].tolist()

    def text(self, n: int, head: str = "") -> tuple[str, int]:
        """(text, tokens) with `len(encode(head + text)) - len(encode(head)) == n` when achievable.

        Decode, re-encode and trim or top up, as vLLM does: n tokens can decode to a string
        that encodes to a different number of tokens.
        """
        if n <= 0:
            return "", 0
        base = len(self.tok.encode(head)) if head else 0
        ids = self._draw(n)
        text, got = "", 0
        for _ in range(self.MAX_TRIES):
            text = self.tok.decode(ids)
            if head and text and not head[-1].isspace() and not text[0].isspace():
                text = " " + text  # tokenizers that drop a leading space would glue the first word to the head
            got_ids = self.tok.encode(head + text)[base:]
            got = len(got_ids)
            if got == n:
                return text, n
            ids = got_ids[:n] if got > n else got_ids + self._draw(n - got)
        self.mismatched += 1
        return text, got


def random_dataset(spec: DatasetSpec, tok: TextTokenizer) -> Dataset:
    """Random prompts (vLLM's random dataset); with --prefix-len, K shared prefixes in front.

    A request's prompt is prefix_len + (sampled input length) tokens as the server counts a
    completions prompt; with --endpoint chat the prefix becomes the system message and the
    server's chat template adds its own tokens (usage reports them).
    """
    rng = np.random.default_rng(spec.seed)
    special = tok.num_special_tokens()
    real_input = max(0, spec.input_len - special)
    in_lo, in_hi = length_range(real_input, spec.range_ratio)
    out_len = spec.output_len or DEFAULT_OUTPUT_LEN
    out_lo, out_hi = length_range(out_len, spec.range_ratio, minimum=1)
    if spec.prefix_len + in_lo < 1:
        raise ValueError(f"--input-len {spec.input_len} leaves no prompt tokens after {special} special token(s)")
    n = spec.num_prompts
    input_lens = rng.integers(in_lo, in_hi + 1, size=n)
    output_lens = rng.integers(out_lo, out_hi + 1, size=n)

    maker = _TextMaker(tok, rng)
    prefixes = [maker.text(spec.prefix_len)[0] for _ in range(spec.num_prefixes)] if spec.prefix_len else [""]
    # Every prefix serves an equal share of the prompts, interleaved at random (vLLM shuffles too).
    groups = rng.permutation(np.arange(n) % len(prefixes))
    requests = []
    for i in range(n):
        prefix = prefixes[int(groups[i])]
        text, _ = maker.text(int(input_lens[i]), head=prefix)
        prompt_len = len(tok.encode(prefix + text)) + special
        requests.append(SampleRequest(prompt=text, prompt_len=prompt_len, output_len=int(output_lens[i]), system=prefix))
    notes = []
    if maker.mismatched:
        notes.append(f"{maker.mismatched} prompt(s) could not be made an exact length; their real lengths are used")
    if spec.prefix_len:
        notes.append(f"{len(prefixes)} shared prefix(es) of {spec.prefix_len} tokens, {n} prompts spread over them")
    return Dataset(requests, notes)


def _repeat(requests: list[SampleRequest], n: int, what: str, notes: list[str]) -> list[SampleRequest]:
    """The first n requests, cycling through the file when it holds fewer."""
    if not requests:
        raise ValueError(f"{what} holds no usable prompts")
    if len(requests) < n:
        notes.append(f"{what} holds {len(requests)} usable prompts; repeated to make {n}")
    return [requests[i % len(requests)] for i in range(n)]


def jsonl_dataset(spec: DatasetSpec, tokenizer: Callable[[], TextTokenizer] | None = None) -> Dataset:
    """One JSON object a line: {"prompt": str} or {"messages": [...]}, optional "output_len"/"max_tokens"
    and "system". Prompt lengths are counted with the tokenizer when one can be had. Shuffled with
    the seed unless `spec.shuffle` is False (then the file's order, e.g. a trace, is kept)."""
    path = Path(spec.path or "")
    if not path.is_file():
        raise FileNotFoundError(f"--dataset-path {path}: no such file")
    tok = _optional(tokenizer)
    special = tok.num_special_tokens() if tok else 0
    out: list[SampleRequest] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not (isinstance(obj.get("prompt"), str) or isinstance(obj.get("messages"), list)):
                raise ValueError(f'{path}:{lineno}: each line needs "prompt" (a string) or "messages" (a list)')
            output_len = obj.get("output_len", obj.get("max_tokens", spec.output_len or DEFAULT_OUTPUT_LEN))
            if not isinstance(output_len, int) or output_len < 1:
                raise ValueError(f"{path}:{lineno}: output_len must be a positive integer, got {output_len!r}")
            system = str(obj.get("system") or "")
            messages = tuple(obj["messages"]) if isinstance(obj.get("messages"), list) else None
            prompt = obj.get("prompt") or ""
            counted = system + prompt if messages is None else " ".join(str(m.get("content", "")) for m in messages)
            prompt_len = len(tok.encode(counted)) + special if tok else None
            out.append(SampleRequest(prompt=prompt, prompt_len=prompt_len, output_len=output_len, system=system, messages=messages))
    notes: list[str] = []
    if tok is None:
        notes.append("no tokenizer: prompt lengths come from the server's usage only")
    if spec.shuffle:
        out = [out[int(k)] for k in np.random.default_rng(spec.seed).permutation(len(out))]
    return Dataset(_repeat(out, spec.num_prompts, str(path), notes), notes)


def sharegpt_dataset(spec: DatasetSpec, tok: TextTokenizer) -> Dataset:
    """ShareGPT conversations: the first human turn is the prompt; the reply's length is the
    output length unless --output-len is given. vLLM's filters: prompt and reply ≥ 4 tokens,
    prompt ≤ 1024, prompt + reply ≤ 2048. Shuffled with the seed."""
    path = Path(spec.path or "")
    if not path.is_file():
        raise FileNotFoundError(f"--dataset-path {path}: no such file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a ShareGPT JSON file ({e.msg})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}} entries")
    order = np.random.default_rng(spec.seed).permutation(len(data)) if spec.shuffle else np.arange(len(data))
    special = tok.num_special_tokens()
    out: list[SampleRequest] = []
    for k in order:
        if len(out) >= spec.num_prompts:
            break
        turns = data[int(k)].get("conversations") if isinstance(data[int(k)], dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        prompt, reply = str(turns[0].get("value", "")), str(turns[1].get("value", ""))
        prompt_len = len(tok.encode(prompt)) + special
        output_len = spec.output_len or len(tok.encode(reply))
        if prompt_len < 4 or (spec.output_len is None and output_len < 4):
            continue
        if prompt_len > 1024 or prompt_len + output_len > 2048:
            continue
        out.append(SampleRequest(prompt=prompt, prompt_len=prompt_len, output_len=output_len))
    notes: list[str] = []
    return Dataset(_repeat(out, spec.num_prompts, str(path), notes), notes)


def _optional(tokenizer: Callable[[], TextTokenizer] | None) -> TextTokenizer | None:
    """A tokenizer when one can be had, else None (JSONL prompts can go without)."""
    if tokenizer is None:
        return None
    try:
        return tokenizer()
    except (ValueError, FileNotFoundError, OSError):
        return None


def summarize_lengths(requests: Sequence[SampleRequest]) -> dict[str, Any]:
    """Mean/min/max prompt and output lengths, for the report's config section."""

    def stats(xs: list[int]) -> dict[str, float] | None:
        return {"mean": float(np.mean(xs)), "min": int(min(xs)), "max": int(max(xs))} if xs else None

    return {
        "prompt_tokens": stats([r.prompt_len for r in requests if r.prompt_len is not None]),
        "output_tokens": stats([r.output_len for r in requests if r.output_len is not None]),
    }
