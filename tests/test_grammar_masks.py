"""The sampler's grammar masks, exact: each constrained row gets its own grammar's mask of its
current state, whatever rows around it have another grammar or none, whatever the batch held the
step before (the bitmask buffer is reused); rows without a grammar are left as they were."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from inferlab.engine.outputs import ScheduledRequest
from inferlab.engine.request import SamplingParams, StructuredOutputsParams
from inferlab.engine.sampler import Sampler
from inferlab.engine.structured_outputs import GrammarCompiler, GrammarMasker, apply_bitmask
from inferlab.kernels import build

VOCAB = 390  # the tiny tokenizer's 384 tokens, padded to a width that is no multiple of 32
CONSTRAINTS = {
    "choice": StructuredOutputsParams(choice=["yes", "no", "maybe"]),
    "digits": StructuredOutputsParams(regex="[0-9]{2,6}"),
    "json": StructuredOutputsParams(json=json.dumps(
        {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "enum": ["a", "b"]}},
         "required": ["n", "s"], "additionalProperties": False})),
}


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    from transformers import AutoTokenizer

    from inferlab.models.testing import save_tiny_tokenizer

    hf = AutoTokenizer.from_pretrained(str(save_tiny_tokenizer(tmp_path_factory.mktemp("tok"))))
    return GrammarCompiler(hf, VOCAB, (hf.eos_token_id,))


def allowed(grammar) -> set[int]:
    """The grammar's allowed next tokens, asked of llguidance one matcher at a time."""
    words = np.frombuffer(grammar.matcher.compute_bitmask(), dtype=np.int32)
    return {t for t in range(VOCAB) if (int(words[t // 32]) >> (t % 32)) & 1}


def finite(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def test_apply_bitmask_bit_order_runs_and_chunks():
    """Bit j of word w allows token 32w + j; rows [0, 1, 2] and [4] are two runs, the first longer
    than one chunk at this width; row 3 is untouched; allowed values keep their exact bits."""
    torch.manual_seed(0)
    vocab = 49_152 + 17
    logits = torch.randn(5, vocab)
    logits[0, 7] = -0.0
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, (vocab + 31) // 32), dtype=torch.int32)
    bitmask[1] = 0
    bitmask[1, 1] = 1 << 3  # token 35 alone
    bitmask[2] = -1
    out = logits.clone()
    apply_bitmask(out, bitmask, [0, 1, 2, 4])
    t = torch.arange(vocab)
    for k, row in enumerate([0, 1, 2, 4]):
        keep = ((bitmask[k, t // 32].long() >> (t % 32)) & 1).bool()
        assert torch.equal(out[row][keep].view(torch.int32), logits[row][keep].view(torch.int32))  # -0.0 stays
        assert bool((out[row][~keep] == float("-inf")).all())
    assert finite(out[1]) == {35} and torch.equal(out[2], logits[2]) and torch.equal(out[3], logits[3])


@pytest.mark.skipif(not build.available(), reason=f"kernels unavailable: {build.unavailable_reason()}")
def test_the_kernel_apply_gives_the_definition_bits():
    """torch.ops.inferlab.apply_bitmask_ (the sampler's, where the kernels run) against
    apply_bitmask (the definition) bit for bit: whole-word, empty and mixed words, a vocabulary
    that is not a multiple of 32 (the scalar tail), rows out of order, NaN / inf / -0.0 logits
    (a NaN stays NaN, forbidden or not), extra bitmask words past the vocabulary."""
    g = torch.Generator().manual_seed(1)
    vocab = 1_000 + 7
    logits = torch.randn(6, vocab, generator=g)
    logits[:, ::97] = float("nan")
    logits[:, 5::101] = float("inf")
    logits[:, 3::89] = -0.0
    words = (vocab + 31) // 32 + 1
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, words), dtype=torch.int32, generator=g)
    bitmask[0, ::2] = -1
    bitmask[1, 1::3] = 0
    rows = [5, 0, 3, 2]
    want, got = logits.clone(), logits.clone()
    apply_bitmask(want, bitmask, rows)
    torch.ops.inferlab.apply_bitmask_(got, bitmask, torch.tensor(rows))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert Sampler(fused=True).grammar_masks.kernel and not Sampler(fused=False).grammar_masks.kernel
    with pytest.raises(RuntimeError, match="outside the logits"):
        torch.ops.inferlab.apply_bitmask_(got, bitmask, torch.tensor([0, 1, 2, 6]))


def test_apply_bitmask_refuses_what_it_cannot_mask():
    with pytest.raises(ValueError, match="float32"):
        apply_bitmask(torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int32))


def test_mixed_batch_each_row_its_own_current_mask(compiler):
    """Three schemas and rows without one in one batch, over three steps whose layouts differ
    (more rows, then fewer, rows moved): every mask is that row's grammar's, of its state now."""
    masker = GrammarMasker()
    g = {name: [compiler.matcher(p) for _ in range(2)] for name, p in CONSTRAINTS.items()}
    layouts = [
        [g["choice"][0], None, g["json"][0], g["digits"][0], None, g["choice"][1], g["json"][1]],
        [None, g["digits"][1], g["choice"][0], g["digits"][0], g["json"][0], g["json"][1], g["choice"][1], None],
        [g["json"][1], None, g["choice"][0]],
    ]
    torch.manual_seed(1)
    seen: dict[int, list[set[int]]] = {}
    for layout in layouts:
        logits = torch.randn(len(layout), VOCAB)
        out = logits.clone()
        rows = [i for i, x in enumerate(layout) if x is not None]
        masker(out, rows, [layout[i] for i in rows])
        for i, grammar in enumerate(layout):
            if grammar is None:
                assert torch.equal(out[i], logits[i])
                continue
            want = allowed(grammar)
            assert finite(out[i]) == want and torch.equal(out[i][list(want)], logits[i][list(want)])
            seen.setdefault(id(grammar), []).append(want)
            tok = int(out[i].argmax())  # advance by a token its mask allows
            assert grammar.accept(tok) and not grammar.matcher.is_error()
    # The masks did change from step to step: a stale one would have failed above.
    assert any(len({frozenset(m) for m in masks}) > 1 for masks in seen.values())
    # Different grammars' masks differ: a row given another row's mask would have failed above.
    assert len({frozenset(m[0]) for m in seen.values()}) >= 3


def test_sampler_masks_grammar_rows_only(compiler):
    """Through the sampler (greedy): a grammar row takes its best allowed token, a row without a
    grammar its raw argmax, in the same batch."""

    def row(grammar) -> ScheduledRequest:
        return ScheduledRequest(request_id="r", token_ids=[1], start_pos=0, block_ids=[0], sample=True,
                                sampling_params=SamplingParams(temperature=0.0), prompt_token_ids=[1],
                                output_token_ids=[], grammar=grammar)

    grammars = [compiler.matcher(CONSTRAINTS["digits"]), None, compiler.matcher(CONSTRAINTS["choice"]), None]
    rows = [row(x) for x in grammars]
    torch.manual_seed(2)
    logits = torch.randn(len(rows), VOCAB)
    raw = logits.clone()
    tokens = Sampler().__call__(logits, rows).token_ids
    for i, grammar in enumerate(grammars):
        if grammar is None:
            assert tokens[i] == int(raw[i].argmax())
        else:
            want = sorted(allowed(grammar))
            assert tokens[i] == want[int(raw[i, want].argmax())]


def test_draft_positions_get_the_masks_after_their_drafts(compiler):
    """Speculative decoding: a request with drafts has a row per draft position; row j gets the
    mask of a matcher that has taken drafts[:j], up to the first draft the grammar refuses
    (later rows repeat the last mask: never read), and the matcher is left where it was."""
    walk = compiler.matcher(CONSTRAINTS["digits"])  # [0-9]{2,6}: digit tokens, then only the end
    digits = []
    while len(digits) < 8 and (ok := sorted(allowed(walk) - set(compiler._eos))):
        digits.append(ok[0])
        assert walk.accept(ok[0])
    assert 2 <= len(digits) < 8  # the walk reached the grammar's end
    grammar = compiler.matcher(CONSTRAINTS["digits"])  # [0-9]{2,6}
    other = compiler.matcher(CONSTRAINTS["choice"])
    before = allowed(grammar)
    refused = next(t for t in range(VOCAB) if t not in before)
    cases = [digits[:2], digits[:1] + [refused, digits[1]], digits + digits[:1]]  # all kept; refused; past the end
    for drafts in cases:
        # [other, grammar at depth 0..len(drafts)]
        rows = [0] + [1 + j for j in range(len(drafts) + 1)]
        grammars = [other] + [grammar] * (len(drafts) + 1)
        logits = torch.randn(len(rows), VOCAB)
        out = logits.clone()
        GrammarMasker()(out, rows, grammars, [()] + [drafts] + [()] * len(drafts))
        assert finite(out[0]) == allowed(other)
        fresh = compiler.matcher(CONSTRAINTS["digits"])
        want = [allowed(fresh)]
        for t in drafts:
            if not (fresh.matcher.validate_tokens([t]) == 1 and fresh.accept(t)) or fresh.is_terminated():
                break
            want.append(allowed(fresh))
        want += [want[-1]] * (len(drafts) + 1 - len(want))  # from the refused or completing draft on
        assert [finite(out[1 + j]) for j in range(len(drafts) + 1)] == want
        assert allowed(grammar) == before and not grammar.matcher.is_error()
    assert len(set(map(frozenset, want))) > 1  # the rows' masks did differ (the last case)
