"""Every planner formula against a hand-computed case, and the course's worked numbers."""

from __future__ import annotations

import math

import pytest

from inferlab.plan.hardware import HardwareSpec, builtin_hardware
from inferlab.plan.model_spec import ModelSpec, builtin_model, builtin_model_names, count_params
from inferlab.plan.planner import PlanInputs, Workload, build_plan
from inferlab.plan.precision import parse_precision
from inferlab.plan.roofline import (
    Roofline,
    StepShape,
    attention_pairs,
    blocks_for,
    cost_per_million_tokens,
    kv_bytes_per_token,
    mean_decode_context,
    sequences_that_fit,
    weight_bytes,
)

GiB = 1 << 30
MiB = 1 << 20


# ---------------------------------------------------------------- the course's numbers


def test_llama_3_1_8b_kv_is_128_kib_per_token_and_1_gib_for_8192_tokens():
    m = builtin_model("meta-llama/Llama-3.1-8B-Instruct")
    per_token = kv_bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, 2)
    assert per_token == 128 * 1024
    assert per_token * 8192 == GiB
    rf = Roofline(m, builtin_hardware("h100"), kv_precision="bf16")
    assert rf.kv_bytes_per_token == 131072
    # 8-bit KV halves it
    assert Roofline(m, builtin_hardware("h100"), kv_precision="fp8").kv_bytes_per_token == 65536


def test_qwen3_0_6b_q8_0_weights_match_the_610_mib_file():
    m = builtin_model("qwen3-0.6b")
    assert m.num_params == 596_049_920  # "about 596 million numbers"
    rf = Roofline(m, builtin_hardware("rtx-4090"), weight_precision="q8_0")
    assert rf.weight_bytes == 596_049_920 * 8.5 / 8 == 633_303_040
    # The file also holds the tokenizer and F32 norms: the computed weights are within 2% of it.
    assert rf.weight_bytes / (610 * MiB) == pytest.approx(1.0, abs=0.02)
    assert rf.weight_bytes < 610 * MiB


@pytest.mark.parametrize("tok_s, usd", [(586, 0.42), (4854, 0.05)])
def test_cost_per_million_tokens_from_the_course(tok_s, usd):
    value = cost_per_million_tokens(0.89, tok_s)
    assert round(value, 2) == usd
    assert value == pytest.approx(0.89 / (tok_s * 3600) * 1e6)


def test_cost_rejects_zero_throughput():
    with pytest.raises(ValueError, match="tokens per second"):
        cost_per_million_tokens(1.0, 0)


# ---------------------------------------------------------------- parameters and precisions


@pytest.mark.parametrize("name", builtin_model_names())
def test_builtin_parameter_counts_match_the_formula(name):
    m = builtin_model(name)
    fields = {k: getattr(m, k) for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                                         "intermediate_size", "vocab_size", "tie_word_embeddings", "qk_norm",
                                         "attention_bias")}
    assert count_params(**fields) == m.num_params
    assert m.params_kind == "cited"


def test_count_params_by_hand():
    # 1 layer, h=4, 2 heads of d=2, 1 KV head, I=8, V=10, untied, no extras:
    # q 4·4=16, k,v 2·4·2=16, o 16, mlp 3·4·8=96, norms 8 → 152; embeddings 2·40=80; final norm 4.
    assert count_params(num_layers=1, hidden_size=4, num_heads=2, num_kv_heads=1, head_dim=2,
                        intermediate_size=8, vocab_size=10, tie_word_embeddings=False) == 152 + 80 + 4
    # qk_norm adds 2·d = 4 per layer, biases H·d + 2·K·d = 8, tying removes one table (40).
    assert count_params(num_layers=1, hidden_size=4, num_heads=2, num_kv_heads=1, head_dim=2,
                        intermediate_size=8, vocab_size=10, tie_word_embeddings=True, qk_norm=True,
                        attention_bias=True) == 152 + 4 + 8 + 40 + 4


