"""The OTLP exporter's HTTP session: what the SDK's exporter sees but does not pass on.

The SDK's OTLP/HTTP exporter tells its caller one thing per export, retries included:
success or failure. Counting each record once needs two more, which the ``requests``
session it sends through sees (:class:`proxy.accounting.records.otlp.OtlpSink` reads them):

- the collector's last answer, whose body may be a partial success and whose status may
  be a redirect, which the SDK takes for a success;
- whether an attempt ended with no answer after its request may have gone out (a read
  timeout, a connection reset or closed before or while answering): the collector may
  have taken those spans, so a failed export with such an attempt is ``unconfirmed``, not
  ``export_failed``. Only an attempt whose connection was never made (refused, no such
  host, a connect timeout, a TLS handshake that failed) certainly delivered nothing.

It also holds the exporter to its timeout. The SDK passes each attempt the time left, but
``requests`` applies it to each read of the socket, not to the answer: a collector sending
a byte now and then held the sink's thread without end. A timer shuts the attempt's
connection down when its time is up, which ends the attempt like a reset (the request
went out: ``unconfirmed`` if no later attempt is confirmed). Connections through an HTTP
proxy (``HTTPS_PROXY``) are not watched: ``requests`` builds their pools elsewhere.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any

import requests
from requests import exceptions
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import NewConnectionError

#: The connections the current attempt of this thread used, for its timer to shut down.
_attempt = threading.local()


class _Watched:
    """A urllib3 connection that tells the attempt using it that it does."""

    def request(self, *args: Any, **kwargs: Any) -> None:
        used = getattr(_attempt, "connections", None)
        if used is not None:
            used.append(self)
        super().request(*args, **kwargs)  # type: ignore[misc]


class _WatchedHTTP(_Watched, HTTPConnection):
    pass


class _WatchedHTTPS(_Watched, HTTPSConnection):
    pass


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _WatchedHTTP


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPS


class _Deadline:
    """Shuts down the connections an attempt used once ``seconds`` have passed, unless it
    ended first (the lock keeps a connection back in the pool from being shut)."""

    def __init__(self, seconds: float) -> None:
        self.connections: list[Any] = []
        self.passed = False
        self._lock = threading.Lock()
        self._ended = False
        self._timer = threading.Timer(seconds, self._cut)
        self._timer.daemon = True
        self._timer.start()

    def _cut(self) -> None:
        with self._lock:
            if self._ended:
                return
            self.passed = True
            for connection in self.connections:
                sock = connection.sock  # once: the sink's thread may close it meanwhile
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)

    def end(self) -> bool:
        """Stop the timer; whether it had already shut the attempt's connections down."""
        with self._lock:
            self._ended = True
        self._timer.cancel()
        return self.passed


def maybe_delivered(exc: Exception) -> bool:
    """Whether the request that failed with ``exc`` may have reached the collector."""
    if isinstance(exc, exceptions.ConnectTimeout | exceptions.SSLError):
        return False
    if isinstance(exc, exceptions.ConnectionError):
        cause = exc.args[0] if exc.args else None  # urllib3's MaxRetryError, or the error itself
        return not isinstance(getattr(cause, "reason", cause), NewConnectionError)
    return isinstance(exc, exceptions.Timeout | exceptions.ChunkedEncodingError | exceptions.ContentDecodingError)


class ExportSession(requests.Session):
    """A ``requests`` session that keeps the last answer and notes an unanswered attempt."""

    def __init__(self) -> None:
        super().__init__()
        self.answer: requests.Response | None = None
        self.unanswered = False
        for adapter in self.adapters.values():
            adapter.poolmanager.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}

    def forget(self) -> None:
        """Start one export: no answer, no unanswered attempt yet."""
        self.answer, self.unanswered = None, False

    def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
        timeout = kwargs.get("timeout")
        deadline = _Deadline(timeout) if isinstance(timeout, int | float) else None
        _attempt.connections = None if deadline is None else deadline.connections
        self.answer = None  # this attempt's, not an earlier retry's
        try:
            answer = super().send(request, **kwargs)
            if deadline is not None and deadline.end():  # what came is cut short: no answer
                raise exceptions.ReadTimeout("the collector's answer outlasted the timeout", request=request)
        except Exception as exc:
            self.unanswered = self.unanswered or maybe_delivered(exc)
            raise
        finally:
            _attempt.connections = None
            if deadline is not None:
                deadline.end()
        self.answer = answer
        return answer
