"""Time our own engine on a short, fixed workload whose steps span the shapes the simulator
asks about, so that the step cost model is fitted to this machine rather than to a spec sheet.

The workload (`ProfileSpec`), in order, each part starting once the last has drained:

1. lone prefills: one prompt of each length in `prefill_lens`, max_tokens=1, so each is one
   pure prefill step;
2. bursts: `n` prompts of `burst_len` tokens at once for each n in `bursts`, max_tokens=1 —
   what a closed loop of n clients sends when it starts; several short prompts in one step
   cost less per token than one long one (less attention, larger matrix products);
3. ramps: `batch` prompts of `prompt_len` tokens admitted together — the token budget splits
   them over a few prefill steps, the later ones mixed with the first prompts' decodes — then
   decoding while the batch halves every `steps_per_level` steps (32, 16, 8, 4, 2, 1). Each
   time the batch shrinks, one fresh prompt of `inject_len` tokens joins for one step: a mixed
   step (decodes + a prefill) at every batch size, as a closed loop of clients produces.

A ramp rather than one run per batch size: on a CPU the prompts' prefill is most of the
profiling time, and a ramp pays it once for all its batch sizes.

Each sample's `step_time_s` is the wall time of the whole `LLMEngine.step()` — what the
simulator's clock must advance by — and `forward_time_s` the runner's forward pass and
sampling (`ModelRunnerOutput.step_time`); the difference is the engine's own overhead
(scheduling, bookkeeping, detokenization), reported by `overhead_summary`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inferlab.plan.cost_model import StepSample, shape_of


@dataclass(frozen=True)
class Ramp:
    """`batch` prompts of `prompt_len` tokens, decoded while the batch halves."""

    batch: int
    prompt_len: int

    def levels(self) -> list[int]:
        """Batch sizes visited: batch, batch // 2, ..., 1."""
        out, b = [], self.batch
        while b >= 1:
            out.append(b)
            b //= 2
        return out

    def max_tokens(self, index: int, steps_per_level: int) -> int:
        """Request `index` stays for every level larger than its index: 1 token from its
        prefill step, then `steps_per_level` per level it belongs to."""
        return 1 + steps_per_level * sum(1 for level in self.levels() if level > index)