@pytest.mark.parametrize("name, bits", [("bf16", 16), ("FP16", 16), ("float32", 32), ("fp8", 8), ("int8", 8),
                                        ("q8_0", 8.5), ("Q4_0", 4.5), ("q4_1", 5), ("q6_k", 6.5625)])
def test_precision_bits(name, bits):
    assert parse_precision(name).bits == bits


def test_unknown_precision_is_a_value_error():
    with pytest.raises(ValueError, match="unknown precision 'q9_9'"):
        parse_precision("q9_9")


def test_weight_bytes_and_blocks():
    assert weight_bytes(1000, 16) == 2000
    assert weight_bytes(64, 4.5) == 36
    assert blocks_for(8448, 16) == 528
    assert blocks_for(17, 16) == 2
    assert blocks_for(16, 16) == 1


def test_sequences_that_fit_by_hand():
    # 100 bytes, 10% reserve → 90; weights 40 → 50 for KV; 12 bytes/sequence → 4.
    assert sequences_that_fit(100, 40, 12, reserve_fraction=0.10) == 4
    # a fixed 5-byte reserve on top leaves 45 → 3
    assert sequences_that_fit(100, 40, 12, reserve_fraction=0.10, reserve_bytes=5) == 3
    # weights that do not fit leave no sequence (not a negative count)
    assert sequences_that_fit(100, 95, 12) == 0


def test_attention_pairs_and_mean_context():
    assert attention_pairs(0, 4) == 1 + 2 + 3 + 4
    assert attention_pairs(5, 1) == 6  # a decode at position 5 attends to 6 keys
    assert attention_pairs(3, 2) == 4 + 5
    assert mean_decode_context(100, 10) == 105
    # check P + O/2 against the explicit mean over decode steps j = 1..O-1 of (P + j)
    assert sum(100 + j for j in range(1, 10)) / 9 == mean_decode_context(100, 10)


# ---------------------------------------------------------------- the roofline on a toy model


def toy_model(**over) -> ModelSpec:
    fields = dict(name="toy", num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                  intermediate_size=16, vocab_size=10, tie_word_embeddings=False, num_params=1000,
                  params_kind="computed", source="test")
    fields.update(over)
    return ModelSpec(**fields)


TOY_HW = HardwareSpec("toy", memory_bytes=1e6, memory_bandwidth=1e3, flops={"bf16": 1e5}, kind="cited",
                      source="test")


def test_roofline_step_by_hand():
    rf = Roofline(toy_model(), TOY_HW, weight_precision="bf16", kv_precision="bf16")
    assert rf.weight_bytes == 2000
    assert rf.weight_bytes_read_per_step == 2000 - 10 * 8 * 2  # untied: the input table is not read
    assert rf.kv_bytes_per_token == 2 * 2 * 1 * 4 * 2 == 32
    assert rf.matmul_flops_per_token == 2 * (1000 - 80)
    assert rf.attention_flops_per_pair == 4 * 2 * 2 * 4 == 64
    # decode, batch 3, context 10: bytes 1840 + 3·10·32 = 2800 → 2.8 s; FLOPs 3·1840 + 64·30 = 7440 → 0.0744 s
    est = rf.decode_step(3, 10)
    assert est.bytes == 2800
    assert est.flops == 3 * 1840 + 64 * 30
    assert est.time_s == pytest.approx(2.8)
    assert est.bound == "memory"
    # a prefill of 100 tokens: FLOPs 100·1840 + 64·5050 = 507,200 → 5.072 s; bytes 1840 + 3200 → 5.04 s
    pre = rf.prefill(100)
    assert pre.flops == 100 * 1840 + 64 * 5050
    assert pre.time_s == pytest.approx(5.072)
    assert pre.bound == "compute"


def test_efficiencies_and_overhead_scale_the_roofs():
    rf = Roofline(toy_model(), TOY_HW, "bf16", memory_efficiency=0.5, step_overhead_s=0.25)
    assert rf.decode_step(3, 10).time_s == pytest.approx(2.8 / 0.5 + 0.25)
    with pytest.raises(ValueError, match="memory efficiency"):
        Roofline(toy_model(), TOY_HW, "bf16", memory_efficiency=1.5)


