"""`inferlab perplexity` end to end on tiny models, against a direct full forward of each chunk
(transformers' own model), and its one-line refusals."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from inferlab.cli import main
from inferlab.models.testing import load_reference_model, make_tiny_hf_model
from inferlab.tokenizer import Tokenizer

N_CTX = 32
ENGINE = ["--dtype", "float32", "--weight-dtype", "float32", "--kv-cache-dtype", "float32"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppl")
    return make_tiny_hf_model(root / "base", seed=0), make_tiny_hf_model(root / "other", seed=1)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    words = "the quick brown fox jumps over the lazy dog while a model predicts the next token".split()
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(" ".join(rng.choice(words, 400)), encoding="utf-8")
    return path


def reference_rows(model_dir, text_path) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each chunk's scored log-softmax rows from one plain forward of the whole chunk."""
    tok = Tokenizer.from_path(model_dir)
    ids = tok.encode(text_path.read_text(encoding="utf-8"))
    chunks = [ids[i * N_CTX : (i + 1) * N_CTX] for i in range(len(ids) // N_CTX)]
    ref = load_reference_model(model_dir)
    first = N_CTX // 2
    with torch.no_grad():
        rows = [torch.log_softmax(ref(torch.tensor([c])).logits[0].double(), -1)[first : N_CTX - 1] for c in chunks]
    return chunks, rows


def run_json(capsys, *argv) -> dict:
    assert main(["perplexity", *argv, *ENGINE, "--json", "-b", str(3 * N_CTX)]) == 0
    return json.loads(capsys.readouterr().out)


def test_perplexity_equals_a_full_forward(models, text, capsys):
    base, _ = models
    doc = run_json(capsys, "-m", str(base), "-f", str(text), "-c", str(N_CTX))
    chunks, rows = reference_rows(base, text)
    first = N_CTX // 2
    nll = torch.cat([-r.gather(1, torch.tensor(c[first + 1 :]).unsqueeze(1))[:, 0] for c, r in zip(chunks, rows)])
    assert doc["chunks"] == len(chunks) >= 4 and doc["scored_tokens"] == nll.numel()
    assert doc["ppl"] == pytest.approx(math.exp(nll.mean().item()), rel=1e-4)
    se = math.sqrt((nll.pow(2).mean() - nll.mean() ** 2).item() / (nll.numel() - 1))
    assert doc["ppl_error"] == pytest.approx(doc["ppl"] * se, rel=1e-3)


def test_kl_divergence_equals_a_full_forward_of_both_models(models, text, tmp_path, capsys):
    base, other = models
    path = tmp_path / "base.safetensors"
    common = ["-f", str(text), "-c", str(N_CTX), "--kl-divergence-base", str(path)]
    run_json(capsys, "-m", str(base), *common, "--kld-top-k", "100000")  # whole rows: exact KLD
    doc = run_json(capsys, "-m", str(other), *common, "--kl-divergence")["kl_divergence"]
    chunks, rows_b = reference_rows(base, text)
    _, rows_q = reference_rows(other, text)
    kld = torch.cat([(rb.exp() * (rb - rq)).sum(1) for rb, rq in zip(rows_b, rows_q)])
    assert doc["kld"][0] == pytest.approx(kld.mean().item(), rel=1e-4)
    assert doc["kld_percentiles"]["max"] == pytest.approx(kld.max().item(), rel=1e-4)
    same = torch.cat([rb.argmax(1) == rq.argmax(1) for rb, rq in zip(rows_b, rows_q)]).double().mean().item()
    assert doc["same_top"][0] == pytest.approx(same)
    # The top-K file: a lower bound, close for a peaked-enough distribution.
    run_json(capsys, "-m", str(base), *common, "--kld-top-k", "64")
    approx = run_json(capsys, "-m", str(other), *common, "--kl-divergence")["kl_divergence"]["kld"][0]
    assert approx <= doc["kld"][0] + 1e-6 and approx > 0.5 * doc["kld"][0]


def test_a_short_text_is_one_line_with_the_counts(models, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("the quick brown fox", encoding="utf-8")
    assert main(["perplexity", "-m", str(models[0]), "-f", str(short), "-c", str(N_CTX)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs at least 64" in err[0] and "Traceback" not in err[0]
    assert f"has {len(Tokenizer.from_path(models[0]).encode('the quick brown fox'))} tokens" in err[0]


def test_a_base_from_another_context_or_text_is_refused(models, text, tmp_path, capsys):
    path = tmp_path / "base.safetensors"
    run_json(capsys, "-m", str(models[0]), "-f", str(text), "-c", str(N_CTX), "--kl-divergence-base", str(path))
    argv = ["perplexity", "-m", str(models[1]), "--kl-divergence-base", str(path), "--kl-divergence", *ENGINE]
    assert main([*argv, "-f", str(text), "-c", str(N_CTX // 2), "--chunks", "4"]) == 2
    assert f"n_ctx {N_CTX} in the base, {N_CTX // 2} here" in capsys.readouterr().err
    other = tmp_path / "other.txt"
    other.write_text(text.read_text(encoding="utf-8").replace("fox", "dog"), encoding="utf-8")
    assert main([*argv, "-f", str(other), "-c", str(N_CTX)]) == 2
    assert "token ids hash" in capsys.readouterr().err
