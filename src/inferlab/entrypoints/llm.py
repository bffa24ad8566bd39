"""`LLM`: the offline API, as vLLM users know it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from inferlab.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig
from inferlab.engine.llm_engine import LLMEngine
from inferlab.engine.request import RequestOutput, SamplingParams

PromptLike = str | list[int] | dict[str, Any]


class LLM:
    """Load a model once, then generate for many prompts in continuous batches.

    model: None (the default SmolLM2-135M-Instruct), a GGUF file, a Hugging Face directory,
    or a hub id. dtype "auto" is bfloat16 where the CPU computes in it natively, else float32.
    weight_dtype is how the linear layers' weights are stored: "auto" is float16 when dtype
    "auto" resolved to float32 on the CPU and our kernels load (half the bytes a decode step
    reads), else the compute dtype; or "float32" | "bfloat16" | "float16" | "int8" | "w8a8"
    (int8 weights and int8 activations, integer dot products: where the CPU has VNNI).
    kv_cache_dtype is how K and V are stored: "auto" is float16 where "auto" weights are, else
    the compute dtype; or "float32" | "bfloat16" | "float16" | "int8" (codes with one float32
    scale per token and KV head: ~1.9x float16's tokens in the same memory).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        weight_dtype: str = "auto",
        kv_cache_dtype: str = "auto",
        load_format: str = "auto",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 2048,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        block_size: int = 16,
        kv_cache_memory: int | None = None,
        num_kv_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        num_threads: int | None = None,
        heap_trim_interval_s: float | None = 5.0,
        hf_config_path: str | None = None,
        device: str = "cpu",
    ):
        config = EngineConfig(
            load=LoadConfig(
                model=model,
                load_format=load_format,
                dtype=dtype,
                weight_dtype=weight_dtype,
                seed=seed,
                hf_config_path=hf_config_path,
                device=device,
            ),
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory=kv_cache_memory,
                num_blocks_override=num_kv_blocks,
                enable_prefix_caching=enable_prefix_caching,
                cache_dtype=kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                enable_chunked_prefill=enable_chunked_prefill,
                long_prefill_token_threshold=long_prefill_token_threshold,
            ),
            num_threads=num_threads,
            heap_trim_interval_s=heap_trim_interval_s,
        )
        self.engine = LLMEngine(config)

    def get_tokenizer(self):
        return self.engine.tokenizer

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
        params = _as_params_list(sampling_params, len(items))
        ids = []
        for item, sp in zip(items, params):
            rid = self.engine.new_request_id()
            try:
                self.engine.add_request(rid, item, sp, use_prefix_cache=use_prefix_cache, cache_salt=cache_salt)
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
