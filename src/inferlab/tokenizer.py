"""Text <-> token ids at the request boundary: the model's own tokenizer and chat template
(the incremental detokenizer that streams outputs lives in `engine/detokenizer.py`).

Two sources, one class:
- a Hugging Face model folder (`tokenizer.json` + `tokenizer_config.json`), loaded as is;
- a GGUF file, whose metadata carries the vocabulary, merges, token types, special ids and
  chat template. transformers' GGUF support turns that into a fast tokenizer; it takes seconds,
  so the result is saved once per GGUF file (keyed by path, size and mtime) and reused.

Encoding and decoding go straight to the Rust `tokenizers.Tokenizer`: the transformers wrapper
adds Python overhead per call and, on decode, "clean-up" of spaces that the model never wrote.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from inferlab import cache_paths

logger = logging.getLogger(__name__)


# Bump when the converted form changes, so old cache entries are not reused.
_CACHE_FORMAT = 1
_CACHE_MARKER = "inferlab-gguf-source.json"

# llama.cpp falls back to ChatML when a model has no template; so do we (see Tokenizer.render_chat).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Tokens that end a turn in the common chat formats. llama.cpp treats each of these as
# end-of-generation whenever the vocabulary has it as a special token, whatever the
# tokenizer's single `eos_token` says; we do the same so that e.g. SmolLM2 also stops on
# `<|endoftext|>` and Llama 3 on `<|eot_id|>` as well as `<|end_of_text|>`.
_END_OF_TURN_TOKENS = frozenset(
    {
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<EOT>",
        "_<EOT>",
        "<｜end▁of▁sentence｜>",
        "<end_of_utterance>",
    }
)

# llama.cpp's pre-tokenizers that split every digit on its own before the GPT-2 regex
# (StarCoder lineage, SmolLM among them). transformers' GGUF conversion uses the plain GPT-2
# regex for these; we restore the digit split so numbers tokenize as llama.cpp does.
_INDIVIDUAL_DIGIT_PRE = frozenset({"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva"})

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback pieces


def _gpt2_byte_decoder() -> dict[str, int]:
    """Byte-level BPE spells each byte as one printable character; this maps it back.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to U+0100...
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shift)
            shift += 1
    return {c: b for b, c in chars.items()}


_BYTE_DECODER = _gpt2_byte_decoder()


def _show_bytes(data: bytes) -> str:
    """UTF-8 text, with any bytes that are not (yet) a whole character shown as `<0xHH>`."""
    out: list[str] = []
    while data:
        try:
            out.append(data.decode("utf-8"))
            break
        except UnicodeDecodeError as e:
            out.append(data[: e.start].decode("utf-8"))
            out.append("".join(f"<0x{b:02X}>" for b in data[e.start : e.end]))
            data = data[e.end :]
    return "".join(out)


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


