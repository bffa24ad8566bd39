"""Weights from a GGUF file (llama.cpp's format), dequantized and renamed to Hugging Face names.

We dequantize at load time (numpy, `gguf.quants`) rather than running quantized matmuls:
one decoder then serves every format, at the cost of memory (a Q4_1 file grows ~4x in bf16),
which is fine for the small models this engine runs on CPU. The exception is weight_dtype int4
(`keep_int4`): Q4_0 / Q4_1 / Q4_K matrices become Int4Weight (kernels/int4.py) from their bytes,
so the file's codes are the ones multiplied.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from inferlab.engine.generation_config import read_gguf_sampling
from inferlab.kernels.int4 import GGUF_INT4_TYPES, Int4Weight, from_gguf
from inferlab.models.loaded import LoadedModel, check_weights
from inferlab.models.model_config import gguf_field, model_config_from_gguf

SUPPORTED_TYPES = (
    QType.F32,
    QType.F16,
    QType.BF16,
    QType.Q8_0,
    QType.Q4_0,
    QType.Q4_1,
    QType.Q4_K,
    QType.Q5_K,
    QType.Q6_K,
)

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Tensors that are not weights to us: rope_freqs is folded into ModelConfig.rope_scaling.
_SKIPPED = {"rope_freqs.weight"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


class _ArrayGGUFReader(gguf.GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map, that stops at the end of the data.

    Speed: np.memmap runs Python code on every slice; the reader slices once per token and
    merge of the vocabulary (~150k times for a 49k vocabulary), which makes opening a small
    file take seconds. A plain view of the same mapping (no copy) opens it ~3x faster.

    Safety: the stock reader silently returns short slices past the end of the file, so a
    truncated file fails later with an obscure numpy error, and a corrupt array length can
    make it loop for a very long time. `_get` refuses to read past the end instead.
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._array

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._array = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        if offset + np.dtype(dtype).itemsize * int(count) > len(self._array):
            raise ValueError(f"the file ends at byte {len(self._array)}, inside data that starts at byte {offset}")
        return super()._get(offset, dtype, count, override_order)


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Open a GGUF file; a missing file is FileNotFoundError, anything unreadable a ValueError naming it."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a directory, not a GGUF file")
    if not path.is_file():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (the first bytes are {magic!r}, not b'GGUF')")
    try:
        return _ArrayGGUFReader(path)
    except Exception as e:  # the reader raises whatever numpy raises on a truncated buffer
        raise ValueError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for tensors we skip; ValueError for unknown ones."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    if gguf_name in _SKIPPED:
        return None
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file")


def dequantize_tensor(tensor: gguf.ReaderTensor) -> torch.Tensor:
    """One GGUF tensor as float32 in torch's dimension order (GGUF lists dims innermost first)."""
    if tensor.tensor_type not in SUPPORTED_TYPES:
        raise ValueError(
            f"tensor {tensor.name!r} has type {tensor.tensor_type.name}, which is not supported "
            f"(supported: {', '.join(t.name for t in SUPPORTED_TYPES)})"
        )
    arr = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    arr = arr.reshape(tuple(int(d) for d in reversed(tensor.shape)))
    if not arr.flags.writeable:  # F32 comes back as a view of the read-only memory map
        arr = np.array(arr)
    return torch.from_numpy(arr)


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order for `llama` GGUFs.

    Hugging Face keeps each head's rows as [first half | second half] (rotate_half RoPE);
    llama.cpp's converter interleaves them as pairs (row 2j+a <- row a*d/2+j) for its
    interleaved RoPE. Reading the rows as (head, pair j, a) and swapping to (head, a, j)
    restores HF's order. Works for weights and biases alike (only dim 0 moves).
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_tensor(tensor: gguf.ReaderTensor, keep_int4: bool) -> torch.Tensor | Int4Weight:
    """A Q4 matrix as Int4Weight when `keep_int4`, anything else dequantized (float32)."""
    if keep_int4 and tensor.tensor_type in GGUF_INT4_TYPES and len(tensor.shape) == 2:
        cols, rows = (int(d) for d in tensor.shape)
        return from_gguf(tensor.data, tensor.tensor_type, rows, cols)
    return dequantize_tensor(tensor)


def load_gguf(path: str | Path, dtype: torch.dtype, name: str = "", keep_int4: bool = False) -> LoadedModel:
    """Read a GGUF model into HF-named tensors of `dtype`, checked against its config; with
    `keep_int4`, Q4 matrices stay 4-bit (Int4Weight) for weight_dtype int4."""
    path = Path(path)
    reader = open_gguf(path)
    try:
        config = model_config_from_gguf(reader, name=name)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    permuted = gguf_field(reader, "general.architecture") == "llama"
    heads = {"self_attn.q_proj": config.num_heads, "self_attn.k_proj": config.num_kv_heads}
    weights: dict[str, torch.Tensor | Int4Weight] = {}
    for tensor in reader.tensors:
        try:
            name_hf = hf_name(tensor.name)
            if name_hf is None:
                continue
            value = read_tensor(tensor, keep_int4)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        if permuted:
            module = name_hf.split(".", 3)[-1].rsplit(".", 1)[0]  # e.g. "self_attn.q_proj"
            if module in heads and isinstance(value, Int4Weight):  # the same row order, by index
                value = value.index_select(unpermute_qk(torch.arange(value.shape[0]), heads[module]))
            elif module in heads:
                value = unpermute_qk(value, heads[module])
        weights[name_hf] = value if isinstance(value, Int4Weight) else value.to(dtype)
    check_weights(config, weights, path)  # type: ignore[arg-type]
    return LoadedModel(config=config, weights=weights, source_path=path, format="gguf",  # type: ignore[arg-type]
                       sampling_defaults=read_gguf_sampling(reader))
