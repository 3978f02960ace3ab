"""A test OTLP/HTTP trace receiver on 127.0.0.1: decodes what an exporter sends with
opentelemetry-proto (not with our code) and keeps every span's attributes.

``status`` (default 200) is what it answers; only spans of a request it answers with a 2xx are
kept, as a collector that redirects a request (3xx), refuses it (4xx) or fails it (5xx) has not
taken them. ``reject`` (default 0) makes each 2xx a partial success, as OTLP/HTTP defines it: the
last ``reject`` spans of the request (all, if it has fewer) are not kept, and the answer's
``partial_success.rejected_spans`` says ``reject`` (a negative one keeps them all), with
``message`` as its ``error_message``. ``body``, when set, is the answer's body in place of an
OTLP response (a proxy's ``OK``). ``script`` holds one ``(status,
reject)`` for each of the next requests, answered in turn before those defaults apply.
A status of :data:`RESET` keeps the request's spans and resets the connection without an
answer; ``delay_s`` keeps them and waits that long before answering: a collector that took
the spans, as far as the exporter can tell, or not. ``max_body`` (bytes) answers 413 to a
larger request, as a proxy in front of a collector does (nginx's default: 1 MiB).
``drip`` keeps the spans of the next that many requests and answers each a byte every
0.2 s, with no end: a collector slower than any deadline, though each byte comes well
within a read timeout. ``malformed`` adds a header line without a colon to each answer, which
``http.client`` skips and urllib3 logs a warning for. ``requests`` counts every request, whatever
the answer."""

from __future__ import annotations

import contextlib
import gzip
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

#: The status that answers nothing: the spans are kept, the connection reset.
RESET = 0


@dataclass
class ReceivedSpan:
    name: str
    kind: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    start_ns: int
    end_ns: int
    status_code: int
    trace_id: str
    parent_span_id: str
    span_id: str
    scope: tuple[str, str]  # the instrumentation scope's name and version


@dataclass
class Receiver:
    url: str
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    status: int = 200
    reject: int = 0
    message: str = "span too large"
    body: bytes | None = None
    delay_s: float = 0.0
    max_body: int | None = None
    drip: int = 0
    malformed: bool = False
    script: list[tuple[int, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attributes(items: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in items}


@contextlib.contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    receiver = Receiver(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            encoding = self.headers.get("content-encoding", "")
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            with receiver.lock:
                receiver.requests += 1
                status, reject = receiver.script.pop(0) if receiver.script else (receiver.status, receiver.reject)
                if receiver.max_body is not None and len(body) > receiver.max_body:
                    status, reject = 413, 0
                dripping, receiver.drip = receiver.drip > 0, max(receiver.drip - 1, 0)
                received = []
                taken = 200 <= status < 300 or status == RESET
                for resource_spans in request.resource_spans if taken else ():
                    resource = _attributes(resource_spans.resource.attributes)
                    for scope_spans in resource_spans.scope_spans:
                        scope = (scope_spans.scope.name, scope_spans.scope.version)
                        for span in scope_spans.spans:
                            received.append(ReceivedSpan(
                                span.name, span.kind, _attributes(span.attributes), resource,
                                span.start_time_unix_nano, span.end_time_unix_nano, span.status.code,
                                span.trace_id.hex(), span.parent_span_id.hex(), span.span_id.hex(), scope,
                            ))
                receiver.spans.extend(received[: max(len(received) - reject, 0)])
            if status == RESET:
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True  # closed with a linger of 0: a reset
                return
            time.sleep(receiver.delay_s)
            if dripping:
                with contextlib.suppress(OSError):  # until the exporter hangs up
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nx-padding: ")
                    while True:
                        self.wfile.write(b"x")
                        time.sleep(0.2)
            partial = ExportTracePartialSuccess(rejected_spans=reject, error_message=receiver.message)
            answer = ExportTraceServiceResponse(partial_success=partial if reject else None).SerializeToString()
            if receiver.body is not None:
                answer = receiver.body
            with contextlib.suppress(OSError):  # an exporter that stopped waiting has left
                self.send_response(status)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                if receiver.malformed:
                    self._headers_buffer.append(b"a header line without a colon\r\n")  # type: ignore[attr-defined]
                self.end_headers()
                self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
