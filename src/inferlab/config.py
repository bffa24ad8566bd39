"""Configuration dataclasses, built once (CLI or Python API), validated, then frozen.

Each component receives only its own part: the scheduler a `SchedulerConfig`, the
KV cache manager a `CacheConfig`, the model runner a `ModelConfig` and `LoadConfig`.
No module reads the environment on its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts of one decoder-only model (from config.json or GGUF metadata).

    One decoder implementation covers every supported family; the flags below are the
    only differences between Llama 1/2/3, Mistral, SmolLM/SmolLM2, Qwen2/2.5 and Qwen3.
    """

    architecture: str  # family: "llama" (also Mistral, SmolLM), "qwen2", "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Hugging Face's rope_scaling dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...}; None = plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""  # a display name (the served model name defaults to it)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )


# int8: weight-only (float products); w8a8: int8 weights and x quantized per group on the fly,
# integer dot products (8-bit x per 192 values by vpdpbusd / AMX tiles on the AVX-512 kernel
# variants, 7-bit per 16 by vpmaddubsw on AVX2; not without the kernels), SmoothQuant's scales
# folded into the weights at load (models/smoothing.py), faster in batches, less accurate.
# int4: 4-bit codes with a float16 scale and min per group of 32 (GGUF Q4_0 / Q4_1 / Q4_K kept as
# they are), x quantized per group of 32, integer dot products on both kernel variants.
WEIGHT_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "w8a8", "int4")
# int8: K and V as int8 codes with one float32 scale per token and KV head (models/kv_cache.py).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")
# Which code runs the forward and decode attention (models/backends.py registers each; "auto"
# takes the fastest this model and machine run).
DECODER_BACKENDS = ("auto", "step", "fused", "eager")
ATTENTION_BACKENDS = ("auto", "paged", "sdpa")


@dataclass(frozen=True)
class LoadConfig:
    """Where the weights come from and in what precision they run."""

    model: str | None = None  # None = the default model; else a path (GGUF file / HF dir) or a hub id
    load_format: str = "auto"  # "auto" | "gguf" | "hf" | "dummy"
    dtype: str = "auto"  # compute dtype: "auto" (bfloat16 where the CPU computes in it, else float32) | ...
    # Storage of the linear layers' weights, read once per decode step (the bandwidth that bounds
    # decode): "auto" (16-bit on a float32 CPU when our kernels load, else as dtype) | "float32" |
    # "bfloat16" | "float16" | "int8" (weight-only, per-output-channel scales) | "w8a8" | "int4".
    weight_dtype: str = "auto"
    seed: int = 0  # seeds dummy weights and the global sampler generator
    device: str = "cpu"
    # Overrides for a dummy model's config: path to a config.json (dummy weights of a real shape).
    hf_config_path: str | None = None
    decoder_backend: str = "auto"  # DECODER_BACKENDS
    attention_backend: str = "auto"  # ATTENTION_BACKENDS

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "gguf", "hf", "dummy"):
            raise ValueError(f"load_format must be auto, gguf, hf or dummy, not {self.load_format!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, not {self.weight_dtype!r}")
        if self.decoder_backend not in DECODER_BACKENDS:
            raise ValueError(f"decoder_backend must be one of {', '.join(DECODER_BACKENDS)}, not {self.decoder_backend!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"not {self.attention_backend!r}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, memory budget, prefix caching."""

    block_size: int = 16
    # Bytes for the KV pool; None = derive from num_gpu_blocks_override or a default of 1 GiB on CPU.
    kv_cache_memory: int | None = None
    num_blocks_override: int | None = None  # exact number of blocks (tests force preemption with this)
    enable_prefix_caching: bool = True
    # How K and V are stored: "auto" (float16 where the weights are float16 by "auto": a float32
    # CPU with our kernels; else the compute dtype) | "float32" | "bfloat16" | "float16" | "int8"
    # (codes + a float32 scale per token and KV head: ~1.9x float16's tokens in the same memory).
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {self.cache_dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0, got {self.kv_cache_memory}")
        if self.num_blocks_override is not None and self.num_blocks_override < 1:
            raise ValueError(f"num_blocks_override must be >= 1, got {self.num_blocks_override}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: one token budget covers prefill chunks and decodes."""

    max_num_seqs: int = 64  # running requests at most
    max_num_batched_tokens: int = 2048  # tokens per step (prefill chunks + decodes)
    max_model_len: int | None = None  # prompt + output tokens of one request; None: the model's (LLMEngine resolves it)
    enable_chunked_prefill: bool = True
    # A single prefill chunk takes at most this many tokens (0 = no extra cap), so that
    # a long prompt leaves room in the step for other requests' decodes.
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens must be >= max_model_len "
                f"({self.max_num_batched_tokens} < {self.max_model_len})"
            )


