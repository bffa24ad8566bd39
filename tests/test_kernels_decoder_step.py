"""The whole-step decode kernel (kernels/csrc/decoder_step.cpp) against the per-operator forward
it replaces: the same tokens and log-probabilities for every architecture and weight storage,
at batch sizes that take each of its code paths, and clear errors on wrong input."""

from __future__ import annotations

import pytest
import torch
from kernel_marks import needs_int8_dot
from same_outputs import assert_same_greedy

from inferlab import LLM, SamplingParams
from inferlab.kernels import build
from inferlab.models import decoder
from inferlab.models.testing import make_tiny_hf_model

pytestmark = pytest.mark.skipif(not build.available(), reason=f"kernels unavailable: {build.unavailable_reason()}")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("step")
    # llama: SmolLM2's layout; qwen2: a qkv bias; qwen3: per-head q/k norms (head_dim 32).
    return {arch: make_tiny_hf_model(root / arch, arch=arch) for arch in ("llama", "qwen2", "qwen3")}


def _generate(path, monkeypatch, use_step: bool, weight_dtype: str, n_prompts: int, kv_cache_dtype: str = "auto",
              expect_step: bool | None = None, num_kv_blocks: int = 128, **backends):
    """Greedy outputs on the "step" backend or (`use_step` False) the "fused" one, unless
    `backends` says otherwise; asserts whether a DecoderStep really ran (`expect_step`, default:
    whenever it is on)."""
    backends.setdefault("decoder_backend", "step" if use_step else "fused")
    steps = []
    real = decoder.DecoderModel._decode_step

    def spy(self, *a, **kw):
        step = real(self, *a, **kw)
        steps.append(step is not None)  # None: the model fell back to the operators
        return step

    monkeypatch.setattr(decoder.DecoderModel, "_decode_step", spy)
    llm = LLM(str(path), dtype="float32", weight_dtype=weight_dtype, kv_cache_dtype=kv_cache_dtype,
              num_kv_blocks=num_kv_blocks, **backends)
    steps.clear()  # the engine's warm-up at start ran a small step: count the generation's own
    g = torch.Generator().manual_seed(n_prompts)
    prompts = [torch.randint(3, 250, (int(n),), generator=g).tolist()
               for n in torch.randint(2, 40, (n_prompts,), generator=g)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3))
    assert any(steps) == (use_step if expect_step is None else expect_step)  # the path asked for is the path taken
    return outs


W8A8 = pytest.param("w8a8", 5, marks=needs_int8_dot)
# 13 rows: x made once a phase by every thread (decoder_step.cpp SharedX), 4 tiles, the last of one row
W8A8_MANY = pytest.param("w8a8", 13, marks=needs_int8_dot)


# 1 and 2 rows: the norm computed by every thread, x rows read in registers; 7: the shared norm,
# weight blocks converted to float32 first; 40: many 3-row micro-kernel tiles and a remainder;
# w8a8 at 5: the 5 rows at once over each panel (avx512), a 4-row tile and a 1-row one (avx2).
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("weight_dtype,n_prompts",
                         [("float32", 1), ("float16", 2), ("int8", 7), ("bfloat16", 40), W8A8, W8A8_MANY])
def test_decode_step_gives_the_per_operator_tokens_and_logprobs(models, monkeypatch, arch, weight_dtype, n_prompts):
    step = _generate(models[arch], monkeypatch, True, weight_dtype, n_prompts)
    ops = _generate(models[arch], monkeypatch, False, weight_dtype, n_prompts)
    # bf16 products (AVX512-BF16) round x to bf16: a 1-ulp difference between the paths' norms
    # can flip an element's rounding (2^-8 of it), so their logprobs agree to ~1e-3, not 1e-4.
    # int8 weight-only from INT8_BF16_MIN_ROWS rows too (its codes as bf16 tiles, x rounded).
    # w8a8 on either variant: a last-bit difference can move a value across a quantization step
    # (on avx2 a 7-bit one: seen 2e-3).
    rounds_x = weight_dtype == "w8a8" or (weight_dtype in ("bfloat16", "int8") and build.kernel_info().bf16_dot)
    tol = 5e-3 if rounds_x else 1e-4
    assert_same_greedy(step, ops, tol=tol, top_ids=True)


