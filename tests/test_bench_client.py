"""The client against a server that fails, stalls and cuts off requests on purpose:
every outcome is counted in its own bucket, exactly."""

from __future__ import annotations

import asyncio
import socket

import pytest
from fake_openai_server import FakeOpenAIServer

from inferlab.bench.arrivals import LoadSpec
from inferlab.bench.client import EndpointConfig, build_payload, fetch_server_info, normalize_base_url
from inferlab.bench.datasets import SampleRequest
from inferlab.bench.metrics import summarize
from inferlab.bench.records import RequestStatus
from inferlab.bench.runner import fill_output_tokens, run_load


def requests(n: int, output_len: int = 6) -> list[SampleRequest]:
    return [SampleRequest(prompt=f"the house of the river {i}", prompt_len=7, output_len=output_len) for i in range(n)]


def run(server: FakeOpenAIServer, n: int, load: LoadSpec, **cfg_kw) -> list:
    cfg = EndpointConfig(base_url=server.base_url, model=server.model, **cfg_kw)
    return asyncio.run(run_load(requests(n), cfg, load)).records


def test_each_failure_kind_is_counted_separately_and_exactly():
    schedule = ("ok", "http500", "ok", "error_event", "drop", "ok", "stall", "eof", "ok", "ok")
    with FakeOpenAIServer(schedule, stall_s=3.0) as srv:
        records = run(srv, 10, LoadSpec(max_concurrency=10), timeout_s=0.5)
    by = {s: [r for r in records if r.status is s] for s in RequestStatus}
    assert len(records) == 10
    assert len(by[RequestStatus.OK]) == 5
    assert len(by[RequestStatus.FAILED]) == 2  # the 500 and the error event
    assert len(by[RequestStatus.INCOMPLETE]) == 2  # the cut connection and the clean close without [DONE]
    assert len(by[RequestStatus.TIMEOUT]) == 1
    errors = sorted(r.error for r in by[RequestStatus.FAILED])
    assert errors[0].startswith("HTTP 500: injected failure")
    assert errors[1] == "error event: injected mid-stream error"
    assert sorted(r.http_status for r in by[RequestStatus.FAILED]) == [200, 500]
    assert all(r.output_tokens == 6 and r.output_tokens_source == "usage" for r in by[RequestStatus.OK])
    s = summarize(records, 1.0)
    assert (s.completed, s.failed, s.incomplete, s.timeout) == (5, 2, 2, 1)


def test_payload_asks_for_streaming_usage_and_ignore_eos():
    with FakeOpenAIServer() as srv:
        run(srv, 1, LoadSpec(), ignore_eos=True)
        body = srv.stats.bodies[0]
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body["ignore_eos"] is True
    assert body["max_tokens"] == 6
    assert body["model"] == "fake-model"
    assert body["prompt"] == "the house of the river 0"


def test_multi_token_chunks_are_split_per_token_with_continuous_usage():
    with FakeOpenAIServer(tokens_per_chunk=2) as srv:
        [r] = run(srv, 1, LoadSpec())
        [plain] = run(srv, 1, LoadSpec(), continuous_usage=False)
    assert r.status is RequestStatus.OK
    assert r.chunk_tokens == [2, 2, 2]
    assert r.output_tokens == 6
    assert len(r.itls) == 4  # two gaps, each split over the two tokens of its chunk
    # without per-chunk usage each chunk counts as one token, but the total still comes from usage
    assert plain.chunk_tokens == [1, 1, 1]
    assert plain.output_tokens == 6
    assert len(plain.itls) == 2


def test_chat_endpoint_ignores_the_empty_role_chunk_and_sends_the_system_prompt():
    with FakeOpenAIServer() as srv:
        cfg = EndpointConfig(base_url=srv.base_url, model=srv.model, endpoint="chat")
        req = SampleRequest(prompt="hello there", prompt_len=None, output_len=4, system="you are terse")
        result = asyncio.run(run_load([req], cfg, LoadSpec()))
        body = srv.stats.bodies[0]
    [r] = result.records
    assert body["messages"] == [{"role": "system", "content": "you are terse"}, {"role": "user", "content": "hello there"}]
    assert r.status is RequestStatus.OK
    assert len(r.chunk_times) == 4  # the role chunk (empty content) is not a token
    assert r.text == " w0 w1 w2 w3"
    assert r.prompt_tokens == 5 + 5  # from the server's usage, template included


def test_without_usage_tokens_are_counted_with_the_tokenizer_or_by_chunks():
    class Words:
        name = "words"

        def encode(self, text):
            return list(range(len(text.split())))

    with FakeOpenAIServer(("no_usage",), tokens_per_chunk=3) as srv:
        records = run(srv, 2, LoadSpec())
    assert all(r.output_tokens is None for r in records)
    fill_output_tokens(records[:1], Words())
    fill_output_tokens(records[1:], None)
    assert (records[0].output_tokens, records[0].output_tokens_source) == (6, "tokenizer")
    assert (records[1].output_tokens, records[1].output_tokens_source) == (2, "chunks")  # 2 chunks of 3 tokens each


def test_max_concurrency_caps_requests_in_flight():
    with FakeOpenAIServer(token_delay_s=0.02) as srv:
        records = run(srv, 6, LoadSpec(max_concurrency=2))
        assert srv.stats.max_running == 2
    assert all(r.ok for r in records)


