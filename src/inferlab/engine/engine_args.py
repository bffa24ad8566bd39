"""`EngineArgs`: every engine setting written once, for `LLM(...)`, `serve`, `generate` and the tools.

Why one object: the same eighteen settings were keywords of `LLM`, flags of `serve` and of
`generate`, each with its own defaults, help and validation, and each missing some of the
others'. Here each setting is one field with one default; `add_cli_args` makes the flags (one
help text each), `from_cli_args` reads them back, `create_engine_config` builds the frozen
`EngineConfig` the engine runs on (where the values are validated, once).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Collection
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from inferlab.config import (
    ATTENTION_BACKENDS,
    DECODER_BACKENDS,
    KV_CACHE_DTYPES,
    WEIGHT_DTYPES,
    CacheConfig,
    EngineConfig,
    LoadConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from inferlab.engine.generation_config import SAMPLING_DEFAULT_MODES, parse_override

__all__ = ["PRECISION", "EngineArgs", "parse_size"]

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "gguf", "hf", "dummy")
# The fields that say what the model is and how precisely it runs: the flags a tool that builds
# its own batches (perplexity, the quantization report) takes, without the scheduler's.
PRECISION = ("model", "dtype", "weight_dtype", "kv_cache_dtype", "load_format")

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3, "ti": 1024**4, "tib": 1024**4,
}  # fmt: skip


def parse_size(text: str) -> int:
    """'2GiB' → 2147483648, '500MB' → 500000000, '1e9' → 1000000000 (bytes)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 2GiB, 512MiB, 1.5GB)")
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"the size must be > 0, got {text!r}")
    return value


@dataclass
class EngineArgs:
    """The engine's settings as a user gives them (strings such as "auto" not resolved yet: the
    engine resolves precision once, at load, and reports it in `LLMEngine.info()`)."""

    model: str | None = None  # None: the default SmolLM2-135M-Instruct; else a GGUF file, HF directory or hub id
    dtype: str = "auto"
    weight_dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context length, capped by what the KV pool holds
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    block_size: int = 16
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int | None = None
    heap_trim_interval_s: float | None = 5.0
    hf_config_path: str | None = None
    device: str = "cpu"
    decoder_backend: str = "auto"
    attention_backend: str = "auto"
    sampling_defaults: str = "model"  # "model": the model's file, else llama.cpp's (GGUF) / OpenAI's; "openai"
    override_generation_config: dict[str, Any] | str | None = None  # JSON or dict over the model's defaults
    # Speculative decoding: a dict or its JSON text, e.g. {"method": "ngram", "num_speculative_tokens": 4}.
    speculative_config: dict[str, Any] | str | None = None
    chat_template: str | None = None  # a file holding a Jinja chat template, or the template itself
    tensor_parallel_size: int = 1  # processes the layers are split over (engine/tp_worker.py)

    def create_engine_config(self) -> EngineConfig:
        """The frozen EngineConfig (its dataclasses validate every value: one ValueError naming it)."""
        return EngineConfig(
            load=LoadConfig(model=self.model, load_format=self.load_format, dtype=self.dtype,
                            weight_dtype=self.weight_dtype, seed=self.seed, hf_config_path=self.hf_config_path,
                            device=self.device, decoder_backend=self.decoder_backend,
                            attention_backend=self.attention_backend),
            cache=CacheConfig(block_size=self.block_size, kv_cache_memory=self.kv_cache_memory,
                              num_blocks_override=self.num_kv_blocks, enable_prefix_caching=self.enable_prefix_caching,
                              cache_dtype=self.kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_model_len=self.max_model_len, enable_chunked_prefill=self.enable_chunked_prefill,
                                      long_prefill_token_threshold=self.long_prefill_token_threshold),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size),
            num_threads=self.num_threads,
            heap_trim_interval_s=self.heap_trim_interval_s,
            sampling_defaults=self.sampling_defaults,
            override_generation_config=parse_override(self.override_generation_config),
            speculative=SpeculativeConfig.parse(self.speculative_config),
            chat_template=read_chat_template(self.chat_template),
        )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, only: Collection[str] | None = None,
                     skip: Collection[str] = ()) -> None:
        """The flags of the fields in `only` (default: all) minus `skip`, each with its help."""
        for name, flags, kw in _FLAGS:
            if (only is None or name in only) and name not in skip:
                parser.add_argument(*flags, dest=name, **kw)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineArgs:
        """The fields whose flags were added (others keep their defaults), then `overrides`."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if given.get("heap_trim_interval_s") is not None and given["heap_trim_interval_s"] < 0:
            given["heap_trim_interval_s"] = None  # the flag's "a negative value turns it off"
        return cls(**{**given, **overrides})


def read_chat_template(value: str | None) -> str | None:
    """--chat-template as vLLM takes it: a file's path, else the template's own text (one with
    Jinja in it); a value that is neither is a ValueError naming the flag."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template")


