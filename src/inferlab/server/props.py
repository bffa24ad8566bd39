"""`GET /props` and `GET /version`: what a client may ask the server about itself.

/props keeps llama-server's field names where they mean the same thing here
(`default_generation_settings.n_ctx` and `.params`, `total_slots`, `model_path`, `model_alias`,
`chat_template`, `bos_token`, `eos_token`, `modalities`, `build_info`), so tools written for
llama-server read it unchanged, and adds what only this engine decides: the resolved precision
and kernel path (from `LLMEngine.info()`) and where each sampling default came from.
"""

from __future__ import annotations

from typing import Any

from inferlab import __version__
from inferlab.server.serving import sampling_defaults


def version() -> dict[str, str]:
    return {"version": __version__}


def props(engine: Any, served_model_names: list[str]) -> dict[str, Any]:
    """The /props body for a loaded engine (a real LLMEngine, or any object with its attributes)."""
    info: dict[str, Any] = engine.info() if hasattr(engine, "info") else {}
    defaults = sampling_defaults(engine)
    n_ctx = int(engine.max_model_len)
    values = defaults.values()
    params = {
        "temperature": values["temperature"],
        "top_k": values["top_k"],
        "top_p": values["top_p"],
        "min_p": values["min_p"],
        "repeat_penalty": values["repetition_penalty"],  # llama.cpp's name
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "n_predict": -1,  # no max_tokens: up to the context window
    }
    tok = getattr(engine, "tokenizer", None)
    tok_info: dict[str, Any] = dict(tok.info()) if tok is not None and hasattr(tok, "info") else {}
    model_path = info.get("model_path")
    return {
        "default_generation_settings": {"n_ctx": n_ctx, "params": params, "model": model_path},
        "total_slots": int(engine.max_num_seqs),
        "model_path": model_path,
        "model_alias": served_model_names[0] if served_model_names else engine.model_name,
        "chat_template": tok_info.get("chat_template"),
        "bos_token": tok_info.get("bos_token"),
        "eos_token": tok_info.get("eos_token"),
        "modalities": {"vision": False, "audio": False},
        "build_info": f"inferlab {__version__}",
        # inferlab's own
        "model": engine.model_name,
        "n_ctx": n_ctx,
        "sampling_defaults": defaults.as_dict(),
        "precision": info.get("precision"),
        "kernels": info.get("kernels"),
        "device": info.get("device"),
    }
