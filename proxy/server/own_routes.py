"""What cachetally answers itself, the same way in both servers it runs in.

``/stats`` (and, beside the sim and upstream engines, ``/health`` and ``/metrics``) are
read-only: ``GET`` and ``HEAD`` only, any other method an OpenAI error 405 with
``Allow``. The ready line is the one log line an operator waits for after a start.
Used by :mod:`proxy.server.app` and :mod:`proxy.vllm_middleware`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from starlette.types import Scope, Send

from proxy.asgi.errors import send_error
from proxy.asgi.paths import route_path
from proxy.asgi.replies import send_body


async def read_only(scope: Scope, send: Send, answer: Callable[[Send], Awaitable[None]]) -> None:
    """``answer`` a ``GET`` or ``HEAD``; refuse any other method with 405."""
    if scope["method"] in ("GET", "HEAD"):
        await answer(send)
    else:
        await send_error(send, route_path(scope), 405, "Method Not Allowed", [(b"allow", b"GET, HEAD")])


async def send_stats(send: Send, stats: Mapping[str, Any]) -> None:
    """``/stats``: the totals of :meth:`proxy.accounting.metrics.Metrics.stats_dict`, as JSON."""
    await send_body(send, 200, orjson.dumps(stats), b"application/json")


def ready_line(where: str, engine: str, description: str, started_s: float) -> str:
    """``cachetally ready on http://HOST:PORT: engine E (what runs), started in S s``."""
    return f"cachetally ready on {where}: engine {engine} ({description}), started in {started_s:.1f} s"
