"""Random weights of a real model's shapes: speed and memory checks without downloading weights.

Each tensor is allocated once in its final dtype and on its final device and filled in
place (`normal_`), so an 8B-parameter config costs one pass over 16 GB, not several copies.
"""

from __future__ import annotations

from pathlib import Path

import torch

from inferlab.config import ModelConfig
from inferlab.models.loaded import LoadedModel, expected_weight_shapes
from inferlab.models.model_config import model_config_from_hf_dir

INIT_STD = 0.02  # the usual initializer_range: keeps activations finite through many layers


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def load_dummy(
    config: ModelConfig | str | Path,
    dtype: torch.dtype,
    seed: int = 0,
    device: str | torch.device = "cpu",
    name: str = "",
) -> LoadedModel:
    """Weights ~ N(0, 0.02) (biases 0, norm weights 1) for `config` or a config.json path / HF dir.

    Deterministic for a given seed, device and config: tensors are filled in name order
    from one generator.
    """
    source: Path | None = None
    if not isinstance(config, ModelConfig):
        source = Path(config)
        default_name = source.parent.name if source.is_file() else source.name
        config = model_config_from_hf_dir(source, name=name or default_name)
    generator = torch.Generator(device=device).manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for key, shape in expected_weight_shapes(config).items():
        if _is_norm(key):
            weights[key] = torch.ones(shape, dtype=dtype, device=device)
        elif key.endswith(".bias"):
            weights[key] = torch.zeros(shape, dtype=dtype, device=device)
        else:
            weights[key] = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, INIT_STD, generator=generator)
    return LoadedModel(config=config, weights=weights, source_path=source, format="dummy")
