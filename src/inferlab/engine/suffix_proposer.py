"""Suffix decoding (the idea of arctic-inference's, our own code): drafts from counted suffix
trees of what was already said, for the repetitive traffic of agents and code edits.

Two trees of bounded depth D (every substring of up to D tokens, with how often it occurs):
one per request over its prompt and output (extended token by token as the output grows), and
one global over the outputs of the last `max_cached_requests` finished requests (the oldest
taken out, counts and all, when a new one comes in). A proposal finds the longest suffix of
the request's tokens that occurred before with a continuation (up to D - K tokens long), then
walks the most frequent continuation, as long as its estimated probability (the product of
each step's count / its siblings' counts) stays >= min_token_prob and the drafts stay within
max_spec_factor x the match length: a long, confident match drafts many tokens, a short or
ambiguous one few or none. Of the two trees' proposals the one with more expected accepted
tokens (the sum of those probabilities) wins.

Pure Python, no torch: the scheduler asks it when it schedules decodes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from inferlab.engine.request import Request


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] | None = None

    def child(self, token: int) -> _Node:
        if self.children is None:
            self.children = {}
        node = self.children.get(token)
        if node is None:
            node = self.children[token] = _Node()
        return node


class SuffixTree:
    """Every substring of at most `depth` tokens of the sequences added, with its count."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()

    def add(self, tokens: Sequence[int], sign: int = 1) -> None:
        """Count (sign 1) or uncount (sign -1, pruning what reaches 0) every substring of `tokens`."""
        for i in range(len(tokens)):
            node = self.root
            for t in tokens[i : i + self.depth]:
                assert node.children is not None or sign > 0
                nxt = node.child(t) if sign > 0 else node.children[t]  # type: ignore[index]
                nxt.count += sign
                if nxt.count == 0:
                    del node.children[t]  # type: ignore[union-attr]
                    break
                node = nxt

    def match(self, context: Sequence[int], max_len: int) -> tuple[_Node | None, int]:
        """The node of the longest suffix of `context` (at most max_len tokens) that occurred
        with a continuation, and its length; (None, 0) if none. A suffix that occurs has every
        shorter suffix occurring too, so the longest occurring one is found by bisection
        (log D walks, not D); from there down to the first with a continuation."""
        lo, hi = 0, min(max_len, len(context))  # suffixes of length lo occur; of more than hi, not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._find(context, mid) is not None:
                lo = mid
            else:
                hi = mid - 1
        for m in range(lo, 0, -1):
            node = self._find(context, m)
            if node is not None and node.children:
                return node, m
        return None, 0

    def _find(self, context: Sequence[int], m: int) -> _Node | None:
        node: _Node | None = self.root
        for t in context[len(context) - m :]:
            node = node.children.get(t) if node.children else None  # type: ignore[union-attr]
            if node is None:
                return None
        return node


class _Growing:
    """A request's own tree, extended as its tokens grow: the nodes of the suffixes ending at
    the last token (at most depth - 1 long) are kept, so a new token costs depth steps."""

    def __init__(self, depth: int) -> None:
        self.tree = SuffixTree(depth)
        self.active: list[_Node] = []
        self.num_tokens = 0

    def extend(self, tokens: Sequence[int]) -> None:
        depth = self.tree.depth
        for t in tokens[self.num_tokens :]:
            nxt = []
            for node in [self.tree.root, *self.active]:
                c = node.child(t)
                c.count += 1
                nxt.append(c)
            self.active = nxt[: depth - 1]
        self.num_tokens = len(tokens)

    def match(self, max_len: int) -> tuple[_Node | None, int]:
        """SuffixTree.match for the request's own tokens, without a walk: the nodes of the
        suffixes ending at the last token are at hand, longest last."""
        for m in range(min(max_len, len(self.active)), 0, -1):
            node = self.active[m - 1]
            if node.children:
                return node, m
        return None, 0


def walk(node: _Node, max_drafts: int, min_prob: float) -> tuple[list[int], float]:
    """The most frequent continuation from `node`: tokens while the running probability is >=
    min_prob, and the expected number accepted (the sum of the running probabilities)."""
    out: list[int] = []
    prob, score = 1.0, 0.0
    while len(out) < max_drafts and node.children:
        total = sum(c.count for c in node.children.values())
        token, best = max(node.children.items(), key=lambda kv: kv[1].count)
        prob *= best.count / total
        if prob < min_prob:
            break
        out.append(token)
        score += prob
        node = best
    return out, score


class SuffixProposer:
    def __init__(self, num_speculative_tokens: int, max_depth: int = 24, max_cached_requests: int = 1000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> None:
        self.k = num_speculative_tokens
        self.depth = max(max_depth, num_speculative_tokens + 1)
        self.max_cached = max_cached_requests
        self.factor = max_spec_factor
        self.min_prob = min_token_prob
        self.local: dict[str, _Growing] = {}
        self.global_tree = SuffixTree(self.depth)
        self.cached: OrderedDict[str, list[int]] = OrderedDict()  # request id → output, oldest first

    def propose_requests(self, batch: list[tuple[Request, int]]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for request, room in batch:
            own = self.local.get(request.request_id)
            if own is None:
                own = self.local[request.request_id] = _Growing(self.depth)
            tokens = request.all_token_ids
            own.extend(tokens)
            drafts = self.propose(tokens, room, own)
            if drafts:
                out[request.request_id] = drafts
        return out

    def propose(self, tokens: Sequence[int], room: int, own: SuffixTree | _Growing | None = None) -> list[int]:
        """Drafts to follow `tokens`: the better of the request's own tree's proposal and the
        global tree's."""
        best: list[int] = []
        best_score = 0.0
        max_match = self.depth - min(self.k, room)
        for tree in (own, self.global_tree):
            if tree is None:
                continue
            node, m = tree.match(max_match) if isinstance(tree, _Growing) else tree.match(tokens, max_match)
            if node is None:
                continue
            limit = min(self.k, room, max(1, int(m * self.factor)))
            drafts, score = walk(node, limit, self.min_prob)
            if score > best_score:
                best, best_score = drafts, score
        return best

    def finish(self, request: Request) -> None:
        """Drop the request's own tree; its output joins the global tree (the oldest leaves it
        beyond max_cached_requests)."""
        self.local.pop(request.request_id, None)
        output = list(request.output_token_ids)
        if not output or request.request_id in self.cached:
            return
        self.cached[request.request_id] = output
        self.global_tree.add(output)
        while len(self.cached) > self.max_cached:
            _, old = self.cached.popitem(last=False)
            self.global_tree.add(old, -1)
