"""cachetally's own log output, independent of the root logger.

Every cachetally logger lives under the ``cachetally`` namespace (``cachetally.app``,
``cachetally.stats``, ``cachetally.engine.vllm``, ...). :func:`configure_logging` gives
that namespace its own stderr handler and level and stops it propagating, so what other
code does to the root logger cannot silence it. This is not hypothetical: while vLLM
0.32 builds its OpenAI app it imports ``model_hosting_container_standards``, which sets
the root logger's level to ``$LOG_LEVEL`` (default ``ERROR``) and leaves it there; with
``logging.basicConfig`` alone that dropped the debug stats line and the ready line.

Nothing secret reaches a line: URLs the operator gives are :func:`redacted`, and uvicorn's
access log (on by default, in every mode, vLLM's too) and its WebSocket handshake lines lose
the query string, where clients put keys (``?api_key=...``; a browser's WebSocket cannot send
a header, so its key is most often there). At debug, uvicorn hands its logger to the
``websockets`` library, which writes every handshake header (``Authorization``, ``Cookie``,
a key sent as a subprotocol) and every frame (prompt and completion text) as a line of its
own: those lines are not written.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

NAMESPACE = "cachetally"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> logging.Logger:
    """Send ``cachetally.*`` records at ``level`` and above to stderr, whatever root says."""
    root = logging.getLogger(NAMESPACE)
    root.setLevel(level.upper())
    root.propagate = False
    if not any(getattr(h, "_cachetally", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        handler._cachetally = True  # type: ignore[attr-defined]  # idempotent re-configuration
        root.addHandler(handler)
    _keep_secrets_out_of_uvicorns_lines()
    return root


@contextlib.contextmanager
def quiet_check() -> Iterator[None]:
    """No ``cachetally.*`` line while the parent only checks settings that the processes it
    starts (vLLM's API servers, ``--workers N``) build again and announce themselves: the
    check's lines ("usage records: JSONL files in ...") were each said twice. A refusal still
    reaches the operator: it is an exception, printed by the caller."""
    root = logging.getLogger(NAMESPACE)
    level = root.level
    root.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        root.setLevel(level)


class _NoQuery(logging.Filter):
    """uvicorn's lines that show a request's target with its query as ``?***``: the access line
    (``'%s - "%s %s HTTP/%s" %d'``, the target third) and, on ``uvicorn.error``, a WebSocket
    handshake's (``'%s - "WebSocket %s" 403'``, second). The target is known by its place in
    the line, not by a leading ``/``: ``GET *?api_key=...`` is served, and logged as ``%2A?...``."""

    def __init__(self, at: int, line: str = "") -> None:
        super().__init__()
        self.at, self.line = at, line  # the target's argument, in lines whose format starts so

    def filter(self, record: logging.LogRecord) -> bool:
        args, at = record.args, self.at
        if (isinstance(args, tuple) and len(args) > at and str(record.msg).startswith(self.line)
                and isinstance(target := args[at], str) and "?" in target):
            record.args = (*args[:at], target[: target.index("?")] + "?***", *args[at + 1:])
        return True


class _NoWebSocketWire(logging.Filter):
    """Without the ``websockets`` library's debug trace of the wire: ``< %s: %s`` (a header),
    ``< %s`` (a frame), the ``>`` lines of what is sent, and the ``!`` lines of a handshake it
    refused, whose traceback quotes the header it could not read (a subprotocol holding a key)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.DEBUG and str(record.msg).startswith(("< ", "> ", "! ")))


def _keep_secrets_out_of_uvicorns_lines() -> None:
    websocket_line = '%s - "WebSocket %s"'
    for name, filters in (("uvicorn.access", (_NoQuery(2),)),
                          ("uvicorn.error", (_NoQuery(1, websocket_line), _NoWebSocketWire()))):
        lines = logging.getLogger(name)
        for new in filters:
            if not any(type(f) is type(new) for f in lines.filters):
                lines.addFilter(new)


def redacted(url: str) -> str:
    """``url`` fit for a message: whatever precedes its last ``@`` (a user, a password, however
    malformed), and its query or fragment (a token), shown as ``***``."""
    if (at := url.rfind("@")) >= 0:
        scheme, sep, _ = url.partition("://")
        url = f"{scheme}://***{url[at:]}" if sep and len(scheme) < at else f"***{url[at:]}"
    cut = min((i for i in (url.find("?"), url.find("#")) if i >= 0), default=-1)
    return url if cut < 0 else url[: cut + 1] + "***"
