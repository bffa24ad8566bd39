"""AsyncLLM on the fake engine: streams, abort, deadlines, queue limit, engine failures, threads."""

from __future__ import annotations

import asyncio
import threading

import pytest
from fake_engine import FakeEngine
from server_harness import wait_until

from inferlab.engine.async_llm import (
    AsyncLLM,
    EngineNotReadyError,
    EngineStepError,
    QueueFullError,
    RequestTimeoutError,
    merge_outputs,
)
from inferlab.engine.errors import ContextLengthError
from inferlab.engine.request import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams


def make_llm(**kw) -> tuple[AsyncLLM, dict]:
    engine_kw = {k: kw.pop(k) for k in list(kw) if k in ("step_delay", "max_num_seqs", "num_blocks", "max_model_len")}
    holder: dict = {}

    def factory():
        holder["engine"] = FakeEngine(**engine_kw)
        return holder["engine"]

    llm = AsyncLLM(factory, **kw)
    llm.start()
    assert llm.wait_ready(30)
    return llm, holder


def run(coro):
    return asyncio.run(coro)


def test_generate_streams_deltas_that_add_up():
    llm, holder = make_llm()
    try:

        async def go():
            outs = [o async for o in llm.generate("hello", SamplingParams(max_tokens=12, seed=3), "r1")]
            return outs

        outs = run(go())
        final = outs[-1]
        assert final.finished and final.outputs[0].finish_reason == "length"
        assert len(final.outputs[0].token_ids) == 12
        assert "".join(o.outputs[0].text_delta for o in outs) == final.outputs[0].text
        assert sum(len(o.outputs[0].token_ids_delta) for o in outs) == 12
        assert holder["engine"].thread_ids == {llm._thread.ident}  # only the engine thread touched it
    finally:
        llm.shutdown(5)


def test_add_request_errors_come_back_before_streaming():
    llm, _ = make_llm(max_model_len=64)
    try:

        async def go():
            with pytest.raises(ContextLengthError) as e:
                await llm.add_request("r1", "x" * 60, SamplingParams(max_tokens=10))
            assert e.value.n_ctx == 64 and e.value.n_prompt_tokens == 60
            with pytest.raises(ValueError, match="empty"):
                await llm.add_request("r2", [], SamplingParams())
            # the engine keeps serving after rejecting
            outs = [o async for o in llm.generate("ok", SamplingParams(max_tokens=2), "r3")]
            assert outs[-1].finished

        run(go())
        assert llm.num_in_flight == 0
    finally:
        llm.shutdown(5)


def test_abort_frees_the_request_within_a_step():
    llm, holder = make_llm(step_delay=0.01)
    try:

        async def go():
            stream = await llm.add_request("long", "hi", SamplingParams(max_tokens=200))
            first = await stream.__anext__()
            assert not first.finished
            steps_at_abort = holder["engine"].num_steps
            stream.abort()
            return steps_at_abort

        steps_at_abort = run(go())
        eng = holder["engine"]
        wait_until(lambda: llm.num_in_flight == 0 and not eng.has_unfinished_requests(), what="abort applied")
        assert eng.get_stats().kv_cache_usage == 0.0
        # the step in progress when abort() was called, at most one more: never the 200 it asked for
        assert eng.num_steps - steps_at_abort <= 2
    finally:
        llm.shutdown(5)


def test_deadline_aborts_and_raises():
    llm, _ = make_llm(step_delay=0.01, request_timeout=0.2)
    try:

        async def go():
            with pytest.raises(RequestTimeoutError):
                async for _ in llm.generate("hi", SamplingParams(max_tokens=200), "slow"):
                    pass

        run(go())
        wait_until(lambda: llm.get_stats().num_running == 0, what="timed-out request freed")
    finally:
        llm.shutdown(5)