@pytest.mark.parametrize("weight_dtype,max_rows", [("float16", 256), ("int8", 128)])
def test_16bit_decode_steps_of_up_to_256_rows_run_in_one_call(models, monkeypatch, weight_dtype, max_rows):
    """precision.decode_step_max_rows: with 16-bit weights a decode-only step of 128-255 rows (140
    prompts decoded in lock step; speculative verification at 32 streams is up to 160) still runs
    as one DecoderStep call, so it multiplies as a smaller step does; int8 weights go per operator
    from 128 rows. The operators' tokens either way."""
    big = dict(num_kv_blocks=640, max_num_seqs=256, max_num_batched_tokens=8192)  # every prompt in one step
    llm = LLM(str(models["llama"]), dtype="float32", weight_dtype=weight_dtype, num_kv_blocks=16)
    assert llm.engine.precision.decode_step_max_rows == max_rows
    step = _generate(models["llama"], monkeypatch, True, weight_dtype, 140, expect_step=max_rows > 140, **big)
    ops = _generate(models["llama"], monkeypatch, False, weight_dtype, 140, **big)
    tol = 5e-3 if weight_dtype == "int8" and build.kernel_info().bf16_dot else 1e-4
    assert_same_greedy(step, ops, tol=tol, top_ids=True)


def _direct_step(models):
    """A DecoderStep built by the model for its runner's caches, and valid inputs for 2 rows."""
    llm = LLM(str(models["llama"]), dtype="float32", weight_dtype="float16", num_kv_blocks=8, block_size=16)
    runner = llm.engine.runner
    model = runner.model
    step = model._decode_step(runner.kv_caches, 16)
    hidden = model.config.hidden_size
    inputs = dict(x=torch.randn(2, hidden), positions=torch.tensor([3, 0]), slots=torch.tensor([3, 16]),
                  block_tables=torch.tensor([[0], [1]], dtype=torch.int32),
                  context_lens=torch.tensor([4, 1], dtype=torch.int32))
    return step, inputs, runner


def test_decode_step_refuses_bad_inputs_with_a_clear_error(models):
    step, good, runner = _direct_step(models)
    step.forward(**{k: v.clone() for k, v in good.items()})  # the valid call works
    slots = runner.kv_caches[0].k.shape[1]
    bad = {
        "slot": ({"slots": torch.tensor([3, slots])}, "slot"),
        "position": ({"positions": torch.tensor([3, 10**6])}, "rope table"),
        "block": ({"block_tables": torch.tensor([[0], [99]], dtype=torch.int32)}, "outside the cache"),
        "length": ({"context_lens": torch.tensor([4, 0], dtype=torch.int32)}, "at least its own token"),
        "x shape": ({"x": torch.randn(2, 7)}, "x must be"),
        "x dtype": ({"x": torch.randn(2, good["x"].shape[1], dtype=torch.float64)}, "float32"),
        "table dtype": ({"block_tables": torch.tensor([[0], [1]])}, "int32"),
    }
    for change, message in bad.values():
        args = {k: v.clone() for k, v in good.items()} | change
        with pytest.raises((ValueError, RuntimeError), match=message):
            step.forward(**args)


def test_decode_step_writes_the_new_tokens_kv_into_the_cache(models):
    step, good, runner = _direct_step(models)
    k0, v0 = runner.kv_caches[0].k.clone(), runner.kv_caches[0].v.clone()
    step.forward(**good)
    k1, v1 = runner.kv_caches[0].k, runner.kv_caches[0].v
    changed = ((k1 != k0).any(dim=2) | (v1 != v0).any(dim=2)).any(dim=0).nonzero().flatten().tolist()
    assert changed == [3, 16]  # exactly the two slots of the two rows


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_decode_step_with_a_16bit_cache(models, monkeypatch, arch, kv):
    """K/V stored in float16 (what "auto" picks beside float16 weights) or bfloat16: the step
    kernel writes and reads the cache as the per-operator path does (float32 arithmetic here)."""
    step = _generate(models[arch], monkeypatch, True, "float16", 5, kv_cache_dtype=kv)
    ops = _generate(models[arch], monkeypatch, False, "float16", 5, kv_cache_dtype=kv)
    assert_same_greedy(step, ops)


