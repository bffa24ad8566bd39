"""Factories for tiny models in real formats, shared by the tests of the whole project.

    make_tiny_hf_model(dir, arch)       -> a Hugging Face directory saved by transformers itself
    make_tiny_gguf(path, arch, qtype)   -> a real GGUF written with gguf.GGUFWriter, laid out as
                                           llama.cpp's converter does (incl. its q/k permutation)
    load_reference_model(dir)           -> transformers' own model, the ground truth for the decoder

Weights are random but seeded, so make_tiny_hf_model(d, arch, seed=s) and
make_tiny_gguf(p, arch, seed=s) hold the same model. Unlike transformers' init (std 0.02,
norms exactly 1, biases 0), every tensor gets visible values: a decoder that forgot a norm
weight or a bias, or mixed up q and k, then fails a comparison instead of passing it by luck.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from inferlab.config import ModelConfig
from inferlab.models.gguf_loader import GLOBAL_NAMES, LAYER_NAMES
from inferlab.models.model_config import llama3_rope_factors, model_config_from_hf
from inferlab.tokenizer import CHATML_TEMPLATE  # the tiny models speak ChatML, llama.cpp's fallback

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2, as in SmolLM2
TINY_VOCAB_SIZE = 384

# A few sentences with spaces, punctuation, digits and non-ASCII, so the BPE learns merges of
# every kind a detokenizer must handle (multi-byte UTF-8 pieces, leading-space tokens).
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "A language model predicts the next token from the tokens before it.",
    "The scheduler batches requests; the model runner computes one step for all of them.",
    "Paged attention stores keys and values in fixed-size blocks of memory.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2048 3.14159",
    "Café, naïve, résumé, Straße, 東京, こんにちは, 🙂 and 🚀 are not ASCII.",
    "user: What is the capital of France?\nassistant: The capital of France is Paris.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time there was a little model that could write stories.",
]

_HF_ARCHS = {
    # arch -> (transformers config class name, per-arch defaults over the tiny shape)
    "llama": ("LlamaConfig", {"tie_word_embeddings": True, "rope_theta": 100000.0}),  # SmolLM2-like
    "mistral": ("MistralConfig", {"tie_word_embeddings": False, "sliding_window": None}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True, "rope_theta": 1000000.0}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True, "head_dim": 32, "rope_theta": 1000000.0}),
    "llama3": (
        "LlamaConfig",
        {
            "tie_word_embeddings": False,
            "rope_theta": 10000.0,
            # original context 64 puts two of the eight frequencies in the smoothed band.
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
}
TINY_ARCHS = tuple(_HF_ARCHS)

_TINY_SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.1,  # the std of every random weight (see the module docstring)
}


@functools.lru_cache(maxsize=1)
def _tiny_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok.to_str()


def save_tiny_tokenizer(directory: str | Path) -> Path:
    """tokenizer.json + tokenizer_config.json (ChatML template, eos <|im_end|>) + special_tokens_map.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(_tiny_tokenizer_json(), encoding="utf-8")
    specials = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": _TINY_SHAPE["max_position_embeddings"],
        "chat_template": CHATML_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    (directory / "special_tokens_map.json").write_text(json.dumps(specials, indent=2), encoding="utf-8")
    return directory


def tiny_hf_config(arch: str = "llama", **overrides: Any) -> Any:
    """A transformers config object of tiny shape for `arch` (one of TINY_ARCHS)."""
    import transformers

    if arch not in _HF_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r} (choose from {', '.join(TINY_ARCHS)})")
    class_name, arch_defaults = _HF_ARCHS[arch]
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    kwargs = {"vocab_size": TINY_VOCAB_SIZE, **_TINY_SHAPE, **ids, **arch_defaults, **overrides}
    return getattr(transformers, class_name)(**kwargs)


def tiny_model_config(arch: str = "llama", **overrides: Any) -> ModelConfig:
    """Our ModelConfig of the tiny model `make_tiny_hf_model(dir, arch, **overrides)` writes."""
    config = tiny_hf_config(arch, **overrides)
    return model_config_from_hf({**config.to_dict(), "architectures": config.architectures or []}, name=f"tiny-{arch}")