def test_finished_and_aborted_requests_leave_no_deadline_behind():
    """Every request with a timeout pushes a deadline; one that finishes or is aborted long
    before it must not keep its entry until the deadline passes (a server under a one-hour
    timeout held an hour of arrivals)."""
    llm, holder = make_llm(request_timeout=3600.0, max_num_seqs=8)
    try:

        async def one(i: int) -> None:
            stream = await llm.add_request(f"r{i}", "hi", SamplingParams(max_tokens=4 if i % 3 else 50))
            async for _out in stream:
                if i % 3 == 0:  # a client that goes away after the first chunk
                    stream.abort()
                    break

        async def go():
            for start in range(0, 120, 8):
                await asyncio.gather(*(one(i) for i in range(start, start + 8)))

        run(go())
        eng = holder["engine"]
        wait_until(lambda: llm.num_in_flight == 0 and not eng.has_unfinished_requests(), what="all requests done")
        wait_until(lambda: len(llm._deadlines) <= 16, what="stale deadlines dropped")
        assert not llm._requests
    finally:
        llm.shutdown(5)


def test_queue_limit_rejects_then_recovers():
    llm, _ = make_llm(step_delay=0.01, max_num_seqs=1, max_queue_len=1)
    try:

        async def go():
            a = await llm.add_request("a", "hi", SamplingParams(max_tokens=200))
            await a.__anext__()  # running now
            b = await llm.add_request("b", "hi", SamplingParams(max_tokens=2))  # waits
            with pytest.raises(QueueFullError):
                await llm.add_request("c", "hi", SamplingParams(max_tokens=2))
            a.abort()
            outs = [o async for o in b]
            assert outs[-1].finished
            outs = [o async for o in llm.generate("hi", SamplingParams(max_tokens=2), "d")]
            assert outs[-1].finished

        run(go())
    finally:
        llm.shutdown(5)


def test_a_burst_before_the_first_step_is_admitted_up_to_seats_plus_queue():
    # Issue 13, finding 3: 60 at once with 8 seats and a queue of 8 must admit 16, not 8 (the
    # last step's running count is 0 before the first step, so every request looked waiting).
    llm, _ = make_llm(step_delay=0.01, max_num_seqs=8, max_queue_len=8)
    try:

        async def one(i):
            try:
                stream = await llm.add_request(f"b{i}", "hi", SamplingParams(max_tokens=3))
            except QueueFullError:
                return "refused"
            outs = [o async for o in stream]
            return "served" if outs[-1].finished else "lost"

        async def go():
            return await asyncio.gather(*(one(i) for i in range(60)))

        results = run(go())
        assert results.count("served") == 16 and results.count("refused") == 44
    finally:
        llm.shutdown(5)


def test_a_reader_that_stops_reading_holds_one_merged_output():
    # A client that stops reading must not grow memory one cumulative output per step.
    llm, _ = make_llm()
    try:

        async def go():
            stream = await llm.add_request("slow", "hi", SamplingParams(max_tokens=120, seed=1))
            while llm.num_in_flight:  # the engine runs all 120 steps while nobody reads
                assert len(stream._queue) <= 1
                await asyncio.sleep(0.001)
            for _ in range(5000):  # the count drops before the last step's output is handed over
                if stream._queue and stream._queue._items[-1].finished:
                    break
                await asyncio.sleep(0.001)
            assert len(stream._queue) == 1
            outs = [o async for o in stream]
            return outs

        outs = run(go())
        assert len(outs) == 1 and outs[0].finished
        c = outs[0].outputs[0]
        assert len(c.token_ids_delta) == 120 and c.text_delta == c.text
    finally:
        llm.shutdown(5)


def test_engine_step_failure_fails_in_flight_and_keeps_serving():
    llm, holder = make_llm(step_delay=0.005)
    try:

        async def go():
            holder["engine"].fail_next_steps = 1
            with pytest.raises(EngineStepError, match="injected"):
                async for _ in llm.generate("hi", SamplingParams(max_tokens=5), "boom"):
                    pass
            outs = [o async for o in llm.generate("hi", SamplingParams(max_tokens=5), "after")]
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"

        run(go())
        assert llm.is_healthy()
    finally:
        llm.shutdown(5)