def test_tied_head_reads_the_whole_table():
    rf = Roofline(toy_model(tie_word_embeddings=True), TOY_HW, "bf16")
    assert rf.weight_bytes_read_per_step == rf.weight_bytes
    assert rf.matmul_flops_per_token == 2000


def test_compute_bound_batch_balances_the_two_roofs():
    hw = HardwareSpec("fast", 1e9, memory_bandwidth=1e3, flops={"bf16": 1e4}, kind="cited", source="t")
    rf = Roofline(toy_model(), hw, "bf16")
    b = rf.compute_bound_batch(context=2)
    assert b is not None
    est = rf.step(StepShape.decode(b, 2))
    assert est.memory_time_s == pytest.approx(est.compute_time_s)
    # by hand: (1840/1e3) / ((1840 + 64·2)/1e4 − 2·32/1e3) = 1.84 / (0.1968 − 0.064)
    assert b == pytest.approx(1.84 / (0.1968 - 0.064))
    # long contexts: per-sequence K/V reads outgrow per-sequence FLOPs → never compute-bound
    assert rf.compute_bound_batch(context=10_000) is None


# ---------------------------------------------------------------- the whole plan


def seed001_plan(**over):
    inputs = dict(model=builtin_model("llama-3.1-8b"), hardware=builtin_hardware("h100"),
                  workload=Workload(8192, 256), usd_per_hour=2.0)
    inputs.update(over)
    return build_plan(PlanInputs(**inputs))


def test_seed_001_memory_budget():
    plan = seed001_plan()
    assert plan.value("weight_bytes") == 8_030_261_248 * 2
    assert plan.value("kv_bytes_per_sequence") == 8448 * 131072
    assert plan.value("kv_memory_available") == pytest.approx(80e9 * 0.9 - 8_030_261_248 * 2)
    # (72e9 − 16.06e9) / 1.107e9 = 50.5 → 50, the course's "fifty"
    assert plan.value("max_sequences") == 50
    assert plan.value("concurrency") == 50


def test_seed_001_decode_speeds_by_hand():
    plan = seed001_plan()
    read = 8_030_261_248 * 2 - 128256 * 4096 * 2  # weights less the input embedding table
    ctx = 8192 + 128
    single = (read + ctx * 131072) / 3.35e12
    assert plan.value("decode_step_time_single") == pytest.approx(single)
    assert plan.value("decode_tokens_per_s_single") == pytest.approx(1 / single)
    at50 = (read + 50 * ctx * 131072) / 3.35e12
    assert plan.value("decode_step_time") == pytest.approx(at50)
    assert plan.value("per_user_tokens_per_s") == pytest.approx(1 / at50)
    assert plan.value("total_tokens_per_s") == pytest.approx(50 / at50)
    # cost from the decode-only total
    assert plan.value("cost_per_million_tokens") == pytest.approx(2.0 / (50 / at50 * 3600) * 1e6)
    # at 8K context decode never turns compute-bound; with short contexts it does near 295
    assert plan.value("compute_bound_batch") is None
    weights_only = (read / 3.35e12) / (2 * (8_030_261_248 - 128256 * 4096) / 989.4e12)
    assert plan.value("compute_bound_batch_weights_only") == pytest.approx(weights_only)


