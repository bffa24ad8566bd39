"""`ModelConfig` from a Hugging Face config.json or from GGUF metadata.

Both sources describe the same few facts under different names; this module is the only
place that knows both vocabularies. Anything the one decoder cannot run (another
architecture, partial rotary, MLP biases, yarn rope scaling, ...) is refused here with a
ValueError, before any weights load, so it never turns into silently wrong output later.
The planner derives its ModelSpec from the same ModelConfig, so it needs no torch here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from inferlab.config import ModelConfig

# Hugging Face `architectures[0]` -> our family. Mistral and SmolLM are Llama to the decoder.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# config.json's model_type, used when `architectures` is absent.
HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# GGUF general.architecture -> our family (llama.cpp writes Mistral models as "llama").
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# Llama 3.1 / 3.2's rope scaling settings: tried first when a GGUF carries rope_freqs.weight.
_LLAMA3_CANONICAL = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# Rope scalings models/rope.py implements ("default" is plain RoPE, rope_scaling None).
ROPE_SCALINGS = ("linear", "llama3")


def _unsupported(arch: str, supported: dict[str, str]) -> ValueError:
    return ValueError(f"unsupported architecture {arch!r} (supported: {', '.join(sorted(supported))})")


def _token_ids(value: Any) -> list[int]:
    """An eos/bos entry of a config: None, an int or a list of ints."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _dedupe(ids: list[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))


