"""`LLMEngine`: one object that owns the tokenizer, the scheduler and the model runner, and
moves every request one step forward per `step()` call. Not thread-safe: `AsyncLLM` runs it
on one thread; the offline `LLM` calls it in a loop.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from inferlab.config import EngineConfig
from inferlab.engine.draft_proposer import DraftModelProposer, build_draft_proposer
from inferlab.engine.engine_core import RequestBook, resolve_max_model_len
from inferlab.engine.generation_config import resolve_sampling_defaults
from inferlab.engine.heap import HeapTrimmer
from inferlab.engine.model_runner import ModelRunner, num_kv_blocks
from inferlab.engine.output_processor import OutputProcessor
from inferlab.engine.outputs import ModelRunnerOutput, SchedulerOutput
from inferlab.engine.request import RequestOutput, SamplingParams, StructuredOutputsParams
from inferlab.engine.scheduler import Scheduler
from inferlab.engine.spec_policy import measured_step_cost
from inferlab.engine.structured_outputs import GrammarCompiler
from inferlab.engine.tracing import TraceRecorder
from inferlab.models.backends import select_backends
from inferlab.models.loader import load_model
from inferlab.models.precision import resolve_precision
from inferlab.models.registry import resolve_model
from inferlab.models.tp import tp_backends
from inferlab.tokenizer import Tokenizer

if TYPE_CHECKING:
    from inferlab.engine.tp_worker import TensorParallelGroup

logger = logging.getLogger(__name__)


class LLMEngine(RequestBook):
    def __init__(self, config: EngineConfig):
        self.parallel: TensorParallelGroup | None = None  # tensor parallel: the other ranks
        try:
            self._build(config)
        except BaseException:
            self.shutdown()  # no rank outlives an engine that failed to start
            raise

    def shutdown(self) -> None:
        """Stop what the engine started besides this thread (the tensor-parallel ranks); the
        engine cannot step afterwards. Idempotent."""
        if self.parallel is not None:
            self.parallel.shutdown()

    def _build(self, config: EngineConfig) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        load = config.load
        if load.load_format == "dummy" and load.model is None and load.hf_config_path is None:
            raise ValueError("load_format='dummy' needs a model (a config.json or a model directory)")
        # Every precision decision, once (building the kernels now, before /health says ready);
        # the loader, the runner and the decoder take it as it is.
        self.precision = resolve_precision(load, config.cache)
        resolved = resolve_model(load.model) if load.load_format != "dummy" or load.model else None
        if config.parallel.tensor_parallel_size > 1:  # checks the heads split, before any weight loads
            from inferlab.engine.tp_worker import TensorParallelGroup

            self.parallel = TensorParallelGroup.start(
                config, self.precision, resolved.path if resolved is not None else None,
                lambda m: num_kv_blocks(config.cache, self.precision.kv_bytes_per_token(m)))
        loaded = load_model(load, resolved.path if resolved is not None else None, precision=self.precision)
        self.model_config = loaded.config
        self.model_name = (resolved.name if resolved is not None else "") or loaded.config.name or "model"
        self.tokenizer = _load_tokenizer(resolved)
        if config.chat_template is not None:
            if self.tokenizer is None:
                raise ValueError("chat_template: this model has no tokenizer to use it with")
            self.tokenizer.set_chat_template(config.chat_template)
            logger.info("chat template: the one given (--chat-template), not the model's")
        self.model_path = resolved.path if resolved is not None else loaded.source_path
        self.sampling_defaults = resolve_sampling_defaults(
            config.sampling_defaults, loaded.sampling_defaults, _SOURCE_NAMES.get(loaded.format, loaded.format),
            is_gguf=loaded.format == "gguf", override=config.override_generation_config,
        )
        logger.info("sampling defaults: %s", self.sampling_defaults.describe())

        logger.info("%s", self.precision.describe(loaded.config))
        self.backends = select_backends(self.precision, loaded.config, load.decoder_backend, load.attention_backend)
        if self.parallel is not None:
            self.backends = tp_backends(self.backends)  # every rank's, the runner's too: no whole-step kernel across ranks
        logger.info("%s", self.backends.describe())
        self.runner = ModelRunner(loaded.config, loaded.weights, self.precision, config.cache, seed=load.seed,
                                  backends=self.backends, parallel=self.parallel)
        del loaded
        self.num_blocks = self.runner.num_blocks
        pool_tokens = self.num_blocks * config.cache.block_size
        max_len = resolve_max_model_len(config.scheduler.max_model_len, self.model_config.max_position_embeddings,
                                        pool_tokens)
        self.scheduler_config = dataclasses.replace(config.scheduler, max_model_len=max_len)
        if not self.scheduler_config.enable_chunked_prefill and self.scheduler_config.max_num_batched_tokens < max_len:
            self.scheduler_config = dataclasses.replace(self.scheduler_config, max_num_batched_tokens=max_len)
        self.cache_config = config.cache
        self.config = dataclasses.replace(config, scheduler=self.scheduler_config)
        self.speculative_config = config.speculative
        self.draft_proposer: DraftModelProposer | None = None
        if config.speculative is not None and config.speculative.method == "draft_model":
            self.draft_proposer = build_draft_proposer(config.speculative, self.model_config, self.model_name, load,
                                                       config.cache, self.num_blocks, self.scheduler_config.max_num_seqs,
                                                       self.precision)
            self.runner.draft_probs = self.draft_proposer.probs_of
        self.scheduler = self._new_scheduler()
        self.eos_token_ids = tuple(
            sorted(set(self.model_config.eos_token_ids) | set(getattr(self.tokenizer, "eos_token_ids", ()) or ()))
        )
        self.grammars = (GrammarCompiler(self.tokenizer.hf, self.vocab_size, self.eos_token_ids)
                         if self.tokenizer is not None else None)
        tok = self.tokenizer
        token_text = (lambda i: tok.decode([i], skip_special_tokens=False)) if tok is not None else None
        self.output_processor = OutputProcessor(self._make_detokenizer, token_text)
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        self._ids = itertools.count()
        # Called after every forward pass with (SchedulerOutput, ModelRunnerOutput): profiling
        # and the planner's calibration record step shapes and times through it.
        self.step_observer: Callable[[SchedulerOutput, ModelRunnerOutput], None] | None = None
        self.heap_trimmer = HeapTrimmer(config.heap_trim_interval_s)
        self.traces = TraceRecorder()  # each recent request's spans (engine/tracing.py)
        self._warm_up()

    def _warm_up(self) -> None:
        """Run one short request (a prefill, decode steps, the sampler) and one budget-sized prefill
        before anyone else can.

        What a first request would otherwise pay (kernels built and loaded, oneDNN primitives
        created, pages touched, ~18 s on a cold machine) is paid while the server still answers
        /health with 503, so a ready engine's first request is as fast as its second. The
        scheduler is then made anew: no cached prefix, no counted query is left from it. The heap
        is not trimmed after it (the AsyncLLM loop trims once the server has been idle a while).
        """
        vocab = self.model_config.vocab_size
        prompt = [i % vocab for i in range(1, 1 + min(32, self.max_model_len - 4))]
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        self.add_request("inferlab-warm-up", prompt, params)
        while self.has_unfinished_requests():
            self.step()
        # Then one step as large as the token budget allows (up to 2,048 tokens): its activations'
        # pages are touched here, and the heap is left holding them, so a first long prompt does
        # not fault them in (a 1,024-token first request paid ~20,000 page faults, ~10% of its
        # TTFT on the Xeon kind; vLLM's start-up profile run primes the same way).
        big = min(self.scheduler_config.max_num_batched_tokens, 2048, self.max_model_len - 1,
                  (self.num_blocks - 1) * self.cache_config.block_size)
        if big > len(prompt):
            self.add_request("inferlab-warm-up-big", [(7 * i + 3) % vocab for i in range(big)],
                             SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
            while self.has_unfinished_requests():
                self.step()
        cost = self._measure_step_cost() if self.scheduler.policy is not None else None
        self.scheduler = self._new_scheduler(cost)
        self.traces.clear()

    def _measure_step_cost(self) -> tuple[float, float] | None:
        """For the speculation rule: (a, b) of the decode step's cost a + b·rows on this machine,
        from 8 decode steps of one row and 8 of up to 32, every row attending to a 256-token
        context (a draft row's cost is its products and its attention); spec_policy.py says why
        the rule needs it. The 256 prompt tokens are computed once: the other requests find them
        in the prefix cache. ~0.7 s at start-up, only with adaptive speculation; None where it
        cannot be measured."""
        ctx = min(256, self.max_model_len - 10)
        block = self.cache_config.block_size
        rows = min(self.scheduler_config.max_num_seqs, 32, (self.num_blocks - ctx // block - 1) // 2)
        if rows < 4 or ctx < 16 or not self.cache_config.enable_prefix_caching:
            return None
        vocab = self.model_config.vocab_size
        prompt = [(31 * j + 7) % vocab for j in range(ctx)]
        params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
        steps: list[tuple[int, float]] = []

        def record(so: SchedulerOutput, ro: ModelRunnerOutput) -> None:
            if so.decode_only:
                steps.append((so.num_scheduled_tokens, ro.step_time))

        observer, self.step_observer = self.step_observer, record
        try:
            for n in (1, rows):
                for i in range(n):
                    self.add_request(f"inferlab-warm-up-{n}-{i}", prompt, params)
                while self.has_unfinished_requests():
                    self.step()
        finally:
            self.step_observer = observer
        cost = measured_step_cost(steps)
        if cost is not None:
            logger.info("speculation: a decode step of T rows costs %.1f ms + %.2f ms x T here (measured at start-up: "
                        "decode steps of 1 and %d rows, %d-token contexts)", cost[0] * 1e3, cost[1] * 1e3, rows, ctx)
        return cost

    def _new_scheduler(self, step_cost: tuple[float, float] | None = None) -> Scheduler:
        if self.draft_proposer is not None:
            self.draft_proposer.reset()
        return Scheduler(self.scheduler_config, self.cache_config, self.num_blocks,
                         speculative_config=self.speculative_config, proposer=self.draft_proposer,
                         step_cost=step_cost)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """SamplingParams at this engine's sampling defaults (vLLM's get_default_sampling_params):
        what the offline LLM uses when no SamplingParams are given."""
        return SamplingParams(**{**self.sampling_defaults.values(), **overrides})  # type: ignore[arg-type]

    def info(self) -> dict[str, Any]:
        """What this engine decided, for `GET /server_info` and the benchmarks that read it
        instead of guessing from flags: precision, kernels, KV cache, limits."""
        model = self.runner.model
        precision = self.precision.as_dict(self.model_config)
        return {
            "model": self.model_name,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": self.scheduler_config.max_num_batched_tokens,
            "speculative": dataclasses.asdict(self.speculative_config) if self.speculative_config else None,
            # The engine's ResolvedPrecision (compute, weights, kv_cache, int8_activations as
            # before; products, kernel path, K/V bytes per token, the fallbacks' reasons).
            "precision": {**precision, "summary": model.describe_precision()},
            "kv_cache": {"num_blocks": self.num_blocks, "block_size": self.cache_config.block_size,
                         "dtype": precision["kv_cache"],
                         "bytes_per_token": self.runner.kv_bytes_per_token,
                         "prefix_caching": self.cache_config.enable_prefix_caching},  # fmt: skip
            "kernels": self.precision.kernel.as_dict(),
            "backends": self.backends.as_dict(),
            "device": str(self.runner.device),
            "tensor_parallel_size": self.config.parallel.tensor_parallel_size,
            "sampling_defaults": self.sampling_defaults.as_dict(),
            "model_path": str(self.model_path) if self.model_path is not None else None,
        }

    def _grammar_factory(self, so: StructuredOutputsParams) -> Callable[[], Any]:
        self.compile_grammar(so)  # the server has compiled it already: a cache hit
        grammars = self.grammars
        assert grammars is not None  # else compile_grammar raised
        return lambda: grammars.matcher(so)

    def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """Compile a structured-outputs constraint into the cache; ValueError naming the problem.
        Thread-safe: the server calls it on a worker thread, off the engine's step loop."""
        if self.grammars is None:
            raise ValueError(f"{params.source} needs the model's tokenizer, and this model has none")
        self.grammars.compile(params)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, update; the outputs of every request that moved."""
        outputs, self._pending = self._pending, []
        so = self.scheduler.schedule()
        if so.is_empty:
            return self._trace_finished(outputs)
        started = time.monotonic()
        try:
            ro = self.runner.execute(so)
        except BaseException:
            self.scheduler.discard_step(so)
            raise
        self.traces.on_step(so, started, time.monotonic())
        if self.step_observer is not None:
            self.step_observer(so, ro)
        if ro.prompt_logprobs:
            self.output_processor.add_prompt_logprobs(ro.prompt_logprobs)
        if ro.prompt_logprob_rows:
            self.output_processor.add_prompt_logprob_rows(ro.prompt_logprob_rows)
        return self._end_step(so, ro, outputs)

    def trim_heap(self) -> bool:
        """Hand the C heap's free pages back (engine/heap.py): once the engine is idle, and every
        interval while it is busy; True when it trimmed. Not part of `step`: its driver calls it
        after handing the step's outputs on, so that no token waits for the trim (13-18 ms on
        the Zen 5 kind: the whole of a finished request's last token, or its first when it
        asked for one)."""
        return self.heap_trimmer.after_step(idle=not self.scheduler.has_unfinished_requests())


# LoadedModel.format -> where its own sampling defaults were read.
_SOURCE_NAMES = {"gguf": "gguf", "hf": "generation_config.json", "dummy": "openai"}


def _load_tokenizer(resolved) -> Tokenizer | None:
    if resolved is None:
        return None
    if resolved.format == "gguf":
        return Tokenizer.from_gguf(resolved.path)
    try:
        return Tokenizer.from_pretrained_dir(resolved.path)
    except (OSError, ValueError) as e:
        logger.warning("no tokenizer in %s (%s): prompts must be token ids", resolved.path, e)
        return None
