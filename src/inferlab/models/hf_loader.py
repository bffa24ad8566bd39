"""Weights from a Hugging Face model directory: config.json + *.safetensors (one file or sharded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from inferlab.engine.generation_config import read_hf_sampling
from inferlab.models.loaded import LoadedModel, check_weights, expected_weight_shapes
from inferlab.models.model_config import model_config_from_hf_dir


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint files of a directory: those a sharded index names, else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from None
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names {missing[0].name}, which is not in {path}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files (only safetensors checkpoints are supported)")
    return files


def load_hf_dir(path: str | Path, dtype: torch.dtype, name: str = "") -> LoadedModel:
    """Load a HF directory's weights as `dtype`, keeping only the tensors the decoder uses.

    Extra tensors (e.g. old checkpoints' rotary `inv_freq`) are dropped, and so is a saved
    `lm_head.weight` when the embeddings are tied: the decoder then reads the embedding.
    """
    path = Path(path)
    if path.is_file():
        raise ValueError(
            f"{path} is a file, not a model directory: a config.json alone has no weights "
            "(load_format='dummy' gives random weights of its shape)"
        )
    if not path.is_dir():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    config = model_config_from_hf_dir(path, name=name)
    wanted = expected_weight_shapes(config)
    weights: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if key in wanted:
                        weights[key] = f.get_tensor(key).to(dtype)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file}: cannot read safetensors file ({e})") from None
    check_weights(config, weights, path)
    return LoadedModel(config=config, weights=weights, source_path=path, format="hf",
                       sampling_defaults=read_hf_sampling(path))
