"""The one decoder: Llama 1/2/3, Mistral, SmolLM/SmolLM2, Qwen2/2.5 and Qwen3 over a flat batch.

Prefill and decode are the same forward pass: a flat list of tokens with per-token positions;
attention reads and writes the paged cache (see attention.py). Weights arrive with Hugging
Face names (the loaders' contract) and are fused here: q/k/v into one matrix and gate/up into
another, so a layer is 4 matrix products instead of 7 (fewer dispatches, bigger products).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferlab.config import ModelConfig
from inferlab.models.attention import AttentionMetadata, paged_attention
from inferlab.models.rope import apply_rope, rope_cache


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2 kvH) * D, hidden]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor


class DecoderModel:
    """Weights plus a forward pass; no nn.Module machinery (nothing here is trained)."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype):
        self.config = config
        self.dtype = dtype
        c = config
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.scale = c.head_dim**-0.5

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"the checkpoint has no tensor {name!r}")
            return weights[name].to(dtype).contiguous()

        self.embed = take("model.embed_tokens.weight")
        self.final_norm = take("model.norm.weight")
        if "lm_head.weight" in weights and not c.tie_word_embeddings:
            self.lm_head = take("lm_head.weight")
        else:
            self.lm_head = self.embed
        self.layers: list[LayerWeights] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if c.attention_bias:
                bias = torch.cat([take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias")])
            self.layers.append(
                LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=torch.cat([take(a + "q_proj.weight"), take(a + "k_proj.weight"), take(a + "v_proj.weight")]),
                    qkv_bias=bias,
                    q_norm=take(a + "q_norm.weight") if c.qk_norm else None,
                    k_norm=take(a + "k_norm.weight") if c.qk_norm else None,
                    o=take(a + "o_proj.weight"),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
                    down=take(p + "mlp.down_proj.weight"),
                )
            )
        self.cos, self.sin = rope_cache(
            c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings, dtype
        )

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]."""
        c = self.config
        t = input_ids.shape[0]
        x = self.embed.index_select(0, input_ids)
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        for layer, cache in zip(self.layers, kv_caches):
            h = self._norm(x, layer.input_norm)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(t, c.num_heads, c.head_dim)
            k = k.reshape(t, c.num_kv_heads, c.head_dim)
            v = v.reshape(t, c.num_kv_heads, c.head_dim)
            if layer.q_norm is not None:
                q = self._norm(q, layer.q_norm)
                k = self._norm(k, layer.k_norm)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            attn = paged_attention(q, k, v, cache, meta, self.scale)
            x = x + F.linear(attn, layer.o)
            h = self._norm(x, layer.post_norm)
            gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        return self._norm(x, self.final_norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for the given hidden rows."""
        return F.linear(hidden, self.lm_head).float()
