"""`--otlp-traces-endpoint URL` (vLLM's flag): each request's trace sent to an OpenTelemetry
collector over OTLP/HTTP (protobuf), by OpenTelemetry's own SDK and exporter.

Imported only when the flag is given (the SDK is the optional `otlp` extra). Spans are made
after the fact from the engine's `RequestTrace` with explicit start and end times (the monotonic
clock mapped once onto the wall clock), batched and sent by the SDK's background thread, so a
request pays a few span objects, never a network call.
"""

from __future__ import annotations

import time
from urllib.parse import urlsplit

from inferlab.engine.tracing import RequestTrace


def traces_url(endpoint: str) -> str:
    """The collector's traces URL: a bare host:port gets OTLP/HTTP's path, /v1/traces."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-traces-endpoint must be an http(s) URL, like http://127.0.0.1:4318, got {endpoint!r}")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


class OtlpTraceExporter:
    """An `on_complete` hook of `TraceRecorder`: one OTel trace per request."""

    def __init__(self, endpoint: str, service_name: str = "inferlab"):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as e:
            raise ValueError(
                "--otlp-traces-endpoint needs OpenTelemetry: pip install 'inferlab[otlp]' "
                f"(opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http): {e}"
            ) from None
        self.url = traces_url(endpoint)
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=self.url),
                                                            schedule_delay_millis=500))  # fmt: skip
        self.tracer = self.provider.get_tracer("inferlab")
        self._offset_ns = time.time_ns() - time.monotonic_ns()

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self._offset_ns

    def __call__(self, trace: RequestTrace) -> None:
        from opentelemetry import trace as otel

        spans = trace.spans()
        root = spans[0]
        root_span = self.tracer.start_span(root.name, start_time=self._ns(root.start), attributes=root.attributes,
                                           kind=otel.SpanKind.SERVER)  # fmt: skip
        contexts = {root.name: otel.set_span_in_context(root_span)}
        children = []
        for s in spans[1:]:
            span = self.tracer.start_span(s.name, context=contexts.get(s.parent or "", contexts[root.name]),
                                          start_time=self._ns(s.start), attributes=s.attributes)  # fmt: skip
            contexts.setdefault(s.name, otel.set_span_in_context(span))
            children.append((span, s))
        for span, s in children:
            span.end(end_time=self._ns(s.end))
        root_span.end(end_time=self._ns(root.end))

    def shutdown(self) -> None:
        """Send what is batched, then stop the SDK's thread."""
        self.provider.shutdown()
