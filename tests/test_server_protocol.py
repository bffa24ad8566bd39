"""Request bodies → SamplingParams: every field reaches the engine under its own name."""

from __future__ import annotations

import pytest

from inferlab.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest

FIELDS = {"n": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "seed": 11,
          "presence_penalty": 0.3, "frequency_penalty": 0.2, "repetition_penalty": 1.1, "min_tokens": 2,
          "stop": ["\n\n"], "stop_token_ids": [7], "ignore_eos": True, "include_stop_str_in_output": True,
          "skip_special_tokens": False}  # fmt: skip


def _params(kind, **body):
    if kind == "chat":
        return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})
    return CompletionRequest.model_validate({"prompt": "hi", **body})


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_every_sampling_field_is_mapped(kind):
    p = _params(kind, max_tokens=9, **FIELDS).to_sampling_params()
    for name, value in FIELDS.items():
        assert getattr(p, name) == value, name
    assert p.max_tokens == 9


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_absent_fields_take_the_neutral_defaults(kind):
    p = _params(kind).to_sampling_params()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs, p.prompt_logprobs) == ([], [], False, None, None)


def test_logprobs_mapping_per_route():
    chat = _params("chat", logprobs=True, top_logprobs=3).to_sampling_params()
    assert chat.logprobs == 3
    assert _params("chat", logprobs=True).to_sampling_params().logprobs == 0
    with pytest.raises(ApiError, match="top_logprobs needs logprobs"):
        _params("chat", top_logprobs=3).to_sampling_params()
    comp = _params("completion", logprobs=2, echo=True, prompt_logprobs=4).to_sampling_params()
    assert (comp.logprobs, comp.prompt_logprobs) == (2, 4)
    assert _params("chat", max_completion_tokens=5, max_tokens=9).to_sampling_params().max_tokens == 5


def test_a_bad_value_is_a_400_naming_the_field():
    with pytest.raises(ApiError) as e:
        _params("completion", temperature=-1.0).to_sampling_params()
    assert e.value.status == 400 and "temperature" in str(e.value)