def _check_rope(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """Refuse a rope scaling the decoder cannot apply (yarn, dynamic, longrope, ...)."""
    if scaling is not None and scaling["rope_type"] not in ROPE_SCALINGS:
        raise ValueError(
            f"unsupported rope scaling {scaling['rope_type']!r} (supported: none, {', '.join(ROPE_SCALINGS)})"
        )
    return scaling


def _one_per_layer(value: Any, what: str) -> int:
    """A GGUF count that some files write per layer: one number, refused when the layers differ."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"GGUF has a different {what} per layer; not supported")
        value = value[0]
    return int(value)


def _hf_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either transformers 5's `rope_parameters` or 4.x's `rope_scaling`."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    source = params if params.get("rope_type", params.get("type", "default")) != "default" else scaling
    source = {k: v for k, v in source.items() if k != "rope_theta"}
    rope_type = source.pop("rope_type", None) or source.pop("type", None) or "default"
    source.pop("type", None)
    if rope_type == "default":
        return theta, None
    return theta, _check_rope({"rope_type": rope_type, **source})


def model_config_from_hf(
    config: dict[str, Any], name: str = "", generation_config: dict[str, Any] | None = None
) -> ModelConfig:
    """Map a config.json dict (plus generation_config.json's, whose eos ids are added) to a ModelConfig."""
    archs = config.get("architectures") or []
    if archs:
        arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
        if arch is None:
            raise _unsupported(archs[0], HF_ARCHITECTURES)
    else:
        model_type = config.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            raise _unsupported(str(model_type), HF_MODEL_TYPES)
        arch = HF_MODEL_TYPES[model_type]

    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}: the decoder implements SwiGLU (silu) only")
    if config.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias=true: the decoder's MLP has no biases")

    try:
        hidden = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        fields = dict(
            vocab_size=int(config["vocab_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
        )
    except KeyError as e:
        raise ValueError(f"config.json lacks {e.args[0]!r}") from None
    theta, rope_scaling = _hf_rope(config)
    max_pos = int(config.get("max_position_embeddings", 2048))
    # Mistral v0.1 attends over a sliding window; within the window that equals full
    # attention, so capping the context is exact, whereas ignoring it would be silently wrong.
    window = config.get("sliding_window")
    if arch == "llama" and window and config.get("use_sliding_window", True) and int(window) < max_pos:
        max_pos = int(window)
    eos = _token_ids(config.get("eos_token_id"))
    if generation_config:
        eos += _token_ids(generation_config.get("eos_token_id"))
    bos = _token_ids(config.get("bos_token_id"))
    return ModelConfig(
        architecture=arch,
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases (its config has no flag for it); Llama may opt in.
        attention_bias=arch == "qwen2" or bool(config.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=_dedupe(eos),
        name=name,
        **fields,
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def model_config_from_hf_dir(path: str | Path, name: str = "") -> ModelConfig:
    """ModelConfig of a Hugging Face model directory (config.json + optional generation_config.json).

    `path` may also be a config.json file itself (dummy weights of a real shape).
    """
    path = Path(path)
    config_path = path if path.is_file() else path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    gen_path = config_path.parent / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.is_file() else None
    return model_config_from_hf(_read_json(config_path), name=name, generation_config=gen)


# --- GGUF -----------------------------------------------------------------------------------


def gguf_field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as a plain Python value (str, int, float, bool or list)."""
    field = reader.get_field(key)
    return default if field is None else field.contents()


def llama3_rope_factors(head_dim: int, theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """The per-frequency divisors Llama 3's rope scaling applies (llama.cpp stores them as
    rope_freqs.weight): models/rope.py's formula as plain / scaled inverse frequencies, in
    numpy so that reading a GGUF's shape (the planner does) needs no torch."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = (old_ctx / wavelen - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    divisors = np.where(wavelen > old_ctx / low, factor, np.where(wavelen < old_ctx / high, 1.0, medium))
    return divisors.astype(np.float32)


def _llama3_scaling_from_factors(factors: np.ndarray, head_dim: int, theta: float) -> dict[str, Any]:
    """Recover Hugging Face's llama3 rope_scaling dict from llama.cpp's rope_freqs tensor.

    Only the ratios of (original context, low, high) are observable, so low_freq_factor is
    taken as 1 (as in every Llama 3.x release). The canonical 3.1/3.2 settings are tried
    first; otherwise the medium band is fitted. Whatever is chosen must reproduce the tensor.
    """
    factors = factors.astype(np.float64)
    factor = _f32(factors.max())
    candidates = [{"factor": factor, **_LLAMA3_CANONICAL}]
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    medium = (factors > 1 + 1e-4) & (factors < factor * (1 - 1e-4))
    if medium.sum() >= 2 and factor > 1:
        # smooth = old_ctx/(high-low) * (1/wavelen) - low/(high-low), linear in 1/wavelen.
        smooth = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(inv_freq[medium] / (2 * math.pi), smooth, 1)
        if intercept < 0 and slope > 0:
            high = 1 - 1 / intercept
            old_ctx = -slope / intercept
            candidates.append(
                {
                    "factor": factor,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": round(float(high), 4),
                    "original_max_position_embeddings": int(round(old_ctx)),
                }
            )
    for cand in candidates:
        if np.allclose(llama3_rope_factors(head_dim, theta, cand), factors, rtol=1e-3):
            return {"rope_type": "llama3", **cand}
    raise ValueError("rope_freqs.weight does not match Llama 3 rope scaling; this GGUF is not supported")


def _f32(value: Any) -> float:
    """A GGUF float32 as the decimal it was written from (9.999999747e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _gguf_tensor(reader: gguf.GGUFReader, name: str) -> Any:
    return next((t for t in reader.tensors if t.name == name), None)


def model_config_from_gguf(reader: gguf.GGUFReader, name: str = "") -> ModelConfig:
    """Map GGUF metadata (and the tensor table, for the facts it implies) to a ModelConfig."""
    arch_name = gguf_field(reader, "general.architecture")
    if arch_name not in GGUF_ARCHITECTURES:
        raise _unsupported(str(arch_name), GGUF_ARCHITECTURES)

    def meta(key: str, default: Any = None) -> Any:
        value = gguf_field(reader, f"{arch_name}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch_name}.{key}")
        return value

    hidden = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    num_kv_heads = _one_per_layer(meta("attention.head_count_kv", num_heads), "KV head count")
    head_dim = int(meta("attention.key_length", hidden // num_heads))
    rope_dim = int(meta("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary embeddings (rope dims {rope_dim} < head_dim {head_dim}) are not supported")
    theta = _f32(meta("rope.freq_base", 10000.0))

    embd = _gguf_tensor(reader, "token_embd.weight")
    if embd is None:
        raise ValueError("GGUF has no token_embd.weight tensor")
    names = {t.name for t in reader.tensors}

    rope_scaling: dict[str, Any] | None = None
    freqs = _gguf_tensor(reader, "rope_freqs.weight")
    scaling_type = meta("rope.scaling.type", "none")
    if freqs is not None:
        rope_scaling = _llama3_scaling_from_factors(np.asarray(freqs.data, dtype=np.float32), head_dim, theta)
    elif scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _f32(meta("rope.scaling.factor"))}
    elif scaling_type != "none":
        _check_rope({"rope_type": scaling_type})

    eos = _token_ids(gguf_field(reader, "tokenizer.ggml.eos_token_id"))
    # End-of-turn ends generation too (llama.cpp stops on either).
    eos += _token_ids(gguf_field(reader, "tokenizer.ggml.eot_token_id"))
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch_name],
        # The table's rows, not tokenizer.ggml.tokens or {arch}.vocab_size: padded vocabularies differ.
        vocab_size=int(embd.shape[1]),  # GGUF dims are reversed: [hidden, vocab]
        hidden_size=hidden,
        intermediate_size=_one_per_layer(meta("feed_forward_length"), "MLP width"),
        num_layers=int(meta("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads),
        head_dim=head_dim,
        rms_norm_eps=_f32(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_dedupe(eos),
        name=name,
    )
