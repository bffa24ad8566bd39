"""SmoothQuant for w8a8, folded into the weights at load.

w8a8 rounds each row of x to 8 bits per scale (kernels/csrc/matvec.h: 192 values a scale on
AVX-512, 16 on AVX2). A norm's output has a few channels tens of times larger than the rest
(the norm weight and the residual stream put them there, in the same channels for every token),
so one scale over them leaves the others a few codes each. SmoothQuant (Xiao et al., 2023)
moves that range into the weights: with s_j = max|x_j|^a / max|W_:,j|^(1 - a), x_j / s_j and
W_:,j * s_j give the same product in exact arithmetic, and both quantize better. x / s is
folded into the norm's weight, W * s into the weights that read the norm (q, k, v; gate, up;
the lm_head after the final norm), once, before they are quantized: the kernels and a step's
cost are unchanged.

max|x_j| is measured, not guessed: a float32 forward over CALIBRATION_TOKENS token ids drawn
with a fixed seed (the same every load, so a model smooths the same way each time, and nothing
but the weights is needed: every loader and every tensor-parallel rank gets the same scales).
The outlier channels are the model's, not the text's: measured on SmolLM2-135M (x's rounding
emulated in float32, the perplexity text, 16 chunks of 512, KLD against float32), per 192 values
0.0108 without smoothing; with, 0.0052 from these ids, 0.0052 from 512 tokens of English prose,
code and dialogue, 0.0052 from 8,000 tokens of another text; per 64 values 0.0061 without, 0.0037
with. The norm weights alone as a guide of max|x| (no forward): 0.018, worse than none. a = 0.5.
The forward and the folds take ~0.8 s of the default model's ~9.6 s w8a8 load (2 cores).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from inferlab.config import ModelConfig
from inferlab.models.rope import apply_rope, rope_cache

log = logging.getLogger(__name__)

ALPHA = 0.5  # SmoothQuant's migration strength: half of x's range (in log scale) moves to W
# The lm_head's: its errors land on the logits themselves. Measured (the engine, w8a8 at 192
# values a scale, 16 chunks of 512, KLD against float32) on the perplexity text / on a second
# text: a = 0.3 0.0090 / 0.0080, 0.5 0.0100 / 0.0089, 0.7 0.0164 / -; the head not smoothed
# 0.0121 / -; for the layers' a at head 0.3: 0.4 0.0097, 0.5 0.0090, 0.6 0.0089, 0.7 0.0091.
HEAD_ALPHA = 0.3
CALIBRATION_TOKENS = 512


def calibration_tokens(vocab_size: int) -> list[int]:
    """CALIBRATION_TOKENS ids drawn uniformly from the vocabulary with a fixed seed."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (CALIBRATION_TOKENS,), generator=g).tolist()


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def norm_output_maxima(config: ModelConfig, weights: dict[str, torch.Tensor],
                       tokens: list[int]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Per layer, max |x_j| over `tokens` of the inputs of qkv and of gate/up (the two norms'
    outputs), and of the lm_head's (the final norm's): the model's forward in float32, one
    causal sequence, plain torch."""
    c = config
    t = len(tokens)

    def w(name: str) -> torch.Tensor:
        return weights[name].float()

    def lin(h: torch.Tensor, name: str) -> torch.Tensor:
        bias = weights.get(name + ".bias")
        return F.linear(h, w(name + ".weight"), None if bias is None else bias.float())

    cos, sin = (r.unsqueeze(1) for r in rope_cache(c.head_dim, c.rope_theta, c.rope_scaling, t, torch.float32))
    x = w("model.embed_tokens.weight")[torch.tensor(tokens)]
    maxima = []
    with torch.no_grad():
        for i in range(c.num_layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            h = _rms_norm(x, w(p + "input_layernorm.weight"), c.rms_norm_eps)
            attn_in = h.abs().amax(0)
            q = lin(h, a + "q_proj").view(t, c.num_heads, c.head_dim)
            k = lin(h, a + "k_proj").view(t, c.num_kv_heads, c.head_dim)
            v = lin(h, a + "v_proj").view(t, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q, k = _rms_norm(q, w(a + "q_norm.weight"), c.rms_norm_eps), _rms_norm(k, w(a + "k_norm.weight"), c.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               is_causal=True, enable_gqa=True)
            x = x + lin(o.transpose(0, 1).reshape(t, -1), a + "o_proj")
            h = _rms_norm(x, w(p + "post_attention_layernorm.weight"), c.rms_norm_eps)
            mlp_in = h.abs().amax(0)
            x = x + lin(F.silu(lin(h, p + "mlp.gate_proj")) * lin(h, p + "mlp.up_proj"), p + "mlp.down_proj")
            maxima.append((attn_in, mlp_in))
        head_in = _rms_norm(x, w("model.norm.weight"), c.rms_norm_eps).abs().amax(0)
    return maxima, head_in


def smoothing_scales(x_max: torch.Tensor, weights: list[torch.Tensor], alpha: float = ALPHA) -> torch.Tensor:
    """s_j = max|x_j|^a / max|W_:,j|^(1 - a) over every weight reading x; 1 where either is 0
    (a channel never seen active keeps its scale rather than growing without bound)."""
    w_max = torch.stack([m.float().abs().amax(0) for m in weights]).amax(0)
    ok = (x_max > 0) & (w_max > 0)
    s = x_max.clamp_min(1e-30).pow(alpha) / w_max.clamp_min(1e-30).pow(1 - alpha)
    return torch.where(ok, s, torch.ones_like(s))


def _fold(weights: dict[str, torch.Tensor], norm: str, readers: list[str], x_max: torch.Tensor,
          alpha: float) -> None:
    """weights[norm] /= s and weights[r] *= s (columns) for each reader r, each a new tensor put
    in the old one's place (the old is freed as it goes: a load's peak holds one layer's copies)."""
    s = smoothing_scales(x_max, [weights[r] for r in readers], alpha)
    g = weights[norm]
    weights[norm] = (g.float() / s).to(g.dtype)
    for r in readers:
        weights[r] = (weights[r].float() * s).to(weights[r].dtype)


def smooth_weights(config: ModelConfig, weights: dict[str, torch.Tensor], tokens: list[int] | None = None) -> None:
    """Each norm of `weights` (a loader's, changed in place) divided by its s and the weights it
    feeds multiplied by it (see the module docstring), the other tensors as they are; always an
    "lm_head.weight" of its own after (a tied model's embedding rows must stay as they are: the
    caller unties the two). `tokens`: calibration_tokens by default."""
    tokens = calibration_tokens(config.vocab_size) if tokens is None else tokens
    maxima, head_in = norm_output_maxima(config, weights, tokens)
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    _fold(weights, "model.norm.weight", ["lm_head.weight"], head_in, HEAD_ALPHA)
    for i, (attn_in, mlp_in) in enumerate(maxima):
        p = f"model.layers.{i}."
        _fold(weights, p + "input_layernorm.weight", [p + f"self_attn.{n}_proj.weight" for n in "qkv"], attn_in, ALPHA)
        _fold(weights, p + "post_attention_layernorm.weight", [p + f"mlp.{n}_proj.weight" for n in ("gate", "up")],
              mlp_in, ALPHA)
    log.info("w8a8: SmoothQuant scales (a = %.1f, the lm_head's %.1f) from %d calibration tokens folded into "
             "the norms and the q/k/v, gate/up and lm_head weights", ALPHA, HEAD_ALPHA, len(tokens))