def _randomize(model: torch.nn.Module, std: float, generator: torch.Generator) -> None:
    """Give every parameter visible random values: matrices/biases N(0, std), norm weights 1 + N(0, 0.1)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else std * noise)


def make_tiny_hf_model(directory: str | Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random `arch` model (config, safetensors, generation config, tokenizer) into `directory`.

    `overrides` are transformers config fields (e.g. tie_word_embeddings=False, num_hidden_layers=3).
    """
    import transformers

    directory = Path(directory)
    config = tiny_hf_config(arch, **overrides)
    config.architectures = [config.__class__.__name__.replace("Config", "ForCausalLM")]
    with torch.device("cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, config.initializer_range, torch.Generator().manual_seed(seed))
    model.save_pretrained(directory)
    save_tiny_tokenizer(directory)
    return directory


def load_reference_model(directory: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' own model for a directory (eval mode): the reference our decoder must match."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype)
    return model.eval()


# --- GGUF -----------------------------------------------------------------------------------

_HF_TO_GGUF_LAYER = {hf: g for g, hf in LAYER_NAMES.items()}
_HF_TO_GGUF_GLOBAL = {hf: g for g, hf in GLOBAL_NAMES.items()}
_GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Types gguf.quants can write; the K-quants (Q4_K, Q5_K, Q6_K) it can only read.
WRITABLE_QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def permute_qk_for_gguf(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter step for `llama` files: per head, rows [first half | second half]
    become interleaved pairs (new row 2j+a <- old row a*d/2+j). The loader must undo it."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensor_name(hf: str) -> str:
    if hf in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)  # model.layers.{i}.{rest}
    return f"blk.{layer}.{_HF_TO_GGUF_LAYER[rest]}"


def _write_tokenizer_metadata(writer: gguf.GGUFWriter) -> None:
    data = json.loads(_tiny_tokenizer_json())
    vocab: dict[str, int] = dict(data["model"]["vocab"])
    vocab.update({t["content"]: t["id"] for t in data["added_tokens"]})
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(SPECIAL_TOKENS.index("<|im_start|>"))
    writer.add_eos_token_id(SPECIAL_TOKENS.index("<|im_end|>"))
    writer.add_pad_token_id(SPECIAL_TOKENS.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)


def _encode(array: np.ndarray, qtype: gguf.GGMLQuantizationType) -> tuple[np.ndarray, Any]:
    """(data, raw_dtype) for GGUFWriter.add_tensor: 1-D tensors stay F32, as llama.cpp keeps them."""
    if array.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
        return array.astype(np.float32), None
    if qtype == gguf.GGMLQuantizationType.F16:
        return array.astype(np.float16), None
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def write_gguf_from_hf(
    path: str | Path, hf_dir: str | Path, qtype: str = "F32", gguf_arch: str | None = None
) -> Path:
    """Convert a (tiny) HF directory to GGUF the way llama.cpp's converter lays it out.

    `gguf_arch` overrides general.architecture (e.g. "gpt2", to test the refusal).
    """
    from safetensors.numpy import load_file

    if qtype not in WRITABLE_QTYPES:
        raise ValueError(f"cannot write {qtype} (gguf.quants quantizes only {', '.join(WRITABLE_QTYPES)})")
    qt = gguf.GGMLQuantizationType[qtype]
    path, hf_dir = Path(path), Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    arch = gguf_arch or _GGUF_ARCH[cfg["model_type"]]
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    rope = cfg.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(hf_dir.name)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if head_dim != hidden // heads:  # llama.cpp writes it only when it is not implied
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    _write_tokenizer_metadata(writer)

    tensors = load_file(str(hf_dir / "model.safetensors"))
    if cfg.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    if rope.get("rope_type") == "llama3":  # llama.cpp stores llama3 scaling as per-frequency divisors
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, theta, rope))
    for hf, array in tensors.items():
        if arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            array = permute_qk_for_gguf(array, heads if ".q_proj." in hf else kv_heads)
        data, raw_dtype = _encode(array, qt)
        writer.add_tensor(_gguf_tensor_name(hf), data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def make_tiny_gguf(
    path: str | Path,
    arch: str = "llama",
    qtype: str = "F32",
    seed: int = 0,
    hf_dir: str | Path | None = None,
    gguf_arch: str | None = None,
    **overrides: Any,
) -> Path:
    """A tiny GGUF holding the same model as make_tiny_hf_model(dir, arch, seed, **overrides).

    Pass `hf_dir` to convert an existing tiny HF directory instead (then arch/overrides are unused).
    """
    if hf_dir is not None:
        return write_gguf_from_hf(path, hf_dir, qtype, gguf_arch)
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_hf_model(Path(tmp) / f"tiny-{arch}", arch, seed=seed, **overrides)
        return write_gguf_from_hf(path, Path(tmp) / f"tiny-{arch}", qtype, gguf_arch)


def default_gguf_path(cache_dir: str | Path | None = None) -> Path:
    """The real default model (SmolLM2-135M-Instruct Q4_1), downloaded once into the cache."""
    from inferlab.models.registry import resolve_model

    return resolve_model(None, cache_dir=cache_dir).path
