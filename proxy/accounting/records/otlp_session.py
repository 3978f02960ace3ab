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
"""

from __future__ import annotations

from typing import Any

import requests
from requests import exceptions
from urllib3.exceptions import NewConnectionError


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

    def forget(self) -> None:
        """Start one export: no answer, no unanswered attempt yet."""
        self.answer, self.unanswered = None, False

    def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
        try:
            self.answer = super().send(request, **kwargs)
        except Exception as exc:
            self.unanswered = self.unanswered or maybe_delivered(exc)
            raise
        return self.answer