class Tokenizer:
    """A model's tokenizer: encode, decode, token pieces, chat template, end-of-turn ids.

    Build it with `from_path`, `from_gguf` or `from_pretrained_dir`. It wraps a transformers
    fast tokenizer (for loading and chat templates) and calls its Rust backend directly for
    encode/decode.
    """

    def __init__(self, hf_tokenizer: Any, *, extra_eos_token_ids: Iterable[int] = (), name: str = "") -> None:
        self._hf = hf_tokenizer
        self._backend = hf_tokenizer.backend_tokenizer  # tokenizers.Tokenizer
        self.name = name or str(getattr(hf_tokenizer, "name_or_path", ""))
        added = self._backend.get_added_tokens_decoder()
        self._added_ids = frozenset(added)
        self._byte_level = _decoder_is_byte_level(self._backend)
        self._eos_token_ids = self._find_eos_ids(added, extra_eos_token_ids)
        # What the post-processor does to an empty text tells whether encode() adds BOS/EOS;
        # it is the truth for both sources (a GGUF's add_bos flag, a tokenizer.json template).
        probe = self._backend.encode("", add_special_tokens=True).ids
        self.add_bos_token = bool(probe) and probe[0] == self.bos_token_id

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_path(cls, path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Tokenizer:
        """A GGUF file or a Hugging Face model folder, told apart by content (not by name)."""
        p = Path(path).expanduser()
        if p.is_dir():
            return cls.from_pretrained_dir(p)
        if not p.exists():
            raise FileNotFoundError(f"no such model file or folder: {p}")
        if not _is_gguf(p):
            raise ValueError(f"{p} is neither a GGUF file nor a model folder")
        return cls.from_gguf(p, cache_dir=cache_dir)

    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """A Hugging Face folder: tokenizer.json as serialized, tokenizer_config.json for the
        special tokens, BOS/EOS flags and chat template, generation_config.json for extra EOS ids."""
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"no such model folder: {folder}")
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        try:
            if (folder / "tokenizer.json").is_file():
                # The generic class loads tokenizer.json verbatim; model-specific classes may
                # rebuild the pipeline from vocab and merges, which is slower and can differ.
                hf = PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
            else:  # e.g. only a SentencePiece tokenizer.model: let transformers convert it
                hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"cannot load a tokenizer from {folder}: {e}") from e
        return cls(hf, extra_eos_token_ids=_generation_config_eos_ids(folder), name=str(folder))

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Tokenizer:
        """The tokenizer a GGUF file describes (vocabulary, merges, token types, special ids,
        add_bos flag, chat template), converted once and cached under `cache_dir` (default:
        tokenizers/ under the cache root, see cache_paths.py).

        The cache entry is keyed by the file's resolved path, size and mtime and by the
        transformers version, so a replaced file or a new converter gives a new entry.
        """
        gguf_path = Path(path).expanduser().resolve()
        if not gguf_path.is_file():
            raise FileNotFoundError(f"no such GGUF file: {gguf_path}")
        cache_root = Path(cache_dir).expanduser() if cache_dir is not None else cache_paths.cache_root() / "tokenizers"
        entry = cache_root / _gguf_cache_key(gguf_path)
        from transformers import PreTrainedTokenizerFast

        if (entry / _CACHE_MARKER).is_file():
            try:
                hf = PreTrainedTokenizerFast.from_pretrained(str(entry), local_files_only=True)
                return cls(hf, name=str(gguf_path))
            except (OSError, ValueError) as e:  # a damaged entry: convert again
                logger.warning("ignoring damaged tokenizer cache %s: %s", entry, e)
        hf = _convert_gguf_tokenizer(gguf_path)
        _save_to_cache(hf, entry, gguf_path)
        return cls(hf, name=str(gguf_path))

    # ---- encode / decode ------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. `add_special_tokens` adds BOS (and EOS) only where the model's
        tokenizer says so (SmolLM2: neither). Special-token text such as `<|im_start|>` is
        matched as that token, as llama.cpp does by default."""
        if not isinstance(text, str):
            raise ValueError(f"the text to tokenize must be a string, not {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary's spelling of each id (`'Ġis'` in byte-level BPE)."""
        return [self._token(i) for i in ids]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this one token stands for, with the leading space it carries."""
        token = self._token(token_id)
        if token_id in self._added_ids:
            return token.encode("utf-8")
        if self._byte_level:
            try:
                return bytes(_BYTE_DECODER[c] for c in token)
            except KeyError:  # not spelled in the byte alphabet: take it literally
                return token.encode("utf-8")
        m = _BYTE_TOKEN.fullmatch(token)
        if m:
            return bytes([int(m.group(1), 16)])
        return token.replace("\u2581", " ").encode("utf-8")

    def id_to_piece(self, token_id: int) -> str:
        """The text of one token as llama-tokenize prints it: `' is'` with its leading space,
        special tokens as written; bytes that are only part of a character as `<0xE2>`."""
        return _show_bytes(self.token_bytes(token_id))

    def _token(self, token_id: int) -> str:
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is out of range (vocabulary size {self.vocab_size})")
        return token

    # ---- chat -----------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        template = getattr(self._hf, "chat_template", None)
        return template if isinstance(template, str) and template else None

    def set_chat_template(self, template: str) -> None:
        """Use `template` (Jinja) instead of the model's own (--chat-template)."""
        self._hf.chat_template = template

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text the model's own Jinja chat template makes of `messages`.

        A model without a template gets ChatML, as llama.cpp does, rather than an error:
        many small base models were tuned on it, and a refusal would make them unusable for
        chat. `template_kwargs` reach the template (e.g. `enable_thinking` for Qwen3).
        """
        checked = _check_messages(messages)
        try:
            text = self._hf.apply_chat_template(
                checked,
                chat_template=self.chat_template or CHATML_TEMPLATE,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **(template_kwargs or {}),
            )
        except Exception as e:  # jinja2 errors, the template's raise_exception(...)
            if type(e).__module__.startswith("jinja2"):
                raise ValueError(f"the chat template rejected these messages: {e}") from e
            raise
        if not isinstance(text, str):  # some versions wrap a single rendering in a list
            text = text[0]
        return text

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat. No BOS is added on top: a template that wants one
        writes it itself (as transformers and vLLM do), so it is never doubled."""
        return self.encode(self.render_chat(messages, add_generation_prompt, template_kwargs), add_special_tokens=False)

    # ---- facts ------------------------------------------------------------------------------

    @property
    def bos_token_id(self) -> int | None:
        return self._hf.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._hf.eos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: EOS first, then the end-of-turn tokens."""
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        """Ids in use, added tokens included (the model's embedding table may be larger)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def hf(self) -> Any:
        """The transformers fast tokenizer (what the grammar engine reads the vocabulary from)."""
        return self._hf

    @property
    def backend(self) -> Any:
        """The Rust `tokenizers.Tokenizer` (for the incremental detokenizer's hot path)."""
        return self._backend

    def info(self) -> dict[str, Any]:
        """The configuration as vLLM's /tokenizer_info gives it: tokenizer_config.json as
        transformers loaded it (file paths left out, added tokens as plain dicts), the special
        tokens as text, the class name and the chat template."""
        config = {k: v for k, v in (getattr(self._hf, "init_kwargs", None) or {}).items()
                  if k not in _LOADER_KWARGS}  # fmt: skip
        config = _json_safe(config)
        special = getattr(self._hf, "special_tokens_map", None) or {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = special.get(key)
            config[key] = value if isinstance(value, str) else _json_safe(value)
        config["tokenizer_class"] = type(self._hf).__name__
        config["chat_template"] = self.chat_template
        return config

    def _find_eos_ids(self, added: dict[int, Any], extra: Iterable[int]) -> tuple[int, ...]:
        ids: list[int] = []
        if self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        ids.extend(extra)
        ids.extend(i for i, t in sorted(added.items()) if t.special and t.content in _END_OF_TURN_TOKENS)
        return tuple(dict.fromkeys(ids))  # unique, in order

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size})"


