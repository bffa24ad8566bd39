"""`AsyncLLM`: the engine on its own thread, per-request async streams, cancellation, admission.

The engine is not thread-safe and its `step()` blocks for a whole forward pass, so it gets a
thread of its own; the HTTP side (an asyncio loop) only ever talks to it through an inbox:

    asyncio side                                     engine thread
    ────────────                                     ─────────────
    add_request() ─┐                                 ┌► engine.add_request()   ─► ack / error
    abort()       ─┴► inbox (deque + Condition) ─────┤► engine.abort_request()
                                                     ├► expire deadlines
    RequestStream ◄── loop.call_soon_threadsafe ◄────┴─ engine.step() outputs (one call per step)

The loop drains the inbox between steps, so an abort lands before the next step; when there is
nothing to do it sleeps on the Condition (no busy spin). Outputs of one step travel to the event
loop in a single `call_soon_threadsafe` (one wake-up per step, not one per token), and a reader
that falls behind has its outputs merged into one as they arrive (`Mailbox`: deltas concatenated),
so a slow client never makes the engine wait and a stopped one holds one output, not one per step. The engine does wait, up to HANDOFF_WAIT_S, for the event loop to
take a step's outputs before it starts the next step, so that the HTTP work does not compete
with the step for the cores.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import heapq
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from inferlab.engine.errors import EngineDeadError
from inferlab.engine.outputs import SchedulerStats
from inferlab.engine.request import CompletionOutput, RequestOptions, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """Too many requests are already waiting (HTTP 503 with Retry-After)."""

    def __init__(self, num_waiting: int, max_queue_len: int):
        self.num_waiting = num_waiting
        self.max_queue_len = max_queue_len
        super().__init__(
            f"the server is busy: {num_waiting} requests are already waiting (limit {max_queue_len}); retry later"
        )


class RequestTimeoutError(TimeoutError):
    """The request ran past its deadline and was aborted (HTTP 504, or an error event mid-stream)."""

    def __init__(self, request_id: str, timeout: float):
        self.request_id = request_id
        self.timeout = timeout
        super().__init__(f"request {request_id} exceeded its deadline of {timeout:g} s and was aborted")


class EngineNotReadyError(RuntimeError):
    """The model is still loading (HTTP 503)."""


class EngineStepError(RuntimeError):
    """The engine failed while this request was in flight (HTTP 500, or an error event mid-stream)."""


class RequestAbortedError(RuntimeError):
    """The request was aborted (by its client, or by shutdown) before it finished."""


class EngineLike(Protocol):
    """What `AsyncLLM` needs of an engine (`LLMEngine`, or a fake in tests)."""

    model_name: str
    max_model_len: int
    max_num_seqs: int

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams,
                    options: RequestOptions | None = None) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def abort_request(self, request_ids: list[str]) -> None: ...
    def has_unfinished_requests(self) -> bool: ...
    def get_stats(self) -> SchedulerStats: ...


class EngineObserver(Protocol):
    """Hooks called on the engine thread (metrics). They must be quick and must not raise."""

    def on_ready(self, engine: Any) -> None: ...
    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None: ...
    def on_stats(self, stats: SchedulerStats) -> None: ...
    def on_request_dropped(self, request_id: str, reason: str) -> None: ...


_ACCEPTED = object()  # first item of every accepted request's queue


@dataclasses.dataclass(eq=False)
class _Tracked:
    """One in-flight request, as the engine thread sees it."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: Mailbox
    prompt: Any
    params: SamplingParams
    options: RequestOptions  # arrival_time set
    deadline: float | None
    timeout: float | None


@dataclasses.dataclass(frozen=True)
class _Abort:
    """The inbox's other message (the first is a `_Tracked` request to add)."""

    request_id: str


