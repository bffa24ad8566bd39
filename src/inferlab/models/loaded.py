"""What every weight loader returns, and the one table of expected weight names and shapes.

The decoder consumes Hugging Face Llama/Qwen-style names whatever the file format was, so
GGUF, safetensors and dummy loaders all meet in `LoadedModel`. `expected_weight_shapes` is
the single source of truth for those names: the dummy loader generates from it and the other
loaders check against it, so a missing or misshapen tensor fails at load time with a clear
message instead of deep inside the first forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from inferlab.config import ModelConfig


@dataclass
class LoadedModel:
    """A model's architecture facts and its weights, named as in Hugging Face checkpoints."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF names -> tensors (lm_head.weight absent when tied)
    source_path: Path | None  # the GGUF file, HF directory or config.json it came from; None for dummy
    format: str  # "gguf" | "hf" | "dummy"
    # The file's own sampling defaults (GGUF general.sampling.*, generation_config.json), read
    # while the file is open: engine/generation_config.py resolves them against the others.
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the decoder needs for `config`, in torch (out_features, in_features) order."""
    h, hd = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor], source: object) -> None:
    """Raise ValueError naming the first missing or misshapen tensor (extra tensors are the caller's business)."""
    expected = expected_weight_shapes(config)
    missing = [name for name in expected if name not in weights]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ValueError(f"{source}: missing weight {missing[0]!r}{more}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(
                f"{source}: weight {name!r} has shape {tuple(weights[name].shape)}, the config implies {shape}"
            )
