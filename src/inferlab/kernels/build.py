"""Compile and load our C++ CPU kernels on first use; say why not when they cannot be.

Why compiled at run time rather than at install: the package installs from a pyproject without
a build step that needs torch (a build-isolated install would fetch a second torch), and the
kernels are compiled for the CPU that runs them. The sources are `csrc/*.cpp`; each file
registers its operators with `TORCH_LIBRARY_FRAGMENT(inferlab, m)`, so after `load()` they are
`torch.ops.inferlab.<name>` and go through torch's dispatcher like any operator (and run on
torch's own OpenMP runtime, through `at::parallel_for` or, in decoder_step.cpp, `omp parallel`:
torch's libgomp is the one already loaded; a second OpenMP runtime would fight it for the cores).

The build (~35 s on 2 cores, once) lands in ~/.cache/inferlab/kernels/<hash of sources, flags,
torch version> ($INFERLAB_CACHE/kernels/... when set, see cache_paths.py), so a changed source or torch rebuilds and a clean machine builds once.
`INFERLAB_KERNELS=0` turns them off (everything falls back to plain torch operators); so does a
CPU without AVX2/FMA/F16C or a missing compiler, with the reason kept in `unavailable_reason()`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

from inferlab.cache_paths import cache_root

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-std=c++17"]
_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "reason": str


def _cache_dir(sources: list[Path]) -> Path:
    h = hashlib.sha256()
    for p in sources:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(" ".join(CFLAGS).encode())
    h.update(torch.__version__.encode())
    return cache_root() / "kernels" / h.hexdigest()[:16]


def _why_not() -> str | None:
    if os.environ.get("INFERLAB_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return "turned off by INFERLAB_KERNELS=0"
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in ("AVX2", "AVX512"):
        return f"this CPU's vector capability is {cap!r}; the kernels need AVX2 with FMA and F16C"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler on PATH (c++ or $CXX)"
    if not list(CSRC.glob("*.cpp")):
        return f"no kernel sources in {CSRC}"
    return None


def load() -> bool:
    """Build (once per source version) and load the kernels; True when torch.ops.inferlab.* exist."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        reason = _why_not()
        if reason is None:
            sources = sorted(CSRC.glob("*.cpp"))
            build_dir = _cache_dir(sources + sorted(CSRC.glob("*.h")))  # a changed header rebuilds too
            build_dir.mkdir(parents=True, exist_ok=True)
            try:
                from torch.utils.cpp_extension import load as cpp_load

                # torch calls `ninja` by name: the one our venv installs sits beside its python.
                bindir = str(Path(sys.executable).parent)
                if bindir not in os.environ.get("PATH", "").split(os.pathsep):
                    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")

                log.info("loading inferlab CPU kernels (first use compiles them, ~35 s on 2 cores) from %s", build_dir)
                cpp_load(name="inferlab_kernels", sources=[str(s) for s in sources], extra_cflags=CFLAGS,
                         extra_ldflags=["-fopenmp"], build_directory=str(build_dir), is_python_module=False,
                         verbose=False)
            except Exception as e:  # a compiler error, a missing ninja: fall back, keep the reason
                reason = f"building the kernels failed: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"
        if reason is not None:
            log.warning("inferlab CPU kernels unavailable (%s); using plain torch operators", reason)
        _state["ok"], _state["reason"] = reason is None, reason or ""
        return reason is None


def available() -> bool:
    return load()


def unavailable_reason() -> str:
    """Empty when the kernels loaded; else why they did not."""
    load()
    return str(_state["reason"])
