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

Departures from the SDK's usual wiring, because a usage record is billing data, not a
trace sample:

- No ``TracerProvider``, sampler or span limits: each span is built directly as the SDK's
  ``ReadableSpan`` from the finished record (start and end times given explicitly). A
  sampler would follow the caller's ``traceparent`` flags (``-00``: not sampled), and
  ``OTEL_SDK_DISABLED``, ``OTEL_TRACES_SAMPLER`` or ``OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT`` in
  the environment would drop spans or attributes: a client or an environment variable
  could make its usage vanish. Every record is exported, flagged sampled, keeping the
  caller's trace id and span id (as parent) whatever their flags.
- No ``BatchSpanProcessor``: it drops spans when its queue is full and the exporter's
  failures stay inside it, so neither could be counted in
  ``cachetally_usage_records_dropped_total``. This sink's thread exports batches of at
  most :data:`MAX_BATCH` spans and counts what the exporter did not confirm; the exporter
  retries within ``timeout_s``, then the rest of the batch is dropped and counted.
- The collector's answer is read, which the SDK's exporter does not do: OTLP/HTTP lets a
  collector take part of a request and say so in a ``200`` whose body is a
  ``partial_success`` with the number of spans it rejected (and the client must not send
  them again). Those are counted dropped as ``export_failed``, not written. So is a chunk
  the collector answered with a redirect: the SDK takes any status below 400 for a
  success, but follows no redirect, so a ``3xx`` delivered nothing.
- A chunk not taken after an attempt at it went unanswered (a read timeout, a connection
  reset after the request went out) may be at the collector all the same: it is counted
  ``unconfirmed``, not ``export_failed``, the reason for records that may or may not
  have been delivered (:mod:`proxy.accounting.records.otlp_session`).

The exporter's own per-failure log lines are silenced: the recorder's once-a-minute line
says the same. So is the SDK's line for an ``OTEL_EXPORTER_OTLP_HEADERS`` entry it cannot
read, which quotes the entry, credentials and all (``Authorization: Bearer ...`` written
for ``authorization=Bearer%20...``): ours names the variable, not the value. urllib3, under the
SDK's ``requests`` session, quotes the endpoint's query (a token) in its lines: a warning for an
answer header it cannot parse, a debug line per request. Its NullHandler hides them unless the
operator's logging config gives the root logger a handler; there they show the query as ``***``.
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from proxy.accounting.records.queue import Delivery
from proxy.accounting.records.record import UsageRecord
from proxy.server.logs import redacted

MAX_BATCH = 512
logger = logging.getLogger("cachetally.records")
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
        "cachetally.record_id": record.record_id,
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


class _HeaderEntryUnshown(logging.Filter):
    """In place of the SDK's warning that quotes a headers entry it skips: one without it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Header format invalid"):
            return True
        logger.warning("OTEL_EXPORTER_OTLP_HEADERS (or OTEL_EXPORTER_OTLP_TRACES_HEADERS): an entry that is "
                       "not name=value (URL-encoded, comma-separated) is not sent; its value is not shown")
        return False


class _QueryUnshown(logging.Filter):
    """urllib3's lines with each URL or request target they quote :func:`redacted`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redacted(a) if isinstance(a, str) and "?" in a else a for a in record.args)
        return True


