"""Model loading: config mapping, GGUF / safetensors / dummy weights, the real default GGUF."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from inferlab.config import LoadConfig, ModelConfig
from inferlab.kernels.build import KernelInfo
from inferlab.models.dummy_loader import load_dummy
from inferlab.models.gguf_loader import dequantize_tensor, load_gguf, open_gguf, unpermute_qk
from inferlab.models.hf_loader import load_hf_dir
from inferlab.models.loaded import expected_weight_shapes
from inferlab.models.loader import load_model
from inferlab.models.model_config import (
    gguf_field,
    llama3_rope_factors,
    model_config_from_gguf,
    model_config_from_hf,
    model_config_from_hf_dir,
)
from inferlab.models.precision import resolve_precision
from inferlab.models.testing import (
    TINY_ARCHS,
    default_gguf_path,
    load_reference_model,
    make_tiny_gguf,
    make_tiny_hf_model,
    permute_qk_for_gguf,
)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_hf_model(root / arch, arch) for arch in TINY_ARCHS}


# --- config mapping -------------------------------------------------------------------------

EXPECTED = {
    # arch -> fields of ModelConfig that identify the family's differences
    "llama": dict(architecture="llama", tie_word_embeddings=True, attention_bias=False, qk_norm=False,
                  head_dim=16, rope_theta=100000.0, rope_scaling=None),
    "mistral": dict(architecture="llama", tie_word_embeddings=False, attention_bias=False, qk_norm=False,
                    head_dim=16, rope_theta=10000.0, rope_scaling=None),
    "qwen2": dict(architecture="qwen2", tie_word_embeddings=True, attention_bias=True, qk_norm=False,
                  head_dim=16, rope_theta=1000000.0, rope_scaling=None),
    "qwen3": dict(architecture="qwen3", tie_word_embeddings=True, attention_bias=False, qk_norm=True,
                  head_dim=32, rope_theta=1000000.0, rope_scaling=None),
    "llama3": dict(architecture="llama", tie_word_embeddings=False, attention_bias=False, qk_norm=False,
                   head_dim=16, rope_theta=10000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}  # fmt: skip


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_hf_config_mapping(tiny_dirs: dict[str, Path], arch: str) -> None:
    config = model_config_from_hf_dir(tiny_dirs[arch], name="tiny")
    common = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, rms_norm_eps=1e-6, max_position_embeddings=512, bos_token_id=1,
                  eos_token_ids=(2,), name="tiny")  # fmt: skip
    for field, value in {**common, **EXPECTED[arch]}.items():
        assert getattr(config, field) == value, field


def test_hf_config_transformers4_style_and_generation_eos() -> None:
    # A Llama-3.1-8B-Instruct config.json as transformers 4.x wrote it.
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "tie_word_embeddings": False,
    }  # fmt: skip
    mc = model_config_from_hf(config, name="llama-8b", generation_config={"eos_token_id": [128001, 128009, 7]})
    assert (mc.head_dim, mc.num_kv_heads, mc.rope_theta) == (128, 8, 500000.0)
    assert mc.rope_scaling == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }  # fmt: skip
    assert mc.eos_token_ids == (128001, 128008, 128009, 7)
    assert mc.bos_token_id == 128000
    # The old spelling "type" of rope_scaling, e.g. linear scaling.
    linear = model_config_from_hf({**config, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert linear.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_hf_config_mistral_sliding_window_caps_context() -> None:
    config = {
        "architectures": ["MistralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
        "max_position_embeddings": 32768, "sliding_window": 4096, "rope_theta": 10000.0,
    }  # fmt: skip
    mc = model_config_from_hf(config)
    assert mc.architecture == "llama" and mc.max_position_embeddings == 4096
    assert model_config_from_hf({**config, "sliding_window": None}).max_position_embeddings == 32768


@pytest.mark.parametrize(
    "config, message",
    [
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "unsupported architecture 'GPT2LMHeadModel'"),
        ({"model_type": "bert"}, "unsupported architecture 'bert'"),
        ({"architectures": ["LlamaForCausalLM"], "hidden_act": "gelu"}, "hidden_act"),
        ({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}, "lacks 'num_attention_heads'"),
    ],
)
def test_hf_config_refusals(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        model_config_from_hf(config)
    if "GPT2" in message:
        assert "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM" in str(info.value)
    if "bert" in message:
        assert "supported: llama, mistral, qwen2, qwen3" in str(info.value)


LLAMA_SHAPE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
               "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 128}  # fmt: skip


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "factor": 4.0}, {"type": "dynamic", "factor": 2.0}])
def test_hf_config_refuses_rope_scaling_the_decoder_lacks(rope: dict) -> None:
    with pytest.raises(ValueError, match=rf"unsupported rope scaling '{rope.get('rope_type', rope.get('type'))}'"):
        model_config_from_hf({**LLAMA_SHAPE, "rope_scaling": rope})
    # transformers 5's spelling too
    with pytest.raises(ValueError, match="unsupported rope scaling"):
        model_config_from_hf({**LLAMA_SHAPE, "rope_parameters": {**rope, "rope_theta": 1e4}})


def test_yarn_is_refused_before_any_weight_is_read(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    model = tmp_path / "yarn"
    model.mkdir()
    cfg = json.loads((tiny_dirs["llama"] / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    (model / "model.safetensors").write_bytes(b"not weights")  # reading it would fail differently
    with pytest.raises(ValueError, match="unsupported rope scaling 'yarn'"):
        load_hf_dir(model, torch.float32)


def _tiny_gguf_with(path: Path, **meta: object) -> Path:
    """A tiny llama GGUF (one 8-wide layer) whose metadata may carry per-layer lists and rope scaling."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(meta.get("ffn", 16))  # type: ignore[arg-type]
    w.add_head_count(2)
    w.add_head_count_kv(meta.get("kv", 1))  # type: ignore[arg-type]
    w.add_vocab_size(meta.get("vocab", 10))  # type: ignore[arg-type]
    if "rope" in meta:
        w.add_rope_scaling_type(meta["rope"])  # type: ignore[arg-type]
        w.add_rope_scaling_factor(4.0)
    w.add_tensor("token_embd.weight", np.zeros((12, 8), np.float32))  # 12 rows: a padded vocabulary
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_config_per_layer_counts_and_vocabulary(tmp_path: Path) -> None:
    config = model_config_from_gguf(open_gguf(_tiny_gguf_with(tmp_path / "a.gguf", kv=[1], ffn=[16])))
    assert (config.num_kv_heads, config.intermediate_size) == (1, 16)
    assert config.vocab_size == 12  # the embedding table's rows, not {arch}.vocab_size
    with pytest.raises(ValueError, match="different KV head count per layer"):
        model_config_from_gguf(open_gguf(_tiny_gguf_with(tmp_path / "b.gguf", kv=[1, 2])))
    with pytest.raises(ValueError, match="different MLP width per layer"):
        model_config_from_gguf(open_gguf(_tiny_gguf_with(tmp_path / "c.gguf", ffn=[16, 32])))
    with pytest.raises(ValueError, match="unsupported rope scaling 'yarn'"):
        model_config_from_gguf(open_gguf(_tiny_gguf_with(tmp_path / "d.gguf", rope=gguf.RopeScalingType.YARN)))
    linear = _tiny_gguf_with(tmp_path / "e.gguf", rope=gguf.RopeScalingType.LINEAR)
    assert model_config_from_gguf(open_gguf(linear)).rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_llama3_rope_factors_match_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, rope_scaling=scaling)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    plain = 500000.0 ** (-torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    expected = (plain / scaled.double()).numpy()
    np.testing.assert_allclose(llama3_rope_factors(128, 500000.0, scaling), expected, rtol=1e-5)


# --- GGUF -----------------------------------------------------------------------------------


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)  # 4 heads of 8 rows
    permuted = permute_qk_for_gguf(w, 4)
    assert not np.array_equal(permuted, w)
    # llama.cpp's layout: head 0's rows 0..3 (first half) and 4..7 (second half) interleave.
    assert permuted[:8, 0].tolist() == [0, 12, 3, 15, 6, 18, 9, 21]
    assert torch.equal(unpermute_qk(torch.from_numpy(permuted), 4), torch.from_numpy(w))
    bias = np.arange(16, dtype=np.float32)
    assert torch.equal(unpermute_qk(torch.from_numpy(permute_qk_for_gguf(bias, 2)), 2), torch.from_numpy(bias))


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_gguf_f32_round_trip_is_exact(tiny_dirs: dict[str, Path], tmp_path: Path, arch: str) -> None:
    path = make_tiny_gguf(tmp_path / "m.gguf", hf_dir=tiny_dirs[arch], qtype="F32")
    hf = load_hf_dir(tiny_dirs[arch], torch.float32)
    loaded = load_gguf(path, torch.float32, name="x")
    assert loaded.format == "gguf" and loaded.source_path == path
    assert loaded.config == ModelConfig(**{**hf.config.__dict__, "name": "x"})
    assert loaded.weights.keys() == hf.weights.keys()
    for name, value in hf.weights.items():
        assert torch.equal(loaded.weights[name], value), name
    if EXPECTED[arch]["architecture"] == "llama":
        # The file really holds permuted rows, so equality above proves the un-permutation.
        raw = next(t for t in open_gguf(path).tensors if t.name == "blk.0.attn_q.weight")
        assert not torch.equal(dequantize_tensor(raw), hf.weights["model.layers.0.self_attn.q_proj.weight"])


