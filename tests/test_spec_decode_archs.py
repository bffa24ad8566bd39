"""Every speculative method on a tiny model of every architecture we load: float32 greedy tokens
and logprobs identical to decoding without drafts; n-gram and suffix with drafts both kept and
rolled back, the draft model being the target itself (every draft kept, the bonus token too: a
random smaller draft agrees with a random target on some architectures and never on others;
test_spec_decode_draft rolls a disagreeing one back). The method tests go deeper on llama and
qwen3; this is the breadth."""

from __future__ import annotations

import pytest
from same_outputs import assert_same_greedy
from test_spec_decode_engine import prompts

from inferlab import LLM, SamplingParams
from inferlab.models.testing import TINY_ARCHS, make_tiny_hf_model

KW = {"dtype": "float32", "num_kv_blocks": 256}


@pytest.fixture(scope="module", params=TINY_ARCHS)
def arch(request, tmp_path_factory):
    """(the architecture's tiny model, the plain engine on it)."""
    target = make_tiny_hf_model(tmp_path_factory.mktemp(request.param), arch=request.param)
    return str(target), LLM(str(target), **KW)


def config(method: str, target: str) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": 4}
    return {"method": "draft_model", "model": target, "num_speculative_tokens": 4}


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
def test_every_method_keeps_greedy_output_on_every_architecture(arch, method):
    target, base = arch
    # adaptive off: every step drafts, whatever the step timings.
    llm = LLM(target, speculative_config={**config(method, target), "adaptive": False}, **KW)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    assert_same_greedy(llm.generate(prompts(), params), base.generate(prompts(), params), top_ids=True)
    stats = llm.engine.get_stats()
    if method == "draft_model":
        assert 0 < stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    else:
        assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens, method
