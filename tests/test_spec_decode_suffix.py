"""Suffix decoding: the counted suffix trees read off token arrays (torch-free), and through the real engine float32
greedy output identical with and without it (tiny models; the default model in
test_spec_decode_engine), drafts from the
request's own tokens and from other requests' outputs."""

from __future__ import annotations

import numpy as np
import pytest
from same_outputs import assert_same_greedy
from test_spec_decode_engine import prompts

from inferlab import LLM, SamplingParams
from inferlab.engine.request import Request
from inferlab.engine.spec_decode import until_end
from inferlab.engine.suffix_proposer import SEP, SuffixProposer, TokenBuffer, longest_match, walk
from inferlab.models.testing import make_tiny_hf_model

SPEC = {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False}


def _reference(seq, context, max_len, depth, max_drafts, min_prob):
    """Suffix decoding by counting substrings one by one (the tree's definition, slowly)."""
    def count(s):
        return sum(1 for i in range(len(seq) - len(s) + 1) if list(seq[i : i + len(s)]) == s)

    def followers(s):  # next token -> occurrences of s + [token]
        out = {}
        for i in range(len(seq) - len(s)):
            if list(seq[i : i + len(s)]) == s and seq[i + len(s)] != -1:
                out.setdefault(seq[i + len(s)], [0, i])[0] += 1
        return out

    m = 0
    for n in range(min(max_len, len(context)), 0, -1):
        if followers(list(context[-n:])):
            m = n
            break
    if not m:
        return m, []
    s, out, prob = list(context[-m:]), [], 1.0
    while len(out) < max_drafts and len(s) < depth:
        f = followers(s)
        if not f:
            break
        token = min(f, key=lambda t: (-f[t][0], f[t][1]))  # most frequent, then seen first
        prob *= f[token][0] / sum(c for c, _ in f.values())
        if prob < min_prob:
            break
        out.append(token)
        s.append(token)
    assert count(list(context[-m:])) >= 1
    return m, out


def test_array_search_is_the_counted_suffix_tree():
    """longest_match + walk over an int32 copy give what counting every substring gives."""
    import random

    rng = random.Random(0)
    for trial in range(64):
        # The last few: long enough that one token ends over 64 candidates (narrowed one at a time).
        seq = [rng.choice([1, 2, 3]) for _ in range(rng.randint(2, 40) if trial < 60 else 300)]
        if trial % 4 == 0:  # a corpus of several outputs (the context, then, not from it)
            seq[rng.randrange(len(seq))] = SEP
        context = seq if trial % 2 else [rng.choice([1, 2, 3]) for _ in range(6)]
        arr = np.asarray(seq, dtype=np.int32)
        for max_len in (1, 3, 6):
            ends, m = longest_match(arr, context, max_len)
            want_m, want = _reference(seq, context, max_len, depth=8, max_drafts=4, min_prob=0.2)
            assert m == want_m, (seq, context, max_len)
            if m:
                assert walk(arr, ends, m, 8, 4, 0.2)[0] == want, (seq, context, max_len)


def test_the_request_buffer_grows_in_place():
    b = TokenBuffer()
    prompt, out = list(range(300)), []
    assert b.sync(prompt, out).tolist() == prompt
    data = b.data
    out += [7, 8]
    assert b.sync(prompt, out).tolist() == prompt + [7, 8] and b.data is data  # copied in place


def test_most_frequent_continuation_of_the_longest_match():
    p = SuffixProposer(4, max_depth=8, max_spec_factor=2.0, min_token_prob=0.0)
    # After [1, 2] came 3 twice and 9 once; after [7, 1, 2] only 9.
    own = [1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 7, 1, 2, 9, 0]
    assert p.propose([5, 1, 2], 4, own) == [3, 4, 0, 1]
    assert p.propose([7, 1, 2], 4, own) == [9, 0]  # the longer match wins, up to where it ends
    assert p.propose([6, 6], 4, own) == []


def test_draft_length_follows_confidence_and_match_length():
    own = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 3]  # after [1, 2]: 3 (2x), 4, 5
    confident = SuffixProposer(4, max_depth=8, min_token_prob=0.4)
    # 3 at 1/2, then 1 after [1, 2, 3] (1/1): two drafts, as many as the match is long.
    assert confident.propose([9, 1, 2], 4, own) == [3, 1]
    strict = SuffixProposer(4, max_depth=8, min_token_prob=0.6)
    assert strict.propose([9, 1, 2], 4, own) == []  # nothing as likely as 0.6
    short = SuffixProposer(4, max_depth=8, max_spec_factor=0.5, min_token_prob=0.0)
    assert short.propose([9, 4, 1, 2], 4, own) == [5]  # a 3-token match x 0.5: one draft