# Worst-case error of each format relative to a tensor's largest |value|.
QUANT_TOLERANCE = {"F16": 1e-3, "BF16": 8e-3, "Q8_0": 1.0 / 127 + 1e-3, "Q4_1": 1.0 / 15 + 0.01, "Q4_0": 1.0 / 8 + 0.01}


@pytest.mark.parametrize("qtype", sorted(QUANT_TOLERANCE))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_quantized_within_error(tiny_dirs: dict[str, Path], tmp_path: Path, arch: str, qtype: str) -> None:
    path = make_tiny_gguf(tmp_path / "m.gguf", hf_dir=tiny_dirs[arch], qtype=qtype)
    hf = load_hf_dir(tiny_dirs[arch], torch.float32).weights
    loaded = load_gguf(path, torch.float32).weights
    assert loaded.keys() == hf.keys()
    any_error = False
    for name, value in hf.items():
        err = (loaded[name] - value).abs().max().item()
        assert err <= QUANT_TOLERANCE[qtype] * value.abs().max().item(), (name, err)
        any_error |= err > 0
    assert any_error, "a quantized file should not reproduce the weights exactly"


def _constant_k_quant_blocks() -> dict[str, tuple[np.ndarray, float]]:
    """One 256-value block per K-quant type whose every value is known by construction."""

    def f16(x: float) -> np.ndarray:
        return np.array([x], dtype=np.float16).view(np.uint8)

    # 8 sub-blocks, each scale 2 and min 1 (6-bit fields packed into 12 bytes).
    scales = np.array([2] * 4 + [1] * 4 + [0x12] * 4, dtype=np.uint8)
    d, dmin, all_q3 = f16(0.25), f16(0.5), np.full(128, 0x33, np.uint8)
    q6_low, q6_high, q6_scales = np.full(128, 0x11, np.uint8), np.zeros(64, np.uint8), np.full(16, 3, np.uint8)
    return {
        # d*sc*q - dmin*m = 0.25*2*3 - 0.5*1
        "Q4_K": (np.concatenate([d, dmin, scales, all_q3]), 1.0),
        # the high bits add 16 to every q: 0.25*2*19 - 0.5*1
        "Q5_K": (np.concatenate([d, dmin, scales, np.full(32, 0xFF, np.uint8), all_q3]), 9.0),
        # d*scale*(q-32) = 0.5*3*(1-32)
        "Q6_K": (np.concatenate([q6_low, q6_high, q6_scales, f16(0.5)]), -46.5),
    }


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_dequantization(tmp_path: Path, qtype: str) -> None:
    block, value = _constant_k_quant_blocks()[qtype]
    path = tmp_path / "k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w", np.tile(block, (3, 2)), raw_dtype=gguf.GGMLQuantizationType[qtype])  # 3 rows x 512
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = open_gguf(path).tensors
    out = dequantize_tensor(tensor)
    assert out.shape == (3, 512) and out.dtype == torch.float32
    assert torch.all(out == value)


