"""Optional export of telemetry to OpenTelemetry: spans for messages, programs and collectives, with
failures as error spans; metrics for call counts and durations, collective bytes and worker memory.
On when `opentelemetry-sdk` is installed and OTEL_EXPORTER_OTLP_ENDPOINT is set (the OTLP/HTTP
exporter package must be installed too), or when providers are passed to `export_to`. The default
path needs none of it.
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
    """Turns event batches into spans of one tracer and into metrics of one meter (when given)."""

    def __init__(self, provider: Any, meters: Any = None) -> None:
        self.tracer = provider.get_tracer("monarch")
        self.meter = meters.get_meter("monarch") if meters is not None else None
        if self.meter is not None:
            self.calls = self.meter.create_counter("monarch.messages", description="actor calls run")
            self.took = self.meter.create_histogram("monarch.message.duration", unit="us")
            self.moved = self.meter.create_counter("monarch.collective.bytes", unit="By")
            self.rss = self.meter.create_gauge("monarch.worker.rss", unit="By")
            self.held = self.meter.create_gauge("monarch.worker.tensor_bytes", unit="By")

    def export(self, events: Events) -> None:
        self._spans(events)
        if self.meter is not None:
            self._metrics(events)

    def _metrics(self, events: Events) -> None:
        for r in events.table("messages"):
            where = {"rank": r[0], "endpoint": f"{r[1]}.{r[2]}", "status": r[7]}
            self.calls.add(1, where)
            self.took.record(r[6] - r[5], where)
        for r in events.table("collectives"):
            self.moved.add(r[3], {"rank": r[0], "kind": r[1]})
        for r in events.table("memory"):
            self.rss.set(r[1], {"rank": r[0]})
            self.held.set(r[2], {"rank": r[0]})

    def _spans(self, events: Events) -> None:
        from opentelemetry.trace import Status, StatusCode
        for table, (name, start, end, attrs) in SPANS.items():
            for r in events.table(table):
                if r[end] <= 0:
                    continue
                span = self.tracer.start_span(name(r), start_time=r[start] * 1000,
                                              attributes={k: r[i] for i, k in attrs.items()})
                if table == "messages" and r[7] != "ok":
                    span.set_status(Status(StatusCode.ERROR))
                span.end(end_time=r[end] * 1000)
        for r in events.table("failures"):
            span = self.tracer.start_span(f"failure: {r[2]}", start_time=r[5] * 1000,
                                          attributes={"rank": r[0], "mesh": r[1], "what": r[3], "detail": r[4]})
            span.set_status(Status(StatusCode.ERROR, r[4]))
            span.end(end_time=r[5] * 1000)


def from_environment() -> Exporter | None:
    """An exporter to OTEL_EXPORTER_OTLP_ENDPOINT, when that is set and the packages are installed."""
    if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        return None
    resource = Resource.create({"service.name": "monarch"})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    meters = MeterProvider(resource=resource, metric_readers=[PeriodicExportingMetricReader(OTLPMetricExporter())])
    return Exporter(provider, meters)
