"""Suffix decoding (the idea of arctic-inference's, our own code): drafts from what was already
said, counted, for the repetitive traffic of agents and code edits.

Two token corpora, read as depth-bounded counted suffix trees (every substring of up to D
tokens, with how often it occurs): each request's own prompt and output, and the outputs of the
last `max_cached_requests` finished requests (the oldest leaving when a new one comes in). A
proposal finds the longest suffix of the request's tokens that occurred before with a
continuation (up to D - K tokens long), then walks the most frequent continuation, as long as
its estimated probability (the product of each step's count / its siblings' counts) stays >=
min_token_prob and the drafts stay within max_spec_factor x the match length: a long, confident
match drafts many tokens, a short or ambiguous one few or none. Of the two corpora's proposals
the one with more expected accepted tokens (the sum of those probabilities) wins.

Why arrays and not node objects: a tree of Python nodes costs D node updates per token added
(a 200-token prompt: thousands of them, at every new request) and a dict walk per step; at 32
streams that was more time than the accepted drafts saved. A node of the tree is the set of
positions where its string ends, so the same counts come from numpy comparisons over an int32
copy of the tokens, grown in place as the output grows: a request costs O(its length) vector
work per proposal and nothing in between (a request the "when it pays" rule keeps from
drafting costs no proposing at all). No torch: the scheduler asks it when it schedules decodes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from inferlab.engine.request import Request

SEP = -1  # between outputs in the global corpus: no match or continuation crosses it
_EMPTY = np.empty(0, dtype=np.int64)


class TokenBuffer:
    """A request's tokens as a growing int32 array: only the tokens new since the last sync are
    copied (prompt and output only ever grow; rejected drafts never reach the output)."""

    def __init__(self) -> None:
        self.data = np.empty(256, dtype=np.int32)
        self.n = 0

    def sync(self, prompt: Sequence[int], output: Sequence[int]) -> np.ndarray:
        p, total = len(prompt), len(prompt) + len(output)
        if total > len(self.data):
            grown = np.empty(max(total, 2 * len(self.data)), dtype=np.int32)
            grown[: self.n] = self.data[: self.n]
            self.data = grown
        if self.n < p:
            self.data[self.n : p] = prompt[self.n :]
            self.n = p
        if self.n < total:
            self.data[self.n : total] = output[self.n - p :]
            self.n = total
        return self.data[: self.n]


def longest_match(seq: np.ndarray, context: Sequence[int], max_len: int) -> tuple[np.ndarray, int]:
    """The longest suffix of `context` (at most max_len tokens) that occurs in `seq` followed by
    a token, as (the positions in seq where its occurrences end, its length m); (empty, 0) if
    none. Every shorter suffix of an occurring one occurs at the same ends: the candidates are
    the ends of the last token, narrowed a token at a time while many (a common token in a big
    corpus), then each one's match length at once (a few vector operations whatever the length)."""
    n = len(seq)
    top = min(max_len, len(context))
    if top < 1 or n < 2:
        return _EMPTY, 0
    ends = np.flatnonzero((seq[:-1] == context[-1]) & (seq[1:] != SEP))
    m = 1
    while ends.size > 64 and m < top:
        prev = ends - m
        keep = ends[(prev >= 0) & (seq[np.maximum(prev, 0)] == context[-1 - m])]
        if not keep.size:
            return ends, m
        ends, m = keep, m + 1
    if not ends.size:
        return _EMPTY, 0
    if m < top:
        back = np.arange(m, top)
        idx = ends[:, None] - back  # [candidate, j]: where context[-1 - j] must be
        want = np.asarray(context[len(context) - top : len(context) - m], dtype=np.int64)[::-1]
        same = (idx >= 0) & (seq[np.maximum(idx, 0)] == want)
        more = np.cumprod(same, axis=1).sum(axis=1)  # matched tokens beyond the first m
        best = int(more.max())
        ends, m = ends[more == best], m + best
    return ends, m


