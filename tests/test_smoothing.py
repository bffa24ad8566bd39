"""w8a8's SmoothQuant scales (models/smoothing.py): folded into the weights at load, they change
nothing in exact arithmetic, and they take the outlier channels' range off x's 8-bit scales."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kernel_marks import needs_int8_dot

from inferlab import LLM, SamplingParams
from inferlab.models import loader
from inferlab.models.smoothing import calibration_tokens, norm_output_maxima, smoothing_scales
from inferlab.models.testing import TINY_ARCHS, load_reference_model, make_tiny_hf_model

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 9, 200], [300, 12, 8, 77, 150]]


def _prompt_logprobs(llm: LLM) -> list[torch.Tensor]:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    return [torch.tensor([next(iter(d.values())).logprob for d in r.prompt_logprobs[1:]])
            for r in llm.generate(PROMPTS, params)]


_load_smoothed = loader._smoothed


def _smooth_always(loaded, precision):
    """loader._smoothed as for w8a8, whatever the precision: the float32 model with the scales
    folded in (and its lm_head untied)."""
    return _load_smoothed(loaded, SimpleNamespace(int8_activations=True))


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_the_folded_scales_leave_a_float32_model_as_it_was(tmp_path: Path, arch: str, monkeypatch) -> None:
    """x / s into the norms, W * s into q/k/v, gate/up and the (now untied) lm_head: in float32
    the same prompt logprobs to rounding, on every architecture (biases, q/k norms, tied or not)."""
    model = make_tiny_hf_model(tmp_path / arch, arch=arch)
    before = LLM(str(model), dtype="float32", weight_dtype="float32", num_kv_blocks=64)
    plain = _prompt_logprobs(before)
    monkeypatch.setattr(loader, "_smoothed", _smooth_always)
    llm = LLM(str(model), dtype="float32", weight_dtype="float32", num_kv_blocks=64)
    assert llm.engine.runner.model.lm_head is not llm.engine.runner.model.embed  # untied
    a, b = before.engine.runner.model, llm.engine.runner.model  # the folds did change the weights
    assert not torch.allclose(a.layers[0].input_norm, b.layers[0].input_norm)
    assert not torch.allclose(a.final_norm, b.final_norm)
    smoothed = _prompt_logprobs(llm)
    for a, b in zip(plain, smoothed):
        assert torch.allclose(a, b, atol=1e-4), (arch, float((a - b).abs().max()))


def test_maxima_are_the_reference_models_norm_outputs(tmp_path: Path) -> None:
    """The calibration forward is the model's: its norm outputs' maxima equal those transformers'
    own model makes of the same tokens."""
    model = make_tiny_hf_model(tmp_path / "m", arch="qwen3")  # q/k norms, the most to get right
    ref = load_reference_model(model)
    from inferlab.models.hf_loader import load_hf_dir

    loaded = load_hf_dir(model, torch.float32, "m")
    tokens = calibration_tokens(loaded.config.vocab_size)[:40]
    seen: dict[str, torch.Tensor] = {}

    def keep(name):
        return lambda _m, _i, out: seen.__setitem__(name, out[0].abs().amax(0))

    for i, layer in enumerate(ref.model.layers):
        layer.input_layernorm.register_forward_hook(keep(f"{i}.attn"))
        layer.post_attention_layernorm.register_forward_hook(keep(f"{i}.mlp"))
    ref.model.norm.register_forward_hook(keep("head"))
    with torch.no_grad():
        ref(torch.tensor([tokens]))
    maxima, head_in = norm_output_maxima(loaded.config, loaded.weights, tokens)
    for i, (attn_in, mlp_in) in enumerate(maxima):
        assert torch.allclose(attn_in, seen[f"{i}.attn"], rtol=1e-4, atol=1e-5)
        assert torch.allclose(mlp_in, seen[f"{i}.mlp"], rtol=1e-4, atol=1e-5)
    assert torch.allclose(head_in, seen["head"], rtol=1e-4, atol=1e-5)


def test_scales_follow_the_formula_and_keep_dead_channels() -> None:
    x_max = torch.tensor([4.0, 0.25, 0.0, 1.0])
    w = torch.tensor([[1.0, -4.0, 2.0, 0.0], [-0.5, 1.0, 1.0, 0.0]])
    s = smoothing_scales(x_max, [w], 0.5)
    assert torch.allclose(s, torch.tensor([2.0, 0.25, 1.0, 1.0]))  # sqrt(4 / 1), sqrt(0.25 / 4); zeros: 1


@needs_int8_dot
def test_w8a8_with_the_scales_is_nearer_float32_on_outlier_channels(tmp_path: Path, monkeypatch) -> None:
    """A model whose norms make four channels 80x the rest (as real models' do; one in each 16
    values, so the AVX2 variant's small groups feel them too): w8a8's prompt logprobs are nearer
    float32's with the scales folded in (the load's default) than without.
    The loaded model is untied and says how it was smoothed in the load log."""
    model = make_tiny_hf_model(tmp_path / "m", arch="llama", intermediate_size=192)
    ref = load_reference_model(model)
    with torch.no_grad():
        for layer in ref.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[[3, 17, 38, 60]] *= torch.tensor([80.0, -80.0, 80.0, -80.0])
        ref.model.norm.weight[[5, 21, 40, 52]] *= 80
    ref.save_pretrained(model)
    base = _prompt_logprobs(LLM(str(model), dtype="float32", weight_dtype="float32", num_kv_blocks=64))

    def error(llm: LLM) -> float:
        return float(sum((a - b).abs().sum() for a, b in zip(_prompt_logprobs(llm), base)))

    smoothed = LLM(str(model), weight_dtype="w8a8", num_kv_blocks=64)
    assert smoothed.engine.model_config.tie_word_embeddings is False
    with_scales = error(smoothed)
    monkeypatch.setattr(loader, "_smoothed", lambda loaded, precision: loaded)
    without = error(LLM(str(model), weight_dtype="w8a8", num_kv_blocks=64))
    assert with_scales < 0.7 * without, (with_scales, without)