SPECULATIVE_METHODS = ("ngram", "draft_model", "suffix")
MAX_SPECULATIVE_TOKENS = 16
# The keys each method reads, beyond method and num_speculative_tokens: a key of another
# method is refused (naming it) rather than ignored.
_METHOD_KEYS = {
    "ngram": ("prompt_lookup_max", "prompt_lookup_min"),
    "draft_model": ("model",),
    "suffix": ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"),
}
_COMMON_KEYS = ("method", "num_speculative_tokens", "adaptive")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, vLLM's `--speculative-config` shape. Methods:

    - "ngram" (prompt lookup): the K tokens that followed the most recent earlier occurrence of
      the longest suffix n-gram (prompt_lookup_max down to prompt_lookup_min tokens) of the
      request's own tokens;
    - "draft_model": a small `model` sharing the target's vocabulary proposes K tokens, one
      forward pass of its own per draft (its own KV cache);
    - "suffix" (suffix decoding, the idea of arctic-inference's): a suffix tree over the
      request's prompt and output and one over recent outputs of other requests, the most
      frequent continuation of the longest matching suffix, as many tokens as the match is
      confident of (vLLM's suffix_decoding_* keys).

    Any sampling settings: verification samples the target at each draft position and keeps
    drafts while they match (argmax when greedy: the same tokens as without; rejection sampling
    when temperature > 0: the same distribution, and with a seed the same tokens).

    `adaptive` (default on): each request speculates in a step only when the drafts are
    expected to pay, from its acceptance so far, the batch and the measured step costs
    (engine/spec_policy.py); off: always, as vLLM does.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4  # K: drafts per request and step, at most
    prompt_lookup_max: int = 4  # ngram: longest suffix n-gram tried
    prompt_lookup_min: int = 2  # ngram: shortest suffix n-gram accepted
    model: str | None = None  # draft_model: a GGUF file, HF directory or hub id
    suffix_decoding_max_tree_depth: int = 24  # suffix: longest suffix + continuation stored
    suffix_decoding_max_cached_requests: int = 1000  # suffix: finished outputs in the global tree (LRU)
    suffix_decoding_max_spec_factor: float = 1.0  # suffix: drafts <= factor x match length
    suffix_decoding_min_token_prob: float = 0.1  # suffix: stop where a continuation is less likely
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: unknown method {self.method!r} (known: {', '.join(SPECULATIVE_METHODS)})")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer in "
                             f"1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        for name in ("prompt_lookup_max", "prompt_lookup_min", "suffix_decoding_max_tree_depth",
                     "suffix_decoding_max_cached_requests"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        f = self.suffix_decoding_max_spec_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not f > 0:
            raise ValueError(f"speculative_config: suffix_decoding_max_spec_factor must be a number > 0, got {f!r}")
        pmin = self.suffix_decoding_min_token_prob
        if isinstance(pmin, bool) or not isinstance(pmin, (int, float)) or not 0 <= pmin <= 1:
            raise ValueError(f"speculative_config: suffix_decoding_min_token_prob must be in [0, 1], got {pmin!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config: adaptive must be true or false, got {self.adaptive!r}")
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise ValueError('speculative_config: method "draft_model" needs a model (a GGUF file, HF directory or hub id)')

    @classmethod
    def parse(cls, spec: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """A JSON object (the flag's text) or a dict → the config; None or "" → None. One
        ValueError naming what is wrong: malformed JSON, an unknown key, a bad value."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str):
            if not spec.strip():
                return None
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e.msg} at character {e.pos}): {spec!r}") from None
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(spec).__name__}")
        if "method" not in spec:
            raise ValueError(f"speculative_config needs a method (known: {', '.join(SPECULATIVE_METHODS)})")
        if "num_speculative_tokens" not in spec:
            raise ValueError(f"speculative_config needs num_speculative_tokens (1..{MAX_SPECULATIVE_TOKENS})")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))} "
                             f"(known: {', '.join(sorted(known))})")
        method = spec["method"]
        if method in _METHOD_KEYS:
            foreign = sorted(set(spec) - set(_COMMON_KEYS) - set(_METHOD_KEYS[method]))
            if foreign:
                raise ValueError(f"speculative_config: {', '.join(map(repr, foreign))} not read by method {method!r} "
                                 f"(its keys: {', '.join(_COMMON_KEYS + _METHOD_KEYS[method])})")
        return cls(**spec)


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over processes (engine/tp_worker.py, models/tp.py)."""

    tensor_parallel_size: int = 1  # ranks the layers are split over; 1: one process, as without

    def __post_init__(self) -> None:
        n = self.tensor_parallel_size
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {n!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, grouped by concern."""

    load: LoadConfig = field(default_factory=LoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    num_threads: int | None = None  # torch intra-op threads (all ranks together); None = all cores
    # Seconds between returns of the C heap's free pages to the OS while busy (and once idle: at
    # the end of LLM.generate, after 10 s of idle in the server); None = never. Bounds RSS growth from fragmentation (see engine/heap.py).
    heap_trim_interval_s: float | None = 5.0
    # Sampling defaults for the fields a request leaves out (engine/generation_config.py):
    # "model" | "openai", and a parsed --override-generation-config over them.
    sampling_defaults: str = "model"
    override_generation_config: dict[str, float | int] = field(default_factory=dict)
    speculative: SpeculativeConfig | None = None  # None: one token per request and step
    chat_template: str | None = None  # a Jinja chat template over the model's own (--chat-template)

    def __post_init__(self) -> None:
        if self.sampling_defaults not in ("model", "openai"):
            raise ValueError(f"sampling_defaults must be model or openai, not {self.sampling_defaults!r}")
