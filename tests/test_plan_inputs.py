"""Where the planner's inputs come from: GGUF files, config.json / HF directories, the built-in
tables, hardware files and the CPU measurement."""

from __future__ import annotations

import json

import numpy as np
import pytest

from inferlab.plan.hardware import (
    HardwareSpec,
    builtin_hardware,
    builtin_hardware_names,
    load_hardware_file,
    save_hardware_file,
)
from inferlab.plan.model_spec import builtin_model, count_params, load_model_spec
from inferlab.plan.roofline import Roofline

# a tiny Llama: 2 layers, hidden 64, 4 heads of 16, 2 KV heads, MLP 96, vocab 128
H, L, NH, KV, D, I, V = 64, 2, 4, 2, 16, 96, 128


def _tiny_tensors(tied: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    t = {"token_embd.weight": rng.standard_normal((V, H), dtype=np.float32)}
    if not tied:
        t["output.weight"] = rng.standard_normal((V, H), dtype=np.float32)
    t["output_norm.weight"] = np.ones(H, dtype=np.float32)
    for i in range(L):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = np.ones(H, dtype=np.float32)
        t[p + "ffn_norm.weight"] = np.ones(H, dtype=np.float32)
        t[p + "attn_q.weight"] = rng.standard_normal((NH * D, H), dtype=np.float32)
        t[p + "attn_k.weight"] = rng.standard_normal((KV * D, H), dtype=np.float32)
        t[p + "attn_v.weight"] = rng.standard_normal((KV * D, H), dtype=np.float32)
        t[p + "attn_output.weight"] = rng.standard_normal((H, NH * D), dtype=np.float32)
        t[p + "ffn_gate.weight"] = rng.standard_normal((I, H), dtype=np.float32)
        t[p + "ffn_up.weight"] = rng.standard_normal((I, H), dtype=np.float32)
        t[p + "ffn_down.weight"] = rng.standard_normal((H, I), dtype=np.float32)
    return t


def write_tiny_gguf(path, tied: bool = True) -> tuple[int, int]:
    """Matrices in Q8_0, norms in F32 (as llama.cpp stores them). Returns (params, stored bytes)."""
    import gguf
    from gguf.quants import quantize

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(L)
    w.add_context_length(512)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(NH)
    w.add_head_count_kv(KV)
    w.add_vocab_size(V)
    params = nbytes = 0
    for name, arr in _tiny_tensors(tied).items():
        params += arr.size
        if arr.ndim == 2:
            q = quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            nbytes += arr.size // 32 * 34
        else:
            w.add_tensor(name, arr)
            nbytes += arr.size * 4
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return params, nbytes


def test_gguf_shape_params_and_stored_bytes(tmp_path):
    path = tmp_path / "tiny.Q8_0.gguf"
    params, nbytes = write_tiny_gguf(path, tied=True)
    spec = load_model_spec(str(path))
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (L, H, NH, KV, D)
    assert (spec.intermediate_size, spec.vocab_size) == (I, V)
    assert spec.tie_word_embeddings
    assert spec.num_params == params == count_params(
        num_layers=L, hidden_size=H, num_heads=NH, num_kv_heads=KV, head_dim=D, intermediate_size=I,
        vocab_size=V, tie_word_embeddings=True)
    assert spec.file_weight_bytes == nbytes
    assert spec.native_precision == "q8_0"
    assert spec.params_kind == "computed"
    # As stored: the file's bytes, not params × bits.
    rf = Roofline(spec, builtin_hardware("l4"))
    assert rf.from_file and rf.weight_bytes == nbytes
    # An explicit precision recomputes from the parameter count.
    assert Roofline(spec, builtin_hardware("l4"), weight_precision="bf16").weight_bytes == params * 2


def test_gguf_untied_reads_all_but_the_input_table(tmp_path):
    path = tmp_path / "untied.gguf"
    _, nbytes = write_tiny_gguf(path, tied=False)
    spec = load_model_spec(str(path))
    assert not spec.tie_word_embeddings
    assert spec.file_embedding_bytes == V * H // 32 * 34
    rf = Roofline(spec, builtin_hardware("l4"))
    assert rf.weight_bytes_read_per_step == nbytes - V * H // 32 * 34


def test_a_directory_with_one_gguf(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf")
    assert load_model_spec(str(tmp_path)).num_layers == L


def test_not_a_gguf_is_a_value_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_model_spec(str(bad))


QWEN3_CONFIG = {
    "model_type": "qwen3", "num_hidden_layers": 28, "hidden_size": 1024, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "max_position_embeddings": 40960,
}


def test_config_json_matches_the_builtin(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(QWEN3_CONFIG))
    spec = load_model_spec(str(p))
    assert spec.qk_norm and spec.tie_word_embeddings
    assert spec.num_params == builtin_model("qwen3-0.6b").num_params
    assert spec.params_kind == "computed"


def test_hf_dir_sums_safetensors_headers(tmp_path):
    from safetensors.numpy import save_file

    cfg = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 2,
           "num_key_value_heads": 1, "intermediate_size": 16, "vocab_size": 10, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"model.embed_tokens.weight": np.zeros((10, 8), np.float16),
               "lm_head.weight": np.zeros((10, 8), np.float16),
               "model.layers.0.mlp.up_proj.weight": np.zeros((16, 8), np.float32)},
              str(tmp_path / "model.safetensors"))
    spec = load_model_spec(str(tmp_path))
    assert spec.num_params == 80 + 80 + 128
    assert spec.file_weight_bytes == 160 + 160 + 512
    assert spec.file_embedding_bytes == 160


