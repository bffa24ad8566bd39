"""`inferlab serve --simulate PROFILE.json`: a replica without a model, for testing and
benchmarking routers with many replicas on one small machine (the idea of llm-d's inference
simulator).

`SimulatedEngine` is an engine (`AsyncLLM`'s `EngineLike`) whose forward pass is a sleep: the
real `Scheduler`, KV cache manager and prefix cache decide every step, exactly as in
`LLMEngine`, and the step lasts what the calibrated step cost model (`plan/cost_model.py`, the
one `inferlab simulate` uses) says that step's shape takes. Each sampled token is a placeholder
word, detokenized by the model's real tokenizer, so the server around it (`build_app`, the
same routes, errors, usage, /metrics, /kv_events, /server_info) answers as a real replica does,
at the times the engine would. No torch: a replica costs ~150 MB and almost no CPU.

PROFILE.json is either a step profile (`inferlab simulate --calibrate-engine --profile-out`,
fitted here by least squares) or a saved linear cost model (`--save-cost-model`).

What it cannot honour it refuses (400 naming the field): logprobs, prompt_logprobs and
structured outputs need logits; a simulated replica has none.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inferlab.config import EngineConfig
from inferlab.engine.engine_core import RequestBook, resolve_max_model_len
from inferlab.engine.generation_config import SamplingDefaults
from inferlab.engine.output_processor import OutputProcessor
from inferlab.engine.outputs import ModelRunnerOutput
from inferlab.engine.request import Request, RequestOptions, RequestOutput, SamplingParams
from inferlab.engine.scheduler import Scheduler
from inferlab.engine.tracing import TraceRecorder
from inferlab.plan.cost_model import LinearCost, fit_linear, load_profile, shape_of
from inferlab.server.protocol import ApiError
from inferlab.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Without max_tokens (and without ignore_eos) a reply ends with EOS after this many tokens,
# as a model's would end somewhere: a simulated reply never runs to the context window.
REPLY_TOKENS = 128
PLACEHOLDER = " the quick brown fox jumps over the lazy dog"
DEFAULT_KV_CACHE_BYTES = 1 << 30  # as the real engine on the CPU (engine/model_runner.py)


def load_step_clock(path: str | Path) -> LinearCost:
    """The step cost model in PROFILE.json: a saved cost model, or a profile fitted now."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"--simulate: no such file: {p}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--simulate {p}: not a readable JSON file ({e})") from None
    if isinstance(data, dict) and ("intercept_s" in data or data.get("kind") == "linear"):
        return LinearCost.from_dict(data, origin=str(p))
    try:
        return fit_linear(load_profile(p), source=str(p))
    except ValueError as e:
        raise ValueError(f"--simulate {p}: neither a saved cost model nor a step profile ({e})") from None


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What a simulated replica needs of its model: the KV cache's size per token, the context
    length, the vocabulary; no weights."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2  # K and V in float16


# GGUF value types: struct formats of the scalars; 8 = string, 9 = array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_scalars(path: Path) -> dict[str, Any]:
    """The scalar and string entries of a GGUF header, arrays skipped (the token table is most
    of a header: the gguf package's reader, which parses it all, takes seconds; this, ~0.1 s;
    transformers' reader would import torch)."""
    import struct

    with open(path, "rb") as f:

        def read(fmt: str) -> Any:
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

        def string() -> str:
            return f.read(read("Q")).decode("utf-8", "replace")

        def value(kind: int) -> Any:
            if kind in _GGUF_SCALARS:
                return read(_GGUF_SCALARS[kind])
            if kind == 8:
                return string()
            if kind == 9:
                inner, n = read("I"), read("Q")
                if inner in _GGUF_SCALARS:
                    f.seek(n * struct.calcsize(_GGUF_SCALARS[inner]), 1)
                else:
                    for _ in range(n):
                        value(inner)
                return None
            raise ValueError(f"{path}: unknown GGUF value type {kind}")

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        read("I"), read("Q")  # version, tensor count
        out: dict[str, Any] = {}
        for _ in range(read("Q")):
            key = string()
            v = value(read("I"))
            if v is not None:
                out[key] = v
        return out


