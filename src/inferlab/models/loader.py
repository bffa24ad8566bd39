"""`load_model`: pick the weight loader for a LoadConfig and hand back HF-named tensors.

Formats sit behind one small table (`LOADERS`) so a new format is a new entry, not a new
branch in the runner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from inferlab.config import LoadConfig
from inferlab.kernels.int4 import INT4
from inferlab.models.dummy_loader import load_dummy
from inferlab.models.gguf_loader import load_gguf
from inferlab.models.hf_loader import load_hf_dir
from inferlab.models.loaded import LoadedModel
from inferlab.models.precision import ResolvedPrecision, resolve_precision
from inferlab.models.registry import detect_format, resolve_model
from inferlab.models.smoothing import smooth_weights

__all__ = ["LOADERS", "LoadedModel", "load_model"]

# format -> loader(path, dtype, name)
LOADERS: dict[str, Callable[[Path, torch.dtype, str], LoadedModel]] = {
    "gguf": load_gguf,
    "hf": load_hf_dir,
}


def _default_name(path: Path) -> str:
    return path.stem if path.is_file() else path.name


def _smoothed(loaded: LoadedModel, precision: ResolvedPrecision) -> LoadedModel:
    """w8a8's weights with SmoothQuant's scales folded in (models/smoothing.py), before any
    linear quantizes them; every other mode's as they are."""
    if precision.int8_activations:
        smooth_weights(loaded.config, loaded.weights)
        # the lm_head now differs from the embedding (smoothed): its own weight from here on
        loaded.config = dataclasses.replace(loaded.config, tie_word_embeddings=False)
    return loaded


def load_model(
    load_config: LoadConfig,
    model_path: str | Path | None = None,
    name: str = "",
    cache_dir: str | Path | None = None,
    precision: ResolvedPrecision | None = None,
) -> LoadedModel:
    """Load the weights `load_config` describes, on `load_config.device`.

    `model_path` is an already-resolved location (a .gguf file or HF directory); without it,
    `load_config.model` goes through the registry (default model, local path or hub id),
    which also supplies the display name. Dummy weights take their shapes from
    `load_config.hf_config_path`, else from `model_path` / `load_config.model` (a config.json
    or a HF directory). The weights arrive in `precision.compute` (int4: a GGUF's Q4 blocks as
    they are); `precision` is the engine's (resolve_precision), else resolved here for a load alone.
    """
    precision = precision or resolve_precision(load_config)
    dtype = precision.compute
    if load_config.load_format == "dummy":
        source = load_config.hf_config_path or model_path or load_config.model
        if source is None:
            raise ValueError(
                "dummy weights need a config: pass a config.json path (hf_config_path) or a model directory"
            )
        source = Path(source).expanduser()
        if not source.exists():
            raise FileNotFoundError(f"model path {str(source)!r} does not exist")
        return _smoothed(load_dummy(source, dtype, seed=load_config.seed, device=load_config.device, name=name),
                         precision)

    if model_path is None:
        resolved = resolve_model(load_config.model, cache_dir=cache_dir)
        path, fmt, name = resolved.path, resolved.format, name or resolved.name
    else:
        path = Path(model_path).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"model path {str(path)!r} does not exist")
        fmt, name = detect_format(path), name or _default_name(path)
    if load_config.load_format != "auto" and load_config.load_format != fmt:
        raise ValueError(f"load_format is {load_config.load_format!r} but {path} is a {fmt!r} model")
    if fmt == "gguf" and precision.weights == INT4:
        loaded = load_gguf(path, dtype, name, keep_int4=True)  # Q4 blocks as they are, no dequantize
    else:
        loaded = LOADERS[fmt](path, dtype, name)
    loaded = _smoothed(loaded, precision)
    if torch.device(load_config.device).type != "cpu":
        # One tensor at a time, so the CPU copy of each is freed as soon as it has moved.
        for key in list(loaded.weights):
            loaded.weights[key] = loaded.weights[key].to(load_config.device)
    return loaded
