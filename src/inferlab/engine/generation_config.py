"""The sampling defaults a request gets for the fields it leaves out.

Why: a client that sends no temperature expects the model's own settings, as vLLM and SGLang
take them from `generation_config.json` and llama-server from a GGUF's `general.sampling.*`
keys (else its own 0.8 / top-k 40 / top-p 0.95 / min-p 0.05). Sampling a small instruct model at
temperature 1 with no truncation gives incoherent answers. Resolution, per field:

    the request's value > --override-generation-config > the model's file > the family default

where the family default is llama.cpp's for a GGUF and OpenAI's (temperature 1, top-p 1, no
top-k / min-p / repetition penalty) otherwise. `--sampling-defaults openai` skips the model's
file and llama.cpp's defaults (vLLM's `--generation-config vllm`); the override still applies.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "FIELDS",
    "LLAMA_CPP_DEFAULTS",
    "OPENAI_DEFAULTS",
    "SAMPLING_DEFAULT_MODES",
    "SamplingDefaults",
    "model_sampling_values",
    "parse_override",
    "read_gguf_sampling",
    "read_hf_sampling",
    "resolve_sampling_defaults",
]

logger = logging.getLogger(__name__)

SAMPLING_DEFAULT_MODES = ("model", "openai")
# The SamplingParams fields a model may give defaults for (vLLM reads the same from
# generation_config.json), with their types.
FIELDS: dict[str, type] = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
                           "repetition_penalty": float}  # fmt: skip
OPENAI_DEFAULTS: dict[str, float | int] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                           "repetition_penalty": 1.0}  # fmt: skip
# llama-server's defaults (common/common.h): what a GGUF user gets from llama.cpp.
LLAMA_CPP_DEFAULTS: dict[str, float | int] = {**OPENAI_DEFAULTS, "temperature": 0.8, "top_p": 0.95, "top_k": 40,
                                              "min_p": 0.05}  # fmt: skip
# GGUF general.sampling.* key -> our field.
_GGUF_KEYS = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
              "penalty_repeat": "repetition_penalty"}  # fmt: skip


@dataclass(frozen=True)
class SamplingDefaults:
    """The resolved defaults, and where each came from ("request" never: that is per request)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # field -> "override" | "generation_config.json" | "gguf" | "llama.cpp" | "openai"
    source: dict[str, str] = field(default_factory=lambda: dict.fromkeys(FIELDS, "openai"))

    def values(self) -> dict[str, float | int]:
        return {name: getattr(self, name) for name in FIELDS}

    def as_dict(self) -> dict[str, Any]:
        return {**self.values(), "source": dict(self.source)}

    def describe(self) -> str:
        """One log line: 'temperature 0.8 (llama.cpp), top_k 40 (llama.cpp), ...'."""
        return ", ".join(f"{name} {getattr(self, name):g} ({self.source[name]})" for name in FIELDS)


def _coerce(name: str, value: Any, where: str) -> float | int:
    kind = FIELDS[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: {name} must be a number, got {value!r}")
    if kind is int and float(value) != int(value):
        raise ValueError(f"{where}: {name} must be an integer, got {value!r}")
    return kind(value)


def _known(values: dict[str, Any], where: str) -> dict[str, float | int]:
    """The entries of `values` that are our fields, typed; others are not sampling defaults."""
    return {k: _coerce(k, v, where) for k, v in values.items() if k in FIELDS and v is not None}


def parse_override(text: str | dict[str, Any] | None) -> dict[str, float | int]:
    """--override-generation-config: a JSON object of our fields; anything else is a ValueError
    naming it (an override that changes nothing must not pass silently)."""
    if text is None or text == "":
        return {}
    if isinstance(text, str):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"override_generation_config is not valid JSON: {e}") from None
    else:
        data = text
    if not isinstance(data, dict):
        raise ValueError("override_generation_config must be a JSON object, e.g. '{\"temperature\": 0.5}'")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ValueError(f"override_generation_config: unknown field(s) {', '.join(unknown)} "
                         f"(known: {', '.join(FIELDS)})")
    return _known(data, "override_generation_config")


def read_hf_sampling(model_dir: Path) -> dict[str, float | int]:
    """The sampling fields of a Hugging Face directory's generation_config.json ({} without one).
    `do_sample` is not read, as vLLM does not: the values are what a sampling client gets."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    return _known(data if isinstance(data, dict) else {}, str(path))


def read_gguf_sampling(reader: Any) -> dict[str, float | int]:
    """A GGUF's general.sampling.* defaults (llama.cpp writes them from generation_config.json)."""
    out: dict[str, Any] = {}
    for key, name in _GGUF_KEYS.items():
        f = reader.get_field(f"general.sampling.{key}")
        if f is not None:
            out[name] = f.contents()
    return _known(out, "GGUF general.sampling")


def resolve_sampling_defaults(
    mode: str,
    model_values: dict[str, float | int],
    model_source: str,
    is_gguf: bool,
    override: dict[str, float | int] | None = None,
) -> SamplingDefaults:
    """override > the model's values (mode "model") > llama.cpp's (a GGUF, mode "model") > OpenAI's."""
    if mode not in SAMPLING_DEFAULT_MODES:
        raise ValueError(f"sampling_defaults must be one of {', '.join(SAMPLING_DEFAULT_MODES)}, not {mode!r}")
    family, family_name = (LLAMA_CPP_DEFAULTS, "llama.cpp") if is_gguf and mode == "model" else (OPENAI_DEFAULTS, "openai")
    values: dict[str, float | int] = dict(family)
    source = dict.fromkeys(FIELDS, family_name)
    layers = [(model_values if mode == "model" else {}, model_source), (override or {}, "override")]
    for layer, name in layers:
        for k, v in layer.items():
            values[k] = v
            source[k] = name
    if values["top_k"] == -1:
        values["top_k"] = 0
    defaults = SamplingDefaults(source=source, **values)  # type: ignore[arg-type]
    _check(defaults)
    return defaults


def _check(d: SamplingDefaults) -> None:
    """The same ranges SamplingParams enforces, named here so a bad file fails at load."""
    from inferlab.engine.request import SamplingParams

    try:
        SamplingParams(**d.values())  # type: ignore[arg-type]
    except ValueError as e:
        where = d.source.get(str(e).split(" ", 1)[0], "?")
        raise ValueError(f"sampling defaults: {e} (from {where})") from None


def model_sampling_values(path: Path | None, fmt: str | None) -> tuple[dict[str, float | int], str]:
    """(the model's own sampling fields, where they were read) for a resolved model."""
    if path is None or fmt is None:
        return {}, "openai"
    if fmt == "gguf":
        from inferlab.models.gguf_loader import open_gguf

        return read_gguf_sampling(open_gguf(path)), "gguf"
    directory = path if path.is_dir() else path.parent
    return read_hf_sampling(directory), "generation_config.json"
