"""Reasoning and the chat template: `--reasoning-parser qwen3` (think blocks into
reasoning_content, whole and streamed), `chat_template_kwargs`, `--chat-template`."""

from __future__ import annotations

import pytest

from inferlab.engine.engine_args import EngineArgs, read_chat_template
from inferlab.server.reasoning import ReasoningStream, split_reasoning


def test_split_reasoning():
    assert split_reasoning("<think>\nfirst, 2+2\n</think>\n\nIt is 4.") == ("first, 2+2", "It is 4.")
    assert split_reasoning("It is 4.") == (None, "It is 4.")
    assert split_reasoning("<think>still going") == ("still going", "")  # cut short: all thinking
    assert split_reasoning("<think></think>Hi") == (None, "Hi")


def _stream(pieces):
    s = ReasoningStream()
    r = c = ""
    for p in pieces:
        a, b = s.feed(p)
        r, c = r + a, c + b
    a, b = s.finish()
    return r + a, c + b


@pytest.mark.parametrize("text", ["<think>step one</think>The answer.", "The answer, no thinking.", "<think>cut",
                                  "<thi", "<think>a</thi", "  <think>x</think>y"])
def test_streamed_reasoning_matches_the_whole(text):
    whole_r, whole_c = split_reasoning(text)
    for size in (1, 2, 5):
        r, c = _stream([text[i : i + size] for i in range(0, len(text), size)])
        assert (r.strip() or None, c) == (whole_r, whole_c), (text, size)


def test_streamed_reasoning_holds_back_a_partial_tag():
    s = ReasoningStream()
    assert s.feed("<thi") == ("", "")
    assert s.feed("nk>plan") == ("plan", "")
    assert s.feed(" more</th") == (" more", "")
    assert s.feed("ink>Done") == ("", "Done")


def test_chat_template_kwargs_and_chat_template(tmp_path):
    from inferlab.models.testing import save_tiny_tokenizer
    from inferlab.server.protocol import ApiError, ChatCompletionRequest, ChatMessage
    from inferlab.server.serving import OpenAIServing
    from inferlab.tokenizer import Tokenizer

    template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if enable_thinking %}<think>{% endif %}"
    tok = Tokenizer.from_pretrained_dir(save_tiny_tokenizer(tmp_path / "t"))
    tok.set_chat_template(template)
    msgs = [ChatMessage(role="user", content="hi")]
    on = tok.decode(OpenAIServing._chat_prompt(tok, msgs, True, None, {"enable_thinking": True}), skip_special_tokens=False)
    off = tok.decode(OpenAIServing._chat_prompt(tok, msgs, True, None, {"enable_thinking": False}), skip_special_tokens=False)
    assert on == "hi<think>" and off == "hi"
    with pytest.raises(ApiError) as e:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                              "chat_template_kwargs": {"tokenize": True}})
    assert e.value.param == "chat_template_kwargs"

    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert read_chat_template(str(path)) == template == read_chat_template(template)
    with pytest.raises(ValueError, match="chat_template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    assert EngineArgs(chat_template=str(path)).create_engine_config().chat_template == template


def test_chat_template_flag_reaches_the_engine(tmp_path):
    from inferlab import LLM, SamplingParams
    from inferlab.models.testing import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path, arch="llama")
    (tmp_path / "t.jinja").write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32, max_model_len=256, num_threads=1,
              chat_template=str(tmp_path / "t.jinja"))
    out = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=1))[0]
    assert llm.engine.tokenizer.decode(out.prompt_token_ids) == "[user] hello\n"