_D = EngineArgs()
# (field, flags, argparse keywords): the only place a flag's name, default and help are written.
_FLAGS: list[tuple[str, tuple[str, ...], dict[str, Any]]] = [
    ("model", ("-m", "--model"), dict(default=None, help="GGUF file, HF directory or hub id (default: SmolLM2-135M-Instruct)")),
    ("dtype", ("--dtype",), dict(default=_D.dtype, choices=DTYPES,
                                 help="compute dtype (auto: float32 on the CPU, with 16-bit weights where our kernels load)")),
    ("weight_dtype", ("--weight-dtype",), dict(default=_D.weight_dtype, choices=WEIGHT_DTYPES,
                                               help="how the linear layers' weights are stored (README: Precision and speed)")),
    ("kv_cache_dtype", ("--kv-cache-dtype",), dict(default=_D.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                                                   help="how K and V are stored (auto: float16 where the weights are 16-bit "
                                                        "by auto, else as --dtype; int8: codes with a float32 "
                                                        "scale per token and KV head, ~1.9x float16's tokens)")),
    ("load_format", ("--load-format",), dict(default=_D.load_format, choices=LOAD_FORMATS)),
    ("max_model_len", ("--max-model-len",), dict(type=int, default=None,
                                                 help="context window in tokens (default: the model's context length, "
                                                      "capped by what the KV cache holds)")),
    ("max_num_seqs", ("--max-num-seqs",), dict(type=int, default=_D.max_num_seqs,
                                               help=f"running requests at most (default {_D.max_num_seqs})")),
    ("max_num_batched_tokens", ("--max-num-batched-tokens",),
     dict(type=int, default=_D.max_num_batched_tokens, help=f"tokens per engine step (default {_D.max_num_batched_tokens})")),
    ("enable_chunked_prefill", ("--no-chunked-prefill",), dict(action="store_false", default=True,
                                                               help="prefill each prompt in one step")),
    ("long_prefill_token_threshold", ("--long-prefill-token-threshold",),
     dict(type=int, default=_D.long_prefill_token_threshold,
          help="at most this many tokens of one prompt per step, leaving room for decodes (0: no cap)")),
    ("block_size", ("--block-size",), dict(type=int, default=_D.block_size, help="tokens per KV block")),
    ("kv_cache_memory", ("--kv-cache-memory",), dict(type=parse_size, default=None,
                                                     help="bytes for the KV cache, e.g. 2GiB (default 1 GiB)")),
    ("num_kv_blocks", ("--num-kv-blocks",), dict(type=int, default=None, help="exactly this many KV blocks")),
    ("enable_prefix_caching", ("--no-prefix-caching",), dict(action="store_false", default=True,
                                                             help="turn off reuse of cached prompt prefixes")),
    ("seed", ("--seed",), dict(type=int, default=_D.seed, help="seeds dummy weights and the sampler's generator")),
    ("num_threads", ("--num-threads",), dict(type=int, default=None,
                                             help="torch threads, all ranks together (default: all cores)")),
    ("tensor_parallel_size", ("--tensor-parallel-size",),
     dict(type=int, default=_D.tensor_parallel_size,
          help="split every layer over this many processes (heads, MLP, vocabulary; an all-reduce after "
               "o_proj and down_proj), each with --num-threads / N threads (default 1)")),
    ("heap_trim_interval_s", ("--heap-trim-interval",),
     dict(type=float, default=_D.heap_trim_interval_s,
          help="seconds between returns of freed C-heap pages to the OS while busy; also once the engine has "
               "stayed idle 10 s (default 5; a negative value turns it off)")),
    ("hf_config_path", ("--hf-config-path",), dict(default=None, help="a config.json for --load-format dummy")),
    ("device", ("--device",), dict(default=_D.device, help="torch device (default cpu)")),
    ("decoder_backend", ("--decoder-backend",),
     dict(default=_D.decoder_backend, choices=DECODER_BACKENDS,
          help="how the layers run: step (decode steps in one kernel call), fused (fused operators), eager "
               "(plain torch); auto: the fastest this model and CPU take (the start-up log says which)")),
    ("attention_backend", ("--attention-backend",),
     dict(default=_D.attention_backend, choices=ATTENTION_BACKENDS,
          help="decode attention: paged (our kernel through the block tables) or sdpa (torch); auto: paged "
               "where it runs")),
    ("sampling_defaults", ("--sampling-defaults",),
     dict(default=_D.sampling_defaults, choices=SAMPLING_DEFAULT_MODES,
          help="what a request that leaves a sampling field out gets: model (the model's generation_config.json "
               "or GGUF general.sampling.*, else llama.cpp's 0.8/top-k 40/top-p 0.95/min-p 0.05 for a GGUF and "
               "OpenAI's temperature 1/top-p 1 otherwise; default) or openai")),
    ("override_generation_config", ("--override-generation-config",),
     dict(default=None, metavar="JSON",
          help='sampling defaults over the model\'s, e.g. \'{"temperature": 0.5, "top_k": 20}\' '
               "(temperature, top_p, top_k, min_p, repetition_penalty)")),
    ("chat_template", ("--chat-template",),
     dict(default=None, metavar="FILE", help="a Jinja chat template (a file, or the template's text) used instead "
                                             "of the model's own")),
    ("speculative_config", ("--speculative-config",),
     dict(default=None, metavar="JSON",
          help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
               '"prompt_lookup_min": 2}\' (greedy requests only; the output is unchanged)')),
]
