"""`ModelSpec`: the architecture numbers the planner needs, from a built-in table of public
configurations, a local config.json / Hugging Face directory, or a GGUF file.

The shape of a file is read by the engine's own parser (models/model_config.py), so the
planner plans only what the engine runs and refuses what it refuses. No torch: a GGUF file
is read with the `gguf` package (memory-mapped, metadata and tensor table only) and
safetensors files by their JSON headers, so planning a 70B model costs nothing but arithmetic.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gguf import GGUFReader

from inferlab.config import ModelConfig
from inferlab.models.model_config import model_config_from_gguf, model_config_from_hf
from inferlab.plan.figures import Kind


@dataclass(frozen=True)
class ModelSpec:
    """One decoder-only transformer's shape, and where its numbers came from."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    num_params: int
    params_kind: Kind  # 'cited' for the built-in public counts, 'computed' for formula or file sums
    source: str
    qk_norm: bool = False  # Qwen3: RMSNorm weights over q and k heads (2 × head_dim per layer)
    attention_bias: bool = False  # Qwen2: biases on q, k, v
    max_position_embeddings: int = 0
    native_precision: str = "bf16"  # what the published weights are stored in
    # From a file (GGUF tensors, safetensors headers): the bytes actually stored, and the
    # input embedding's share, so that the planner uses the file and not a formula.
    file_weight_bytes: int | None = None
    file_embedding_bytes: int | None = None

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "vocab_size", "num_params"):
            if getattr(self, f) < 1:
                raise ValueError(f"model {self.name!r}: {f} must be >= 1, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"model {self.name!r}: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matrix product for every token.

        The input embedding is a lookup (one row per token), not a product; when the output
        head is tied to it, the head *is* a product over the same table, so it counts once.
        Norm weights are counted too (negligible).
        """
        return self.num_params if self.tie_word_embeddings else self.num_params - self.embedding_params


def count_params(
    *,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    vocab_size: int,
    tie_word_embeddings: bool,
    qk_norm: bool = False,
    attention_bias: bool = False,
) -> int:
    """Parameters of a Llama-style decoder (GQA attention, gated MLP, RMSNorm).

    per layer: q (h·H·d) + k, v (2·h·K·d) + o (H·d·h) + gate, up, down (3·h·I) + 2 norms (2·h)
               [+ q/k norms 2·d (Qwen3)] [+ q/k/v biases H·d + 2·K·d (Qwen2)]
    plus the embedding V·h (twice when the head is untied) and the final norm h.
    """
    h, d = hidden_size, head_dim
    per_layer = h * num_heads * d + 2 * h * num_kv_heads * d + num_heads * d * h
    per_layer += 3 * h * intermediate_size + 2 * h
    if qk_norm:
        per_layer += 2 * d
    if attention_bias:
        per_layer += num_heads * d + 2 * num_kv_heads * d
    embeddings = vocab_size * h * (1 if tie_word_embeddings else 2)
    return embeddings + h + num_layers * per_layer


# ---------------------------------------------------------------- the built-in table

# name -> (config.json fields of the public checkpoint, public parameter count, hub id)
_BUILTIN: dict[str, tuple[dict[str, Any], int, str]] = {
    "llama-3.1-8b": (dict(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                          intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                          max_position_embeddings=131072), 8_030_261_248, "meta-llama/Llama-3.1-8B"),
    "llama-3.1-70b": (dict(num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, head_dim=128,
                           intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False,
                           max_position_embeddings=131072), 70_553_706_496, "meta-llama/Llama-3.1-70B"),
    "qwen3-0.6b": (dict(num_layers=28, hidden_size=1024, num_heads=16, num_kv_heads=8, head_dim=128,
                        intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, qk_norm=True,
                        max_position_embeddings=40960), 596_049_920, "Qwen/Qwen3-0.6B"),
    "qwen3-8b": (dict(num_layers=36, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                      intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False, qk_norm=True,
                      max_position_embeddings=40960), 8_190_735_360, "Qwen/Qwen3-8B"),
    "qwen3-32b": (dict(num_layers=64, hidden_size=5120, num_heads=64, num_kv_heads=8, head_dim=128,
                       intermediate_size=25600, vocab_size=151936, tie_word_embeddings=False, qk_norm=True,
                       max_position_embeddings=40960), 32_762_123_264, "Qwen/Qwen3-32B"),
    "smollm2-135m": (dict(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                          intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                          max_position_embeddings=8192), 134_515_008, "HuggingFaceTB/SmolLM2-135M"),
    "smollm2-360m": (dict(num_layers=32, hidden_size=960, num_heads=15, num_kv_heads=5, head_dim=64,
                          intermediate_size=2560, vocab_size=49152, tie_word_embeddings=True,
                          max_position_embeddings=8192), 361_821_120, "HuggingFaceTB/SmolLM2-360M"),
    "smollm2-1.7b": (dict(num_layers=24, hidden_size=2048, num_heads=32, num_kv_heads=32, head_dim=64,
                          intermediate_size=8192, vocab_size=49152, tie_word_embeddings=True,
                          max_position_embeddings=8192), 1_711_376_384, "HuggingFaceTB/SmolLM2-1.7B"),
    "mistral-7b-v0.3": (dict(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                             intermediate_size=14336, vocab_size=32768, tie_word_embeddings=False,
                             max_position_embeddings=32768), 7_248_023_552, "mistralai/Mistral-7B-v0.3"),
    "mistral-7b-v0.1": (dict(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                             intermediate_size=14336, vocab_size=32000, tie_word_embeddings=False,
                             max_position_embeddings=32768), 7_241_732_096, "mistralai/Mistral-7B-v0.1"),
}
_BUILTIN_ALIASES = {"mistral-7b": "mistral-7b-v0.3", "llama3.1-8b": "llama-3.1-8b", "llama3.1-70b": "llama-3.1-70b"}


def builtin_model_names() -> list[str]:
    return list(_BUILTIN)


def _builtin_key(name: str) -> str | None:
    key = name.strip().lower().rsplit("/", 1)[-1].replace("_", "-")
    key = re.sub(r"-instruct\b", "", key)
    key = _BUILTIN_ALIASES.get(key, key)
    return key if key in _BUILTIN else None


def builtin_model(name: str) -> ModelSpec:
    key = _builtin_key(name)
    if key is None:
        raise ValueError(f"unknown model {name!r}; built-in: {', '.join(_BUILTIN)} (or a config.json, HF dir, GGUF)")
    fields, params, hub_id = _BUILTIN[key]
    return ModelSpec(
        name=key,
        num_params=params,
        params_kind="cited",
        source=f"config.json of {hub_id} (public); parameter count as published",
        **fields,
    )


# ---------------------------------------------------------------- files


def load_model_spec(name_or_path: str) -> ModelSpec:
    """A built-in name, a config.json, a Hugging Face directory, or a .gguf file."""
    if not name_or_path:
        raise ValueError("--model is required: a built-in name, a config.json, an HF directory or a .gguf file")
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return spec_from_hf_dir(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return spec_from_gguf(ggufs[0])
        raise ValueError(f"{path}: no config.json and not exactly one .gguf file inside")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return spec_from_gguf(path)
        if path.suffix.lower() == ".json":
            return spec_from_config(json.loads(path.read_text()), source=str(path))
        raise ValueError(f"{path}: expected a .gguf file, a config.json or a directory")
    if os.sep in name_or_path and _builtin_key(name_or_path) is None:
        raise FileNotFoundError(f"no such model file or directory: {name_or_path}")
    return builtin_model(name_or_path)


_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                 "vocab_size", "tie_word_embeddings", "qk_norm", "attention_bias")


def _spec(config: ModelConfig, **fields: Any) -> ModelSpec:
    """The planner's view of the engine's ModelConfig: the shape, plus where the numbers came from."""
    shape = {f: getattr(config, f) for f in (*_SHAPE_FIELDS, "max_position_embeddings")}
    return ModelSpec(**shape, params_kind="computed", **fields)


def spec_from_config(cfg: dict[str, Any], source: str, name: str | None = None) -> ModelSpec:
    """A Hugging Face config.json dict -> ModelSpec (read as the engine reads it); parameters
    from the formula."""
    try:
        config = model_config_from_hf(cfg)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    return _spec(
        config,
        name=name or str(cfg.get("_name_or_path") or cfg.get("model_type") or Path(source).parent.name),
        num_params=count_params(**{f: getattr(config, f) for f in _SHAPE_FIELDS}),
        source=f"{source} (parameters from the Llama-style formula)",
        native_precision=_hf_dtype(cfg.get("torch_dtype") or cfg.get("dtype")),
    )


def _hf_dtype(name: Any) -> str:
    return {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(str(name), "bf16")


def spec_from_hf_dir(path: Path) -> ModelSpec:
    """config.json, plus the safetensors headers when present: the stored tensors' real sizes."""
    spec = spec_from_config(json.loads((path / "config.json").read_text()), source=str(path / "config.json"),
                            name=path.name)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return spec
    n_params, n_bytes, embed_bytes = 0, 0, 0
    for f in files:
        for tname, info in _safetensors_header(f).items():
            if tname == "__metadata__":
                continue
            start, end = info["data_offsets"]
            n_params += math.prod(int(dim) for dim in info["shape"])
            n_bytes += end - start
            if tname.endswith("embed_tokens.weight"):
                embed_bytes += end - start
    return replace(
        spec,
        num_params=n_params,
        source=f"{path}: config.json and safetensors headers (tensor sizes summed)",
        file_weight_bytes=n_bytes,
        file_embedding_bytes=embed_bytes or None,
    )


def _safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a .safetensors file: 8-byte little-endian length, then JSON."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", raw)
        if length > 100_000_000:
            raise ValueError(f"{path}: not a safetensors file (header length {length})")
        return json.loads(f.read(length))


def spec_from_gguf(path: Path) -> ModelSpec:
    """GGUF metadata for the shape (read as the engine reads it); the tensor table for
    parameters and actual stored bytes."""
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError/struct errors on foreign files
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from None
    try:
        config = model_config_from_gguf(reader)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    embed = next((int(t.n_bytes) for t in reader.tensors if t.name == "token_embd.weight"), None)
    by_type: dict[str, int] = {}
    for t in reader.tensors:
        by_type[t.tensor_type.name.lower()] = by_type.get(t.tensor_type.name.lower(), 0) + int(t.n_bytes)
    return _spec(
        config,
        name=path.stem,
        num_params=sum(int(t.n_elements) for t in reader.tensors),
        source=f"{path}: GGUF metadata; parameters and bytes summed over its {len(reader.tensors)} tensors",
        native_precision=max(by_type, key=by_type.__getitem__) if by_type else "bf16",
        file_weight_bytes=sum(by_type.values()),
        file_embedding_bytes=embed,
    )