def merge_outputs(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """One output equal to receiving `old` then `new`: `new`'s cumulative fields, both deltas.

    Used when a reader lags behind the engine, so that it sends one chunk instead of several.
    """
    prev = {c.index: c for c in old.outputs}
    merged: list[CompletionOutput] = []
    for c in new.outputs:
        p = prev.pop(c.index, None)
        if p is None or (not p.text_delta and not p.token_ids_delta and not p.logprobs_delta):
            merged.append(c)
            continue
        lp = None
        if p.logprobs_delta is not None or c.logprobs_delta is not None:
            lp = (p.logprobs_delta or []) + (c.logprobs_delta or [])
        merged.append(
            dataclasses.replace(
                c,
                text_delta=p.text_delta + c.text_delta,
                token_ids_delta=p.token_ids_delta + c.token_ids_delta,
                logprobs_delta=lp,
                finish_reason=c.finish_reason or p.finish_reason,
                stop_reason=c.stop_reason if c.finish_reason else p.stop_reason,
            )
        )
    if prev:  # sequences the engine left out of `new` (nothing new for them): keep their deltas
        merged.extend(prev.values())
        merged.sort(key=lambda c: c.index)
    return dataclasses.replace(new, outputs=merged)


class Mailbox:
    """One request's items on its event loop, where a lagging reader's outputs merge on arrival.

    An output that arrives while an unfinished one is still unread is merged into it
    (`merge_outputs`), so a client that stops reading holds one pending output however many
    steps the engine runs, not one cumulative output per step. Event-loop thread only.
    """

    def __init__(self) -> None:
        self._items: collections.deque[Any] = collections.deque()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: Any) -> None:
        items = self._items
        last = items[-1] if items else None
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput) and not last.finished:
            items[-1] = merge_outputs(last, item)
        else:
            items.append(item)
        self._ready.set()

    async def get(self) -> Any:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