# init_kwargs that say where and how the files were loaded, not what the tokenizer is.
_LOADER_KWARGS = frozenset(
    {"vocab_file", "merges_file", "tokenizer_file", "name_or_path", "is_local", "local_files_only", "cache_dir", "_commit_hash"}
)


def _json_safe(value: Any) -> Any:
    """A tokenizer config value as JSON: AddedToken as its fields, other objects as text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if hasattr(value, "content") and hasattr(value, "special"):  # tokenizers.AddedToken
        return {"content": value.content, "special": value.special}
    return str(value)


def _decoder_is_byte_level(backend: Any) -> bool:
    decoder = backend.decoder
    if decoder is None:
        return False
    state = json.loads(decoder.__getstate__())
    parts = state.get("decoders", [state]) if state.get("type") == "Sequence" else [state]
    return any(p.get("type") == "ByteLevel" for p in parts)


def _generation_config_eos_ids(folder: Path) -> list[int]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError):
        return []
    if isinstance(eos, int):
        return [eos]
    return [i for i in eos if isinstance(i, int)] if isinstance(eos, list) else []


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages as chat templates expect them, or a ValueError that says what is wrong.

    OpenAI-style content parts (`[{"type": "text", "text": ...}]`) are joined into one
    string, since most templates only handle string content.
    """
    if not isinstance(messages, list):
        raise ValueError(
            f"messages must be a list of {{'role': ..., 'content': ...}} objects, not {type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages must not be empty")
    checked: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', not {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}]: 'role' must be a non-empty string, got {role!r}")
        if "content" not in m:
            raise ValueError(f"messages[{i}] has no 'content'")
        content = m["content"]
        if content is None and role == "assistant":  # an assistant turn that only called tools
            content = ""
        elif isinstance(content, list):
            content = _join_text_parts(content, i)
        elif not isinstance(content, str):
            raise ValueError(
                f"messages[{i}]: 'content' must be a string or a list of text parts, got {type(content).__name__}"
            )
        checked.append({**m, "content": content})
    return checked


