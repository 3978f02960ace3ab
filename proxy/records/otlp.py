"""OTLP sink: one span per request, exported with the OpenTelemetry SDK's OTLP/HTTP exporter.

Needs the ``otlp`` extra (``pip install 'cachetally[otlp]'``). Spans follow the GenAI
semantic conventions: named ``"{operation} {model}"`` (``chat``, ``text_completion``), with
``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.response.model``,
``gen_ai.response.id``, ``gen_ai.usage.input_tokens`` (all prompt tokens, cached ones
included, as the convention defines it), ``gen_ai.usage.cache_read.input_tokens``,
``gen_ai.usage.cache_write.input_tokens`` (prompt tokens written to the prefix cache) and
``gen_ai.usage.output_tokens``. What the convention has no name for is under
``cachetally.*``: the tenant, our request id, the outcome, the sources of the numbers.
Kind ``SERVER``: the span is the proxy serving one HTTP request. When the client sent a
W3C ``traceparent``, the span is its child, so usage joins the caller's trace.

Departure from the SDK's usual wiring: no ``BatchSpanProcessor``. It drops spans when its
queue is full and the exporter's failures stay inside it, so neither could be counted in
``cachetally_usage_records_dropped_total``. Spans are made on the sink's own thread from
finished records (start and end times given explicitly), collected by a processor that
only keeps them, and exported by this sink's thread in batches of at most
:data:`MAX_BATCH`; the exporter retries within ``timeout_s``, then the batch is dropped and
counted. The exporter's own per-failure log lines are silenced: the recorder's
once-a-minute line says the same.
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from proxy.records.record import UsageRecord

MAX_BATCH = 512
_OPERATIONS = {"chat": "chat", "completions": "text_completion", "responses": "chat", "messages": "chat"}


def _package_version() -> str:
    try:
        return version("cachetally")
    except PackageNotFoundError:
        return "0"


def span_attributes(record: UsageRecord) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": _OPERATIONS.get(record.route, record.route),
        "gen_ai.request.model": record.request_model or record.model,
        "gen_ai.response.model": record.model,
        "gen_ai.usage.output_tokens": record.completion_tokens,
        "cachetally.tenant": record.tenant,
        "cachetally.request_id": record.request_id,
        "cachetally.outcome": record.outcome,
        "cachetally.stream": record.stream,
        "cachetally.completion_tokens.source": record.completion_source,
    }
    optional = {
        "gen_ai.response.id": record.response_id,
        "gen_ai.usage.input_tokens": record.prompt_tokens,
        "gen_ai.usage.cache_read.input_tokens": record.cached_tokens,
        "gen_ai.usage.cache_write.input_tokens": record.cache_creation_tokens,
        "cachetally.cached_tokens.source": record.source,
        "http.response.status_code": record.status,
    }
    attrs.update({k: v for k, v in optional.items() if v is not None})
    return attrs


class OtlpSink:
    name = "otlp"
    failure = "export_failed"

    def __init__(self, endpoint: str, timeout_s: float = 10.0) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
        from opentelemetry.sdk.trace.export import SpanExportResult
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        ended: list[ReadableSpan] = []

        class _Keep(SpanProcessor):
            def on_end(self, span: ReadableSpan) -> None:
                ended.append(span)

        logging.getLogger("opentelemetry.exporter.otlp.proto.http").setLevel(logging.CRITICAL)
        self._ended = ended
        self._exporter = OTLPSpanExporter(endpoint=endpoint, timeout=timeout_s)
        self._provider = TracerProvider(resource=Resource.create({"service.name": "cachetally"}))
        self._provider.add_span_processor(_Keep())
        self._tracer = self._provider.get_tracer("cachetally", _package_version())
        self._success = SpanExportResult.SUCCESS
        self._server, self._error = SpanKind.SERVER, Status(StatusCode.ERROR)
        self._propagator = TraceContextTextMapPropagator()

    def write(self, batch: list[UsageRecord]) -> int:
        """Export ``batch``; after a failed export (the exporter retried already), the rest
        of the batch is not tried, so a dead collector costs one timeout per flush, not one
        per :data:`MAX_BATCH` records."""
        for start in range(0, len(batch), MAX_BATCH):
            chunk = batch[start : start + MAX_BATCH]
            for record in chunk:
                attrs = span_attributes(record)
                span = self._tracer.start_span(
                    f"{attrs['gen_ai.operation.name']} {record.model}",
                    kind=self._server,
                    attributes=attrs,
                    start_time=int(record.start_unix * 1e9),
                    context=self._propagator.extract({"traceparent": record.traceparent})
                    if record.traceparent
                    else None,
                )
                if record.outcome == "error":
                    span.set_status(self._error)
                span.end(end_time=int(record.end_unix * 1e9))
            spans = list(self._ended)
            self._ended.clear()
            if self._exporter.export(spans) is not self._success:
                return len(batch) - start
        return 0

    def close(self) -> None:
        self._exporter.shutdown()
        self._provider.shutdown()
