"""Tensor parallelism (models/tp.py, engine/tp_worker.py): the split, TP=2 against TP=1 on a tiny
model of every architecture (float32: the same greedy tokens, logits within 1e-4), the heads
check before any weight loads, and the ranks' lifecycle (no orphan after a stop or a crash of
the engine; a rank that dies fails the engine with its name instead of hanging it)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from kernel_marks import needs_int8_dot

from inferlab.config import LoadConfig
from inferlab.engine.request import SamplingParams
from inferlab.engine.tp_worker import TensorParallelError, precision_mismatch
from inferlab.entrypoints.llm import LLM
from inferlab.kernels import build
from inferlab.models.precision import resolve_precision
from inferlab.models.testing import TINY_ARCHS, make_tiny_hf_model, save_tiny_tokenizer, tiny_model_config
from inferlab.models.tp import Span, plan_shards

# Prompts of several lengths, and a token budget that chunks the long one (continuing prefill
# chunks) and mixes decodes with prefills in one step.
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 70)), [300, 12, 44, 7, 91, 200, 3, 18]]
ENGINE = dict(dtype="float32", num_threads=2, kv_cache_memory=1 << 23, max_num_batched_tokens=32)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _model(tmp_path_factory: pytest.TempPathFactory, arch: str, **overrides) -> Path:
    d = make_tiny_hf_model(tmp_path_factory.mktemp(f"tp-{arch}"), arch, **overrides)
    save_tiny_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model(tmp_path_factory, "llama")


def _run(model: Path, tp: int, **settings) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of PROMPTS and every logits tensor the engine sampled from (the warm-up's
    too), at tensor_parallel_size `tp`."""
    with LLM(str(model), tensor_parallel_size=tp, **{**ENGINE, **settings}) as llm:
        seen: list[torch.Tensor] = []
        model_ = llm.engine.runner.model
        inner = model_.compute_logits

        def recorded(hidden: torch.Tensor) -> torch.Tensor:
            seen.append(inner(hidden).clone())
            return seen[-1]

        model_.compute_logits = recorded  # type: ignore[method-assign]
        llm.engine.runner.fused_greedy = False  # the logits themselves, not the lm_head's argmax
        outs = llm.generate(PROMPTS, GREEDY)
        return [o.outputs[0].token_ids for o in outs], seen


# ---------------------------------------------------------------------- the split, no processes


def test_plan_shards_even_split_by_heads_intermediate_and_vocabulary():
    config = tiny_model_config("llama")  # 4 query heads over 2 KV heads, intermediate 128, vocab 384
    a, b = plan_shards(config, 2)
    assert (a.kv_heads, b.kv_heads) == (Span(0, 1), Span(1, 2))
    assert (a.heads, b.heads) == (Span(0, 2), Span(2, 4))  # each KV head with its query heads
    assert (a.intermediate, b.intermediate) == (Span(0, 64), Span(64, 128))
    assert (a.vocab, b.vocab, a.vocab_rows) == (Span(0, 192), Span(192, 384), 192)


def test_plan_shards_uneven_heads_go_by_whole_kv_groups_the_mlp_by_whole_groups_the_vocabulary_padded():
    # SmolLM2-135M's heads (9 over 3 KV heads) at 2 ranks: 2 + 1 KV heads with their 3 query heads each.
    config = tiny_model_config("llama", num_attention_heads=9, num_key_value_heads=3, hidden_size=72,
                               vocab_size=385, intermediate_size=192)
    a, b = plan_shards(config, 2)
    assert (a.kv_heads, b.kv_heads) == (Span(0, 2), Span(2, 3))
    assert (a.heads, b.heads) == (Span(0, 6), Span(6, 9))
    assert (a.vocab, b.vocab, b.vocab_rows) == (Span(0, 193), Span(193, 385), 193)
    # whole groups of 64 columns (int4 / w8a8 quantize down_proj's input in groups): 128 + 64
    assert (a.intermediate, b.intermediate) == (Span(0, 128), Span(128, 192))


def test_a_size_that_cannot_split_the_heads_is_refused_naming_both_numbers_before_any_weight_loads(
        llama, monkeypatch):
    model = llama  # 2 KV heads

    def no_load(*args, **kwargs):
        raise AssertionError("weights were loaded before the heads check")

    monkeypatch.setattr("inferlab.engine.llm_engine.load_model", no_load)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 .* 2 KV heads"):
        LLM(str(model), tensor_parallel_size=3, **ENGINE)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLM(str(model), tensor_parallel_size=0, **ENGINE)