def test_gguf_unsupported_tensor_type(tmp_path: Path) -> None:
    path = make_tiny_gguf(tmp_path / "m.gguf", "llama", qtype="Q5_0")
    with pytest.raises(ValueError, match=r"tensor 'token_embd.weight' has type Q5_0, which is not supported"):
        load_gguf(path, torch.float32)


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    path = make_tiny_gguf(tmp_path / "m.gguf", "llama", gguf_arch="gpt2")
    with pytest.raises(ValueError, match=r"unsupported architecture 'gpt2' \(supported: llama, qwen2, qwen3\)"):
        load_gguf(path, torch.float32)


@pytest.mark.parametrize("damage", ["truncated_data", "truncated_header", "random_bytes", "empty", "not_gguf"])
def test_corrupt_gguf_is_a_clear_error(tiny_dirs: dict[str, Path], tmp_path: Path, damage: str) -> None:
    good = make_tiny_gguf(tmp_path / "good.gguf", hf_dir=tiny_dirs["llama"]).read_bytes()
    data = {
        "truncated_data": good[: len(good) * 2 // 3],
        "truncated_header": good[:200],
        "random_bytes": b"GGUF" + np.random.default_rng(0).bytes(4096),
        "empty": b"",
        "not_gguf": b"PK\x03\x04 this is a zip file, not a model",
    }[damage]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match="bad.gguf") as info:
        load_gguf(path, torch.float32)
    assert "GGUF" in str(info.value)