def test_server_info_and_unreachable_server():
    with FakeOpenAIServer(max_model_len=2048) as srv:
        info = fetch_server_info(srv.base_url)
    assert (info.model, info.max_model_len, info.model_ids) == ("fake-model", 2048, ("fake-model",))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ValueError, match="cannot reach"):
        fetch_server_info(f"http://127.0.0.1:{port}", timeout_s=2)


def test_connection_refused_mid_run_is_a_failure_not_a_crash():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = EndpointConfig(base_url=f"http://127.0.0.1:{port}", model="m", timeout_s=2)
    [r] = asyncio.run(run_load(requests(1), cfg, LoadSpec())).records
    assert r.status is RequestStatus.FAILED
    assert r.error.startswith("ConnectError")


def test_base_url_normalization_and_bad_urls():
    assert normalize_base_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert normalize_base_url("https://example.test") == "https://example.test"
    for bad in ("localhost:8000", "ftp://x", "", "http://"):
        with pytest.raises(ValueError, match="--base-url"):
            normalize_base_url(bad)


def test_messages_need_the_chat_endpoint():
    cfg = EndpointConfig(base_url="http://127.0.0.1:1", model="m")
    with pytest.raises(ValueError, match="--endpoint chat"):
        build_payload(cfg, SampleRequest(prompt="", prompt_len=None, output_len=4, messages=({"role": "user", "content": "hi"},)))


def test_llamacpp_style_error_field_is_a_failure():
    import httpx

    from inferlab.bench.client import _read_stream
    from inferlab.bench.records import RequestRecord

    body = b'data: {"choices":[{"index":0,"text":" a"}]}\n\nerror: {"code":500,"message":"slot failed","type":"server_error"}\n\n'
    resp = httpx.Response(200, stream=httpx.ByteStream(body))
    rec = RequestRecord(index=0)
    asyncio.run(_read_stream(resp, rec, lambda: 1.0))
    assert rec.status is RequestStatus.FAILED and rec.error == "error event: slot failed"
    assert len(rec.chunk_times) == 1


def _read(body: bytes):
    """Parse one SSE body with the client's reader; the clock ticks once a line, so the events
    (each a data line and a blank line) arrive at t = 1, 3, 5, ..."""
    import httpx

    from inferlab.bench.client import _read_stream
    from inferlab.bench.records import RequestRecord

    clock = iter(range(1, 1000))
    rec = RequestRecord(index=0)
    asyncio.run(_read_stream(httpx.Response(200, stream=httpx.ByteStream(body)), rec, lambda: float(next(clock))))
    return rec


def test_final_usage_on_the_last_content_chunk_credits_that_chunk_one_token():
    # No per-chunk usage; the total rides on the last chunk that still has text (some servers do
    # this). That chunk brings one token, not all four: four chunks, three one-token gaps of 2 s.
    body = (
        b'data: {"choices":[{"index":0,"text":" a"}]}\n\n'
        b'data: {"choices":[{"index":0,"text":" b"}]}\n\n'
        b'data: {"choices":[{"index":0,"text":" c"}]}\n\n'
        b'data: {"choices":[{"index":0,"text":" d","finish_reason":"length"}],'
        b'"usage":{"prompt_tokens":7,"completion_tokens":4}}\n\n'
        b"data: [DONE]\n\n"
    )
    rec = _read(body)
    assert rec.status is RequestStatus.OK
    assert rec.chunk_tokens == [1, 1, 1, 1]
    assert rec.itls == [2.0, 2.0, 2.0]
    assert (rec.output_tokens, rec.prompt_tokens) == (4, 7)


def test_llamacpp_final_chunk_with_empty_text_and_cached_prompt_tokens():
    # llama-server: one token a chunk, then a chunk with choices but no text carrying usage
    # (with prompt_tokens_details.cached_tokens); that chunk is not a token.
    body = (
        b'data: {"choices":[{"index":0,"text":" a","finish_reason":null}]}\n\n'
        b'data: {"choices":[{"index":0,"text":" b","finish_reason":null}]}\n\n'
        b'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}],'
        b'"usage":{"completion_tokens":2,"prompt_tokens":128,"prompt_tokens_details":{"cached_tokens":64}}}\n\n'
        b"data: [DONE]\n\n"
    )
    rec = _read(body)
    assert rec.chunk_tokens == [1, 1]
    assert rec.output_tokens == 2 and rec.cached_tokens == 64 and rec.prompt_tokens == 128
    assert rec.e2e == 7.0  # E2E ends at [DONE], the fourth event


def test_continuous_usage_that_skips_a_step_credits_two_tokens():
    # A step whose text the server held back sends nothing; the next chunk's count grows by 2.
    body = (
        b'data: {"choices":[{"index":0,"text":" a"}],"usage":{"prompt_tokens":5,"completion_tokens":1}}\n\n'
        b'data: {"choices":[{"index":0,"text":"\xc3\xa9"}],"usage":{"prompt_tokens":5,"completion_tokens":3}}\n\n'
        b'data: {"choices":[{"index":0,"text":" b"}],"usage":{"prompt_tokens":5,"completion_tokens":4}}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":4}}\n\n'
        b"data: [DONE]\n\n"
    )
    rec = _read(body)
    assert rec.chunk_tokens == [1, 2, 1]
    assert rec.itls == [1.0, 1.0, 2.0]  # the 2 s gap before the two-token chunk is split in two
    assert rec.cached_tokens is None
