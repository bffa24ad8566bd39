"""Compile and load our C++ CPU kernels for the CPU they run on; say why not when they cannot be.

Why compiled at run time rather than at install: the package installs from a pyproject without
a build step that needs torch (a build-isolated install would fetch a second torch), and the
kernels are compiled for the CPU that runs them. The sources are `csrc/*.cpp`; each file
registers its operators with `TORCH_LIBRARY_FRAGMENT(inferlab, m)`, so after `load()` they are
`torch.ops.inferlab.<name>` and go through torch's dispatcher like any operator (and run on
torch's own OpenMP runtime, through `at::parallel_for` or, in decoder_step.cpp, `omp parallel`:
torch's libgomp is the one already loaded; a second OpenMP runtime would fight it for the cores).

One decision per machine, made once from the CPU's flags (/proc/cpuinfo) and frozen in
`kernel_info()`: the AMX variant (the AVX-512 one's flags and code, its panel products on AMX
tiles: bf16 by tdpbf16ps at every row count, w8a8 by tdpbssd from 2 rows; csrc/amx.h) where the
CPU has AMX-TILE, AMX-BF16 and AMX-INT8 and Linux grants the process the tile state, else the
AVX-512 variant (F/BW/VL/DQ + BF16 + VNNI: bf16 weights multiplied with
vdpbf16ps, int8 with vpdpbusd) where every one of those flags is there, else the AVX2 variant
(AVX2 + FMA + F16C; the same flags and code as before the AVX-512 variant existed, w8a8's int8
x 7-bit x with vpmaddubsw on the same panels), else none
(plain torch operators). `INFERLAB_KERNELS` overrides it: 0 turns the kernels off, avx2 asks for
the AVX2 variant on any CPU that has it (A/B runs on an AVX-512 machine), avx512 for the
AVX-512 one (A/B runs on an AMX machine), amx for the AMX one; a variant the CPU lacks, or an
unknown value, is a one-line error.

The build (~35 s on 2 cores, once per variant) lands in ~/.cache/inferlab/kernels/<hash of
sources, flags, torch version> ($INFERLAB_CACHE/kernels/... when set, see cache_paths.py), so a
changed source or torch rebuilds and a clean machine builds once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import logging
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from inferlab.cache_paths import cache_root

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-std=c++17"]  # the AVX2 variant's
# What each variant needs from the CPU (/proc/cpuinfo's names) and adds to CFLAGS. The AVX-512
# one wants BF16 and VNNI too: without them (Skylake-X) it would gain little over AVX2 here.
_AVX512 = (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"),
           ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni"))
VARIANTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # best first
    "amx": (_AVX512[0] + ("amx_tile", "amx_bf16", "amx_int8"), _AVX512[1] + ("-mamx-tile", "-mamx-bf16", "-mamx-int8")),
    "avx512": _AVX512,
    "avx2": (("avx2", "fma", "f16c"), ()),
}
AMX_FLAGS = frozenset({"amx_tile", "amx_bf16", "amx_int8"})
# Linux hands a process AMX's 8 KiB of tile state only when asked (arch_prctl): x86's
# ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA.
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18
_OFF = ("0", "false", "no", "off")
_AUTO = ("", "1", "true", "yes", "on", "auto")
_lock = threading.Lock()
_state: dict[str, object] = {}  # "info": KernelInfo once load() has run


@dataclasses.dataclass(frozen=True)
class KernelInfo:
    """What this process multiplies with, decided once (`kernel_info()`); the server reports it.

    variant: "amx", "avx512", "avx2" or "none" (plain torch). reason: why "none" (or why not the
    best variant), empty otherwise. bf16_dot: the decode kernels multiply bf16 weights with
    vdpbf16ps (activations rounded to bf16 per row, float32 sums; on amx tdpbf16ps).
    int8_dot: the integer dot product that int8 weights with int8 activations (weight_dtype w8a8)
    run on, codes in panels, "vpdpbusd" (VNNI; "vpdpbusd, tdpbusd" on amx) or "vpmaddubsw"
    (AVX2), or "" (no kernels: no w8a8); int8_x_group and
    int8_x_max: how w8a8 quantizes x (values per scale, largest code: 192 and 127 on AVX-512, 16
    and 63 on AVX2, whose vpmaddubsw holds 7-bit x exactly; csrc/matvec.h), and int8_panel_xor
    what the panels hold (128: the codes' sign bit flipped, u = w + 128, vpmaddubsw's unsigned
    operand), int8_scale_block how its scales are held (256 on AVX2: per 256 values a power of two,
    each group's scale an 8-bit multiple of it; 0: float32);
    int4_dot: the one 4-bit weights run on ("vpmaddubsw" on AVX2: 4-bit codes do not saturate it).
    auto_weight_dtype: what weight_dtype "auto" stores when compute is float32 ("bfloat16",
    "float16", or "" for none: the compute dtype).
    """

    variant: str
    cpu_flags: tuple[str, ...]
    reason: str = ""
    cflags: tuple[str, ...] = ()
    build_dir: str = ""

    @property
    def available(self) -> bool:
        return self.variant != "none"

    @property
    def avx512(self) -> bool:
        """The AVX-512 kernels (the amx variant is them, with its panel products on AMX tiles)."""
        return self.variant in ("amx", "avx512")

    @property
    def amx(self) -> bool:
        return self.variant == "amx"

    @property
    def bf16_dot(self) -> bool:
        return self.avx512

    @property
    def int8_dot(self) -> str:
        return {"amx": "vpdpbusd, tdpbssd", "avx512": "vpdpbusd", "avx2": "vpmaddubsw"}.get(self.variant, "")

    @property
    def int8_x_group(self) -> int:
        return 192 if self.avx512 else 16 if self.variant == "avx2" else 0

    @property
    def int8_x_max(self) -> int:
        return 127 if self.avx512 else 63 if self.variant == "avx2" else 0

    @property
    def int8_panel_xor(self) -> int:
        return 128 if self.variant == "avx2" else 0

    @property
    def int8_scale_block(self) -> int:
        """x values whose group scales share a power of two (each an 8-bit multiple of it), 0
        where the scales are any float32: 256 on AVX2, so that vpmaddwd multiplies by them
        (csrc/matvec.h kI8ScaleBlock)."""
        return 256 if self.variant == "avx2" else 0

    def describe_w8a8(self) -> str:
        """How w8a8 multiplies here, in a few words (the load log, the server's report)."""
        bits = self.int8_x_max.bit_length() + 1
        block = self.int8_scale_block
        scales = f" (scales 8-bit multiples of a power of two per {block})" if block else ""
        return f"x quantized to {bits}-bit per {self.int8_x_group} values{scales}, {self.int8_dot}"

    @property
    def int4_dot(self) -> str:
        return "vpdpbusd" if self.avx512 else "vpmaddubsw" if self.variant == "avx2" else ""

    @property
    def auto_weight_dtype(self) -> str:
        return "bfloat16" if self.avx512 else "float16" if self.variant == "avx2" else ""

    def describe(self) -> str:
        """One line: the variant, its weight path, and why when it is not the CPU's best."""
        if not self.available:
            return f"inferlab CPU kernels: none ({self.reason}); plain torch operators"
        path = (("bf16 weights in panels by AMX tiles (tdpbf16ps) at every row count, w8a8 in panels by "
                 "vpdpbusd at one row, from 2 rows by AMX tiles (tdpbssd on the signed codes)") if self.amx else
                "bf16 weights in panels by vdpbf16ps, w8a8 in panels by vpdpbusd, at every row count"
                if self.bf16_dot else
                "float16 / int8 weights converted in registers, float32 FMA; w8a8 in panels by vpmaddubsw")
        extra = f" ({self.reason})" if self.reason else ""
        return f"inferlab CPU kernels: {self.variant}{extra}: {path}; CPU has {' '.join(self.cpu_flags) or '?'}"

    def as_dict(self) -> dict[str, object]:
        """Plain values for a JSON report (the server's, a benchmark's)."""
        d = dataclasses.asdict(self)
        d.update(available=self.available, amx=self.amx, bf16_dot=self.bf16_dot, int8_dot=self.int8_dot, int4_dot=self.int4_dot,
                 int8_x_group=self.int8_x_group, int8_x_max=self.int8_x_max, int8_panel_xor=self.int8_panel_xor,
                 int8_scale_block=self.int8_scale_block,
                 auto_weight_dtype=self.auto_weight_dtype)
        return d


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (/proc/cpuinfo); elsewhere what torch's own
    dispatch found (AVX2 there implies FMA and F16C on every CPU that has it)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    cap = torch.backends.cpu.get_cpu_capability()
    return frozenset({"avx2", "fma", "f16c"} if cap in ("AVX2", "AVX512") else ())


def choose_variant(flags: frozenset[str], setting: str) -> tuple[str, str]:
    """(variant, reason) for these CPU flags and an INFERLAB_KERNELS value; ValueError for a
    value that is no variant, or one the CPU lacks, naming the ones it has."""
    s = setting.strip().lower()
    has = [v for v, (need, _) in VARIANTS.items() if set(need) <= flags]
    if s in _OFF:
        return "none", "turned off by INFERLAB_KERNELS=0"
    if s in _AUTO:
        if not has:
            return "none", "this CPU lacks AVX2/FMA/F16C, which the kernels need"
        best = has[0]
        missing = sorted(set(VARIANTS["avx512"][0]) - flags)
        why = f"AVX-512 without {', '.join(missing)}" if best == "avx2" and "avx512f" in flags else ""
        return best, why
    if s in VARIANTS and s in has:
        return s, f"INFERLAB_KERNELS={s}" if s != has[0] else ""
    raise ValueError(f"INFERLAB_KERNELS={setting!r}: this machine has {', '.join(['0', 'auto'] + has)}"
                     + (f" ({s} needs {', '.join(sorted(set(VARIANTS[s][0]) - flags))})" if s in VARIANTS else ""))


def amx_permitted() -> bool:
    """Ask Linux for AMX's tile state for this process (every thread, for its life), as oneDNN
    does before its own AMX kernels; False where it refuses (an older kernel, another OS)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def _cflags(variant: str) -> list[str]:
    return CFLAGS + list(VARIANTS[variant][1])


def _cache_dir(sources: list[Path], cflags: list[str] | None = None) -> Path:
    """One build directory per (sources, flags, torch, where the sources live): torch's build.ninja
    names the sources by absolute path, so two checkouts sharing one directory would rebuild it
    in turn (and a build killed midway would hold up the other)."""
    h = hashlib.sha256()
    h.update(str(sources[0].parent.resolve()).encode() if sources else b"")
    for p in sources:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(" ".join(CFLAGS if cflags is None else cflags).encode())
    h.update(torch.__version__.encode())
    return cache_root() / "kernels" / h.hexdigest()[:16]


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Hold an flock on the build directory while torch builds or loads into it.

    Why: torch's own lock (a `lock` file it creates, then waits on while it exists) outlives a
    process killed mid-build, and every later process then waits on it forever. An flock is
    released by the kernel when its holder dies, so one holder at a time builds, and a torch
    `lock` file found while we hold ours was left by a dead process: removed, with a warning.
    """
    with open(build_dir / "inferlab.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing %s, left by a kernel build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _venv_bin_on_path() -> Iterator[None]:
    """torch runs `ninja` by name, and the one our venv installs sits beside its python: PATH has
    that directory during the build only (the process's environment is left as it was)."""
    before = os.environ.get("PATH")
    bindir = str(Path(sys.executable).parent)
    if bindir not in (before or "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + (before or "")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


def _build(variant: str, flags: tuple[str, ...], why: str) -> KernelInfo:
    """Compile (or find compiled) and load one variant; a KernelInfo of "none" with the reason
    when that fails."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return KernelInfo("none", flags, "no C++ compiler on PATH (c++ or $CXX)")
    sources = sorted(CSRC.glob("*.cpp"))
    if not sources:
        return KernelInfo("none", flags, f"no kernel sources in {CSRC}")
    cflags = _cflags(variant)
    build_dir = _cache_dir(sources + sorted(CSRC.glob("*.h")), cflags)  # a changed header rebuilds too
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        from torch.utils.cpp_extension import load as cpp_load

        log.info("loading inferlab CPU kernels, %s variant (first use compiles them, ~35 s on 2 cores) from %s",
                 variant, build_dir)
        with build_lock(build_dir), _venv_bin_on_path():
            cpp_load(name=f"inferlab_kernels_{variant}", sources=[str(s) for s in sources], extra_cflags=cflags,
                     extra_ldflags=["-fopenmp"], build_directory=str(build_dir), is_python_module=False,
                     verbose=False)
        compiled = str(torch.ops.inferlab.compiled_isa())
    except Exception as e:  # a compiler error, a missing ninja: fall back, keep the reason
        msg = str(e).strip()
        return KernelInfo("none", flags, f"building the kernels failed: {msg.splitlines()[-1] if msg else e!r}")
    if compiled != variant:  # a stale or foreign build: never run code for the wrong CPU
        return KernelInfo("none", flags, f"the {variant} build reports ISA {compiled!r}")
    info = KernelInfo(variant, flags, why, tuple(cflags), str(build_dir))
    numerics = [int(v) for v in torch.ops.inferlab.w8a8_numerics()]
    reported = [info.int8_x_group, info.int8_x_max, info.int8_panel_xor, info.int8_scale_block]
    if numerics != reported:  # what we report is what runs
        return KernelInfo("none", flags, f"the {variant} build's w8a8 numerics {numerics} are not the reported ones")
    return info


def load() -> bool:
    """Decide the variant (once per process), build and load it; True when torch.ops.inferlab.* exist."""
    return kernel_info().available


def kernel_info() -> KernelInfo:
    """The frozen decision for this process (building the kernels on first call), logged once."""
    with _lock:
        info = _state.get("info")
        if info is None:
            flags = cpu_flags()
            shown = tuple(f for f in sorted(set().union(*(n for n, _ in VARIANTS.values())) | {"avx_vnni"}) if f in flags)
            refused = AMX_FLAGS <= flags and not amx_permitted()
            variant, why = choose_variant(flags - AMX_FLAGS if refused else flags, os.environ.get("INFERLAB_KERNELS", ""))
            if refused and variant == "avx512":
                why = "the CPU has AMX but Linux refused this process its tile state (arch_prctl)"
            info = KernelInfo("none", shown, why) if variant == "none" else _build(variant, shown, why)
            _state["info"] = info
            (log.warning if not info.available else log.info)("%s", info.describe())
        return info  # type: ignore[return-value]


def available() -> bool:
    return load()


def unavailable_reason() -> str:
    """Empty when the kernels loaded; else why they did not."""
    info = kernel_info()
    return "" if info.available else info.reason
