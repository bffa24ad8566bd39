"""`LLM`: the offline API, as vLLM users know it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from inferlab.engine.engine_args import EngineArgs
from inferlab.engine.llm_engine import LLMEngine
from inferlab.engine.request import RequestOptions, RequestOutput, SamplingParams

PromptLike = str | list[int] | dict[str, Any]


class LLM:
    """Load a model once, then generate for many prompts in continuous batches.

    model: None (the default SmolLM2-135M-Instruct), a GGUF file, a Hugging Face directory,
    or a hub id. dtype "auto" is bfloat16 where the CPU computes in it natively, else float32.
    weight_dtype is how the linear layers' weights are stored: "auto" is float16 when dtype
    "auto" resolved to float32 on the CPU and our kernels load (half the bytes a decode step
    reads), else the compute dtype; or "float32" | "bfloat16" | "float16" | "int8" | "w8a8"
    (int8 weights and int8 activations, integer dot products: where our kernels load).
    kv_cache_dtype is how K and V are stored: "auto" is float16 where "auto" weights are, else
    the compute dtype; or "float32" | "bfloat16" | "float16" | "int8" (codes with one float32
    scale per token and KV head: ~1.9x float16's tokens in the same memory). Every other engine
    setting is a keyword too: the fields of EngineArgs, the same settings `inferlab serve` takes.
    """

    def __init__(self, model: str | None = None, **engine_args: Any):
        """`engine_args`: any field of EngineArgs (engine/engine_args.py), e.g. dtype="float32",
        max_num_seqs=8; an unknown name is a TypeError naming it."""
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args).create_engine_config())

    def shutdown(self) -> None:
        """Stop the processes the engine started (tensor-parallel ranks; they also stop when this
        object is collected or the program exits)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        return cls(**dataclasses.asdict(engine_args))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams at the model's sampling defaults (what `generate` uses without any)."""
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_prefix_cache: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of the prompts.

        A prompt is a string, a list of token ids, or {"prompt": ...} / {"prompt_token_ids": [...]}.
        Bad input raises ValueError before anything runs.
        """
        items = _as_prompt_list(prompts)
        if sampling_params is None:  # the model's defaults, as vLLM's LLM takes them
            sampling_params = self.engine.default_sampling_params()
        params = _as_params_list(sampling_params, len(items))
        options = RequestOptions(cache_salt=cache_salt, use_prefix_cache=use_prefix_cache)  # arrival: when added
        ids = []
        for item, sp in zip(items, params):
            rid = self.engine.new_request_id()
            try:
                self.engine.add_request(rid, item, sp, options)
            except Exception:
                self.engine.abort_request(ids)  # leave the engine as we found it
                raise
            ids.append(rid)
        return self._run(ids)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} messages) or a list of them."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        if messages and isinstance(messages[0], dict):
            conversations = [messages]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        prompts = [tok.apply_chat_template(conv, add_generation_prompt=True) for conv in conversations]
        return self.generate(prompts, sampling_params, **kwargs)

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        wanted = set(request_ids)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(wanted):
            if not self.engine.has_unfinished_requests():
                raise RuntimeError("the engine stopped before every request finished")
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
            self.engine.trim_heap()
        return [done[r] for r in request_ids]


def _as_prompt_list(prompts: PromptLike | Sequence[PromptLike]) -> list[str | list[int]]:
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    elif isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        prompts = [prompts]
    out: list[str | list[int]] = []
    for p in prompts:  # type: ignore[union-attr]
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                out.append(list(p["prompt_token_ids"]))
            elif "prompt" in p:
                out.append(p["prompt"])
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(p, (str, list)):
            out.append(p)
        else:
            raise ValueError(f"a prompt must be a string, a list of token ids or a dict, not {type(p).__name__}")
    if not out:
        raise ValueError("no prompts given")
    return out


def _as_params_list(sp: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(sp, SamplingParams):
        return [sp] * n
    sp = list(sp)
    if len(sp) != n:
        raise ValueError(f"got {len(sp)} SamplingParams for {n} prompts")
    return sp