def req(rid: str, prompt: list[int], output: list[int] | None = None) -> Request:
    return Request(rid, prompt, SamplingParams(), output_token_ids=list(output or []))


def test_global_tree_drafts_from_other_requests_outputs_and_forgets_the_oldest():
    p = SuffixProposer(4, max_depth=8, max_cached_requests=1, min_token_prob=0.0)
    p.finish(req("a", [1, 2], [10, 11, 12, 13, 14, 15]))
    r = req("b", [20, 21, 10, 11, 12])
    assert p.propose_requests([(r, 4)]) == {"b": [13, 14, 15]}
    p.finish(req("c", [1], [30, 31, 32]))  # beyond the bound: "a" leaves
    assert list(p.cached) == ["c"]
    assert p.propose_requests([(req("d", [10, 11, 12]), 4)]) == {}


def test_no_drafts_where_the_longer_match_says_the_reply_ends():
    """A reply that copied its prompt: its own tokens go on where the prompt went on, the replies
    of the same request that just finished ended there (EOS = 2). The global corpus's match is
    the longer: no drafts, not the prompt's next tokens."""
    p = SuffixProposer(4, max_depth=12, min_token_prob=0.0)
    prompt = [40, 41, 42, 43, 44, 45, 46, 47, 9, 9, 9, 50, 51, 52]
    reply = [40, 41, 42, 99, 44, 45, 46, 47]  # an edit: its own match is [44 .. 47], the corpus's all of it
    for i in range(3):
        p.finish(Request(f"done{i}", prompt, SamplingParams(), eos_token_ids=(2,), output_token_ids=reply + [2]))
    last = Request("last", prompt, SamplingParams(), eos_token_ids=(2,), output_token_ids=list(reply))
    assert p.propose_requests([(last, 4)]) == {}
    # Where EOS does not end it, the end's evidence is no evidence: the corpus's EOS is a token like any.
    free = Request("free", prompt, SamplingParams(ignore_eos=True), eos_token_ids=(2,), output_token_ids=list(reply))
    assert p.propose_requests([(free, 4)]) == {"free": [9, 9, 9, 50]}
    # A shorter match that ends is outweighed by a longer one that goes on (its own prompt).
    q = SuffixProposer(4, max_depth=12, min_token_prob=0.0)
    q.finish(Request("other", [1], SamplingParams(), eos_token_ids=(2,), output_token_ids=[46, 47, 2]))
    assert q.propose_requests([(Request("r", prompt, SamplingParams(), eos_token_ids=(2,),
                                        output_token_ids=list(reply)), 4)]) == {"r": [9, 9, 9, 50]}


def test_a_draft_never_reaches_past_the_end_of_the_reply():
    assert until_end([5, 6, 2, 7], frozenset({2})) == [5, 6]
    assert until_end([2, 7], frozenset({2, 3})) == []
    assert until_end([5, 6], frozenset()) == [5, 6]
    request = Request("r", [1], SamplingParams(stop_token_ids=[3]), eos_token_ids=(2,))
    assert request.end_token_ids == {2, 3}
    request.sampling_params.ignore_eos = True
    assert request.end_token_ids == {3}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp(request.param), arch=request.param)
    kw = {"dtype": "float32", "num_kv_blocks": 256}
    return LLM(str(path), **kw), LLM(str(path), speculative_config=SPEC, **kw)


def test_same_greedy_tokens_and_logprobs(tiny):
    base, spec = tiny
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    want = base.generate(prompts(), params)
    got = spec.generate(prompts(), params)
    assert_same_greedy(got, want, top_ids=True)
    stats = spec.engine.get_stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    # A second round: the global tree now holds the first round's outputs.
    again = spec.generate(prompts(), params)
    assert_same_greedy(again, want, top_ids=True)
    assert spec.engine.get_stats().spec_num_accepted_tokens > 2 * stats.spec_num_accepted_tokens


def test_chunked_prefill_and_preemption(tiny):
    base, _ = tiny
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = base.generate(prompts(), params)
    small = LLM(str(base.engine.config.load.model), dtype="float32", num_kv_blocks=14,
                max_num_batched_tokens=16, speculative_config=SPEC)
    got = small.generate(prompts(), params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = small.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.spec_num_accepted_tokens > 0


