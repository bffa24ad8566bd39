"""Bits per stored number for each weight or KV-cache precision.

llama.cpp's block formats carry a scale (and for *_1 a minimum) per block of 32 numbers, so
Q8_0 is 32 int8 + one fp16 scale = 34 bytes per 32 = 8.5 bits. The table below names the
common ones; any other ggml type name (q6_k, iq4_xs, ...) is read from the `gguf` package's
own block-size table, so it stays in step with the file format.
"""

from __future__ import annotations

from dataclasses import dataclass

# name -> (bits per element, why)
_BITS: dict[str, tuple[float, str]] = {
    "fp32": (32.0, "IEEE float32"),
    "bf16": (16.0, "bfloat16"),
    "fp16": (16.0, "IEEE float16"),
    "fp8": (8.0, "FP8 (E4M3/E5M2), per-tensor scale ignored"),
    "int8": (8.0, "8-bit integers, per-channel scales ignored"),
    "int4": (4.0, "4-bit integers, group scales ignored"),
    "q8_0": (8.5, "ggml Q8_0: 32 int8 + fp16 scale = 34 bytes per 32"),
    "q4_0": (4.5, "ggml Q4_0: 32 4-bit + fp16 scale = 18 bytes per 32"),
    "q4_1": (5.0, "ggml Q4_1: 32 4-bit + fp16 scale + fp16 min = 20 bytes per 32"),
    "q5_0": (5.5, "ggml Q5_0: 22 bytes per 32"),
    "q5_1": (6.0, "ggml Q5_1: 24 bytes per 32"),
}

_ALIASES: dict[str, str] = {
    "float32": "fp32", "f32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16", "f16": "fp16", "half": "fp16",
    "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "float8": "fp8", "e4m3": "fp8", "e5m2": "fp8",
    "i8": "int8", "w8a16": "int8", "w4a16": "int4", "i4": "int4",
}


@dataclass(frozen=True)
class Precision:
    """A storage format: its canonical name and the bits one stored number takes."""

    name: str
    bits: float
    note: str

    @property
    def bytes_per_element(self) -> float:
        return self.bits / 8.0


def parse_precision(name: str) -> Precision:
    """'bf16', 'Q8_0', 'float16', 'q6_k', ... -> Precision. Unknown names raise ValueError."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError("precision must be a name such as bf16, fp8, q8_0 or q4_1")
    key = name.strip().lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key in _BITS:
        bits, note = _BITS[key]
        return Precision(key, bits, note)
    ggml = _ggml_bits(key)
    if ggml is not None:
        return Precision(key, ggml, f"ggml {key.upper()}: from gguf's block-size table")
    known = ", ".join(sorted(_BITS))
    raise ValueError(f"unknown precision {name!r}; use one of {known} or a ggml type name (q6_k, ...)")


def _ggml_bits(key: str) -> float | None:
    """Bits per element of a ggml quantization type, from gguf's (block size, bytes) table."""
    try:
        import gguf  # numpy only; no torch
    except ImportError:  # pragma: no cover - gguf is a dependency
        return None
    try:
        qtype = gguf.GGMLQuantizationType[key.upper()]
    except KeyError:
        return None
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return size * 8.0 / block