@dataclass(frozen=True)
class ProfileSpec:
    """What `profile_engine` runs; see the module docstring."""

    prefill_lens: tuple[int, ...] = (32, 64, 128, 256, 512, 1024)
    bursts: tuple[int, ...] = (4, 8, 16)
    burst_len: int = 128
    ramps: tuple[Ramp, ...] = (Ramp(32, 128), Ramp(16, 512))
    steps_per_level: int = 3
    inject_len: int = 64
    repeats: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.prefill_lens and not self.ramps and not self.bursts:
            raise ValueError("a profile needs at least one prefill length, burst or ramp")
        if any(n < 1 for n in self.prefill_lens):
            raise ValueError(f"prefill lengths must be >= 1, got {self.prefill_lens}")
        if any(n < 1 for n in self.bursts):
            raise ValueError(f"burst sizes must be >= 1, got {self.bursts}")
        for r in self.ramps:
            if r.batch < 1 or r.prompt_len < 1:
                raise ValueError(f"a ramp needs batch >= 1 and prompt length >= 1, got {r}")
        for name in ("steps_per_level", "inject_len", "repeats", "burst_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def sized(cls, max_batch: int = 32, max_prefill: int = 1024, **kw: Any) -> ProfileSpec:
        """The default shape scaled to a largest decode batch and a longest prompt: prefills of
        32, 64, ... up to `max_prefill`; bursts of 4, 8, ... up to half of `max_batch` short
        prompts (128); a ramp from `max_batch` at short prompts and one from half of it at half
        the longest prompt (the context-length dimension)."""
        if max_batch < 1 or max_prefill < 1:
            raise ValueError(f"profile sizes must be >= 1, got max batch {max_batch}, max prefill {max_prefill}")
        lens, n = [], 32
        while n < max_prefill:
            lens.append(n)
            n *= 2
        lens.append(max_prefill)
        short = min(128, max_prefill)
        bursts, n = [], 4
        while n <= max_batch // 2:
            bursts.append(n)
            n *= 2
        kw.setdefault("bursts", tuple(bursts))
        kw.setdefault("burst_len", short)
        ramps = [Ramp(max_batch, short)]
        if max_prefill // 2 > short:
            ramps.append(Ramp(max(max_batch // 2, 1), max_prefill // 2))
        kw.setdefault("inject_len", min(64, max_prefill))
        return cls(prefill_lens=tuple(lens), ramps=tuple(ramps), **kw)

    @property
    def max_batch(self) -> int:
        """Sequences running at once: the largest ramp plus its injected prompt, or a burst."""
        return max([r.batch + 1 for r in self.ramps] + list(self.bursts) + [1])

    @property
    def max_model_len(self) -> int:
        """The longest request: a ramp's prompt plus everything its first request decodes."""
        need = [n + 1 for n in self.prefill_lens] + [self.inject_len + 1, self.burst_len + 1]
        need += [r.prompt_len + r.max_tokens(0, self.steps_per_level) for r in self.ramps]
        return max(need)

    @property
    def total_prefill_tokens(self) -> int:
        """Prompt tokens the profile computes (most of its time on a CPU)."""
        per = sum(self.prefill_lens) + self.burst_len * sum(self.bursts)
        per += sum(r.batch * r.prompt_len + self.inject_len * len(r.levels()) for r in self.ramps)
        return per * self.repeats


class StepRecorder:
    """Drives `LLMEngine.step()` and records one `StepSample` per forward pass.

    The engine's `step_observer` hands us the step's `SchedulerOutput` (its shape) and
    `ModelRunnerOutput` (forward time); we time the whole `step()` around it. Use as a context
    manager: the engine's previous observer is put back on exit.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.samples: list[StepSample] = []
        self.recording = True
        self._seen: tuple[Any, float] | None = None
        self._previous = getattr(engine, "step_observer", None)

    def __enter__(self) -> StepRecorder:
        self.engine.step_observer = self._observe
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.step_observer = self._previous

    def _observe(self, scheduler_output: Any, runner_output: Any) -> None:
        self._seen = (shape_of(scheduler_output), float(runner_output.step_time))
        if self._previous is not None:
            self._previous(scheduler_output, runner_output)

    def step(self) -> list[Any]:
        """One engine step; records it when it ran a forward pass and recording is on."""
        self._seen = None
        t0 = time.perf_counter()
        outputs = self.engine.step()
        wall = time.perf_counter() - t0
        if self._seen is not None and self.recording:
            shape, forward = self._seen
            self.samples.append(StepSample(shape, max(wall, forward, 1e-9), forward_time_s=forward))
        return outputs


def profile_engine(engine: Any, spec: ProfileSpec, log: Callable[[str], None] | None = None) -> list[StepSample]:
    """Run `spec` on an idle engine and return its measured steps (see the module docstring).

    The engine must admit `spec.max_batch` sequences and `spec.max_model_len` tokens; prefix
    caching should be off (the prompts are random, but a cache hit would shorten a prefill).
    """
    from inferlab.engine.request import RequestOptions, SamplingParams

    if engine.has_unfinished_requests():
        raise ValueError("profile an idle engine: it still has unfinished requests")
    if engine.scheduler_config.max_num_seqs < spec.max_batch:
        raise ValueError(f"the profile runs {spec.max_batch} sequences at once; the engine admits "
                         f"{engine.scheduler_config.max_num_seqs} (raise max_num_seqs)")
    if engine.max_model_len < spec.max_model_len:
        raise ValueError(f"the profile needs requests of {spec.max_model_len} tokens; the engine's context "
                         f"window is {engine.max_model_len} (lower the profile's lengths)")
    say = log or (lambda s: None)
    rng = random.Random(spec.seed)
    vocab = engine.model_config.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    def add(n: int, max_tokens: int) -> str:
        rid = engine.new_request_id()
        engine.add_request(rid, prompt(n), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                           RequestOptions(use_prefix_cache=False))
        return rid

    with StepRecorder(engine) as rec:
        # Warm-up, not recorded: first calls pay for allocations and kernel selection.
        rec.recording = False
        add(min(16, spec.max_model_len - 3), 3)
        _drain(rec, engine)
        rec.recording = True
        for rep in range(spec.repeats):
            for n in spec.prefill_lens:
                add(n, 1)
                _drain(rec, engine)
            say(f"profile {rep + 1}/{spec.repeats}: lone prefills of {', '.join(map(str, spec.prefill_lens))} "
                f"tokens ({len(rec.samples)} steps so far)")
            for n in spec.bursts:
                for _ in range(n):
                    add(spec.burst_len, 1)
                _drain(rec, engine)
            if spec.bursts:
                say(f"profile {rep + 1}/{spec.repeats}: bursts of {', '.join(map(str, spec.bursts))} × "
                    f"{spec.burst_len}-token prompts ({len(rec.samples)} steps so far)")
            for ramp in spec.ramps:
                _run_ramp(rec, engine, ramp, spec, add)
                say(f"profile {rep + 1}/{spec.repeats}: ramp of {ramp.batch} × {ramp.prompt_len}-token prompts "
                    f"({len(rec.samples)} steps so far)")
    return rec.samples


def _drain(rec: StepRecorder, engine: Any) -> None:
    while engine.has_unfinished_requests():
        rec.step()


def _run_ramp(rec: StepRecorder, engine: Any, ramp: Ramp, spec: ProfileSpec, add: Callable[[int, int], str]) -> None:
    live = {add(ramp.prompt_len, ramp.max_tokens(i, spec.steps_per_level)) for i in range(ramp.batch)}
    size = len(live)
    while engine.has_unfinished_requests():
        for out in rec.step():
            if out.finished:
                live.discard(out.request_id)
        if live and len(live) < size:
            # The batch just shrank: one fresh prompt joins for one step (a mixed step).
            size = len(live)
            add(spec.inject_len, 1)


# ------------------------------------------------------------------ summaries


def step_kind(sample: StepSample) -> str:
    s = sample.shape
    if s.num_prefill_tokens and s.num_decode_tokens:
        return "mixed"
    return "prefill" if s.num_prefill_tokens else "decode"


@dataclass(frozen=True)
class OverheadSummary:
    """The engine's time outside the forward pass, per step."""

    n: int
    median_s: float
    max_s: float
    share: float  # of all recorded step time

    def describe(self) -> str:
        return (f"engine overhead outside the forward pass (scheduling, bookkeeping, detokenization): "
                f"median {self.median_s * 1e3:.3g} ms, max {self.max_s * 1e3:.3g} ms per step, "
                f"{self.share * 100:.2g}% of step time over {self.n} steps; included in the fit "
                f"(it is fitted to whole engine steps)")


def overhead_summary(samples: list[StepSample]) -> OverheadSummary | None:
    """None when no sample carries a forward time (a profile recorded elsewhere)."""
    pairs = [(s.step_time_s, s.forward_time_s) for s in samples if s.forward_time_s is not None]
    if not pairs:
        return None
    over = sorted(max(w - f, 0.0) for w, f in pairs)
    total = sum(w for w, _ in pairs)
    mid = len(over) // 2
    median = over[mid] if len(over) % 2 else (over[mid - 1] + over[mid]) / 2
    return OverheadSummary(len(over), median, over[-1], sum(over) / total if total > 0 else 0.0)