@pytest.mark.skipif(not build.kernel_info().bf16_dot,
                    reason=f"bf16 attention needs the kernels' avx512 variant (AVX512_BF16); this process has "
                           f"{build.kernel_info().variant}")
def test_decode_step_with_a_bfloat16_cache_attends_in_bf16_as_the_operators_do(tmp_path, monkeypatch):
    """bf16 weights and a bfloat16 cache (`--kv-cache-dtype bfloat16`; "auto" keeps float16): the
    step's attention and the paged kernel's both multiply by vdpbf16ps (head_dim 64, a group of 2
    heads), so the two paths give the same tokens; the precision says so once for both."""
    path = make_tiny_hf_model(tmp_path / "d64", arch="llama", hidden_size=128, head_dim=64, num_attention_heads=4,
                              num_key_value_heads=2)
    step = _generate(path, monkeypatch, True, "bfloat16", 6, kv_cache_dtype="bfloat16")
    ops = _generate(path, monkeypatch, False, "bfloat16", 6, kv_cache_dtype="bfloat16")
    assert_same_greedy(step, ops, tol=5e-3, top_ids=True)
    llm = LLM(str(path), dtype="float32", weight_dtype="bfloat16", kv_cache_dtype="bfloat16", num_kv_blocks=16)
    assert llm.engine.runner.model.precision.bf16_decode_attention


def test_float16_cache_through_plain_torch_matches_the_kernels(models, monkeypatch):
    """The plain-operator paths (no fused operators, SDPA decode attention) convert to and from a
    float16 cache and give the kernels' tokens."""
    kernels = _generate(models["llama"], monkeypatch, True, "float32", 4, kv_cache_dtype="float16")
    plain = _generate(models["llama"], monkeypatch, False, "float32", 4, kv_cache_dtype="float16",
                      decoder_backend="eager", attention_backend="sdpa")
    assert_same_greedy(kernels, plain, tol=1e-3)


def test_long_contexts_attend_in_partitions_on_every_path(tmp_path):
    """Prompts of 520-1,100 tokens: the decode step's and the paged operator's attention run each
    context past 512 positions in partitions and merge them; plain torch (SDPA over the gathered
    context) attends in one pass. The same tokens."""
    path = make_tiny_hf_model(tmp_path / "long", arch="llama", max_position_embeddings=2048)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 250, (int(n),), generator=g).tolist() for n in (520, 700, 1100, 30)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    outs = {}
    for name, kw in {"step": {"decoder_backend": "step"}, "fused": {"decoder_backend": "fused"},
                     "plain": {"decoder_backend": "eager", "attention_backend": "sdpa"}}.items():
        llm = LLM(str(path), dtype="float32", num_kv_blocks=256, max_model_len=1200, **kw)
        outs[name] = llm.generate(prompts, params)
    assert_same_greedy(outs["step"], outs["fused"], top_ids=True)
    assert_same_greedy(outs["step"], outs["plain"], tol=1e-3)


def test_a_model_the_step_cannot_take_falls_back_to_the_operators(tmp_path, monkeypatch, caplog):
    """head_dim 6 (not a multiple of 4): DecoderStep refuses it at construction; the model logs
    why and runs its decode steps per operator, with the same tokens as with the step turned off."""
    path = make_tiny_hf_model(tmp_path / "odd", arch="llama", hidden_size=24, head_dim=6)
    with caplog.at_level("WARNING"):
        on = _generate(path, monkeypatch, True, "float32", 2, expect_step=False)
    assert "does not take this model" in caplog.text
    off = _generate(path, monkeypatch, False, "float32", 2)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
