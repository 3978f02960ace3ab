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
    handshake's (``'%s - "WebSocket %s" 403'``, second). A target is the one argument that
    starts with ``/``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(map(_without_query, record.args))
        return True


def _without_query(arg: object) -> object:
    if isinstance(arg, str) and arg.startswith("/") and "?" in arg:
        return arg[: arg.index("?")] + "?***"
    return arg


class _NoWebSocketWire(logging.Filter):
    """Without the ``websockets`` library's debug trace of the wire: ``< %s: %s`` (a header),
    ``< %s`` (a frame), and the ``>`` lines of what is sent."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.DEBUG and str(record.msg).startswith(("< ", "> ")))


def _keep_secrets_out_of_uvicorns_lines() -> None:
    for name, kinds in (("uvicorn.access", (_NoQuery,)), ("uvicorn.error", (_NoQuery, _NoWebSocketWire))):
        lines = logging.getLogger(name)
        for kind in kinds:
            if not any(isinstance(f, kind) for f in lines.filters):
                lines.addFilter(kind())


def redacted(url: str) -> str:
    """``url`` fit for a message: whatever precedes its last ``@`` (a user, a password, however
    malformed), and its query or fragment (a token), shown as ``***``."""
    if (at := url.rfind("@")) >= 0:
        scheme, sep, _ = url.partition("://")
        url = f"{scheme}://***{url[at:]}" if sep and len(scheme) < at else f"***{url[at:]}"
    cut = min((i for i in (url.find("?"), url.find("#")) if i >= 0), default=-1)
    return url if cut < 0 else url[: cut + 1] + "***"
