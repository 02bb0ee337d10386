"""Optional export of telemetry to OpenTelemetry: spans for messages, programs and collectives, with
failures as error spans. On when `opentelemetry-sdk` is installed and OTEL_EXPORTER_OTLP_ENDPOINT is
set (the OTLP/HTTP exporter package must be installed too), or when a tracer provider is passed to
`export_to`. The default path needs none of it.
"""
from __future__ import annotations

import os
from typing import Any

from monarch.runtime.telemetry import Events

SPANS = {  # table -> (name of the span, index of start, index of end, attribute names by index), as recorded
    "messages": (lambda r: f"{r[1]}.{r[2]}", 5, 6, {0: "rank", 3: "bytes", 7: "status"}),
    "ops": (lambda r: r[2], 4, 5, {0: "rank", 1: "program", 3: "instructions"}),
    "collectives": (lambda r: r[1], 4, 5, {0: "rank", 2: "mdim", 3: "bytes"}),
}


class Exporter:
    """Turns event batches into spans of one tracer."""

    def __init__(self, provider: Any) -> None:
        self.tracer = provider.get_tracer("monarch")

    def export(self, events: Events) -> None:
        from opentelemetry.trace import Status, StatusCode
        for table, (name, start, end, attrs) in SPANS.items():
            for r in events.rows.get(table, ()):
                if r[end] <= 0:
                    continue
                span = self.tracer.start_span(name(r), start_time=r[start] * 1000,
                                              attributes={k: r[i] for i, k in attrs.items()})
                if table == "messages" and r[7] != "ok":
                    span.set_status(Status(StatusCode.ERROR))
                span.end(end_time=r[end] * 1000)
        for r in events.rows.get("failures", ()):
            span = self.tracer.start_span(f"failure: {r[2]}", start_time=r[5] * 1000,
                                          attributes={"rank": r[0], "mesh": r[1], "what": r[3], "detail": r[4]})
            span.set_status(Status(StatusCode.ERROR, r[4]))
            span.end(end_time=r[5] * 1000)


def from_environment() -> Exporter | None:
    """An exporter to OTEL_EXPORTER_OTLP_ENDPOINT, when that is set and the packages are installed."""
    if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": "monarch"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return Exporter(provider)
