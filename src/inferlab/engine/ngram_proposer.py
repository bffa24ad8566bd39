"""Prompt-lookup drafts (n-gram speculation): guess the next tokens by finding the request's
last few tokens earlier in its own prompt + output and copying what followed them there.

Why it pays: a request that repeats, quotes or edits its input (code edits, "repeat this text",
retrieval answers) mostly continues a span it has already seen; a draft costs a substring search
and, when accepted, saves a whole decode step per token. Pure Python, no torch: the scheduler
asks it for drafts when it schedules a decode.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from inferlab.engine.request import Request

_ITEM = array("i").itemsize  # token ids fit a C int


class NgramProposer:
    """For tokens t[0..L-1]: the longest suffix t[L-n:] (n from `max_n` down to `min_n`) that
    also occurs earlier, at its most recent such occurrence i (i < L - n, overlaps allowed);
    the drafts are t[i+n : i+n+k]. A copy that reaches the end goes on over the drafts it has
    made (LZ77's overlapping copy): a run of period p repeats itself, k drafts, not p."""

    def __init__(self, num_speculative_tokens: int, max_n: int, min_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.k = num_speculative_tokens
        self.max_n = max_n
        self.min_n = min_n

    def propose_requests(self, batch: list[tuple[Request, int]]) -> dict[str, list[int]]:
        return {r.request_id: self.propose(r.all_token_ids, room) for r, room in batch}

    def finish(self, request: Request) -> None:
        pass  # stateless

    def propose(self, tokens: Sequence[int], max_drafts: int | None = None) -> list[int]:
        """Up to min(k, max_drafts) draft tokens to follow `tokens`; [] when no n-gram recurs.

        The search is bytes.rfind over the ids packed as C ints (a match must start on a token
        border): C speed, so a 2,048-token request costs microseconds per step, not a Python
        loop over every position.
        """
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        n_tok = len(tokens)
        if k <= 0 or n_tok <= self.min_n:
            return []
        data = array("i", tokens).tobytes()
        # A match must end before the last token, so that at least one token follows it.
        limit = (n_tok - 1) * _ITEM
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            pattern = data[(n_tok - n) * _ITEM :]
            end = limit
            while True:
                at = data.rfind(pattern, 0, end)
                if at < 0:
                    break
                if at % _ITEM == 0:
                    return _copy(tokens, at // _ITEM + n, k)
                end = at + len(pattern) - 1  # misaligned: look further left
        return []


def _copy(tokens: Sequence[int], start: int, k: int) -> list[int]:
    """k tokens of `tokens + drafts` from `start` on (start < len(tokens))."""
    out = list(tokens[start : start + k])
    period = len(tokens) - start
    while len(out) < k:
        out.append(out[len(out) - period])  # len(out) >= period here
    return out
