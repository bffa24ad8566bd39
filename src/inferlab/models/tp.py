"""Tensor parallelism: how a model splits over N ranks, and rank r's shard of the decoder.

Megatron's split of a decoder layer, one rank's share of every matrix:

    x (replicated) ─► norm ─► qkv [its q heads | its kv heads]  (column-parallel: no talk)
                          ─► attention over its own KV cache shard (its kv heads only)
                          ─► o_proj [hidden, its heads' columns]  (row-parallel: a partial sum)
                          ─► all-reduce ─► x += ...
                      norm ─► gate_up [its share of intermediate] ─► silu × up
                          ─► down [hidden, its share's columns] ─► all-reduce ─► x += ...

so a layer costs two all-reduces of [T, hidden] and nothing else crosses ranks; the residual
stream and every norm stay replicated. The embedding and the lm_head are split by vocabulary
rows: a lookup reads only the ids in its rows (the others give zeros) and an all-reduce adds
the ranks' rows up; the lm_head gives each rank its columns of the logits, gathered on rank 0.

Heads go by KV-head groups: each rank holds whole KV heads with their query heads (GQA's group
stays on one rank, so attention needs no talk). When N divides the KV heads every rank holds
the same; when it does not (SmolLM2-135M: 9 query heads over 3 KV heads, at N = 2) the groups
are dealt out as evenly as they go (2 + 1 KV heads) and the ranks' attention work differs, a
cost the start-up log names. Past one KV head per rank there is nothing left to split: an
error naming both numbers. (vLLM replicates KV heads there; not done here.)

A rank's model is the one decoder (models/decoder.py), built on the rank's cut of the weights
(`shard_weights`) and the shape they imply (`local_config`), with o_proj and down_proj wrapped
row-parallel and the embedding and lm_head vocabulary-parallel (`build_shard`): whatever the
decoder's backends and weight formats do, a rank does too, but the whole-step decode kernel
(`tp_backends`), whose layers leave no room for the all-reduces. The collectives are a small
interface (`Collectives`) that engine/tp_worker.py implements on torch.distributed, so nothing
here knows about processes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from inferlab.config import ModelConfig
from inferlab.kernels.int4 import Int4Weight
from inferlab.kernels.linear import DenseLinear, WeightOnlyLinear
from inferlab.models.backends import Backends
from inferlab.models.decoder import DecoderModel
from inferlab.models.precision import ResolvedPrecision

__all__ = ["Collectives", "Span", "TPShard", "build_shard", "check_tensor_parallel", "plan_shards", "shard_weights"]

Linear = DenseLinear | WeightOnlyLinear


@dataclass(frozen=True)
class Span:
    """Rows start .. stop - 1 of some dimension."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class TPShard:
    """What rank `rank` of `world` holds: spans of KV heads, query heads, the MLP's intermediate
    dimension and the vocabulary (`vocab_rows`: every rank's table padded to the same height,
    so the logits gather is one equal-sized call; the padding's logits are cut off)."""

    rank: int
    world: int
    kv_heads: Span
    heads: Span
    intermediate: Span
    vocab: Span
    vocab_rows: int


# The intermediate dimension is dealt out in units of this many columns where it divides, so a
# rank's down_proj keeps whole quantization groups (int4: 32, w8a8: 64 input values a group).
INTERMEDIATE_UNIT = 64


