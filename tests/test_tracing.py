"""Per-request traces: the engine's spans (engine/tracing.py), /traces, and the OTLP export to a
stand-in collector started here (OTLP/HTTP protobuf, parsed with OpenTelemetry's own proto)."""

from __future__ import annotations

import http.server
import threading
import time

import httpx
import pytest
from server_harness import ServerThread, wait_until

from inferlab.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig
from inferlab.engine.llm_engine import LLMEngine
from inferlab.engine.request import CompletionOutput, RequestMetrics, RequestOutput
from inferlab.engine.tracing import TraceRecorder
from inferlab.models.testing import make_tiny_hf_model
from inferlab.server.app import ServerSettings, build_app


def _output(rid: str, m: RequestMetrics, reason: str | None) -> RequestOutput:
    return RequestOutput(request_id=rid, prompt=None, prompt_token_ids=[1] * 10,
                         outputs=[CompletionOutput(index=0, token_ids=[5, 6, 7], finish_reason=reason)],
                         finished=True, metrics=m)  # fmt: skip


def phases(spans):
    return [s for s in spans if s.attributes.get("inferlab.phase")]


def test_phases_are_contiguous_and_sum_to_the_request():
    rec = TraceRecorder()
    rec.start("r", 10.0)
    m = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0, last_token_time=12.0,
                       finished_time=12.0)  # fmt: skip
    rec.finish(_output("r", m, "length"))
    rec.complete("r", 12.25, stream_start=11.01)
    spans = rec._traces["r"].spans()
    root = spans[0]
    assert (root.name, root.start, root.end) == ("llm_request", 10.0, 12.25)
    ph = phases(spans)
    assert [(s.name, s.start, s.end) for s in ph] == [("queue", 10.0, 10.5), ("prefill", 10.5, 11.0),
                                                      ("decode", 11.0, 12.0), ("finish", 12.0, 12.25)]
    assert sum(s.duration for s in ph) == pytest.approx(root.duration)
    assert rec.get("r")["complete"] and rec.recent()[0]["request_id"] == "r"


def test_an_abort_in_the_queue_ends_with_an_abort_span_and_the_ring_is_bounded():
    rec = TraceRecorder(capacity=3)
    for i in range(5):
        rec.start(f"r{i}", float(i))
    assert [t["request_id"] for t in rec.recent()] == ["r4", "r3", "r2"]
    rec.complete("r4", 4.5)  # the server ended first (client gone), the engine's abort after
    exported = []
    rec.on_complete.append(exported.append)
    rec.finish(_output("r4", RequestMetrics(arrival_time=4.0, finished_time=4.2), None))
    spans = exported[0].spans()
    assert [(s.name, s.start, s.end) for s in phases(spans)] == [("queue", 4.0, 4.2), ("abort", 4.2, 4.5)]


class Collector:
    """A stand-in OpenTelemetry collector: POST /v1/traces (protobuf) → spans kept here."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans: list = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        outer.spans.extend(ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = v.string_value or v.int_value or v.bool_value or v.double_value
    return out


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("trace-tiny"), arch="llama")


def test_a_request_trace_reaches_an_otlp_collector_and_sums_to_its_time(tiny_path):
    pytest.importorskip("opentelemetry.sdk", reason="the 'otlp' extra (opentelemetry-sdk) is not installed")
    config = EngineConfig(
        load=LoadConfig(model=str(tiny_path), dtype="float32"),
        cache=CacheConfig(block_size=16, num_blocks_override=64),
        scheduler=SchedulerConfig(max_model_len=512, max_num_batched_tokens=32),  # a long prompt: several chunks
        num_threads=1,
    )
    with Collector() as collector:
        settings = ServerSettings(served_model_names=("tiny",), otlp_traces_endpoint=collector.url)
        with ServerThread(build_app(lambda: LLMEngine(config), settings)) as srv:
            srv.wait_ready()
            prompt = list(range(10, 110))  # 100 tokens: 4 chunks of at most 32
            t0 = time.monotonic()
            r = httpx.post(srv.url("/v1/completions"), timeout=60,
                           json={"prompt": prompt, "max_tokens": 6, "ignore_eos": True, "temperature": 0})  # fmt: skip
            wall_ms = (time.monotonic() - t0) * 1000
            assert r.status_code == 200, r.text
            rid, timings = r.json()["id"], r.json()["timings"]
            local = httpx.get(srv.url(f"/traces/{rid}")).json()
            assert local["complete"] and local["finish_reason"] == "length"
            assert httpx.get(srv.url("/traces/nope")).status_code == 404

            def exported():
                return [s for s in collector.spans if s.name == "llm_request" and attrs(s).get("gen_ai.request.id") == rid]

            wait_until(lambda: exported(), timeout=20, what="the request's trace at the collector")
    root = exported()[0]
    mine = [s for s in collector.spans if s.trace_id == root.trace_id]
    by_name: dict[str, list] = {}
    for s in mine:
        by_name.setdefault(s.name, []).append(s)
    ph = [by_name[n][0] for n in ("queue", "prefill", "decode", "finish")]
    assert all(s.parent_span_id == root.span_id for s in ph)
    dur = lambda s: (s.end_time_unix_nano - s.start_time_unix_nano) / 1e6  # noqa: E731
    root_ms = dur(root)
    assert sum(dur(s) for s in ph) == pytest.approx(root_ms, abs=0.01)  # contiguous phases: the whole request
    assert root_ms <= wall_ms  # the server's time, inside what the client measured
    assert dur(ph[0]) == pytest.approx(timings["queue_ms"], abs=0.01)
    assert dur(ph[1]) == pytest.approx(timings["prompt_ms"], abs=0.01)
    assert dur(ph[2]) >= timings["predicted_ms"] - 0.01
    chunks = by_name["prefill_chunk"]
    assert len(chunks) == 4 and sum(attrs(c)["inferlab.tokens"] for c in chunks) == 100
    assert all(c.parent_span_id == ph[1].span_id for c in chunks)
    assert attrs(root)["gen_ai.usage.completion_tokens"] == 6
