"""The tokenizer the benchmark counts with: a local one (HF directory, tokenizer.json or GGUF
file), else the server's own `/tokenize` + `/detokenize`, else the default model's.

The bench needs only three things from it: encode plain text (no special tokens), decode
ids, and how many special tokens the server adds to a plain prompt (BOS), which random
prompts leave room for so that the server counts exactly --input-len (as vLLM does).
No torch: `tokenizers` for local files, `inferlab.tokenizer` for GGUF vocabularies.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import httpx


class TextTokenizer(Protocol):
    """What the bench needs from a tokenizer."""

    name: str  # where it came from, for the report

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def num_special_tokens(self) -> int:
        """Tokens added around a plain prompt (BOS/EOS) when the server encodes it."""
        ...


class LocalTokenizer:
    """A tokenizer in this process behind the bench's interface: Hugging Face `tokenizers`' from a
    tokenizer.json (fast, no transformers import), or `inferlab.tokenizer.Tokenizer` (GGUF
    vocabularies, HF directories), whose encode gives the ids themselves rather than an Encoding."""

    def __init__(self, tok: Any, name: str) -> None:
        self._tok = tok
        self.name = name

    @classmethod
    def from_file(cls, path: str | Path) -> LocalTokenizer:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)), str(path))

    def _ids(self, text: str, special: bool) -> list[int]:
        out = self._tok.encode(text, add_special_tokens=special)
        return list(getattr(out, "ids", out))

    def encode(self, text: str) -> list[int]:
        return self._ids(text, False)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def num_special_tokens(self) -> int:
        return len(self._ids("a", True)) - len(self._ids("a", False))


class RemoteTokenizer:
    """The server's own tokenizer over HTTP: vLLM's and ours (`prompt` → `tokens`, `tokens` → `prompt`)
    and llama.cpp's (`content` → `tokens`, `tokens` → `content`) shapes both work."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None, timeout_s: float = 30.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s, verify=base_url.startswith("https://"))
        self._model = model
        self.name = f"{base_url}/tokenize"
        self._special: int | None = None

    def _tokenize(self, text: str, add_special: bool) -> list[int]:
        body = {"prompt": text, "content": text, "add_special_tokens": add_special, "add_special": add_special}
        if self._model:
            body["model"] = self._model
        r = self._http.post("/tokenize", json=body)
        r.raise_for_status()
        tokens = r.json()["tokens"]
        # llama.cpp may return [{"id": .., "piece": ..}] when asked for pieces; take the ids.
        return [t["id"] if isinstance(t, dict) else int(t) for t in tokens]

    def encode(self, text: str) -> list[int]:
        return self._tokenize(text, add_special=False)

    def decode(self, ids: Sequence[int]) -> str:
        body: dict[str, Any] = {"tokens": list(map(int, ids))}
        if self._model:
            body["model"] = self._model
        r = self._http.post("/detokenize", json=body)
        r.raise_for_status()
        out = r.json()
        return out["prompt"] if "prompt" in out else out["content"]

    def num_special_tokens(self) -> int:
        if self._special is None:
            self._special = len(self._tokenize("a", True)) - len(self._tokenize("a", False))
        return self._special

    def works(self) -> bool:
        """Whether the server has a usable /tokenize + /detokenize pair."""
        try:
            return bool(self.encode("hello world")) and isinstance(self.decode(self.encode("hello")), str)
        except (httpx.HTTPError, KeyError, ValueError, TypeError, json.JSONDecodeError):
            return False

    def close(self) -> None:
        self._http.close()


def load_tokenizer(path: str | Path) -> TextTokenizer:
    """A local tokenizer: a GGUF file, a tokenizer.json, or a directory holding one."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"--tokenizer {path}: no such file or directory")
    try:  # the project's tokenizer reads GGUF vocabularies and HF directories alike
        from inferlab.tokenizer import Tokenizer  # type: ignore[import-not-found]
    except ImportError:
        Tokenizer = None
    if p.is_file() and p.suffix == ".gguf":
        if Tokenizer is None:
            raise ValueError("reading a GGUF file's tokenizer needs inferlab.tokenizer, which is not installed")
        return LocalTokenizer(Tokenizer.from_gguf(str(p)), str(p))
    if p.is_file() and p.name.endswith(".json"):
        return LocalTokenizer.from_file(p)
    if p.is_dir() and Tokenizer is not None:  # special tokens and BOS flags from tokenizer_config.json too
        return LocalTokenizer(Tokenizer.from_pretrained_dir(str(p)), str(p))
    if p.is_dir() and (p / "tokenizer.json").is_file():
        return LocalTokenizer.from_file(p / "tokenizer.json")
    raise ValueError(f"--tokenizer {path}: expected a .gguf file, a tokenizer.json, or a model directory")


def default_model_tokenizer() -> TextTokenizer:
    """The tokenizer of inferlab's default model (its GGUF file, resolved by the model registry)."""
    try:
        from inferlab.models.registry import resolve_model  # type: ignore[import-not-found]
    except ImportError:
        raise ValueError(
            "no tokenizer: pass --tokenizer PATH (the server has no /tokenize and the default model is unavailable)"
        ) from None
    resolved = resolve_model(None)
    path = getattr(resolved, "path", resolved)
    return load_tokenizer(path)


class TokenizerSource:
    """Finds a tokenizer once, on first need: --tokenizer, else the server's /tokenize, else the default model.

    Lazy, because a JSONL run whose server reports usage never needs one.
    """

    def __init__(self, path: str | None, base_url: str, model: str | None, api_key: str | None) -> None:
        self._path, self._base_url, self._model, self._api_key = path, base_url, model, api_key
        self._tok: TextTokenizer | None = None
        self._remote: RemoteTokenizer | None = None

    def get(self) -> TextTokenizer:
        if self._tok is None:
            if self._path:
                self._tok = load_tokenizer(self._path)
            else:
                remote = RemoteTokenizer(self._base_url, self._model, self._api_key)
                if remote.works():
                    self._tok, self._remote = remote, remote
                else:
                    remote.close()
                    self._tok = default_model_tokenizer()
        return self._tok

    @property
    def loaded(self) -> TextTokenizer | None:
        return self._tok

    def close(self) -> None:
        if self._remote is not None:
            self._remote.close()
