"""The one kernel decision per machine (kernels/build.py): which variant a CPU's flags and
INFERLAB_KERNELS choose, the one-line errors for a variant the CPU lacks or an unknown value,
and that the variant this process loaded is the one its build reports."""

from __future__ import annotations

import json

import pytest

from inferlab.kernels import build

AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
ZEN5 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni", "avx_vnni"}
SKYLAKE_X = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}  # AVX-512 without BF16 / VNNI
SAPPHIRE = ZEN5 | {"amx_tile", "amx_bf16", "amx_int8"}  # and AMX


@pytest.mark.parametrize("flags,setting,variant", [
    (ZEN5, "", "avx512"), (ZEN5, "1", "avx512"), (ZEN5, "auto", "avx512"), (ZEN5, "avx2", "avx2"),
    (ZEN5, "AVX512", "avx512"), (AVX2, "", "avx2"), (SKYLAKE_X, "", "avx2"), (frozenset({"sse2"}), "", "none"),
    (ZEN5, "0", "none"), (AVX2, "off", "none"), (SAPPHIRE, "", "amx"), (SAPPHIRE, "avx512", "avx512"),
    (SAPPHIRE, "amx", "amx"), (SAPPHIRE, "avx2", "avx2"), (SAPPHIRE - {"amx_int8"}, "", "avx512"),
])
def test_the_variant_follows_the_flags_and_the_setting(flags, setting, variant):
    assert build.choose_variant(flags, setting)[0] == variant


def test_a_variant_below_the_best_says_why():
    assert "without avx512_bf16, avx512_vnni" in build.choose_variant(SKYLAKE_X, "")[1]
    assert build.choose_variant(ZEN5, "avx2")[1] == "INFERLAB_KERNELS=avx2"
    assert build.choose_variant(ZEN5, "")[1] == "" and build.choose_variant(AVX2, "")[1] == ""
    assert "lacks AVX2" in build.choose_variant(frozenset(), "")[1]


@pytest.mark.parametrize("flags,setting,says", [
    (AVX2, "avx512", "this machine has 0, auto, avx2 (avx512 needs avx512_bf16, avx512_vnni, avx512bw"),
    (ZEN5, "sse", "this machine has 0, auto, avx512, avx2"),
    (ZEN5, "amx", "this machine has 0, auto, avx512, avx2 (amx needs amx_bf16, amx_int8, amx_tile)"),
    (frozenset(), "avx2", "this machine has 0, auto (avx2 needs avx2, f16c, fma)"),
])
def test_a_variant_the_cpu_lacks_is_a_one_line_error_naming_what_it_has(flags, setting, says):
    with pytest.raises(ValueError) as e:
        build.choose_variant(flags, setting)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_each_variant_adds_flags_to_the_avx2_ones():
    assert build._cflags("avx2") == build.CFLAGS  # the AVX2 variant compiles exactly as before
    assert set(build.CFLAGS) < set(build._cflags("avx512")) and "-mavx512bf16" in build._cflags("avx512")
    assert set(build._cflags("avx512")) < set(build._cflags("amx")) and "-mamx-int8" in build._cflags("amx")
    assert build._cache_dir([], build._cflags("avx2")) != build._cache_dir([], build._cflags("avx512"))


def test_amx_is_the_avx512_kernels_with_tiles():
    amx, avx512 = build.KernelInfo("amx", ()), build.KernelInfo("avx512", ())
    for prop in ("bf16_dot", "int8_x_group", "int8_x_max", "int8_panel_xor", "int8_scale_block", "int4_dot",
                 "auto_weight_dtype", "avx512"):
        assert getattr(amx, prop) == getattr(avx512, prop), prop
    assert amx.amx and not avx512.amx and amx.int8_dot == "vpdpbusd, tdpbssd" and avx512.int8_dot == "vpdpbusd"
    assert "AMX tiles" in amx.describe() and "AMX" not in avx512.describe()


def test_amx_refused_by_the_os_falls_back_to_avx512_and_says_so(monkeypatch):
    """Linux grants a process AMX's tile state only when asked (arch_prctl); where it refuses,
    the AVX-512 variant runs, with the reason in its one line."""
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setattr(build, "cpu_flags", lambda: SAPPHIRE)
    monkeypatch.setattr(build, "amx_permitted", lambda: False)
    monkeypatch.setattr(build, "_build", lambda variant, flags, why: build.KernelInfo(variant, flags, why))
    monkeypatch.delenv("INFERLAB_KERNELS", raising=False)
    info = build.kernel_info()
    assert info.variant == "avx512" and "refused" in info.reason and "refused" in info.describe()
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setattr(build, "amx_permitted", lambda: True)
    assert build.kernel_info().variant == "amx" and build.kernel_info().reason == ""


def test_this_process_loaded_what_its_cpu_and_setting_choose(monkeypatch):
    info = build.kernel_info()
    import os

    want, _ = build.choose_variant(build.cpu_flags(), os.environ.get("INFERLAB_KERNELS", ""))
    assert info.variant == want or (want != "none" and info.variant == "none" and info.reason)
    assert info is build.kernel_info()  # decided once
    line = info.describe()
    assert "\n" not in line and info.variant in line
    d = json.loads(json.dumps(info.as_dict()))  # plain values: what a server puts in a JSON report
    assert d["variant"] == info.variant and d["available"] == info.available
    if info.available:
        import torch

        assert torch.ops.inferlab.compiled_isa() == info.variant
        assert info.auto_weight_dtype in ("bfloat16", "float16")


def test_the_kernels_are_decided_at_load_not_at_the_first_request(monkeypatch):
    """The engine's precision, resolved before the weights load, decides (and builds) the kernels
    whatever the dtype: a bf16 model would otherwise first ask at its first decode, and that
    request waited for the compile."""
    from inferlab.config import LoadConfig
    from inferlab.models.precision import resolve_precision

    asked = []
    real = build.kernel_info
    monkeypatch.setattr(build, "kernel_info", lambda: asked.append(1) or real())
    precision = resolve_precision(LoadConfig(dtype="bfloat16"))
    assert asked and precision.kernel is real() and not precision.uses_kernels


def test_a_pair_without_a_fast_path_says_so_in_one_warning(caplog, tmp_path):
    """bf16 compute with int8 weights has no kernel: one warning line naming the way out."""
    import logging

    from inferlab import LLM

    if not build.kernel_info().available:
        pytest.skip(f"kernels unavailable: {build.unavailable_reason()}")
    from inferlab.models.testing import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path / "m", arch="llama")
    with caplog.at_level(logging.INFO, logger="inferlab.models.decoder"):
        LLM(str(path), dtype="bfloat16", weight_dtype="int8", num_kv_blocks=8)
        LLM(str(path), dtype="float32", weight_dtype="int8", num_kv_blocks=8)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "no fast path for int8 weights with bfloat16 compute" in warnings[0] and "dtype auto" in warnings[0]


def test_a_build_lock_left_by_a_dead_process_is_removed(tmp_path, caplog):
    """torch's `lock` file outlives a build killed midway (and every later process would wait on
    it forever); under our flock such a file can only be stale, and is removed."""
    (tmp_path / "lock").write_text("")
    with caplog.at_level("WARNING"), build.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert "did not finish" in caplog.text


def test_the_build_lock_is_held_by_one_process_at_a_time(tmp_path):
    import fcntl

    with build.build_lock(tmp_path), open(tmp_path / "inferlab.flock") as other:
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(tmp_path / "inferlab.flock") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released on exit
