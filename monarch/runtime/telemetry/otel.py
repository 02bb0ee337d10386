"""Optional export of telemetry to OpenTelemetry: spans for messages, programs and collectives, with
failures as error spans; metrics for call counts and durations, collective bytes and worker memory.
On when `opentelemetry-sdk` is installed and OTEL_EXPORTER_OTLP_ENDPOINT is set (the OTLP/HTTP
exporter package must be installed too), or when providers are passed to `export_to`. The default
path needs none of it.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from monarch import config
from monarch.runtime.telemetry.events import Events, recorded

SPANS = {  # table -> (the span's name, its start and end columns, the columns that become attributes)
    "messages": (lambda r: f"{r['actor']}.{r['endpoint']}", "start_us", "end_us",
                 ("rank", "sender", "bytes", "status")),
    "ops": (lambda r: r["op"], "start_us", "end_us", ("rank", "program", "instructions")),
    "collectives": (lambda r: r["kind"], "start_us", "end_us", ("rank", "mdim", "bytes")),
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
        for r in named(events, "messages"):
            where = {"rank": r["rank"], "endpoint": f"{r['actor']}.{r['endpoint']}", "status": r["status"]}
            self.calls.add(1, where)
            self.took.record(r["end_us"] - r["start_us"], where)
        for r in named(events, "collectives"):
            self.moved.add(r["bytes"], {"rank": r["rank"], "kind": r["kind"]})
        for r in named(events, "memory"):
            self.rss.set(r["rss_bytes"], {"rank": r["rank"]})
            self.held.set(r["tensor_bytes"], {"rank": r["rank"]})

    def _spans(self, events: Events) -> None:
        from opentelemetry.trace import Status, StatusCode
        for table, (name, start, end, attrs) in SPANS.items():
            for r in named(events, table):
                if r[end] <= 0:
                    continue
                span = self.tracer.start_span(name(r), start_time=r[start] * 1000,
                                              attributes={k: r[k] for k in attrs})
                if table == "messages" and r["status"] != "ok":
                    span.set_status(Status(StatusCode.ERROR))
                span.end(end_time=r[end] * 1000)
        for r in named(events, "failures"):
            span = self.tracer.start_span(f"failure: {r['kind']}", start_time=r["time_us"] * 1000,
                                          attributes={k: r[k] for k in ("rank", "mesh", "what", "detail")})
            span.set_status(Status(StatusCode.ERROR, r["detail"]))
            span.end(end_time=r["time_us"] * 1000)


def named(events: Events, table: str) -> Iterator[dict[str, Any]]:
    """The rows of one table of a batch, as dicts by column name (export is off the hot path)."""
    columns = recorded(table)
    return (dict(zip(columns, row, strict=True)) for row in events.table(table))


def from_environment() -> Exporter | None:
    """An exporter to OTEL_EXPORTER_OTLP_ENDPOINT, when that is set and the packages are installed."""
    if not config.external("OTEL_EXPORTER_OTLP_ENDPOINT"):
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