def walk(seq: np.ndarray, ends: np.ndarray, m: int, depth: int, max_drafts: int,
         min_prob: float) -> tuple[list[int], float]:
    """From the occurrences `ends` of a matched string of length m: the most frequent next token
    (ties: the one seen first), while the running probability is >= min_prob and the string
    stays within `depth`; the drafts and the expected number accepted (the sum of the running
    probabilities)."""
    out: list[int] = []
    prob, score = 1.0, 0.0
    n = len(seq)
    while len(out) < max_drafts and m < depth and ends.size:
        if ends.size == 1:  # one occurrence: its continuation, each token certain given the last
            e = int(ends[0]) + 1
            seg = seq[e : e + min(max_drafts - len(out), depth - m)].tolist()
            if SEP in seg:
                seg = seg[: seg.index(SEP)]
            out += seg
            score += prob * len(seg)
            break
        pos = ends + 1
        pos = pos[pos < n]
        toks = seq[pos]
        has = toks != SEP
        pos, toks = pos[has], toks[has]
        if not toks.size:
            break
        if toks.size == 1 or (toks == toks[0]).all():
            token, count = int(toks[0]), toks.size
        else:
            values, first, counts = np.unique(toks, return_index=True, return_counts=True)
            top = np.flatnonzero(counts == counts.max())
            i = top[np.argmin(first[top])]
            token, count = int(values[i]), int(counts[i])
        prob *= count / toks.size
        if prob < min_prob:
            break
        out.append(token)
        score += prob
        ends, m = pos[toks == token], m + 1
    return out, score


class SuffixProposer:
    def __init__(self, num_speculative_tokens: int, max_depth: int = 24, max_cached_requests: int = 1000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> None:
        self.k = num_speculative_tokens
        self.depth = max(max_depth, num_speculative_tokens + 1)
        self.max_cached = max_cached_requests
        self.factor = max_spec_factor
        self.min_prob = min_token_prob
        self.local: dict[str, TokenBuffer] = {}
        self.cached: OrderedDict[str, np.ndarray] = OrderedDict()  # request id → output + SEP, oldest first
        self._corpus: np.ndarray | None = np.empty(0, dtype=np.int32)  # None: rebuild from `cached`

    def propose_requests(self, batch: list[tuple[Request, int]]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for request, room in batch:
            own = self.local.get(request.request_id)
            if own is None:
                own = self.local[request.request_id] = TokenBuffer()
            tokens = own.sync(request.prompt_token_ids, request.output_token_ids)
            drafts = self.propose(tokens, room, tokens, request.end_token_ids)
            if drafts:
                out[request.request_id] = drafts
        return out

    def propose(self, context: Sequence[int], room: int, own: Sequence[int] | None = None,
                end_token_ids: frozenset[int] = frozenset()) -> list[int]:
        """Drafts to follow `context`: the better of the proposal from `own` (the request's
        tokens; `context` itself in the engine) and the global corpus's. None where the proposal
        with the longer match says the reply ends next (one of `end_token_ids`): the longer
        context is the better evidence, and a reply that copied its prompt ends where the
        prompt's copy goes on (32 edits of one file at 32 streams: the last 14 requests drafted
        the prompt's next 1-4 tokens at their final step, all rejected, the step 2-3x as long,
        while the 18 replies that had just finished all ended there)."""
        best: list[int] = []
        best_score, best_match, end_match = 0.0, 0, 0
        max_match = self.depth - min(self.k, room)
        for seq in (own, self.global_corpus()):
            if seq is None or len(seq) == 0:
                continue
            arr = seq if isinstance(seq, np.ndarray) else np.asarray(seq, dtype=np.int32)
            ends, m = longest_match(arr, context, max_match)
            if not m:
                continue
            limit = min(self.k, room, max(1, int(m * self.factor)))
            drafts, score = walk(arr, ends, m, self.depth, limit, self.min_prob)
            if drafts and drafts[0] in end_token_ids:
                end_match = max(end_match, m)
            elif score > best_score:
                best, best_score, best_match = drafts, score, m
        return [] if end_match > best_match else best

    def global_corpus(self) -> np.ndarray:
        """The cached outputs, each followed by SEP, oldest first (one concatenation per change)."""
        if self._corpus is None:
            parts = list(self.cached.values())
            self._corpus = np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)
        return self._corpus

    def finish(self, request: Request) -> None:
        """Drop the request's buffer; its output joins the global corpus (the oldest leaves it
        beyond max_cached_requests)."""
        self.local.pop(request.request_id, None)
        output = request.output_token_ids
        if not output or request.request_id in self.cached:
            return
        entry = np.empty(len(output) + 1, dtype=np.int32)
        entry[:-1] = output
        entry[-1] = SEP
        self.cached[request.request_id] = entry
        while len(self.cached) > self.max_cached:
            self.cached.popitem(last=False)
        self._corpus = None