class RequestStream:
    """The async iterator of one request's outputs; ends after the finished output.

    Raises what the engine thread sent instead of an output (`RequestTimeoutError`,
    `EngineStepError`, `RequestAbortedError`, ...).
    """

    def __init__(self, request_id: str, queue: Mailbox, owner: AsyncLLM):
        self.request_id = request_id
        self._queue = queue
        self._owner = owner
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
            if item.error:
                raise EngineStepError(item.error)
        return item

    def abort(self) -> None:
        """Stop the request in the engine (a no-op once it has finished)."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


# How long the engine thread waits, after a step, for the event loop to take its outputs before
# it starts the next step. On a machine with as many cores as the step has threads, HTTP work
# that runs during a step preempts one of the step's threads, and the others wait for it at the
# next barrier; done between steps it costs only itself. Measured on 2 cores (3 bench runs per
# side): 1 stream, median TPOT 13.6 against 14.2 ms; 32 streams, 152 against 146 output tok/s.
# Bounded, so a stalled event loop cannot stall the engine.
HANDOFF_WAIT_S = 0.01

# How long the engine must stay idle before the loop hands the C heap's free pages back
# (LLMEngine.trim_heap, engine/heap.py). A trim right at the idle point unmapped the activations'
# pages that the next request then faulted back in: a client sending one 1,024-token prompt after
# another paid ~19,500 page faults (~80 MB) per request, 310-330 ms TTFT against 265-300 for the
# same engine steps without them (Xeon, 2 cores); 1 s was too short for a client that pauses a
# second or two between requests (a benchmark launching its next run: ~14,000 faults a request
# still). Idle this long, the server has time to spare; while busy the trimmer's own interval
# still bounds RSS.
IDLE_TRIM_DELAY_S = 10.0


def _deliver(items: list[tuple[Mailbox, Any]], taken: threading.Event | None = None) -> None:
    """Runs on the event loop: hand one step's outputs to their readers; `taken` is set once the
    readers woken here have run (callbacks run in order, so theirs come first)."""
    for q, item in items:
        q.put(item)
    if taken is not None:
        asyncio.get_running_loop().call_soon(taken.set)


class AsyncLLM:
    """An engine behind a thread, for asyncio callers.

    Admission: `max_queue_len` bounds the requests that wait beyond the engine's
    `max_num_seqs` running seats: at most `max_num_seqs + max_queue_len` are in flight, beyond
    which `add_request` raises `QueueFullError`. Counted exactly at admission, under the lock
    (not from the last step's running count, which a burst arriving before the first step
    would see as 0); `request_timeout` (seconds from arrival) aborts a request that runs
    longer and ends its stream with `RequestTimeoutError`.

    Health: `ready` once the engine is built (the factory runs on the engine thread, so a
    server can answer /health while the model loads); `is_healthy()` is False when the loop
    has died or a single engine call has run longer than `stall_timeout` seconds.
    """

    def __init__(
        self,
        engine_factory: Callable[[], EngineLike],
        *,
        max_queue_len: int | None = None,
        request_timeout: float | None = None,
        stall_timeout: float = 300.0,
        observer: EngineObserver | None = None,
    ):
        if max_queue_len is not None and max_queue_len < 1:
            raise ValueError(f"max_queue_len must be >= 1 (or unset), got {max_queue_len}")
        if request_timeout is not None and request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0 seconds (or unset), got {request_timeout}")
        self._factory = engine_factory
        self.max_queue_len = max_queue_len
        self.request_timeout = request_timeout
        self.stall_timeout = stall_timeout
        self.observer = observer
        self.idle_trim_delay_s = IDLE_TRIM_DELAY_S

        self.engine: EngineLike | None = None
        self.load_error: BaseException | None = None
        self.dead_error: BaseException | None = None
        self._cond = threading.Condition()
        self._inbox: collections.deque[_Tracked | _Abort] = collections.deque()
        self._requests: dict[str, _Tracked] = {}  # engine thread only
        self._deadlines: list[tuple[float, int, str]] = []  # engine thread only (heap)
        self._seq = itertools.count()
        self._num_in_flight = 0  # under _cond: admitted and not yet finished
        self._num_seats = 0  # the engine's max_num_seqs, once it is built
        self._accepting = True
        self._stop = False
        self._busy_since: float | None = None
        self._stats = SchedulerStats()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the engine thread; it builds the engine first (the model loads there)."""
        with self._cond:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="inferlab-engine", daemon=True)
            self._thread.start()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.dead_error is None

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the engine is built (or failed to load); True when ready."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready.is_set() and self.load_error is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            self._ready.wait(0.05 if left is None else min(left, 0.05))
        return self.ready

    def is_healthy(self) -> bool:
        if not self.ready or self._thread is None or not self._thread.is_alive():
            return False
        busy = self._busy_since
        return busy is None or time.monotonic() - busy < self.stall_timeout

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def get_stats(self) -> SchedulerStats:
        """The scheduler's state after the last step or inbox drain (taken on the engine thread)."""
        return self._stats

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop admitting, let in-flight requests finish for up to `drain_timeout` s, then stop."""
        with self._cond:
            self._accepting = False
            deadline = time.monotonic() + drain_timeout
            while self._num_in_flight > 0 and self.dead_error is None and self._thread is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    break
                self._cond.wait(min(left, 0.1))
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(drain_timeout, 1.0) + 10.0)

    # ---------------------------------------------------------------- asyncio side
    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        options: RequestOptions | None = None,
        *,
        timeout: float | None = None,
    ) -> RequestStream:
        """Submit a request; returns its stream once the engine has accepted it.

        Raises, before anything streams: `EngineNotReadyError`, `EngineDeadError`,
        `QueueFullError`, and whatever `engine.add_request` raised (`ContextLengthError`,
        `ValueError`).
        """
        if self.load_error is not None:
            raise EngineDeadError(f"the model failed to load: {self.load_error}")
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop stopped: {self.dead_error}")
        if not self._ready.is_set():
            raise EngineNotReadyError("the model is still loading; retry later")
        options = (options or RequestOptions()).arrived(time.monotonic())
        arrival = options.arrival_time
        assert arrival is not None  # set by arrived()
        timeout = self.request_timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        queue = Mailbox()
        tracked = _Tracked(
            request_id=request_id,
            loop=loop,
            queue=queue,
            prompt=prompt,
            params=params,
            options=options,
            deadline=None if timeout is None else arrival + timeout,
            timeout=timeout,
        )
        with self._cond:
            if not self._accepting:
                raise EngineDeadError("the server is shutting down")
            if self.max_queue_len is not None:
                waiting = self._num_in_flight - self._num_seats
                if waiting >= self.max_queue_len:
                    raise QueueFullError(waiting, self.max_queue_len)
            self._num_in_flight += 1
            self._inbox.append(tracked)
            self._cond.notify()
        try:
            first = await queue.get()
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        if first is not _ACCEPTED:
            raise first
        return RequestStream(request_id, queue, self)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str, options: RequestOptions | None = None,
        *, timeout: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; closing the iterator early aborts the request."""
        stream = await self.add_request(request_id, prompt, params, options, timeout=timeout)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe); the engine drops it before its next step."""
        with self._cond:
            self._inbox.append(_Abort(request_id))
            self._cond.notify()

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            self.engine = self._factory()
            self._num_seats = self.engine.max_num_seqs
            if self.observer is not None:
                self.observer.on_ready(self.engine)
            self._refresh_stats()
        except BaseException as e:  # noqa: BLE001 - reported through /health and the CLI
            if isinstance(e, (ValueError, OSError)):  # a user error (bad path, bad config): no traceback
                logger.error("the engine failed to load: %s", e)
            else:
                logger.exception("the engine failed to load")
            self.load_error = e
            with self._cond:
                self._cond.notify_all()
            return
        self._ready.set()
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - a bug in the loop: fail everyone, report dead
            logger.exception("the engine loop died")
            self.dead_error = e
            self._fail_all(EngineDeadError(f"the engine loop stopped: {e}"))
        else:
            self._fail_all(RequestAbortedError("the server shut down before the request finished"))
        finally:
            stop = getattr(self.engine, "shutdown", None)  # LLMEngine's: its tensor-parallel ranks
            if stop is not None:
                stop()

    def _loop(self) -> None:
        engine = self.engine
        assert engine is not None
        trim_heap = getattr(engine, "trim_heap", None)  # LLMEngine's; test doubles have none
        trim_at: float | None = None  # when the engine went idle + IDLE_TRIM_DELAY_S, until it trims
        while True:
            with self._cond:
                while not self._inbox and not self._stop and not engine.has_unfinished_requests():
                    due = [d for d in (self._deadlines[0][0] if self._deadlines else None, trim_at) if d is not None]
                    wait = None
                    if due:
                        wait = max(min(due) - time.monotonic(), 0.0)
                        if wait == 0.0:
                            break
                    self._cond.wait(wait)
                if self._stop:
                    return
                items = list(self._inbox)
                self._inbox.clear()
            if trim_at is not None and not items and not engine.has_unfinished_requests() \
                    and time.monotonic() >= trim_at:
                trim_at = None
                trim_heap()  # idle: trims at once
                continue
            deliveries: dict[asyncio.AbstractEventLoop, list] = {}
            if items:
                self._handle_inbox(items, deliveries)
            if self._deadlines:
                self._expire(deliveries)
            stepped = engine.has_unfinished_requests()
            if stepped:
                self._step(deliveries)
            if len(self._deadlines) > 2 * len(self._requests) + 16:
                self._prune_deadlines()
            self._refresh_stats()  # first: readers woken by the outputs see this step's counts
            if deliveries:  # before the next step, let the event loop take them (HANDOFF_WAIT_S)
                self._flush(deliveries, wait=engine.has_unfinished_requests())
            if stepped and trim_heap is not None:  # after the outputs are on their way (LLMEngine.trim_heap)
                if engine.has_unfinished_requests():
                    trim_at = None
                    trim_heap()  # busy: at most once per the trimmer's interval
                else:
                    trim_at = time.monotonic() + self.idle_trim_delay_s

    def _handle_inbox(self, items: list[_Tracked | _Abort], deliveries: dict) -> None:
        engine = self.engine
        to_abort: list[str] = []
        for item in items:
            if isinstance(item, _Tracked):
                t = item
                if t.request_id in self._requests:
                    error = ValueError(f"request id {t.request_id!r} is already in flight")
                    self._finish(t, error, deliveries)
                    continue
                self._busy_since = time.monotonic()
                try:
                    engine.add_request(t.request_id, t.prompt, t.params, t.options)
                except Exception as e:  # noqa: BLE001 - the caller gets the engine's own error
                    self._busy_since = None
                    self._finish(t, e, deliveries)
                    continue
                self._busy_since = None
                self._requests[t.request_id] = t
                if t.deadline is not None:
                    heapq.heappush(self._deadlines, (t.deadline, next(self._seq), t.request_id))
                deliveries.setdefault(t.loop, []).append((t.queue, _ACCEPTED))
            else:
                gone = self._requests.pop(item.request_id, None)
                if gone is None:
                    continue
                t = gone
                to_abort.append(t.request_id)
                self._finish(t, RequestAbortedError(f"request {t.request_id} was aborted"), deliveries)
                self._dropped(t.request_id, "abort")
        if to_abort:
            self._engine_abort(to_abort)

    def _expire(self, deliveries: dict) -> None:
        now = time.monotonic()
        expired: list[str] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, rid = heapq.heappop(self._deadlines)
            t = self._requests.pop(rid, None)
            if t is None:
                continue
            expired.append(rid)
            self._finish(t, RequestTimeoutError(rid, t.timeout or 0.0), deliveries)
            self._dropped(rid, "abort")
        if expired:
            self._engine_abort(expired)

    def _step(self, deliveries: dict) -> None:
        engine = self.engine
        self._busy_since = time.monotonic()
        try:
            outputs = engine.step()
        except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
            self._busy_since = None
            logger.exception("engine step failed; failing %d in-flight requests", len(self._requests))
            failed = list(self._requests.values())
            self._requests.clear()
            self._deadlines.clear()
            for t in failed:
                self._finish(t, EngineStepError(f"the engine failed: {type(e).__name__}: {e}"), deliveries)
                self._dropped(t.request_id, "error")
            if failed:
                self._engine_abort([t.request_id for t in failed])
            return
        self._busy_since = None
        now = time.monotonic()
        live: list[RequestOutput] = []
        requests = self._requests
        finished = 0
        for out in outputs:
            t = requests.get(out.request_id)
            if t is None:  # aborted or expired: its reader has been told already
                continue
            live.append(out)
            deliveries.setdefault(t.loop, []).append((t.queue, out))
            if out.finished:
                del requests[out.request_id]
                finished += 1
        if finished:
            with self._cond:
                self._num_in_flight -= finished
                self._cond.notify_all()
        if live and self.observer is not None:
            self._observe(self.observer.on_outputs, live, now)

    def _prune_deadlines(self) -> None:
        """Drop the deadlines of requests that have left: otherwise each stays in the heap until
        it passes (request_timeout x arrival rate entries). Called only once stale entries
        outnumber live ones, so the rebuild costs O(1) per request."""
        self._deadlines = [d for d in self._deadlines if d[2] in self._requests]
        heapq.heapify(self._deadlines)

    def _finish(self, t: _Tracked, error: BaseException, deliveries: dict) -> None:
        """End a request with an error; the caller has already removed it from `_requests`."""
        deliveries.setdefault(t.loop, []).append((t.queue, error))
        with self._cond:
            self._num_in_flight -= 1
            self._cond.notify_all()

    def _engine_abort(self, request_ids: list[str]) -> None:
        try:
            self.engine.abort_request(request_ids)
        except Exception:  # noqa: BLE001 - a failed abort must not stop the loop
            logger.exception("engine.abort_request failed for %s", request_ids)

    def _dropped(self, request_id: str, reason: str) -> None:
        if self.observer is not None:
            self._observe(self.observer.on_request_dropped, request_id, reason)

    def _refresh_stats(self) -> None:
        try:
            stats = self.engine.get_stats()
        except Exception:  # noqa: BLE001
            logger.exception("engine.get_stats failed")
            return
        self._stats = stats
        if self.observer is not None:
            self._observe(self.observer.on_stats, stats)

    @staticmethod
    def _observe(hook: Callable[..., None], *args: Any) -> None:
        try:
            hook(*args)
        except Exception:  # noqa: BLE001 - metrics must never break serving
            logger.exception("engine observer failed")

    @staticmethod
    def _flush(deliveries: dict[asyncio.AbstractEventLoop, list], wait: bool = False) -> None:
        """Hand outputs to their event loops; with `wait`, until they have taken them (at most
        HANDOFF_WAIT_S in all)."""
        taken: list[threading.Event] = []
        for loop, items in deliveries.items():
            ev = threading.Event() if wait else None
            try:
                loop.call_soon_threadsafe(_deliver, items, ev)
            except RuntimeError:  # the reader's event loop has closed: nobody is listening
                continue
            if ev is not None:
                taken.append(ev)
        deliveries.clear()
        deadline = time.monotonic() + HANDOFF_WAIT_S
        for ev in taken:
            ev.wait(max(0.0, deadline - time.monotonic()))

    def _fail_all(self, error: BaseException) -> None:
        """The loop is over: end every request still in flight or in the inbox."""
        deliveries: dict = {}
        with self._cond:
            pending = [t for t in self._inbox if isinstance(t, _Tracked)]
            self._inbox.clear()
        for t in list(self._requests.values()) + pending:
            self._finish(t, error, deliveries)
        self._requests.clear()
        self._flush(deliveries)