def test_seed_001_prefill_and_closed_loop_by_hand():
    plan = seed001_plan()
    matmul = 8_030_261_248 - 128256 * 4096
    flops = 2 * matmul * 8192 + 4 * 32 * 32 * 128 * (8192 * 8193 // 2)
    assert plan.value("prefill_flops") == flops
    t_pre = flops / 989.4e12
    assert plan.value("prefill_time") == pytest.approx(t_pre)
    step = plan.value("decode_step_time")
    assert plan.value("total_tokens_per_s_with_prefill") == pytest.approx(50 * 256 / (50 * t_pre + 255 * step))
    assert plan.value("tpot") == pytest.approx(step + 49 * t_pre / 255)
    assert plan.value("e2el") == pytest.approx(t_pre + 255 * plan.value("tpot"))


def test_every_figure_says_its_kind():
    plan = seed001_plan()
    kinds = {f.name: f.kind for f in plan.figures}
    assert kinds["num_params"] == "cited"
    assert kinds["memory_total"] == kinds["memory_bandwidth"] == kinds["compute_peak"] == "cited"
    assert kinds["kv_bytes_per_token"] == kinds["max_sequences"] == kinds["decode_step_time"] == "computed"
    for f in plan.figures:
        d = f.to_dict()
        assert set(d) >= {"value", "unit", "kind", "assumptions"}
    assert any("10%" in a for a in plan.figure("max_sequences").assumptions)
    assert plan.figure("memory_total").source and "H100" in plan.figure("memory_total").source


def test_batch_table_marks_what_fits_and_the_bound():
    plan = seed001_plan(workload=Workload(8192, 256, concurrency=64))
    batches = [r.batch for r in plan.by_batch]
    assert batches[0] == 1 and 50 in batches and 64 in batches
    row64 = next(r for r in plan.by_batch if r.batch == 64)
    assert not row64.fits and row64.bound == "memory"
    assert any("do NOT fit" in a for a in plan.figure("decode_step_time").assumptions)
    short = build_plan(PlanInputs(builtin_model("llama-3.1-8b"), builtin_hardware("h100"), Workload(16, 2),
                                  ))
    assert short.by_batch[-1].bound == "compute"  # thousands of short sequences fit; the big batches compute


def test_weight_dtype_changes_what_fits():
    bf16 = seed001_plan()
    fp8 = seed001_plan(weight_precision="fp8")
    assert fp8.value("weight_bytes") == bf16.value("weight_bytes") / 2
    assert fp8.value("max_sequences") > bf16.value("max_sequences")


def test_request_rate_uses_littles_law():
    rf = PlanInputs(builtin_model("llama-3.1-8b"), builtin_hardware("h100")).roofline()
    ctx = 8192 + 128
    # light load: the fixed point N = rate × (prefill + 255 decode steps at batch N)
    plan = seed001_plan(workload=Workload(8192, 256, request_rate=0.5))
    n = plan.value("concurrency")
    t_pre = plan.value("prefill_time")
    assert n == math.ceil(0.5 * (t_pre + 255 * rf.decode_step(n, ctx).time_s) - 1e-6)
    assert 0 < plan.value("utilization") < 1
    # heavier load: the fixed point would overload the device, so the batch grows until it keeps up
    plan = seed001_plan(workload=Workload(8192, 256, request_rate=2.0))
    n = plan.value("concurrency")

    def busy(k):
        return 2.0 * (t_pre + 255 * rf.decode_step(k, ctx).time_s / k)

    assert busy(n) < 1 <= busy(n - 1)
    assert plan.value("utilization") == pytest.approx(busy(n))
    # overload: more than the device sustains even with every sequence that fits
    over = seed001_plan(workload=Workload(8192, 256, request_rate=100.0))
    assert over.value("concurrency") is None
    assert over.value("utilization") >= 1
    assert any("exceeds" in a for a in over.figure("concurrency").assumptions)
    assert "total_tokens_per_s" not in {f.name for f in over.figures}


@pytest.mark.parametrize("kwargs, message", [
    (dict(input_len=0), "input length"),
    (dict(output_len=0), "output length"),
    (dict(concurrency=0), "concurrency"),
    (dict(request_rate=-1.0), "request rate"),
    (dict(concurrency=2, request_rate=1.0), "either"),
])
def test_bad_workloads_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Workload(**kwargs)


def test_bad_plan_inputs_are_value_errors():
    with pytest.raises(ValueError, match="reserve fraction"):
        PlanInputs(builtin_model("llama-3.1-8b"), builtin_hardware("h100"), reserve_fraction=1.0)
    with pytest.raises(ValueError, match="unknown precision"):
        build_plan(PlanInputs(builtin_model("llama-3.1-8b"), builtin_hardware("h100"), kv_precision="bogus"))
