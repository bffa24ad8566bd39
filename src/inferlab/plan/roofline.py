"""The roofline: how long one engine step takes on a device, from bytes moved and FLOPs done.

    step time = max(bytes moved / (bandwidth × eff_mem),  FLOPs / (peak × eff_compute)) + overhead

    bytes  = weights read once per step + Σ_seq K/V of the tokens each sequence attends to
    FLOPs  = 2 × matmul params × tokens computed + 4 × layers × heads × head_dim × Σ attention pairs

A decode step at batch B reads the weights once for all B sequences, which is why batching
pays while the step is memory-bound; the FLOPs grow with B and eventually win. Everything
here is plain arithmetic on a `ModelSpec` and a `HardwareSpec`; the planner turns it into
`Figure`s and the simulator uses it as one of its cost models.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from inferlab.plan.hardware import HardwareSpec
from inferlab.plan.model_spec import ModelSpec
from inferlab.plan.precision import Precision, parse_precision

# ------------------------------------------------------------------ formulas, one line each


def weight_bytes(num_params: int, bits: float) -> float:
    """Every parameter stored at `bits` bits."""
    return num_params * bits / 8.0


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: float) -> float:
    """K and V (the 2), in every layer, for every KV head."""
    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_element


def blocks_for(tokens: int, block_size: int) -> int:
    """Paged KV: a sequence holds whole blocks, so its last block is partly empty."""
    return -(-tokens // block_size)


def sequences_that_fit(memory_bytes: float, weight_bytes_: float, kv_bytes_per_sequence: float,
                       reserve_fraction: float = 0.10, reserve_bytes: float = 0.0) -> int:
    """Whole sequences whose K/V fit beside the weights after the reserve is set aside."""
    free = kv_memory_available(memory_bytes, weight_bytes_, reserve_fraction, reserve_bytes)
    if kv_bytes_per_sequence <= 0:
        raise ValueError("KV bytes per sequence must be > 0")
    return max(int(free // kv_bytes_per_sequence), 0)


def kv_memory_available(memory_bytes: float, weight_bytes_: float, reserve_fraction: float = 0.10,
                        reserve_bytes: float = 0.0) -> float:
    """Memory × (1 − reserve fraction) − fixed reserve − weights (never below zero)."""
    return max(memory_bytes * (1.0 - reserve_fraction) - reserve_bytes - weight_bytes_, 0.0)


def attention_pairs(start_pos: int, new_tokens: int) -> int:
    """(query, key) pairs of a causal chunk: token i (0-based) attends to positions 0..i.

    new tokens at positions s .. s+n-1 attend to s+1 .. s+n keys: n·s + n(n+1)/2 pairs.
    """
    return new_tokens * start_pos + new_tokens * (new_tokens + 1) // 2


def cost_per_million_tokens(usd_per_hour: float, tokens_per_s: float) -> float:
    """usd_per_hour / (tokens/s × 3600 s/h) × 10^6."""
    if tokens_per_s <= 0:
        raise ValueError("tokens per second must be > 0 to price a million tokens")
    return usd_per_hour / (tokens_per_s * 3600.0) * 1e6


# ------------------------------------------------------------------ one step


@dataclass(frozen=True)
class StepShape:
    """What one engine step computes: the only inputs a step cost model gets.

    context_tokens: Σ over the step's sequences of the positions whose K/V they read
                    (start_pos + new tokens); attention_pairs: Σ of `attention_pairs()`.
    """

    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    context_tokens: float
    attention_pairs: float

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @classmethod
    def from_chunks(cls, chunks: Iterable[tuple[int, int, bool]]) -> StepShape:
        """From (start_pos, new_tokens, is_decode) per scheduled sequence."""
        prefill = decode = seqs = ctx = pairs = 0
        for start, n, is_decode in chunks:
            seqs += 1
            if is_decode:
                decode += n
            else:
                prefill += n
            ctx += start + n
            pairs += attention_pairs(start, n)
        return cls(prefill, decode, seqs, ctx, pairs)

    @classmethod
    def decode(cls, batch: int, context: float) -> StepShape:
        """`batch` sequences each writing one token after `context - 1` earlier ones (a mean
        context may be fractional)."""
        return cls(0, batch, batch, batch * context, batch * context)


@dataclass(frozen=True)
class StepEstimate:
    time_s: float
    bytes: float
    flops: float
    memory_time_s: float
    compute_time_s: float

    @property
    def bound(self) -> str:
        return "compute" if self.compute_time_s > self.memory_time_s else "memory"


class Roofline:
    """A model on a device at given precisions and efficiencies: step times from step shapes."""

    def __init__(
        self,
        model: ModelSpec,
        hardware: HardwareSpec,
        weight_precision: str | None = None,
        kv_precision: str = "bf16",
        compute_precision: str = "bf16",
        memory_efficiency: float = 1.0,
        compute_efficiency: float = 1.0,
        step_overhead_s: float = 0.0,
    ) -> None:
        for name, eff in (("memory efficiency", memory_efficiency), ("compute efficiency", compute_efficiency)):
            if not 0.0 < eff <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {eff}")
        if step_overhead_s < 0:
            raise ValueError(f"step overhead must be >= 0, got {step_overhead_s}")
        self.model = model
        self.hardware = hardware
        self.kv_precision: Precision = parse_precision(kv_precision)
        # None = as stored: the file's own bytes when we read a file, else its native precision.
        self.from_file = weight_precision is None and model.file_weight_bytes is not None
        self.weight_precision: Precision = parse_precision(
            weight_precision if weight_precision is not None else model.native_precision
        )
        # Any name the other precisions take (float32 = fp32): the hardware's rates are keyed by canonical names.
        self.compute_rate, self.compute_precision = hardware.compute_rate(parse_precision(compute_precision).name)
        self.memory_efficiency = memory_efficiency
        self.compute_efficiency = compute_efficiency
        self.step_overhead_s = step_overhead_s

    # -------------------------------------------------------------- sizes

    @property
    def weight_bytes(self) -> float:
        if self.from_file:
            return float(self.model.file_weight_bytes)
        return weight_bytes(self.model.num_params, self.weight_precision.bits)

    @property
    def embedding_bytes(self) -> float:
        if self.from_file and self.model.file_embedding_bytes is not None:
            return float(self.model.file_embedding_bytes)
        return weight_bytes(self.model.embedding_params, self.weight_precision.bits)

    @property
    def weight_bytes_read_per_step(self) -> float:
        """All weights, less the input embedding table when untied (a step gathers only its rows)."""
        if self.model.tie_word_embeddings:
            return self.weight_bytes
        return self.weight_bytes - self.embedding_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        m = self.model
        return kv_bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, self.kv_precision.bytes_per_element)

    @property
    def matmul_flops_per_token(self) -> float:
        return 2.0 * self.model.matmul_params

    @property
    def attention_flops_per_pair(self) -> float:
        """QKᵀ and AV: 2 FLOPs per multiply-add, twice, per head dimension, head and layer."""
        m = self.model
        return 4.0 * m.num_layers * m.num_heads * m.head_dim

    @property
    def effective_bandwidth(self) -> float:
        return self.hardware.memory_bandwidth * self.memory_efficiency

    @property
    def effective_compute(self) -> float:
        return self.compute_rate * self.compute_efficiency

    # -------------------------------------------------------------- steps

    def step(self, shape: StepShape) -> StepEstimate:
        if shape.num_tokens == 0:
            return StepEstimate(0.0, 0.0, 0.0, 0.0, 0.0)
        nbytes = self.weight_bytes_read_per_step + self.kv_bytes_per_token * shape.context_tokens
        flops = self.matmul_flops_per_token * shape.num_tokens + self.attention_flops_per_pair * shape.attention_pairs
        mem_t = nbytes / self.effective_bandwidth
        comp_t = flops / self.effective_compute
        return StepEstimate(max(mem_t, comp_t) + self.step_overhead_s, nbytes, flops, mem_t, comp_t)

    def step_time(self, shape: StepShape) -> float:
        return self.step(shape).time_s

    def decode_step(self, batch: int, context: float) -> StepEstimate:
        return self.step(StepShape.decode(batch, context))

    def prefill(self, prompt_len: int) -> StepEstimate:
        """One prompt computed from scratch in one pass."""
        return self.step(StepShape(prompt_len, 0, 1, prompt_len, attention_pairs(0, prompt_len)))

    def compute_bound_batch(self, context: float) -> float | None:
        """Batch size B where a decode step's FLOP time equals its memory time.

            W/bw + B·c·kv/bw = B·(2·P + A·c)/C   →   B = (W/bw) / ((2·P + A·c)/C − c·kv/bw)

        None when the denominator is ≤ 0: each sequence's K/V reads then cost more time than
        its FLOPs, so adding sequences never makes the step compute-bound.
        """
        bw, comp = self.effective_bandwidth, self.effective_compute
        per_seq_compute = (self.matmul_flops_per_token + self.attention_flops_per_pair * context) / comp
        per_seq_memory = context * self.kv_bytes_per_token / bw
        denom = per_seq_compute - per_seq_memory
        if denom <= 0:
            return None
        return (self.weight_bytes_read_per_step / bw) / denom


def mean_decode_context(input_len: int, output_len: int) -> float:
    """Mean tokens attended over a request's decode steps.

    The prefill step samples token 1; decode step j (1..O−1) computes the token at position
    P + j − 1 and attends to P + j tokens, whose mean is P + O/2.
    """
    return input_len + output_len / 2.0

