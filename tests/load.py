"""Shared load-test helpers: request mixes, a client that hangs up at a chosen point,
soak sizing, server-log and RSS checks, and a figures sink for docs/RELIABILITY.md.

``CACHETALLY_SOAK=1`` switches the tests that use :func:`count` to their large counts;
``CACHETALLY_FIGURES=FILE`` appends each reported figure to ``FILE`` as one JSON line.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil

from tests.servers import metric_value

SOAK = os.environ.get("CACHETALLY_SOAK", "") not in ("", "0")


def count(ci: int, soak: int) -> int:
    """``soak`` under ``CACHETALLY_SOAK=1``, else ``ci``."""
    return soak if SOAK else ci


def report(name: str, **figures: Any) -> None:
    """Print a figure (shown with ``-s`` or on failure) and append it to ``$CACHETALLY_FIGURES``."""
    line = orjson.dumps({"test": name, "soak": SOAK, **figures}, option=orjson.OPT_NON_STR_KEYS)
    print(line.decode())
    if path := os.environ.get("CACHETALLY_FIGURES"):
        with open(path, "ab") as fh:
            fh.write(line + b"\n")


# -- request mix ---------------------------------------------------------------------------

ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
          "responses": "/v1/responses", "messages": "/v1/messages"}


def request_body(rng: random.Random, route: str, stream: bool, *, max_tokens: int = 12, words: int = 300) -> bytes:
    prompt = " ".join(f"w{rng.randrange(50)}" for _ in range(rng.randrange(20, words)))
    body: dict[str, Any] = {"max_tokens": max_tokens, "stream": stream}
    if stream and route in ("chat", "completions"):
        body["stream_options"] = {"include_usage": rng.random() < 0.7}
    if route == "completions":
        body["prompt"] = prompt
    elif route == "responses":
        body = {"max_output_tokens": max_tokens, "stream": stream, "input": prompt}
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    return orjson.dumps(body)


def prepend(payload: dict[str, Any], route: str, preamble: str) -> None:
    """Put ``preamble`` before the prompt of any route's body (a shared prefix)."""
    if route == "completions":
        payload["prompt"] = f"{preamble} {payload['prompt']}"
    elif route == "responses":
        payload["input"] = f"{preamble} {payload['input']}"
    else:
        payload["messages"][0]["content"] = f"{preamble} {payload['messages'][0]['content']}"


# -- a client that hangs up ----------------------------------------------------------------

Seen = Callable[[bytes], bool]


@dataclass(frozen=True, slots=True)
class DropPoint:
    """Where a client hangs up: after ``until(received bytes)`` is true (``None``: at once)."""

    name: str
    until: Seen | None = None
    half_body: bool = False


def _has(marker: bytes) -> Seen:
    return lambda seen: marker in seen


# The last token's event: chat and completions, Messages, Responses.
_FINISHED = re.compile(rb'"finish_reason":\s*"|"stop_reason":"|response\.output_text\.done')
# The stream's last event.
_ENDED = re.compile(rb"\[DONE\]|event: message_stop|event: response\.(completed|incomplete|failed)")

# Engine-neutral (sim and vLLM): counted in SSE events and JSON fields, never token text.
DROP_POINTS = [
    DropPoint("half-body", half_body=True),
    DropPoint("before-headers"),
    DropPoint("after-headers", _has(b"\r\n\r\n")),
    DropPoint("mid-stream", lambda seen: seen.count(b"data:") >= 3),
    DropPoint("before-usage", lambda seen: _FINISHED.search(seen) is not None),
    DropPoint("after-done", lambda seen: _ENDED.search(seen) is not None),
]