class OtlpSink:
    name = "otlp"
    failure = "export_failed"

    def __init__(self, endpoint: str, timeout_s: float = 10.0) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.trace.export import SpanExportResult
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, get_current_span
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from google.protobuf.message import DecodeError
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

        from proxy.accounting.records.otlp_session import ExportSession

        logging.getLogger("opentelemetry.exporter.otlp.proto.http").setLevel(logging.CRITICAL)
        headers = logging.getLogger("opentelemetry.util.re")  # read when the exporter is made
        if not any(isinstance(f, _HeaderEntryUnshown) for f in headers.filters):
            headers.addFilter(_HeaderEntryUnshown())
        for name in ("urllib3.connection", "urllib3.connectionpool"):  # the warning; the request lines
            quoting = logging.getLogger(name)
            if not any(isinstance(f, _QueryUnshown) for f in quoting.filters):
                quoting.addFilter(_QueryUnshown())
        self._session = ExportSession()  # what the SDK does not pass on: the answer, an attempt's fate
        self._parse_answer, self._not_protobuf = ExportTraceServiceResponse.FromString, DecodeError
        self._exporter = OTLPSpanExporter(endpoint=endpoint, timeout=timeout_s, session=self._session)
        self._span, self._context = ReadableSpan, SpanContext
        self._resource = Resource.create({"service.name": "cachetally"})
        self._scope = InstrumentationScope("cachetally", _package_version())
        self._ids = RandomIdGenerator()
        self._sampled = TraceFlags(TraceFlags.SAMPLED)
        self._success = SpanExportResult.SUCCESS
        self._server = SpanKind.SERVER
        self._ok, self._error = Status(StatusCode.UNSET), Status(StatusCode.ERROR)
        self._propagator, self._current = TraceContextTextMapPropagator(), get_current_span

    def _parent(self, traceparent: str | None) -> Any:
        """The caller's span context, whatever its sampled flag; ``None`` if absent or invalid."""
        if not traceparent:
            return None
        parent = self._current(self._propagator.extract({"traceparent": traceparent})).get_span_context()
        return parent if parent.is_valid else None

    def span(self, record: UsageRecord) -> Any:
        """The record's span: the caller's trace id and parent span id when it sent a valid
        ``traceparent``, a new trace otherwise; always flagged sampled, since it is exported."""
        attrs = span_attributes(record)
        parent = self._parent(record.traceparent)
        trace_id = parent.trace_id if parent is not None else self._ids.generate_trace_id()
        return self._span(
            f"{attrs['gen_ai.operation.name']} {record.model}",
            context=self._context(trace_id, self._ids.generate_span_id(), False, self._sampled),
            parent=parent,
            resource=self._resource,
            attributes=attrs,
            kind=self._server,
            instrumentation_scope=self._scope,
            status=self._error if record.outcome == "error" else self._ok,
            start_time=int(record.start_unix * 1e9),
            end_time=int(record.end_unix * 1e9),
        )

    def _rejected(self, answer: Any, sent: int) -> tuple[int, str]:
        """How many of the ``sent`` spans the collector's 2xx ``answer`` says it rejected (a
        partial success), and its message. An answer that is not an OTLP response rejects
        nothing."""
        if answer is None:
            return 0, ""
        try:
            partial = self._parse_answer(answer.content).partial_success
        except self._not_protobuf:
            return 0, ""
        return min(max(partial.rejected_spans, 0), sent), partial.error_message[:200]

    def _export(self, chunk: list[UsageRecord]) -> tuple[int, str]:
        """Export one chunk: how many of its spans the collector took, and why not the rest."""
        try:
            result = self._exporter.export([self.span(record) for record in chunk])
        except Exception as exc:  # the exporter's own errors: this chunk is not delivered
            return 0, f"export raised {type(exc).__name__}"
        answer = self._session.answer  # the last one, after the SDK's retries
        if result is not self._success:
            return 0, "export failed" + ("" if answer is None else f": the collector answered {answer.status_code}")
        if answer is not None and not 200 <= answer.status_code < 300:
            return 0, f"the collector answered {answer.status_code}"  # a redirect: none delivered
        refused, message = self._rejected(answer, len(chunk))
        return len(chunk) - refused, f"the collector rejected {refused} of {len(chunk)} spans: {message!r}"

    def write(self, batch: list[UsageRecord]) -> Delivery:
        """Export ``batch`` in chunks of :data:`MAX_BATCH`. What the collector did not take
        (the exporter failed after its retries within the timeout, or raised; a redirect;
        a partial success) is lost, or ``unconfirmed`` when an attempt at its chunk went
        unanswered (:mod:`proxy.accounting.records.otlp_session`). A chunk refused as too
        large (413) is sent again in halves, down to single spans, so the long names in
        one client's records cost no other record. After any other failed chunk the rest
        is not tried, so a dead collector costs one timeout per flush, not one per chunk."""
        done, detail = Delivery(), ""
        chunks = [batch[start : start + MAX_BATCH] for start in range(0, len(batch), MAX_BATCH)]
        while chunks:
            chunk = chunks.pop(0)
            self._session.forget()
            taken, why = self._export(chunk)
            too_large = not taken and self._too_large()
            if too_large and len(chunk) > 1:
                half = len(chunk) // 2
                chunks[:0] = [chunk[:half], chunk[half:]]
                continue
            done.written += taken
            if taken == len(chunk):
                continue
            detail = why
            if self._session.unanswered:  # the collector may hold what it did not confirm
                done.unconfirmed += len(chunk) - taken
                detail += "; an attempt went unanswered"
            if not taken and not too_large:  # a span too large alone is lost alone
                break
        done.lost = len(batch) - done.written - done.unconfirmed  # the chunks not tried included
        done.detail = detail
        return done

    def _too_large(self) -> bool:
        """Whether the collector answered the last export 413 (a request over its size
        limit, which the SDK does not retry), and no attempt at it went unanswered."""
        answer = self._session.answer
        return not self._session.unanswered and answer is not None and answer.status_code == 413

    def close(self) -> None:
        self._exporter.shutdown()