def test_config_missing_a_field(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ValueError, match="lacks"):
        load_model_spec(str(p))


def test_planner_reads_files_as_the_engine_does(tmp_path):
    """One parser: the spec of a file is the engine's ModelConfig of it, refusals included."""
    from inferlab.models.model_config import model_config_from_gguf, model_config_from_hf

    gguf_path = tmp_path / "m.gguf"
    write_tiny_gguf(gguf_path)
    cfg = {**QWEN3_CONFIG, "architectures": ["Qwen3ForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    import gguf

    for spec, config in ((load_model_spec(str(gguf_path)), model_config_from_gguf(gguf.GGUFReader(str(gguf_path)))),
                         (load_model_spec(str(tmp_path / "config.json")), model_config_from_hf(cfg))):
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                      "vocab_size", "tie_word_embeddings", "qk_norm", "attention_bias", "max_position_embeddings"):
            assert getattr(spec, field) == getattr(config, field), field
    for refused, message in (({**cfg, "architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
                             ({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'")):
        (tmp_path / "config.json").write_text(json.dumps(refused))
        with pytest.raises(ValueError, match=message):
            load_model_spec(str(tmp_path / "config.json"))


def test_builtin_names_and_errors():
    assert builtin_model("Mistral-7B").num_params == 7_248_023_552
    assert builtin_model("HuggingFaceTB/SmolLM2-135M-Instruct").num_params == 134_515_008
    with pytest.raises(ValueError, match="unknown model 'gpt-5'"):
        load_model_spec("gpt-5")
    with pytest.raises(FileNotFoundError):
        load_model_spec("/no/such/dir/model.gguf")


# ---------------------------------------------------------------- hardware


def test_builtin_hardware_from_spec_sheets():
    h100 = builtin_hardware("H100")
    assert (h100.memory_bytes, h100.memory_bandwidth, h100.flops["bf16"]) == (80e9, 3.35e12, 989.4e12)
    assert h100.kind == "cited" and "datasheet" in h100.source
    assert builtin_hardware("h200").memory_bandwidth == 4.8e12
    assert builtin_hardware("a100").memory_bandwidth == 2.039e12
    assert builtin_hardware("L4").memory_bandwidth == 300e9
    assert builtin_hardware("RTX 4090").memory_bandwidth == 1008e9
    assert len(builtin_hardware_names()) == 5
    with pytest.raises(ValueError, match="unknown hardware"):
        builtin_hardware("tpu-v9")


def test_hardware_file_round_trip_and_errors(tmp_path):
    spec = HardwareSpec("box", 64e9, 50e9, {"bf16": 1e12, "fp32": 2e11}, "measured", "test", ["n"])
    path = tmp_path / "hw.json"
    save_hardware_file(spec, path)
    assert load_hardware_file(path) == spec
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_hardware_file(tmp_path / "bad.json")
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(ValueError, match="not a hardware profile"):
        load_hardware_file(tmp_path / "empty.json")
    with pytest.raises(ValueError, match="FLOP/s"):
        HardwareSpec("x", 1, 1, {}, "cited", "t")


def test_compute_rate_falls_back_to_bf16():
    cpu = HardwareSpec("cpu", 1e9, 1e9, {"bf16": 5e11, "fp32": 2e11}, "measured", "t")
    assert cpu.compute_rate("fp8") == (5e11, "bf16")
    assert cpu.compute_rate("fp32") == (2e11, "fp32")


def test_measure_cpu_small(tmp_path):
    from inferlab.plan.measure import measure_cpu

    spec = measure_cpu(threads=1, array_mib=4, repeats=1, matmul_rows=16, matmul_dim=64)
    assert spec.kind == "measured"
    assert spec.memory_bandwidth > 1e8  # any machine moves more than 100 MB/s
    assert spec.flops["bf16"] > 0 and spec.flops["fp32"] > 0
    assert spec.memory_bytes > 0
    save_hardware_file(spec, tmp_path / "cpu.json")
    assert load_hardware_file(tmp_path / "cpu.json").memory_bandwidth == spec.memory_bandwidth


def test_int8_rate_is_the_faster_library_and_names_it(monkeypatch):
    """Without VNNI, torch._int_mm is a reference loop (1-2 GOP/s on an AVX2 EPYC) and held w8a8's
    products to a hundredth of what they run at: the quantized engine's GEMM is measured beside it."""
    import torch

    from inferlab.plan import measure

    if not any(e in torch.backends.quantized.supported_engines for e in ("x86", "fbgemm", "onednn")):
        pytest.skip("torch has no quantized CPU engine here")
    engine_before = torch.backends.quantized.engine

    def no_int_mm(a, b):
        raise RuntimeError("_int_mm: not on this CPU")

    monkeypatch.setattr(torch, "_int_mm", no_int_mm)
    rate, how = measure._int8_rate(torch, 16, 64, 1)
    assert rate > 0 and "by torch.ops.quantized.linear" in how and "_int_mm" not in how
    assert torch.backends.quantized.engine == engine_before
    monkeypatch.undo()
    rate, how = measure._int8_rate(torch, 16, 64, 1)
    assert "torch._int_mm" in how and "torch.ops.quantized.linear" in how  # both measured, both named