def test_idle_loop_does_not_spin():
    # Idle, the engine thread must block on its condition with no timeout (no polling), and
    # take no step until something arrives.
    llm, holder = make_llm()
    waits: list[float | None] = []
    waiting = threading.Event()
    real_wait = llm._cond.wait

    def recording_wait(timeout=None):
        waits.append(timeout)
        waiting.set()
        try:
            return real_wait(timeout)
        finally:
            waiting.clear()

    try:
        llm._cond.wait = recording_wait
        run(_one(llm))
        wait_until(lambda: waiting.is_set() and waits[-1] is None, what="the engine thread to block")
        steps, calls = holder["engine"].num_steps, len(waits)
        run(_one(llm))  # it wakes for work and blocks again
        wait_until(lambda: waiting.is_set() and len(waits) > calls, what="the engine thread to block again")
        assert holder["engine"].num_steps > steps and waits[-1] is None
    finally:
        llm.shutdown(5)


async def _one(llm):
    return [o async for o in llm.generate("x", SamplingParams(max_tokens=1), "one")]


def test_not_ready_while_loading_and_load_errors_are_kept():
    import threading

    gate = threading.Event()
    llm = AsyncLLM(lambda: FakeEngine(load_gate=gate))
    llm.start()
    try:
        assert not llm.ready and not llm.is_healthy()

        async def go():
            with pytest.raises(EngineNotReadyError):
                await llm.add_request("r", "x", SamplingParams())

        run(go())
        gate.set()
        assert llm.wait_ready(10) and llm.is_healthy()
    finally:
        llm.shutdown(5)

    def broken():
        raise FileNotFoundError("no such model: nowhere.gguf")

    bad = AsyncLLM(broken)
    bad.start()
    assert not bad.wait_ready(10)
    assert isinstance(bad.load_error, FileNotFoundError)


def test_shutdown_drains_in_flight_requests():
    llm, _ = make_llm(step_delay=0.01)

    async def go():
        stream = await llm.add_request("r", "hi", SamplingParams(max_tokens=20))
        loop = asyncio.get_running_loop()
        closing = loop.run_in_executor(None, llm.shutdown, 10.0)
        outs = [o async for o in stream]
        await closing
        return outs

    outs = run(go())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 20


def _out(index_texts: list[tuple[int, str, str | None]], finished: bool = False) -> RequestOutput:
    outs = [
        CompletionOutput(index=i, text=t, token_ids=[1] * len(t), text_delta=t[-1:], token_ids_delta=[1], finish_reason=f)
        for i, t, f in index_texts
    ]
    return RequestOutput("r", None, [1], outs, finished, RequestMetrics(arrival_time=0.0))


def test_merge_outputs_concatenates_deltas_and_keeps_the_latest_state():
    a = _out([(0, "ab", None), (1, "x", None)])
    b = _out([(0, "abc", "stop")])  # the engine left sequence 1 out: nothing new for it
    m = merge_outputs(a, b)
    assert [c.index for c in m.outputs] == [0, 1]
    assert m.outputs[0].text == "abc" and m.outputs[0].text_delta == "bc" and m.outputs[0].token_ids_delta == [1, 1]
    assert m.outputs[0].finish_reason == "stop"
    assert m.outputs[1].text_delta == "x"


def test_the_next_step_waits_for_the_readers_of_the_last_one(monkeypatch):
    """The engine thread hands a step's outputs over and waits (bounded) until the event loop's
    readers have taken them before it starts the next step: when a step begins, every output
    produced so far has been read (and none was merged into a later one)."""
    from inferlab.engine import async_llm

    monkeypatch.setattr(async_llm, "HANDOFF_WAIT_S", 5.0)  # the mechanism, not the bound: no flake on a busy CI
    llm, holder = make_llm()
    engine = holder["engine"]
    reads: list[int] = []
    produced = [0]
    at_step_start: list[tuple[int, int]] = []  # (outputs read, outputs produced) as each step begins
    real_step = engine.step

    def step():
        at_step_start.append((len(reads), produced[0]))
        out = real_step()
        produced[0] += len(out)
        return out

    engine.step = step
    try:

        async def go():
            async for _ in llm.generate("hello", SamplingParams(max_tokens=20), "r1"):
                reads.append(1)

        run(go())
        assert produced[0] >= 20 and len(reads) == produced[0]  # one read per output: none merged
        assert at_step_start and all(r == p for r, p in at_step_start), at_step_start
    finally:
        llm.shutdown(5)



