"""One check for "the two paths generate the same": greedy tokens equal, chosen-token logprobs
close, and (optionally) the same top-logprob token ids at every position."""

from __future__ import annotations

import math
from collections.abc import Sequence

from inferlab.engine.request import RequestOutput


def assert_same_greedy(got: Sequence[RequestOutput], want: Sequence[RequestOutput], tol: float = 1e-4,
                       top_ids: bool = False) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        ca_, cb_ = a.outputs[0], b.outputs[0]
        assert ca_.token_ids == cb_.token_ids, i
        for (ca, ta), (cb, tb) in zip(ca_.logprobs, cb_.logprobs, strict=True):
            assert math.isclose(ca.logprob, cb.logprob, rel_tol=tol, abs_tol=tol), (i, ca.logprob, cb.logprob)
            if top_ids:
                assert [x.token_id for x in ta] == [x.token_id for x in tb], i