def _join_text_parts(parts: list[Any], i: int) -> str:
    texts = []
    for part in parts:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise ValueError(f"messages[{i}]: only text content parts ({{'type': 'text', 'text': ...}}) are supported")
        texts.append(part["text"])
    return "\n".join(texts)


# ---- GGUF conversion and its cache -------------------------------------------------------


def _gguf_cache_key(gguf_path: Path) -> str:
    import transformers

    st = gguf_path.stat()
    ident = f"{gguf_path}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|{_CACHE_FORMAT}"
    return f"{gguf_path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def _convert_gguf_tokenizer(gguf_path: Path) -> Any:
    """transformers' GGUF tokenizer conversion, plus the fixes we know it needs."""
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"cannot build a tokenizer from the GGUF file {gguf_path}: {e}") from e
    meta = _read_gguf_tokenizer_meta(gguf_path)
    if not getattr(hf, "chat_template", None) and meta.get("chat_template"):
        hf.chat_template = meta["chat_template"]
    if meta.get("pre") in _INDIVIDUAL_DIGIT_PRE and _decoder_is_byte_level(hf.backend_tokenizer):
        from tokenizers import pre_tokenizers

        hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return hf


def _read_gguf_tokenizer_meta(gguf_path: Path) -> dict[str, Any]:
    """`tokenizer.ggml.pre` and `tokenizer.chat_template` from the GGUF header.

    transformers' header reader skips the big token arrays (milliseconds); gguf's
    GGUFReader parses them all (seconds), so it is only the fallback.
    """
    keys = {"pre": "tokenizer.ggml.pre", "chat_template": "tokenizer.chat_template"}
    try:
        from transformers.integrations.gguf.reader import read_gguf_metadata

        metadata, _ = read_gguf_metadata(str(gguf_path))
        return {name: metadata.get(key) for name, key in keys.items()}
    except ImportError:
        pass
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    out: dict[str, Any] = {}
    for name, key in keys.items():
        field = reader.fields.get(key)
        out[name] = field.contents() if field is not None else None
    return out


def _save_to_cache(hf: Any, entry: Path, gguf_path: Path) -> None:
    """Write the converted tokenizer to a temporary folder, then rename it into place, so
    that concurrent processes never see half an entry. A read-only cache only costs time."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
        try:
            hf.save_pretrained(str(tmp))
            st = gguf_path.stat()
            source = {"gguf": str(gguf_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
            (tmp / _CACHE_MARKER).write_text(json.dumps(source, indent=1), encoding="utf-8")
            if entry.exists():  # a damaged entry, or another process was faster
                shutil.rmtree(entry, ignore_errors=True)
            os.replace(tmp, entry)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        logger.warning("cannot cache the converted tokenizer in %s: %s", entry, e)
