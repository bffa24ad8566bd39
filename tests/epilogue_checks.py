"""A check shared by the tests of the products' fused epilogues (SiLU from the tiles, RoPE and
the KV-cache write from the qkv product): the model's prefills give the same bits with the fused
path switched off."""

from __future__ import annotations

from pathlib import Path

import torch

from inferlab import LLM, SamplingParams
from inferlab.models.testing import make_tiny_hf_model


def assert_same_logprobs_with_the_path_off(tmp_path: Path, paths: tuple[tuple[str, str], ...]) -> None:
    """For each (weight dtype, the model's flag for a fused path): prompt and sampled logprobs of
    two prefill-sized prompts (128+ rows) are the same with the flag on (as the model decided it)
    and off."""
    model = make_tiny_hf_model(tmp_path / "m", arch="llama")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (140, 200)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=1)

    def run(llm: LLM) -> list:
        return [(r.prompt_logprobs, [(t.token_id, t.logprob) for t, _ in r.outputs[0].logprobs])
                for r in llm.generate(prompts, params)]

    for weights, flag in paths:
        llm = LLM(str(model), weight_dtype=weights, num_kv_blocks=128, decoder_backend="fused",
                  enable_prefix_caching=False)
        forward = llm.engine.runner.model
        assert getattr(forward, flag), weights
        fused = run(llm)
        setattr(forward, flag, False)
        assert run(llm) == fused, weights