def test_request_options_reach_the_engine_as_one_object():
    """AsyncLLM hands the engine thread the caller's RequestOptions (no kwargs dict), with the
    arrival time set where the caller left it out, and keeps one the caller gave."""
    import time

    from inferlab.engine.request import RequestOptions

    seen: dict[str, RequestOptions] = {}

    class Recording(FakeEngine):
        def add_request(self, request_id, prompt, params, options=None):
            seen[request_id] = options
            super().add_request(request_id, prompt, params, options)

    llm = AsyncLLM(Recording)
    llm.start()
    assert llm.wait_ready(30)
    try:

        async def go():
            given = RequestOptions(cache_salt="tenant-a", use_prefix_cache=False)
            [o async for o in llm.generate("hi", SamplingParams(max_tokens=2), "salted", given)]
            [o async for o in llm.generate("hi", SamplingParams(max_tokens=2), "dated", RequestOptions(arrival_time=1.5))]

        before = time.monotonic()
        run(go())
        salted = seen["salted"]
        assert (salted.cache_salt, salted.use_prefix_cache) == ("tenant-a", False)
        assert salted.arrival_time is not None and salted.arrival_time >= before
        assert seen["dated"] == RequestOptions(arrival_time=1.5)
    finally:
        llm.shutdown()


def _trimming_llm(factory, idle_trim_delay_s: float) -> AsyncLLM:
    llm = AsyncLLM(factory)
    llm.idle_trim_delay_s = idle_trim_delay_s
    llm.start()
    assert llm.wait_ready(30)
    return llm


def test_the_heap_is_trimmed_after_the_outputs_are_handed_on():
    """The engine loop calls the engine's trim_heap (LLMEngine's malloc_trim, 13-18 ms) only once a
    step's outputs are on their way: a request's last token never waits for it."""
    import threading

    delivered, trimmed = threading.Event(), threading.Event()
    waited: list[bool] = []

    class Trimming(FakeEngine):
        def trim_heap(self) -> bool:
            if not self.has_unfinished_requests():
                waited.append(delivered.wait(10))  # True only if the reader could take its final output first
                trimmed.set()
            return True

    llm = _trimming_llm(Trimming, idle_trim_delay_s=0.0)
    try:

        async def go():
            async for o in llm.generate("hi", SamplingParams(max_tokens=3), "r"):
                if o.finished:
                    delivered.set()

        run(go())
        assert trimmed.wait(10)
        assert waited == [True]
    finally:
        llm.shutdown()


def test_the_idle_trim_waits_until_the_engine_has_stayed_idle():
    """A trim at the idle point unmapped the pages the next request's activations then faulted
    back in (~19,500 faults per 1,024-token prompt sent back to back): the loop trims only once
    the engine has been idle for `idle_trim_delay_s`, and a request arriving before then cancels
    it; while busy, trim_heap is still called after every step (the trimmer's own interval)."""
    calls: list[bool] = []  # busy?, per trim_heap call
    trimmed = threading.Event()

    class Trimming(FakeEngine):
        def trim_heap(self) -> bool:
            calls.append(self.has_unfinished_requests())
            if not calls[-1]:
                trimmed.set()
            return True

    llm = _trimming_llm(Trimming, idle_trim_delay_s=3600.0)
    try:

        async def one(rid: str, n: int) -> None:
            async for _ in llm.generate("hi", SamplingParams(max_tokens=n), rid):
                pass

        run(one("a", 3))
        run(one("b", 3))  # accepted only after the loop has passed a's idle point
        assert calls and all(calls)  # a's and b's busy steps only: the idle points did not trim
        llm.idle_trim_delay_s = 0.0
        run(one("c", 2))
        assert trimmed.wait(10) and calls[-1] is False
    finally:
        llm.shutdown()