def test_missing_gguf_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_gguf(tmp_path / "nope.gguf", torch.float32)


# --- the real default model -----------------------------------------------------------------


@pytest.fixture(scope="module")
def default_model() -> tuple[Path, object]:
    path = default_gguf_path()
    return path, load_gguf(path, torch.float32, name="SmolLM2-135M-Instruct")


def test_default_gguf_config(default_model: tuple[Path, object]) -> None:
    path, loaded = default_model
    c = loaded.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (c.vocab_size, c.head_dim, c.intermediate_size, c.tie_word_embeddings) == (49152, 64, 1536, True)
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1
    assert "lm_head.weight" not in loaded.weights
    assert sum(t.numel() for t in loaded.weights.values()) == 134_515_008
    types = {t.tensor_type.name for t in open_gguf(path).tensors}
    assert types == {"F32", "Q4_1", "Q8_0"}


def test_default_gguf_predicts_english(default_model: tuple[Path, object]) -> None:
    """transformers' Llama with our weights must model text well; q/k rows left in llama.cpp's
    order measure ~4.0 nats per token on this passage, correctly un-permuted ones ~2.4."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    path, loaded = default_model
    reader = open_gguf(path)
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in gguf_field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = (
        "The quick brown fox jumps over the lazy dog. Paris is the capital and most populous city of France. "
        "It is located on the river Seine, in the north of the country, and has been one of the world's major "
        "centres of finance, diplomacy, commerce and culture for centuries."
    )
    ids = torch.tensor([tok.encode(text).ids])
    c = loaded.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, tie_word_embeddings=True,
        max_position_embeddings=c.max_position_embeddings,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf_config)
    model.load_state_dict(loaded.weights, strict=False, assign=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(hf_config)  # its buffers were on meta
    model.tie_weights()
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert loss < 3.0


# --- safetensors ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_hf_weights_match_transformers(tiny_dirs: dict[str, Path], arch: str) -> None:
    loaded = load_hf_dir(tiny_dirs[arch], torch.float32)
    reference = load_reference_model(tiny_dirs[arch]).state_dict()
    tied = loaded.config.tie_word_embeddings
    assert set(loaded.weights) == set(reference) - ({"lm_head.weight"} if tied else set())
    for name, value in loaded.weights.items():
        assert torch.equal(value, reference[name]), name
    assert set(loaded.weights) == set(expected_weight_shapes(loaded.config))


def test_hf_sharded_checkpoint(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    src = tiny_dirs["mistral"]
    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_text((src / name).read_text())
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file))
        weight_map.update({k: file for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    loaded = load_hf_dir(tmp_path, torch.bfloat16)
    assert all(v.dtype == torch.bfloat16 for v in loaded.weights.values())
    for name, value in tensors.items():
        assert torch.equal(loaded.weights[name], value.to(torch.bfloat16)), name
    # A shard named by the index but absent is a clear error.
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
        load_hf_dir(tmp_path, torch.float32)


def test_hf_missing_weight_and_missing_files(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    src = tiny_dirs["mistral"]
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_hf_dir(tmp_path, torch.float32)
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing weight 'model.layers.1.mlp.up_proj.weight'"):
        load_hf_dir(tmp_path, torch.float32)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="cannot read safetensors"):
        load_hf_dir(tmp_path, torch.float32)


# --- dummy weights and the dispatcher -------------------------------------------------------


def test_dummy_weights_shapes_and_values(tiny_dirs: dict[str, Path]) -> None:
    config = model_config_from_hf_dir(tiny_dirs["qwen3"])
    loaded = load_dummy(config, torch.bfloat16, seed=3)
    shapes = expected_weight_shapes(config)
    assert {k: tuple(v.shape) for k, v in loaded.weights.items()} == shapes
    assert all(v.dtype == torch.bfloat16 for v in loaded.weights.values())
    assert torch.all(loaded.weights["model.layers.0.self_attn.q_norm.weight"] == 1)
    assert torch.all(loaded.weights["model.norm.weight"] == 1)
    std = loaded.weights["model.layers.1.mlp.down_proj.weight"].float().std().item()
    assert 0.015 < std < 0.025
    again = load_dummy(config, torch.bfloat16, seed=3).weights
    other = load_dummy(config, torch.bfloat16, seed=4).weights
    name = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(again[name], loaded.weights[name]) and not torch.equal(other[name], loaded.weights[name])
    # From a config.json path: the shapes of a real model, named after its directory.
    from_file = load_dummy(tiny_dirs["qwen2"] / "config.json", torch.float32)
    assert from_file.config.attention_bias and from_file.config.name == "qwen2"
    assert torch.all(from_file.weights["model.layers.0.self_attn.q_proj.bias"] == 0)


def test_expected_shapes_count_llama3_8b() -> None:
    config = model_config_from_hf(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}
    )  # fmt: skip
    assert sum(math.prod(s) for s in expected_weight_shapes(config).values()) == 8_030_261_248


def test_load_model_dispatch(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    gguf_path = make_tiny_gguf(tmp_path / "tiny.gguf", hf_dir=tiny_dirs["qwen2"], qtype="Q8_0")
    m = load_model(LoadConfig(model=str(gguf_path)))
    assert (m.format, m.config.architecture, m.config.name) == ("gguf", "qwen2", str(gguf_path))
    assert m.weights["model.embed_tokens.weight"].dtype == resolve_precision(LoadConfig()).compute
    m = load_model(LoadConfig(dtype="float32"), model_path=tiny_dirs["qwen3"])
    assert (m.format, m.config.architecture, m.config.name) == ("hf", "qwen3", "qwen3")
    assert m.weights["model.norm.weight"].dtype == torch.float32
    m = load_model(LoadConfig(load_format="dummy", hf_config_path=str(tiny_dirs["llama"] / "config.json"), seed=1))
    assert m.format == "dummy" and m.config.tie_word_embeddings
    m = load_model(LoadConfig(load_format="dummy", model=str(tiny_dirs["qwen3"] / "config.json")))
    assert m.format == "dummy" and m.config.qk_norm
    with pytest.raises(ValueError, match="a config.json alone has no weights"):
        load_model(LoadConfig(model=str(tiny_dirs["qwen3"] / "config.json")))
    with pytest.raises(ValueError, match="load_format is 'gguf'"):
        load_model(LoadConfig(model=str(tiny_dirs["llama"]), load_format="gguf"))
    with pytest.raises(ValueError, match="dummy weights need a config"):
        load_model(LoadConfig(load_format="dummy"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(LoadConfig(model=str(tmp_path / "missing" / "model.gguf")))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(LoadConfig(), model_path=tmp_path / "missing")


def test_resolve_compute_dtype() -> None:
    def compute(dtype: str, variant: str, native_bf16: bool) -> torch.dtype:
        return resolve_precision(LoadConfig(dtype=dtype), kernel=KernelInfo(variant, ()), native_bf16=native_bf16).compute

    assert compute("auto", "none", True) == torch.bfloat16  # plain torch
    assert compute("auto", "none", False) == torch.float32  # emulated bf16 is far slower than float32
    assert compute("auto", "avx2", False) == torch.float32  # our kernels take float32 x
    assert compute("auto", "avx512", True) == torch.float32
    assert compute("float16", "avx2", True) == torch.float16
    with pytest.raises(ValueError, match="dtype must be"):
        LoadConfig(dtype="int8")


def test_gguf_config_reads_metadata_directly(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = make_tiny_gguf(tmp_path / "m.gguf", hf_dir=tiny_dirs["llama3"])
    reader = open_gguf(path)
    assert gguf_field(reader, "general.architecture") == "llama"
    assert "rope_freqs.weight" in {t.name for t in reader.tensors}
    config = model_config_from_gguf(reader, name="n")
    assert config.rope_scaling == EXPECTED["llama3"]["rope_scaling"]
    assert config.name == "n" and not config.tie_word_embeddings
