"""Tokenizer (GGUF and Hugging Face folder), chat templates, the incremental detokenizer
(UTF-8 hold-back, stop strings across token borders) and `inferlab tokenize`.

Most tests use the default model's own tokenizer (SmolLM2-135M-Instruct's GGUF, byte-level
BPE); the folder and fallback tests build a tiny byte-level BPE of their own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import inferlab.tokenizer as tokmod
from inferlab.engine.detokenizer import DetokenizerUpdate, IncrementalDetokenizer
from inferlab.tokenizer import Tokenizer

PARCEL = "Why is my parcel late? It was due on Monday."
PARCEL_PIECES = ["Why", " is", " my", " parcel", " late", "?", " It", " was", " due", " on", " Monday", "."]
# SmolLM2's ids for PARCEL, checked against the GGUF's merges by the reference BPE below.
PARCEL_IDS = [4898, 314, 957, 35598, 3008, 47, 657, 436, 1568, 335, 12397, 30]


# ---- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    try:
        from inferlab.models.registry import resolve_model
    except ImportError as e:  # the registry is written separately
        pytest.skip(f"inferlab.models.registry is not importable: {e}")
    return Path(resolve_model(None).path)


@pytest.fixture(scope="session")
def tok_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tokenizer-cache")


@pytest.fixture(scope="session")
def tok(gguf_path, tok_cache) -> Tokenizer:
    """Converted from the GGUF into a fresh cache (the cache test reloads it from there)."""
    return Tokenizer.from_gguf(gguf_path, cache_dir=tok_cache)


@pytest.fixture(scope="session")
def gguf_vocab(gguf_path) -> dict:
    """The GGUF's own tokenizer metadata, read with gguf's reader (not transformers')."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))

    def field(key):
        return reader.fields[key].contents()

    return {
        "tokens": field("tokenizer.ggml.tokens"),
        "merges": field("tokenizer.ggml.merges"),
        "chat_template": field("tokenizer.chat_template"),
        "bos": field("tokenizer.ggml.bos_token_id"),
        "eos": field("tokenizer.ggml.eos_token_id"),
    }


def make_tiny_tokenizer_dir(
    folder: Path, *, chat_template: str | None = None, add_bos: bool = False, generation_eos: list[int] | None = None
) -> Path:
    """A Hugging Face tokenizer folder with a tiny byte-level BPE trained on the spot."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<|eot_id|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello there", "stop here please"] * 20
    rust.train_from_iterator(corpus, trainer=trainer)
    kwargs = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": add_bos}
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, **kwargs)
    folder.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(folder))
    (folder / "config.json").write_text("{}")  # so the model registry accepts the folder
    if generation_eos is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return folder


# ---- the GGUF tokenizer against the GGUF's own vocabulary ------------------------------------


def _reference_bpe(text: str, tokens: list[str], merges: list[str]) -> list[int]:
    """Textbook byte-level BPE over the GGUF's merges, for ASCII text: split each digit on its
    own and words with their leading space (llama.cpp's `smollm` pre-tokenizer), then merge
    the best-ranked pair until none is left."""
    rank = {tuple(m.split(" ")): i for i, m in enumerate(merges)}
    index = {t: i for i, t in enumerate(tokens)}
    ids: list[int] = []
    for word in re.findall(r"\d|'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[^\sA-Za-z\d]+|\s+(?!\S)|\s+", text):
        parts = ["Ġ" if c == " " else ("Ċ" if c == "\n" else c) for c in word]
        while len(parts) > 1:
            pairs = [(rank.get(p, 1 << 30), i) for i, p in enumerate(zip(parts, parts[1:]))]
            best, i = min(pairs)
            if best == 1 << 30:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids.extend(index[p] for p in parts)
    return ids


@pytest.mark.parametrize(
    "text", [PARCEL, "In 2024, 3 cats ate 12 fish!", "Hello world\n\nThe end.  Two  spaces", "It's 9:30 o'clock"]
)
def test_encode_matches_reference_bpe_over_the_gguf_merges(tok, gguf_vocab, text):
    assert tok.encode(text) == _reference_bpe(text, gguf_vocab["tokens"], gguf_vocab["merges"])


def test_parcel_prompt_pieces(tok, gguf_vocab):
    ids = tok.encode(PARCEL)
    assert ids == PARCEL_IDS
    assert [tok.id_to_piece(i) for i in ids] == PARCEL_PIECES
    assert tok.convert_ids_to_tokens(ids) == [gguf_vocab["tokens"][i] for i in ids]
    assert tok.convert_ids_to_tokens(ids)[1] == "Ġis"
    assert tok.decode(ids) == PARCEL


def test_digits_are_split_one_by_one(tok):
    ids = tok.encode(" 2024")
    assert [tok.id_to_piece(i) for i in ids] == [" ", "2", "0", "2", "4"]


def test_special_ids_and_bos_handling(tok, gguf_vocab):
    assert tok.bos_token_id == gguf_vocab["bos"] == 1
    assert tok.eos_token_id == gguf_vocab["eos"] == 2
    # SmolLM2's GGUF says add_bos_token = false: no BOS by default, as llama.cpp does.
    assert tok.add_bos_token is False
    assert tok.encode("hi")[0] != tok.bos_token_id
    # <|im_end|> (EOS) first, then <|endoftext|>, which llama.cpp also treats as end of generation.
    assert tok.eos_token_ids == (2, 0)
    special = {i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special}
    assert special == set(range(17))  # the GGUF's 17 control tokens
    assert tok.vocab_size == len(gguf_vocab["tokens"]) == 49152
    # Special-token text in a prompt is that token, not its characters.
    assert tok.encode("<|im_start|>user") == [1, tok.encode("user")[0]]


ROUND_TRIP_TEXTS = ["", "plain ascii", "naïve café — 漢字 😀 𝔘𝔫𝔦 ﷺ", "tabs\tand\nnewlines\r\n", "  lead"]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_pieces_of_a_split_character_show_bytes(tok):
    ids = tok.encode("😀")
    assert len(ids) >= 2, "the emoji must span several tokens for this test"
    assert b"".join(tok.token_bytes(i) for i in ids) == "😀".encode()
    assert all(re.fullmatch(r"(<0x[0-9A-F]{2}>)+", tok.id_to_piece(i)) for i in ids)
    assert tok.id_to_piece(tok.eos_token_id) == "<|im_end|>"
    with pytest.raises(ValueError, match="out of range"):
        tok.id_to_piece(10**6)


def test_gguf_conversion_is_cached_and_reused(tok, gguf_path, tok_cache, monkeypatch):
    entries = [p for p in tok_cache.iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").is_file()
    source = json.loads((entries[0] / tokmod._CACHE_MARKER).read_text())
    assert source["gguf"] == str(gguf_path.resolve())

    def no_conversion(path):
        raise AssertionError("the cached tokenizer should have been used")

    monkeypatch.setattr(tokmod, "_convert_gguf_tokenizer", no_conversion)
    again = Tokenizer.from_gguf(gguf_path, cache_dir=tok_cache)
    texts = [PARCEL, "In 2024 naïve 漢字 😀", "<|im_start|>assistant\nhi<|im_end|>"]
    assert [again.encode(t) for t in texts] == [tok.encode(t) for t in texts]
    assert again.chat_template == tok.chat_template
    assert again.eos_token_ids == tok.eos_token_ids


def test_from_path_tells_gguf_from_folder(tmp_path, gguf_path, tok_cache):
    assert Tokenizer.from_path(gguf_path, cache_dir=tok_cache).encode(PARCEL) == PARCEL_IDS
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_path(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf")
    with pytest.raises(ValueError, match="neither a GGUF"):
        Tokenizer.from_path(junk)


# ---- chat templates ---------------------------------------------------------------------------


def test_chat_template_is_the_ggufs_own(tok, gguf_vocab):
    assert tok.chat_template == gguf_vocab["chat_template"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PARCEL}]
    text = tok.render_chat(messages)
    assert text == (
        f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{PARCEL}<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids[-4:] == [1, 520, 9531, 198]  # <|im_start|> assistant \n
    assert ids.count(1) == 3 and ids.count(2) == 2
    assert tok.decode(ids, skip_special_tokens=False) == text
    no_prompt = tok.render_chat(messages, add_generation_prompt=False)
    assert not no_prompt.endswith("assistant\n") and text.startswith(no_prompt)


def test_chat_template_adds_default_system_prompt(tok):
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.parametrize(
    "messages, problem",
    [
        ("hello", "must be a list"),
        ([], "must not be empty"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"content": "hi"}], r"messages\[0\]: 'role'"),
        ([{"role": 3, "content": "hi"}], r"'role' must be a non-empty string"),
        ([{"role": "user"}], r"messages\[0\] has no 'content'"),
        ([{"role": "user", "content": 5}], "'content' must be a string"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text content parts"),
    ],
)
def test_malformed_messages_are_refused(tok, messages, problem):
    with pytest.raises(ValueError, match=problem):
        tok.apply_chat_template(messages)


def test_text_content_parts_are_joined(tok):
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    joined = tok.render_chat([{"role": "user", "content": "a\nb"}])
    assert tok.render_chat([{"role": "user", "content": parts}]) == joined


def test_folder_tokenizer_template_bos_and_generation_eos(tmp_path):
    template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    folder = make_tiny_tokenizer_dir(tmp_path / "tiny", chat_template=template, add_bos=True, generation_eos=[1, 2])
    t = Tokenizer.from_pretrained_dir(folder)
    assert t.render_chat([{"role": "user", "content": "hello"}]) == "[user]hello[assistant]"
    assert t.add_bos_token is True
    ids = t.encode("hello world")
    assert ids[0] == t.bos_token_id == 0 and t.encode("hello world", add_special_tokens=False) == ids[1:]
    assert t.decode(ids) == "hello world"
    # The chat path adds no BOS of its own: this template does not write one.
    assert t.bos_token_id not in t.apply_chat_template([{"role": "user", "content": "hello"}])
    assert t.eos_token_ids == (1, 2)  # </s>, then <|eot_id|> (generation_config.json; a known end-of-turn too)


def test_folder_tokenizer_without_template_falls_back_to_chatml(tmp_path):
    t = Tokenizer.from_pretrained_dir(make_tiny_tokenizer_dir(tmp_path / "plain"))
    assert t.chat_template is None
    text = t.render_chat([{"role": "user", "content": "hello"}])
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert t.add_bos_token is False and t.encode("hello")[0] != t.bos_token_id


def test_template_errors_become_value_errors(tmp_path):
    template = "{{ raise_exception('roles must alternate') }}"
    t = Tokenizer.from_pretrained_dir(make_tiny_tokenizer_dir(tmp_path / "strict", chat_template=template))
    with pytest.raises(ValueError, match="roles must alternate"):
        t.render_chat([{"role": "user", "content": "x"}])


def test_missing_folder():
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_pretrained_dir("/nonexistent/model/folder")


# ---- incremental detokenizer ------------------------------------------------------------------


def _detok(tok, prompt=(), stop=(), include_stop=False, skip_special=True) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(
        tok, list(prompt), stop=list(stop), include_stop_str_in_output=include_stop, skip_special_tokens=skip_special
    )


def _stream(detok: IncrementalDetokenizer, ids: list[int], step: int = 1) -> list[DetokenizerUpdate]:
    return [detok.update(ids[i : i + step]) for i in range(0, len(ids), step)]


def _split_char_ids(tok: Tokenizer, text: str, char: str) -> tuple[list[int], int]:
    """Ids of `text` and the index of a token that ends in the middle of `char`."""
    ids = tok.encode(text)
    pos = 0
    for k, i in enumerate(ids):
        pos += len(tok.token_bytes(i))
        start = text.encode().index(char.encode())
        if start < pos < start + len(char.encode()):
            return ids, k
    raise AssertionError(f"no token ends inside {char!r}: pick another character")


@pytest.mark.parametrize("char", ["😀", "漢"])
def test_never_emits_half_a_character(tok, char):
    text = f"Hello {char} world {char}!"
    ids, mid = _split_char_ids(tok, text, char)
    detok = _detok(tok, tok.encode("a prompt"))
    updates = _stream(detok, ids)
    assert updates[mid].text_delta == ""  # held: the character is not complete yet
    assert all("\ufffd" not in u.text_delta for u in updates)
    assert "".join(u.text_delta for u in updates) == text == detok.text
    assert detok.finalize() == ""


def test_several_tokens_per_update(tok):
    text = "naïve café — 漢字 😀 𝔘𝔫𝔦 and more"
    ids = tok.encode(text)
    detok = _detok(tok)
    deltas = [u.text_delta for u in _stream(detok, ids, step=3)] + [detok.finalize()]
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)


def test_prompt_context_keeps_the_leading_space(tok):
    prompt = tok.encode("Say hello:")
    detok = _detok(tok, prompt)
    assert detok.update(tok.encode(" hi there")).text_delta == " hi there"


def test_finalize_flushes_an_incomplete_character(tok):
    ids = tok.encode("ok 😀")
    assert len(ids) >= 3
    detok = _detok(tok)
    out = "".join(u.text_delta for u in _stream(detok, ids[:-1]))
    assert "\ufffd" not in out
    tail = detok.finalize()  # the request ended (e.g. max_tokens) mid-character
    assert out + tail == tok.decode(ids[:-1]) and tail.endswith("\ufffd")
    assert detok.update(ids[-1:]) == DetokenizerUpdate("")  # finished: ignored


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("Hi.<|im_end|>")
    skip = _detok(tok)
    keep = _detok(tok, skip_special=False)
    assert "".join(u.text_delta for u in _stream(skip, ids)) + skip.finalize() == "Hi."
    assert "".join(u.text_delta for u in _stream(keep, ids)) + keep.finalize() == "Hi.<|im_end|>"
    eos_ended = _detok(tok, skip_special=False)
    assert eos_ended.update(ids, stop_terminated=True).text_delta == "Hi."


def test_stop_string_across_token_borders(tok):
    text = "Hello world, the end is near"
    ids = tok.encode(text)
    stop = "d, th"  # the end of " world", ",", the start of " the": three tokens
    assert not any(stop in tok.id_to_piece(i) for i in ids)
    detok = _detok(tok, stop=["zzz", stop])
    updates = _stream(detok, ids)
    hits = [k for k, u in enumerate(updates) if u.stop_string is not None]
    assert len(hits) == 1 and updates[hits[0]].stop_string == stop == detok.stop_string
    assert "".join(u.text_delta for u in updates) == "Hello worl" == detok.text
    assert all(u == DetokenizerUpdate("") for u in updates[hits[0] + 1 :])  # nothing after the stop
    assert detok.finished and detok.finalize() == ""


def test_include_stop_str_in_output(tok):
    ids = tok.encode("Answer: 42. User: next question")
    detok = _detok(tok, stop=["User:"], include_stop=True)
    updates = _stream(detok, ids)
    assert detok.text == "Answer: 42. User:" == "".join(u.text_delta for u in updates)
    assert detok.stop_string == "User:"


def test_earliest_stop_string_wins_within_one_update(tok):
    ids = tok.encode("one two three four")
    detok = _detok(tok, stop=["four", "two"])
    u = detok.update(ids)
    assert u == DetokenizerUpdate("one ", "two")


def test_stop_string_prefix_is_held_then_released(tok):
    detok = _detok(tok, stop=["world peace"])
    deltas = []
    for word in ["Hello", " world", " order", " then", " now"]:
        (i,) = tok.encode(word)
        deltas.append(detok.update([i]).text_delta)
    # " world" may begin "world peace": only the space goes out; " order" proves it does not.
    assert deltas == ["Hello", " ", "world order", " then", " no"]  # "w" may begin it too
    assert detok.stop_string is None


def test_held_stop_prefix_is_flushed_by_finalize(tok):
    detok = _detok(tok, stop=["world peace"])
    out = "".join(u.text_delta for u in _stream(detok, tok.encode("Hello world")))
    assert out == "Hello "
    assert detok.finalize() == "world"  # finished for another reason (length): release it
    assert detok.text == "Hello world" and detok.stop_string is None


def test_partial_stop_suffix_len():
    from inferlab.engine import detokenizer

    f = detokenizer._partial_stop_suffix_len
    assert f("abc", ["cde"]) == 1
    assert f("abcd", ["bcdx", "cdxy"]) == 3
    assert f("abc", ["xyz"]) == 0
    assert f("", ["a"]) == 0
    assert f("aab", ["aaab"]) == 0 and f("aaa", ["aaab"]) == 3


class _CountingBackend:
    """Wraps the Rust tokenizer and records the length of every decode call."""

    def __init__(self, backend):
        self._backend = backend
        self.lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decoding_work_per_token_does_not_grow_with_the_output(tok):
    ids = tok.encode("The quick brown fox jumps over the lazy dog. 漢字 😀 " * 40)
    assert len(ids) > 500
    counting = _CountingBackend(tok.backend)

    class _Tok:
        backend = counting

    detok = _detok(_Tok(), tok.encode("prompt " * 50), stop=["###"])
    for i in ids:
        detok.update([i])
    assert detok.text + detok.finalize() == tok.decode(ids)
    assert max(counting.lengths) <= 10  # a small window, however long the output
    assert len(counting.lengths) <= 2 * len(ids) + 2


# ---- inferlab tokenize ------------------------------------------------------------------------


def test_cli_prints_one_line_per_token_and_the_count(gguf_path, capsys):
    from inferlab.cli import main

    assert main(["tokenize", "-m", str(gguf_path), "-p", PARCEL, "--show-count"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["  4898 -> 'Why'", "   314 -> ' is'"]
    assert lines[:-1] == [f"{i:6d} -> '{p}'" for i, p in zip(PARCEL_IDS, PARCEL_PIECES)]
    assert lines[-1] == "Total number of tokens: 12"


def test_cli_default_model_and_ids(gguf_path, capsys):
    from inferlab.cli import main

    assert main(["tokenize", "-p", PARCEL, "--ids"]) == 0
    assert capsys.readouterr().out.strip() == str(PARCEL_IDS)


def test_cli_no_bos_and_no_parse_special(tmp_path, capsys):
    from inferlab.cli import main

    folder = make_tiny_tokenizer_dir(tmp_path / "bos", add_bos=True)
    assert main(["tokenize", "-m", str(folder), "-p", "hello"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "     0 -> '<s>'"
    assert main(["tokenize", "-m", str(folder), "-p", "hello", "--no-bos", "--show-count"]) == 0
    out = capsys.readouterr().out
    assert "<s>" not in out
    assert main(["tokenize", "-m", str(folder), "-p", "</s>", "--no-bos", "--no-parse-special", "--show-count"]) == 0
    out = capsys.readouterr().out
    assert "'</s>'" not in out and int(out.splitlines()[-1].split(": ")[1]) > 1


def test_cli_errors_are_one_line(tmp_path, capsys):
    from inferlab.cli import main

    assert main(["tokenize", "-m", str(tmp_path / "nope.gguf"), "-p", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("inferlab tokenize: error:") and len(err.strip().splitlines()) == 1
    assert main(["tokenize", "-m", str(tmp_path)]) == 2  # no text given