def _balanced(n: int, world: int, unit: int = 1) -> list[Span]:
    """n rows dealt out to `world` ranks in contiguous spans of whole `unit`s (where `unit`
    divides n; else single rows) whose sizes differ by at most one unit."""
    if n % unit:
        unit = 1
    units = n // unit
    spans, start = [], 0
    for r in range(world):
        size = (units // world + (1 if r < units % world else 0)) * unit
        spans.append(Span(start, start + size))
        start += size
    return spans


def check_tensor_parallel(config: ModelConfig, world: int) -> None:
    """ValueError naming both numbers when `world` ranks cannot split this model's heads (each
    rank needs one whole KV head and its query heads): asked before any weight loads."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    if world > config.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {world} does not split this model's heads: {config.num_kv_heads} KV heads "
            f"({config.num_heads} query heads) give each of {world} ranks no whole KV head; "
            f"use a tensor_parallel_size of at most {config.num_kv_heads}")


def plan_shards(config: ModelConfig, world: int) -> list[TPShard]:
    """Every rank's shard (see the module docstring); ValueError as `check_tensor_parallel`."""
    check_tensor_parallel(config, world)
    group = config.num_heads // config.num_kv_heads
    kv = _balanced(config.num_kv_heads, world)
    inter = _balanced(config.intermediate_size, world, INTERMEDIATE_UNIT)
    rows = -(-config.vocab_size // world)
    return [TPShard(r, world, kv[r], Span(kv[r].start * group, kv[r].stop * group), inter[r],
                    Span(min(r * rows, config.vocab_size), min((r + 1) * rows, config.vocab_size)), rows)
            for r in range(world)]


def describe_shards(config: ModelConfig, shards: list[TPShard]) -> str:
    """One line for the start-up log: what each rank holds, and whether the split is even."""
    kv = "+".join(str(s.kv_heads.size) for s in shards)
    q = "+".join(str(s.heads.size) for s in shards)
    inter = "+".join(str(s.intermediate.size) for s in shards)
    even = len({s.kv_heads.size for s in shards}) == 1
    line = (f"tensor parallel {len(shards)}: KV heads {kv} of {config.num_kv_heads} (query heads {q}), "
            f"intermediate {inter}, vocabulary {shards[0].vocab_rows} rows a rank")
    if not even:
        line += (f"; {len(shards)} does not divide {config.num_kv_heads} KV heads, so the ranks' attention work "
                 "is uneven (the slowest rank sets each step's pace)")
    return line


class Collectives(Protocol):
    """What a shard needs from the other ranks (engine/tp_worker.py on torch.distributed)."""

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `t`, on every rank (in place where it can be)."""
        ...

    def gather(self, t: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `t` ([n, k] each) side by side as [n, world * k] on rank 0; None elsewhere."""
        ...


def local_config(config: ModelConfig, shard: TPShard) -> ModelConfig:
    """The model as one rank holds it: its heads, its intermediate share, its vocabulary rows."""
    return dataclasses.replace(config, num_heads=shard.heads.size, num_kv_heads=shard.kv_heads.size,
                               intermediate_size=shard.intermediate.size, vocab_size=shard.vocab_rows)


def shard_weights(config: ModelConfig, weights: Mapping[str, torch.Tensor | Int4Weight],
                  shard: TPShard) -> dict[str, torch.Tensor]:
    """The HF-named weights of rank `shard.rank`, cut as the module docstring says (views where
    they can be): q/k/v (and their biases) and gate/up by output rows, o_proj and down_proj by
    input columns, the embedding and lm_head by vocabulary rows (zero rows to `vocab_rows`), the
    norms whole. A GGUF's Q4 blocks are not cut at head or column borders: dequantized first
    (an int4 decoder quantizes its shard again)."""
    d = config.head_dim
    q = slice(shard.heads.start * d, shard.heads.stop * d)
    kv = slice(shard.kv_heads.start * d, shard.kv_heads.stop * d)
    mlp = slice(shard.intermediate.start, shard.intermediate.stop)
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": mlp, "up_proj": mlp}
    columns = {"o_proj": q, "down_proj": mlp}
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if isinstance(w, Int4Weight):
            w = w.dequantize(torch.float32)
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            w = w[shard.vocab.start : shard.vocab.stop]
            if w.shape[0] < shard.vocab_rows:
                w = torch.cat([w, w.new_zeros(shard.vocab_rows - w.shape[0], w.shape[1])])
        elif module in rows:
            w = w[rows[module]]
        elif module in columns and parts[-1] == "weight":
            w = w[:, columns[module]]
        out[name] = w
    return out


class RowParallelLinear:
    """A row-parallel linear (o_proj, down_proj): this rank's partial product, summed over the
    ranks by one all-reduce. Stands where the decoder's Linear stands (`__call__`,
    `product_bf16`, `product_q8`, `nbytes`)."""

    def __init__(self, inner: Linear, comm: Collectives):
        self.inner = inner
        self.comm = comm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.inner(x))

    def product_bf16(self, x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return self.comm.all_reduce(self.inner.product_bf16(x, out_dtype))  # type: ignore[union-attr]

    def product_q8(self, xq: torch.Tensor, sx: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.inner.product_q8(xq, sx))  # type: ignore[union-attr]

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes


class VocabParallelTable:
    """The embedding and the lm_head split by vocabulary rows: `rows` looks up the ids in this
    rank's rows (zeros for the others) and sums over the ranks; a call gives this rank's logit
    columns, gathered on rank 0 and cut to the real vocabulary (an empty [n, 0] elsewhere)."""

    def __init__(self, inner: Linear, shard: TPShard, vocab_size: int, comm: Collectives):
        self.inner = inner
        self.span = shard.vocab
        self.vocab_size = vocab_size
        self.comm = comm

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.span.start
        inside = (local >= 0) & (local < self.span.size)
        x = self.inner.rows(local.clamp(0, max(self.span.size - 1, 0))).contiguous()
        x.mul_(inside.unsqueeze(1).to(x.dtype))
        return self.comm.all_reduce(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        whole = self.comm.gather(self.inner(x).float().contiguous())
        return x.new_empty(x.shape[0], 0) if whole is None else whole[:, : self.vocab_size]

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes


def tp_backends(backends: Backends) -> Backends:
    """The backends a rank runs: no whole-step decode kernel (every layer in one C++ call),
    since the all-reduces sit between the layers; the fused layers and the paged decode
    attention stay."""
    if not backends.decode_step:
        return backends
    why = "no decode-step kernel under tensor parallelism (the all-reduces sit between its layers)"
    return dataclasses.replace(backends, decode_step=False, reasons=(*backends.reasons, why))


def build_shard(config: ModelConfig, weights: dict[str, torch.Tensor], precision: ResolvedPrecision,
                backends: Backends, shard: TPShard, comm: Collectives) -> DecoderModel:
    """Rank `shard.rank`'s model: the one decoder (models/decoder.py, whatever backends it runs)
    built on the rank's cut of the weights and the shape it implies, with o_proj and down_proj
    made row-parallel and the embedding / lm_head vocabulary-parallel. Its `forward` returns
    the replicated hidden states; `compute_logits` the whole logits on rank 0."""
    model = DecoderModel(local_config(config, shard), shard_weights(config, weights, shard), precision,
                         tp_backends(backends))
    for layer in model.layers:
        layer.o = RowParallelLinear(layer.o, comm)  # type: ignore[assignment]
        layer.down = RowParallelLinear(layer.down, comm)  # type: ignore[assignment]
    tied = model.lm_head is model.embed
    model.embed = VocabParallelTable(model.embed, shard, config.vocab_size, comm)  # type: ignore[assignment]
    model.lm_head = (model.embed if tied else  # type: ignore[assignment]
                     VocabParallelTable(model.lm_head, shard, config.vocab_size, comm))
    return model