async def dropping_client(
    port: int, path: str, body: bytes, drop: DropPoint, *, headers: bytes = b"", timeout_s: float = 30.0
) -> None:
    """Send ``body`` on a raw connection, read until ``drop.until``, then abort the socket.

    ``Connection: close`` makes the server end the connection after a complete response,
    so a point that never comes (``[DONE]`` in a JSON response) ends at EOF, not at the
    keep-alive timeout. Bounded by ``timeout_s`` in any case.
    """
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = (
            f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"connection: close\r\ncontent-length: {len(body)}\r\n"
        ).encode()
        writer.write(head + headers + b"\r\n" + (body[: len(body) // 2] if drop.half_body else body))
        await writer.drain()
        seen = b""
        deadline = time.monotonic() + timeout_s
        while drop.until is not None and not drop.until(seen):
            chunk = await asyncio.wait_for(reader.read(65536), max(0.01, deadline - time.monotonic()))
            if not chunk:
                break
            seen += chunk
    finally:
        writer.transport.abort()  # hang up without a goodbye


@dataclass
class MixResult:
    statuses: dict[int, int]
    drops: dict[str, int]
    requests: int
    #: The drop point of each request whose client hung up, by its position in the mix.
    dropped_at: dict[int, str] = field(default_factory=dict)


async def run_mix(
    url: str,
    requests: int,
    drop_share: float,
    *,
    seed: int,
    concurrency: int = 32,
    body: Callable[[random.Random, str, bool], bytes] = request_body,
    drop_points: list[DropPoint] = DROP_POINTS,
    headers: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    headers_for: Callable[[int], dict[str, str]] | None = None,
) -> MixResult:
    """``requests`` mixed requests (chat/completions x stream/non-stream); a
    ``drop_share`` of the clients hang up at a random point of ``drop_points``.
    ``timeout_s`` bounds each request (a real engine's tests derive it from its pace);
    ``headers_for(i)`` adds headers to the ``i``-th request."""
    rng = random.Random(seed)
    port = int(url.rsplit(":", 1)[1])
    limit = asyncio.Semaphore(concurrency)
    result = MixResult({}, {}, requests)
    plan = []
    for i in range(requests):
        route = rng.choice(list(ROUTES))
        stream = rng.random() < 0.5
        drop = drop_points[rng.randrange(len(drop_points))] if rng.random() < drop_share else None
        extra = {**(headers or {}), **(headers_for(i) if headers_for else {})}
        plan.append((i, ROUTES[route], body(rng, route, stream), drop, extra))

    # Keep-alive shorter than uvicorn's 5 s: a pooled connection the server is closing just
    # as the client reuses it fails with ReadError, a client-side race, not a proxy fault.
    limits = httpx.Limits(max_connections=concurrency, keepalive_expiry=1.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:

        async def one(i: int, path: str, content: bytes, drop: DropPoint | None, extra: dict[str, str]) -> None:
            async with limit:
                if drop is not None:
                    result.drops[drop.name] = result.drops.get(drop.name, 0) + 1
                    result.dropped_at[i] = drop.name
                    raw_headers = b"".join(f"{k}: {v}\r\n".encode() for k, v in extra.items())
                    await dropping_client(port, path, content, drop, headers=raw_headers, timeout_s=timeout_s)
                    return
                response = await client.post(
                    path, content=content, headers={"content-type": "application/json", **extra}
                )
                result.statuses[response.status_code] = result.statuses.get(response.status_code, 0) + 1

        await asyncio.gather(*(one(*item) for item in plan))
    return result


# -- after a run ---------------------------------------------------------------------------


async def settle(
    read: Callable[[], Awaitable[float]], expected: float = 0.0, timeout_s: float = 5.0
) -> float:
    """Poll ``read`` until it returns ``expected`` (the server finishes after the client)."""
    deadline = time.monotonic() + timeout_s
    while (value := await read()) != expected and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return value


def gauge_reader(url: str, name: str, headers: dict[str, str] | None = None) -> Callable[[], Awaitable[float]]:
    async def read() -> float:
        async with httpx.AsyncClient(timeout=10) as client:
            text = (await client.get(f"{url}/metrics", headers=headers)).text
        return metric_value(text, name)

    return read


LOG_FAILURES = ("Traceback", "Exception")


def log_failures(log: Path) -> list[str]:
    """Lines of a server log that show an unhandled exception."""
    text = log.read_text(errors="replace")
    return [line for line in text.splitlines() if any(word in line for word in LOG_FAILURES)]


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss
