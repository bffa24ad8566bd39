"""The one decoder: Llama 1/2/3, Mistral, SmolLM/SmolLM2, Qwen2/2.5 and Qwen3 over a flat batch.

Prefill and decode are the same forward pass: a flat list of tokens with per-token positions;
attention reads and writes the paged cache (see attention.py). Weights arrive with Hugging
Face names (the loaders' contract) and are fused here: q/k/v into one matrix and gate/up into
another, so a layer is 4 matrix products instead of 7 (fewer dispatches, bigger products).
The linear layers may store their weights in fewer bits than they compute in (16-bit or int8,
kernels/linear.py): a decode step's time is the time to read the weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferlab.config import ModelConfig
from inferlab.kernels.int4 import INT4, Int4Weight, cat_rows, quantize
from inferlab.kernels.linear import MKL_MIN_ROWS, DenseLinear, Int4Linear, WeightOnlyLinear, make_linear
from inferlab.models.attention import AttentionMetadata, PagedDecode, paged_attention
from inferlab.models.backends import Backends, select_backends
from inferlab.models.huge_pages import HugeArena, release_freed
from inferlab.models.kv_cache import KVCache, write_kv
from inferlab.models.precision import ResolvedPrecision, dtype_name
from inferlab.models.rope import apply_rope, rope_cache

log = logging.getLogger(__name__)

Linear = DenseLinear | WeightOnlyLinear


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # [(H + 2 kvH) * D, hidden], with the q/k/v bias when the model has one
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # [2 * intermediate, hidden]
    down: Linear


class DecoderModel:
    """Weights plus a forward pass; no nn.Module machinery (nothing here is trained).

    `precision` (the engine's, models/precision.py) says everything this model computes and
    stores in; nothing here decides it again. `precision.compute` is the compute dtype
    (activations, norms; the K/V cache's is the runner's). `precision.weights` is how the linear
    layers' weights (and the embedding table) are stored: the compute dtype keeps them as they
    are (F.linear); float16 / bfloat16 / torch.int8 / int4 store them in fewer bytes, multiplied
    by kernels/linear.py's WeightOnlyLinear. `backends` (models/backends.py, default: the fastest)
    says which code runs each step: the whole-step decode kernel, the fused operators or plain
    torch operators.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], precision: ResolvedPrecision,
                 backends: Backends | None = None):
        # The kernels were decided and compiled when `precision` was resolved, at load, whatever
        # the dtype: before the server answers /health, so no request waits for a compile (~35-70 s).
        self.config = config
        self.precision = precision
        self.backends = backends or select_backends(precision, config)
        dtype = precision.compute
        self.int8_activations = precision.int8_activations  # x quantized per group, integer dots (kernels/linear.py)
        self.dtype = dtype
        self.weight_dtype = precision.weights
        c = config
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.scale = c.head_dim**-0.5

        def take(name: str) -> torch.Tensor | Int4Weight:
            if name not in weights:
                raise ValueError(f"the checkpoint has no tensor {name!r}")
            w = weights[name]
            if isinstance(w, Int4Weight):  # a GGUF's Q4 blocks (gguf_loader keep_int4): kept for int4
                return w if self.weight_dtype == INT4 else w.dequantize(dtype)
            return w.to(dtype).contiguous()

        def cat(parts: list[torch.Tensor | Int4Weight]) -> torch.Tensor | Int4Weight:
            """Rows of several matrices as one; a float part next to Q4 ones is quantized to join them."""
            if any(isinstance(p, Int4Weight) for p in parts):
                return cat_rows([p if isinstance(p, Int4Weight) else quantize(p) for p in parts])
            return torch.cat(parts)  # type: ignore[arg-type]

        def linear(weight: torch.Tensor | Int4Weight, bias: torch.Tensor | None = None) -> Linear:
            return make_linear(weight, bias, precision)

        def table(weight: torch.Tensor | Int4Weight) -> Linear:
            """The embedding / lm_head. With int4 it stays int8 weight-only (per-row scales,
            float32 x) unless the file gave it in 4 bits (a Q4 token_embd is kept as it is).
            Measured on the default SmolLM2-135M Q4_1 GGUF (token_embd Q8_0, tied), 16 chunks of
            512: perplexity 12.32 in float32, 12.37 with int4 layers and an int8 table, 13.44 with
            a 4-bit table (for 11 MB less per decode step); llama.cpp keeps that table at Q8_0 too.
            x is not rounded to int8 for the table: scored in decode-sized steps against
            llama-perplexity's F16 base (4 chunks, benchmarks/kld_vs_llama_base.py --step-tokens
            96), KLD was 0.0057 with x per 64 in int8 (vpdpbusd), 0.0036 with float32 x, 0.0020
            with a bf16 table (28 MB more a step), against llama.cpp's own 0.0031."""
            if self.weight_dtype == INT4 and not isinstance(weight, Int4Weight):
                return make_linear(weight, None, precision, torch.int8)
            return linear(weight)

        # The embedding table is stored like the lm_head: a lookup dequantizes only the T rows it
        # gathers, and a tied lm_head then shares the one table (113 MB at float32 for SmolLM2).
        self.embed = table(take("model.embed_tokens.weight"))
        self.final_norm = take("model.norm.weight")
        if "lm_head.weight" in weights and not c.tie_word_embeddings:
            self.lm_head = table(take("lm_head.weight"))
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
                    qkv=linear(
                        cat([take(a + "q_proj.weight"), take(a + "k_proj.weight"), take(a + "v_proj.weight")]),
                        bias,
                    ),
                    q_norm=take(a + "q_norm.weight") if c.qk_norm else None,
                    k_norm=take(a + "k_norm.weight") if c.qk_norm else None,
                    o=linear(take(a + "o_proj.weight")),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=linear(cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])),
                    down=linear(take(p + "mlp.down_proj.weight")),
                )
            )
        device = self.final_norm.device
        if device.type == "cpu":
            self._weights_to_huge_pages()
        self.cos, self.sin = (t.to(device) for t in rope_cache(
            c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings, dtype
        ))
        # False once DecoderStep has refused this model (see _decode_step): the backends' choice
        # holds, but such a model's decode steps run per operator.
        self.step_ok = self.backends.decode_step
        # The precision decisions this forward follows (models/precision.py): the linears multiply
        # bf16 weights in bf16 (the avx512 variant), and which prefill attention runs (our flash
        # attention in bf16 there beside bf16 or w8a8 weights, ours in float32 wherever else our
        # kernels run the model, else torch's; models/attention.py).
        self.bf16_products = precision.bf16_products
        self.prefill_attention = precision.prefill_attention
        # w8a8 in panels (the avx512 variant): the norms and SiLU hand the next product their rows
        # as int8 codes (fused.cpp's *_q8), not float32 rows it quantizes again.
        first = self.layers[0].qkv if self.layers else None
        self.q8_epilogues = self.backends.fused_layers and isinstance(first, WeightOnlyLinear) and first.i8_panels
        # A bf16 prefill's SiLU(gate) * up comes straight from the gate_up product while it is in
        # cache (kernels/linear.py product_silu_bf16: the amx variant's tiles, the avx512 variant's
        # panel products), the same bits as the product then silu_mul; w8a8's as the down
        # product's codes on every variant (product_silu_q8).
        self.silu_tiles = self.bf16_products and all(getattr(layer.gate_up, "silu_tiles", False)
                                                     for layer in self.layers)
        self.silu_tiles_q8 = self.q8_epilogues and all(getattr(layer.gate_up, "silu_tiles_q8", False)
                                                       for layer in self.layers)
        # A bf16 prefill's (and w8a8's steps') RoPE and KV-cache write are the qkv product's epilogue
        # (kernels/linear.py product_rope_kv, _q8), the same bits as the product then rope_write_kv.
        whole_heads = self.backends.fused_layers and config.head_dim % 16 == 0
        self.rope_tiles = self.bf16_products and whole_heads  # bf16 products: the linears are panels
        self.rope_tiles_q8 = self.q8_epilogues and whole_heads
        self._step: object | None = None  # torch.classes.inferlab.DecoderStep, built on first use
        self._step_caches: list | None = None
        line = self.describe_precision()
        if "plain torch, dequantized per call" in line:
            # No kernel takes this pair on this CPU: say so once, loudly, with the way out
            # (a per-call dequantize is measured 7-10x slower than dtype auto).
            log.warning("%s: no fast path for %s weights with %s compute on this CPU (kernels: %s); "
                        "dtype auto or float32 runs them in our kernels", line, dtype_name(self.weight_dtype),
                        dtype_name(dtype), precision.kernel.variant)
        else:
            log.info("%s", line)

    def describe_precision(self) -> str:
        """One line for the load log: how weights are stored, what multiplies them, compute dtype."""
        wd, cd = dtype_name(self.weight_dtype), dtype_name(self.dtype)
        kernel = self.precision.kernel
        e = self.layers[0].qkv if self.layers else self.embed
        if isinstance(e, DenseLinear):
            how = "F.linear"
        elif e.use_kernels and self.dtype == torch.float32 and e.weight.device.type == "cpu":
            how = f"our {kernel.variant} kernels"
            if self.int8_activations:
                how += f", {kernel.describe_w8a8()}"
                if getattr(e, "i8_panels", False):
                    how += ", codes in panels"
                how += ", SmoothQuant scales folded in at load"
            elif isinstance(e, Int4Linear):
                how += f", 4-bit codes x int8 x per 32 values, {kernel.int4_dot}"
                if not isinstance(self.lm_head, Int4Linear):
                    how += "; embedding / lm_head int8 weight-only"
            elif getattr(e, "bf16_products", False):
                how += f", bf16 products ({'tdpbf16ps' if kernel.amx else 'vdpbf16ps'}, weights in panels), float32 sums"
        else:
            why = ((kernel.reason if not kernel.available else "") or "kernels off") if not e.use_kernels else f"{cd} activations"
            how = f"plain torch, dequantized per call: {why}"
        return f"weights {wd} ({how}), compute {cd}, {self.weight_nbytes / 1e6:.1f} MB of weights"

    def _linears(self) -> list[Linear]:
        """Every linear the model holds, each once (a tied lm_head is the embedding)."""
        linears: list[Linear] = [self.embed] + ([self.lm_head] if self.lm_head is not self.embed else [])
        for layer in self.layers:
            linears += [layer.qkv, layer.o, layer.gate_up, layer.down]
        return linears

    def _weights_to_huge_pages(self) -> None:
        """Every linear's weight copied onto huge pages, a layer's after the one before
        (models/huge_pages.py: a decode step streams them all). An int4 linear's codes stay
        where they are (its Int4Weight holds them too: a copy would be a second one)."""
        arena, moved = HugeArena(), False
        for lin in self._linears():
            if not isinstance(lin, Int4Linear):
                w, lin.weight = lin.weight, arena.copy(lin.weight)
                moved |= lin.weight is not w
        if moved:  # the old copies are free now (a tiny model's stay: nothing to hand back)
            release_freed()

    @property
    def weight_nbytes(self) -> int:
        """Bytes of every weight the model holds (linears, embedding, norms)."""
        norms = [self.final_norm]
        for layer in self.layers:
            norms += [t for t in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm) if t is not None]
        return sum(lin.nbytes for lin in self._linears()) + sum(t.nbytes for t in norms)

    @property
    def decode_weight_nbytes(self) -> int:
        """Weight bytes a decode step reads: all of them but an untied input embedding (a step
        gathers only a few of its rows)."""
        return self.weight_nbytes - (self.embed.nbytes if self.lm_head is not self.embed else 0)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden].

        One layer loop for the fused operators (~9 per layer instead of ~25: at one decode token
        the dispatch of each eager operator costs more than its arithmetic) and for plain torch
        (the definition): they differ in three places. The residual stream x is updated in place:
        each layer's output is added by the next norm."""
        g = meta.decode
        t = input_ids.shape[0]
        if self.step_ok and meta.num_decode_tokens == t and t < self.precision.decode_step_max_rows \
                and isinstance(g, PagedDecode):
            # A decode-only step (most steps): every layer in one kernel call. From
            # decode_step_max_rows rows on, the per-operator path's GEMMs are faster.
            step = self._decode_step(kv_caches, g.block_size)
            if step is not None:
                x = self.embed.rows(input_ids).contiguous()  # a fresh tensor: the step updates it in place
                args = (x, positions, meta.slot_mapping, g.block_tables, g.context_lens)
                if torch.autograd._profiler_enabled():  # a custom class is no op to the profiler: named here
                    with torch.profiler.record_function("inferlab::decoder_step"):  # (~10 us a step without one)
                        return step.forward(*args)
                return step.forward(*args)
        c = self.config
        fused = self.backends.fused_layers
        ops = torch.ops.inferlab
        # A prefill-sized fused step with bf16 products: the products' bf16 outputs are passed on
        # as they are (the norm adds them to x, silu_mul takes gate_up's) and the norms round their
        # output to bf16 once for the next product: the same roundings as through float32
        # (bitwise), without the conversions (kernels/linear.py product_bf16).
        bf16 = fused and self.bf16_products and t >= MKL_MIN_ROWS
        q8 = self.q8_epilogues

        def add_norm(x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, round_bf16: bool) -> torch.Tensor:
            if delta is None:
                return self._norm(x, w)
            if fused:
                return ops.add_rms_norm_(x, delta, w, c.rms_norm_eps, round_bf16)
            return self._norm(x.add_(delta), w)

        def product(lin: Linear, h: torch.Tensor) -> torch.Tensor:
            return lin.product_bf16(h) if bf16 else lin(h)

        x = self.embed.rows(input_ids).contiguous()  # a fresh tensor: safe to update in place
        if not fused:
            cos = self.cos.index_select(0, positions).unsqueeze(1)
            sin = self.sin.index_select(0, positions).unsqueeze(1)
        delta: torch.Tensor | None = None
        for layer, cache in zip(self.layers, kv_caches):
            rope = (positions, self.cos, self.sin, cache, meta.slot_mapping, c.num_heads, c.num_kv_heads, c.head_dim)
            if bf16 and self.rope_tiles:  # the qkv product's epilogue rotates q and k and writes the cache
                q, k, v = layer.qkv.product_rope_kv(add_norm(x, delta, layer.input_norm, bf16), *rope)
            elif q8 and delta is not None and self.rope_tiles_q8:
                q, k, v = layer.qkv.product_rope_kv_q8(*ops.add_rms_norm_q8_(x, delta, layer.input_norm, c.rms_norm_eps),
                                                       *rope)
            else:
                if q8 and delta is not None:  # w8a8: the normed rows go over as codes
                    qkv = layer.qkv.product_q8(*ops.add_rms_norm_q8_(x, delta, layer.input_norm, c.rms_norm_eps))
                else:
                    h = add_norm(x, delta, layer.input_norm, bf16)
                    qkv = layer.qkv.product_bf16(h, torch.float32) if bf16 else layer.qkv(h)
                v = qkv[:, self.q_size + self.kv_size :].view(t, c.num_kv_heads, c.head_dim)  # fresh prompts read it
                if fused:  # rotate q and k, write k and v into the cache: one operator
                    q, k = ops.rope_write_kv(qkv, positions, self.cos, self.sin, cache.k, cache.v, meta.slot_mapping,
                                             c.num_heads, c.num_kv_heads, c.head_dim, cache.k_scale, cache.v_scale)
                else:
                    q = qkv[:, : self.q_size].reshape(t, c.num_heads, c.head_dim)
                    k = qkv[:, self.q_size : self.q_size + self.kv_size].reshape(t, c.num_kv_heads, c.head_dim)
                    if layer.q_norm is not None:
                        q, k = self._norm(q, layer.q_norm), self._norm(k, layer.k_norm)
                    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
                    write_kv(cache, meta.slot_mapping, k, v)
            attn = paged_attention(q, k, v, cache, meta, self.scale, kv_written=True, prefill=self.prefill_attention,
                                   bf16_decode=self.precision.bf16_decode_attention)
            if q8:
                normed = ops.add_rms_norm_q8_(x, layer.o(attn), layer.post_norm, c.rms_norm_eps)
                # A prefill's rows take SiLU's codes from the gate_up product, as the bf16 path does
                # (a few rows' products run faster on their own; the bits are the same either way).
                if self.silu_tiles_q8 and t >= MKL_MIN_ROWS:
                    delta = layer.down.product_q8(*layer.gate_up.product_silu_q8(*normed))
                else:
                    delta = layer.down.product_q8(*ops.silu_mul_q8(layer.gate_up.product_q8(*normed)))
                continue
            h = add_norm(x, product(layer.o, attn), layer.post_norm, bf16)
            if bf16 and self.silu_tiles:
                act = layer.gate_up.product_silu_bf16(h)
            elif fused:
                act = ops.silu_mul(product(layer.gate_up, h))
            else:
                gate, up = product(layer.gate_up, h).chunk(2, dim=-1)
                act = F.silu(gate) * up
            delta = product(layer.down, act)
        return add_norm(x, delta, self.final_norm, False)

    def _decode_step(self, kv_caches: list[KVCache], block_size: int):
        """The DecoderStep over these caches, built once (it holds references to the weights and
        the caches, not copies); None, with the reason logged once, for a model it cannot take
        (a head_dim not a multiple of 4, say): those steps stay on the per-operator path."""
        if self._step is None or self._step_caches is not kv_caches:
            c = self.config
            none = torch.empty(0)

            def lin(x: Linear) -> list[torch.Tensor]:
                scale = x.scale if isinstance(x, WeightOnlyLinear) else None
                return [x.weight, none if scale is None else scale]

            tensors: list[torch.Tensor] = []
            for layer in self.layers:
                qkv_bias = layer.qkv.bias
                tensors += [layer.input_norm, *lin(layer.qkv), none if qkv_bias is None else qkv_bias.float(),
                            none if layer.q_norm is None else layer.q_norm,
                            none if layer.k_norm is None else layer.k_norm,
                            *lin(layer.o), layer.post_norm, *lin(layer.gate_up), *lin(layer.down)]
            try:
                step = torch.classes.inferlab.DecoderStep(
                    tensors, self.final_norm, self.cos, self.sin, [kv.k for kv in kv_caches],
                    [kv.v for kv in kv_caches],
                    [c.num_heads, c.num_kv_heads, c.head_dim, block_size, int(self.int8_activations),
                     int(self.precision.bf16_decode_attention)],
                    c.rms_norm_eps, self.scale)
                if kv_caches[0].quantized:
                    step.set_kv_scales([kv.k_scale for kv in kv_caches], [kv.v_scale for kv in kv_caches])
                self._step = step
            except (RuntimeError, ValueError) as e:
                log.warning("the decode step kernel does not take this model (%s); decode steps run per operator",
                            str(e).splitlines()[0])
                self.step_ok = False
                return None
            self._step_caches = kv_caches
        return self._step

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for the given hidden rows."""
        return self.lm_head(hidden).float()

    @property
    def fused_greedy(self) -> bool:
        """`greedy_tokens` skips the logits (the lm_head takes its argmax as it goes: w8a8's or
        bf16 panels on our kernels)."""
        return isinstance(self.lm_head, WeightOnlyLinear) and self.lm_head.fused_argmax

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """`compute_logits(hidden).argmax(-1)` (the first index of the largest), int64 [N]."""
        if self.fused_greedy:
            return self.lm_head.argmax(hidden)
        return self.compute_logits(hidden).argmax(dim=-1)