def test_the_cli_refuses_it_in_one_line(llama, capsys):
    from inferlab.cli import main

    assert main(["generate", "-m", str(llama), "--tensor-parallel-size", "4", "--dtype", "float32"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "tensor_parallel_size 4" in err and "2 KV heads" in err


# ---------------------------------------------------------------------- TP=2 against TP=1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tp2_gives_tp1s_greedy_tokens_and_logits_on_every_architecture(tmp_path_factory, arch):
    model = _model(tmp_path_factory, arch)
    tokens1, logits1 = _run(model, 1)
    tokens2, logits2 = _run(model, 2)
    assert tokens2 == tokens1
    assert len(logits2) == len(logits1) and logits2[0].shape[-1] == tiny_model_config(arch).vocab_size
    worst = max(float((a - b).abs().max()) for a, b in zip(logits1, logits2))
    assert worst < 1e-4, worst


@pytest.mark.timeout(120)
def test_tp2_on_heads_that_two_does_not_divide_and_on_the_plain_torch_backends(tmp_path_factory):
    # 6 query heads over 3 KV heads (SmolLM2's 3:1 groups): ranks of 2 + 1 KV heads; the ranks on
    # the eager layers and SDPA decode attention (the other tests: fused layers, the paged kernel).
    model = _model(tmp_path_factory, "llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=96)
    tokens1, logits1 = _run(model, 1)
    tokens2, logits2 = _run(model, 2, decoder_backend="eager", attention_backend="sdpa")
    assert tokens2 == tokens1
    assert max(float((a - b).abs().max()) for a, b in zip(logits1, logits2)) < 1e-4


# ---------------------------------------------------------------------- lifecycle


def _gone(pid: int) -> bool:
    """No such process, or a zombie (exited, not yet reaped by whoever adopted it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(120)
def test_shutdown_leaves_no_rank_and_so_does_the_servers_engine_thread(llama):
    from inferlab.config import EngineConfig
    from inferlab.engine.async_llm import AsyncLLM
    from inferlab.engine.engine_args import EngineArgs
    from inferlab.engine.llm_engine import LLMEngine

    model = llama
    llm = LLM(str(model), tensor_parallel_size=2, **ENGINE)
    pids = llm.engine.parallel.pids
    assert len(pids) == 1 and not _gone(pids[0])
    assert llm.engine.info()["tensor_parallel_size"] == 2
    llm.shutdown()
    assert _wait_gone(pids, 15)
    with pytest.raises(TensorParallelError, match="shut down"):
        llm.generate([[5, 6, 7]], GREEDY)

    config: EngineConfig = EngineArgs(model=str(model), tensor_parallel_size=2, **ENGINE).create_engine_config()
    holder: dict[str, LLMEngine] = {}

    def factory() -> LLMEngine:
        holder["engine"] = LLMEngine(config)
        return holder["engine"]

    server_engine = AsyncLLM(factory)
    server_engine.start()
    assert server_engine.wait_ready(60)
    pids = holder["engine"].parallel.pids
    server_engine.shutdown(drain_timeout=5)
    assert _wait_gone(pids, 15)


@pytest.mark.timeout(120)
def test_a_killed_engine_leaves_no_orphan_rank(llama, tmp_path_factory):
    model = llama
    script = textwrap.dedent(f"""
        import os, signal
        from inferlab.entrypoints.llm import LLM

        if __name__ == "__main__":
            llm = LLM({str(model)!r}, tensor_parallel_size=2, **{ENGINE!r})
            print(*llm.engine.parallel.pids, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no finalizer: the ranks must see it themselves
    """)
    path = tmp_path_factory.mktemp("tp-crash") / "crash.py"
    path.write_text(script)
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=100)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 1
    assert _wait_gone(pids, 20), f"rank process {pids} outlived its engine"


@pytest.mark.timeout(120)
def test_a_rank_that_dies_fails_the_engine_loudly_naming_it(llama):
    model = llama
    llm = LLM(str(model), tensor_parallel_size=2, **ENGINE)
    try:
        (pid,) = llm.engine.parallel.pids
        killer = threading.Timer(0.3, os.kill, (pid, signal.SIGKILL))
        killer.start()
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        deadline = time.monotonic() + 30
        with pytest.raises(TensorParallelError, match=r"rank 1 died \(exit code -9\)"):
            while time.monotonic() < deadline:  # steps until the kill lands, mid-collective or between steps
                llm.generate([list(range(5, 50))] * 4, params)
        killer.join()
    finally:
        llm.shutdown()


def test_a_rank_with_other_kernels_says_which_field_differs():
    """Two ranks whose kernels were compiled from other sources resolve precisions that describe()
    alike: the refusal names the differing field and what to do."""
    p = resolve_precision(LoadConfig(), kernel=build.KernelInfo("avx512", (), build_dir="/cache/kernels/aaaa"))
    other = dataclasses.replace(p, kernel=dataclasses.replace(p.kernel, build_dir="/cache/kernels/bbbb"))
    assert p.describe() == other.describe()
    msg = precision_mismatch(other, p)
    assert "kernel.build_dir '/cache/kernels/bbbb' against '/cache/kernels/aaaa'" in msg
    assert "other sources" in msg and "one install" in msg
    dtypes = dataclasses.replace(p, kv_cache=torch.bfloat16, weights=torch.float16)
    assert precision_mismatch(dtypes, p).count(" against ") == 2 and "other sources" not in precision_mismatch(dtypes, p)


@pytest.mark.timeout(120)
@needs_int8_dot
def test_tp2_runs_w8a8_in_panels_where_the_norms_and_silu_hand_over_codes(llama):
    # The row-parallel down_proj takes SiLU's codes (RowParallelLinear.product_q8) and sums the
    # ranks' partial products. Not tp=1's bits: a rank quantizes its own slice of the rows, in
    # groups of 64 of its slice, and tp=1's decode steps run the one-call decode step; on this
    # tiny model's random weights the logits part by ~0.04-0.08 (of ~2.5), then a near-tie.
    tokens1, logits1 = _run(llama, 1, dtype="auto", weight_dtype="w8a8")
    tokens2, logits2 = _run(llama, 2, dtype="auto", weight_dtype="w8a8")
    assert [t[:4] for t in tokens2] == [t[:4] for t in tokens1]
    assert float((logits1[0] - logits2[0]).abs().max()) < 0.2
