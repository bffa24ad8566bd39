"""Prompt sets: exact token lengths, vLLM's length ranges, shared prefixes, JSONL and ShareGPT files."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from inferlab.bench.datasets import WORDS, DatasetSpec, length_range, load_dataset
from inferlab.bench.tokens import LocalTokenizer, load_tokenizer


def word_level_tokenizer(tmp_path) -> LocalTokenizer:
    """One token per word, BOS added in front (like Llama's tokenizer.json)."""
    vocab = {"[UNK]": 0, "<s>": 1} | {w: i + 2 for i, w in enumerate(dict.fromkeys(WORDS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return load_tokenizer(path)


def byte_level_bpe_tokenizer(tmp_path) -> LocalTokenizer:
    """A byte-level BPE (GPT-2 / Qwen / SmolLM style: the space belongs to the next token), no BOS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<s>"])
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(0, len(WORDS), 7)]
    tok.train_from_iterator(corpus, trainer)
    path = tmp_path / "bpe.json"
    tok.save(str(path))
    return load_tokenizer(path)


@pytest.fixture(params=["word-level", "byte-level-bpe"])
def tok(request, tmp_path):
    return word_level_tokenizer(tmp_path) if request.param == "word-level" else byte_level_bpe_tokenizer(tmp_path)


def test_random_prompts_have_the_exact_token_count_the_server_will_see(tok):
    ds = load_dataset(DatasetSpec(num_prompts=20, input_len=48, output_len=8, seed=1), lambda: tok)
    special = tok.num_special_tokens()
    assert len(ds.requests) == 20
    for r in ds.requests:
        assert len(tok.encode(r.prompt)) + special == 48
        assert r.prompt_len == 48
        assert r.output_len == 8
    assert len({r.prompt for r in ds.requests}) == 20  # no two alike: no accidental prefix-cache hits
    assert not any("exact" in n for n in ds.notes)


def test_special_tokens_are_left_room_for(tmp_path):
    assert word_level_tokenizer(tmp_path).num_special_tokens() == 1
    assert byte_level_bpe_tokenizer(tmp_path).num_special_tokens() == 0


def test_range_ratio_draws_lengths_from_vllms_interval(tmp_path):
    tok = word_level_tokenizer(tmp_path)
    ds = load_dataset(DatasetSpec(num_prompts=300, input_len=21, output_len=10, range_ratio=0.5, seed=2), lambda: tok)
    ins = [r.prompt_len for r in ds.requests]
    outs = [r.output_len for r in ds.requests]
    # text tokens in [floor(20·0.5), ceil(20·1.5)] = [10, 30], plus BOS; outputs in [5, 15]
    assert min(ins) == 11 and max(ins) == 31
    assert min(outs) == 5 and max(outs) == 15
    assert length_range(20, 0.5) == (10, 30)
    assert length_range(1, 0.9, minimum=1) == (1, 2)


def test_shared_prefix_groups_share_an_exact_system_prompt(tok):
    spec = DatasetSpec(name="shared-prefix", num_prompts=9, input_len=12, output_len=4, prefix_len=16, num_prefixes=3, seed=3)
    ds = load_dataset(spec, lambda: tok)
    groups = Counter(r.system for r in ds.requests)
    assert len(groups) == 3 and set(groups.values()) == {3}
    special = tok.num_special_tokens()
    for r in ds.requests:
        assert len(tok.encode(r.system)) == 16
        assert len(tok.encode(r.system + r.prompt)) + special == 16 + 12  # completions: prefix then prompt
        assert r.prompt_len == 28
    assert len({r.prompt for r in ds.requests}) == 9


def test_seed_makes_prompts_repeatable(tmp_path):
    tok = word_level_tokenizer(tmp_path)
    a = load_dataset(DatasetSpec(num_prompts=3, input_len=10, seed=5), lambda: tok).requests
    b = load_dataset(DatasetSpec(num_prompts=3, input_len=10, seed=5), lambda: tok).requests
    c = load_dataset(DatasetSpec(num_prompts=3, input_len=10, seed=6), lambda: tok).requests
    assert a == b and a != c


def test_jsonl_prompts_messages_and_repetition(tmp_path):
    tok = word_level_tokenizer(tmp_path)
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"prompt": "the river city", "output_len": 5}) + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "good morning"}], "max_tokens": 7}) + "\n"
    )
    ds = load_dataset(DatasetSpec(name="jsonl", path=str(path), num_prompts=3, shuffle=False), lambda: tok)
    r0, r1, r2 = ds.requests
    assert (r0.prompt, r0.prompt_len, r0.output_len) == ("the river city", 4, 5)
    assert r1.messages == ({"role": "user", "content": "good morning"},) and r1.output_len == 7
    assert r2 == r0
    assert any("repeated" in n for n in ds.notes)
    orders = {tuple(r.output_len for r in load_dataset(DatasetSpec(name="jsonl", path=str(path), num_prompts=2, seed=s),
                                                        lambda: tok).requests) for s in range(8)}
    assert orders == {(5, 7), (7, 5)}  # shuffled by the seed


def test_jsonl_without_a_tokenizer_leaves_lengths_to_the_server(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n")

    def no_tokenizer():
        raise ValueError("none")

    ds = load_dataset(DatasetSpec(name="jsonl", path=str(path), num_prompts=1, output_len=9), no_tokenizer)
    assert ds.requests[0].prompt_len is None and ds.requests[0].output_len == 9


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_dataset(DatasetSpec(name="jsonl", path=str(path), num_prompts=1), lambda: None)
    path.write_text(json.dumps({"text": "no prompt key"}) + "\n")
    with pytest.raises(ValueError, match='"prompt"'):
        load_dataset(DatasetSpec(name="jsonl", path=str(path), num_prompts=1), lambda: None)


def test_sharegpt_takes_first_turns_and_applies_vllms_filters(tmp_path):
    tok = word_level_tokenizer(tmp_path)
    long = " ".join(["the"] * 1100)
    data = [
        {"conversations": [{"from": "human", "value": "what is the river city like in winter"},
                           {"from": "gpt", "value": "the river city is very cold in winter time"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "the answer is long enough here"}]},  # prompt < 4
        {"conversations": [{"from": "human", "value": long}, {"from": "gpt", "value": "the answer is long enough"}]},  # > 1024
        {"conversations": [{"from": "human", "value": "only one turn here"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    ds = load_dataset(DatasetSpec(name="sharegpt", path=str(path), num_prompts=1), lambda: tok)
    [r] = ds.requests
    assert r.prompt == "what is the river city like in winter"
    assert r.prompt_len == 8 + 1
    assert r.output_len == 9  # the reply's length
    fixed = load_dataset(DatasetSpec(name="sharegpt", path=str(path), num_prompts=1, output_len=3), lambda: tok)
    assert fixed.requests[0].output_len == 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_prompts": 0}, "--num-prompts"),
        ({"input_len": 0}, "--input-len"),
        ({"range_ratio": 1.0}, "--range-ratio"),
        ({"name": "shared-prefix"}, "--prefix-len"),
        ({"name": "jsonl"}, "--dataset-path"),
        ({"name": "nope"}, "--dataset"),
    ],
)
def test_bad_specs_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DatasetSpec(**kwargs)