def model_shape(path: Path, fmt: str) -> ModelShape:
    """From a GGUF header or a model directory's config.json."""
    if fmt == "gguf":
        meta = gguf_scalars(path)
        arch = meta.get("general.architecture")

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"{path}: the GGUF header has no {arch}.{key}")
            return value

        heads = int(get("attention.head_count"))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return ModelShape(int(get("block_count")), int(get("attention.head_count_kv", heads)),
                          int(get("attention.key_length", int(get("embedding_length")) // heads)),
                          int(get("context_length")), int(get("vocab_size", 0)) or 0,
                          (int(eos),) if eos is not None else ())  # fmt: skip
    from inferlab.models.model_config import model_config_from_hf_dir

    c = model_config_from_hf_dir(path)
    return ModelShape(c.num_layers, c.num_kv_heads, c.head_dim, c.max_position_embeddings, c.vocab_size,
                      c.eos_token_ids)  # fmt: skip


class SimulatedEngine(RequestBook):
    """The scheduler and prefix cache of `config`, stepping on `cost`'s clock (module docstring)."""

    def __init__(self, config: EngineConfig, cost: LinearCost, *, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        from inferlab.models.registry import resolve_model

        if config.speculative is not None:
            raise ValueError("--speculative-config: a simulated replica has no model to draft with")
        self.cost = cost
        self.sleep = sleep
        self.clock = clock
        resolved = resolve_model(config.load.model)
        self.tokenizer = (Tokenizer.from_gguf(resolved.path) if resolved.format == "gguf"
                          else Tokenizer.from_pretrained_dir(resolved.path))  # fmt: skip
        shape = model_shape(resolved.path, resolved.format)
        if not shape.vocab_size:
            shape = dataclasses.replace(shape, vocab_size=self.tokenizer.vocab_size)
        self.model_shape = m = shape
        self.model_name = resolved.name or "model"
        if config.chat_template is not None:
            self.tokenizer.set_chat_template(config.chat_template)
        self.sampling_defaults = SamplingDefaults()  # the placeholder words ignore sampling anyway
        cache = config.cache
        self.num_blocks = cache.num_blocks_override or max(
            1, (cache.kv_cache_memory or DEFAULT_KV_CACHE_BYTES) // (m.kv_bytes_per_token * cache.block_size))
        max_len = resolve_max_model_len(config.scheduler.max_model_len, m.max_position_embeddings,
                                        self.num_blocks * cache.block_size)
        self.scheduler_config = dataclasses.replace(config.scheduler, max_model_len=max_len)
        self.cache_config = cache
        self.eos_token_ids = tuple(sorted(set(m.eos_token_ids) | set(self.tokenizer.eos_token_ids)))
        self.words = [t for t in self.tokenizer.encode(PLACEHOLDER, add_special_tokens=False)
                      if t not in self.eos_token_ids]  # fmt: skip
        self.scheduler = Scheduler(self.scheduler_config, cache, self.num_blocks, clock=clock)
        self.output_processor = OutputProcessor(self._make_detokenizer)
        self.traces = TraceRecorder()
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()
        self.simulated_s = 0.0  # the step clock's total
        logger.info("simulated replica of %s: %d KV blocks of %d tokens, max_model_len %d; %s", self.model_name,
                    self.num_blocks, cache.block_size, self.max_model_len, "; ".join(cost.describe()))  # fmt: skip

    # ------------------------------------------------------------------ what the server reads
    @property
    def vocab_size(self) -> int:
        return self.model_shape.vocab_size

    def info(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": self.scheduler_config.max_num_batched_tokens,
            "speculative": None,
            "kv_cache": {"num_blocks": self.num_blocks, "block_size": self.cache_config.block_size,
                         "dtype": "simulated", "prefix_caching": self.cache_config.enable_prefix_caching},
            "device": "simulated",
            "simulated": {"step_cost": self.cost.describe(), "simulated_seconds": self.simulated_s},
        }  # fmt: skip

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    options: RequestOptions | None = None) -> None:  # fmt: skip
        for name in ("logprobs", "prompt_logprobs", "structured_outputs"):
            if getattr(params, name) is not None:
                raise ApiError(400, f"{name}: a simulated replica (serve --simulate) has no logits to honour it",
                               "invalid_request_error", param=name)  # fmt: skip
        super().add_request(request_id, prompt, params, options)

    # ------------------------------------------------------------------ the step
    def _token(self, request: Request) -> int:
        """The placeholder for the request's next output position (EOS to end a reply that
        nothing else bounds, after REPLY_TOKENS)."""
        pos = len(request.output_token_ids)
        if request.eos_token_ids and request.sampling_params.max_tokens is None and pos + 1 >= REPLY_TOKENS:
            return request.eos_token_ids[0]
        return self.words[pos % len(self.words)]

    def step(self) -> list[RequestOutput]:
        """Schedule; wait the step's modelled time; one placeholder token per sampling request."""
        outputs, self._pending = self._pending, []
        so = self.scheduler.schedule()
        if so.is_empty:
            return outputs
        started = self.clock()
        dt = self.cost.step_time(shape_of(so))
        self.simulated_s += dt
        left = started + dt - self.clock()
        if left > 0:
            self.sleep(left)
        ids = [s.request_id for s in so.scheduled if s.sample]
        tokens = [self._token(self.scheduler.requests[rid]) for rid in ids]
        now = self.clock()
        self.traces.on_step(so, started, now)
        return self._end_step(so, ModelRunnerOutput(ids, tokens, step_time=dt), outputs, now)
