"""One EngineArgs behind `LLM(...)`, `inferlab serve` and `inferlab generate`: every engine
setting has one flag, the same in every command, and the flags build the same EngineConfig."""

from __future__ import annotations

import dataclasses

import pytest

from inferlab.cli import build_parser
from inferlab.engine.engine_args import _FLAGS, EngineArgs


def _args(argv: list[str]):
    parser, _ = build_parser(argv)
    return parser.parse_args(argv)


def test_every_field_has_exactly_one_flag():
    names = [f.name for f in dataclasses.fields(EngineArgs)]
    assert sorted(name for name, _, _ in _FLAGS) == sorted(names)


ENGINE_FLAGS = ["--max-num-seqs", "4", "--kv-cache-dtype", "float32", "--num-kv-blocks", "64", "--block-size", "32",
                "--no-prefix-caching", "--no-chunked-prefill", "--max-model-len", "512", "--num-threads", "1",
                "--heap-trim-interval", "-1", "--dtype", "float32", "--weight-dtype", "float16"]


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_serve_and_generate_take_the_same_engine_flags(command):
    got = EngineArgs.from_cli_args(_args([command, *ENGINE_FLAGS]))
    assert got == EngineArgs(max_num_seqs=4, kv_cache_dtype="float32", num_kv_blocks=64, block_size=32,
                             enable_prefix_caching=False, enable_chunked_prefill=False, max_model_len=512,
                             num_threads=1, heap_trim_interval_s=None, dtype="float32", weight_dtype="float16")
    cfg = got.create_engine_config()
    assert cfg.cache.num_blocks_override == 64 and cfg.cache.cache_dtype == "float32"
    assert cfg.scheduler.max_num_seqs == 4 and not cfg.scheduler.enable_chunked_prefill
    assert cfg.heap_trim_interval_s is None


def test_defaults_are_the_llm_defaults():
    for command in ("serve", "generate"):
        assert EngineArgs.from_cli_args(_args([command])) == EngineArgs()


def test_generate_keeps_seed_for_sampling():
    args = _args(["generate", "--seed", "7"])
    assert args.sampling_seed == 7 and EngineArgs.from_cli_args(args).seed == EngineArgs().seed


def test_bad_values_fail_once_with_the_field_named():
    with pytest.raises(ValueError, match="cache_dtype"):
        EngineArgs(kv_cache_dtype="int3").create_engine_config()
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineArgs(max_num_seqs=0).create_engine_config()


def test_llm_takes_exactly_the_engine_args():
    from inferlab import LLM

    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(load_format="dummy", max_num_seq=4)  # a typo is an error, not a silent default
