"""An upstream on 127.0.0.1 that parses what the pool writes with h11, an independent parser.

Every byte the pool sends on a connection goes through one ``h11.Connection`` in the
server role, as a real keep-alive server would read it. It records each request h11
parsed completely (method, target, headers, body), every parse error, and the requests
that were cut off with their connection. What it answers depends on the target:

- ``/echo``: after the whole body, 200 with the body as it came (a request's marker
  comes back only if that request reached the upstream as a request of its own);
- ``/v1/chat/completions``: after the whole body, a chat completion whose message is the
  request's first message, echoed (the marker a soak client checks);
- ``/early`` and ``/v1/files``: 413 at once, without waiting for the body, keeping the connection alive
  and reading on (an auth or size layer in front of a real server does this);
- ``/big/N``: after the body, 200 with ``N`` bytes in one write;
- ``/hang``: nothing, ever (until the server stops);
- ``/slow``: a head, one body chunk, then the rest only after ``/slow`` is released.

``no_read=True`` makes it stop reading after the first request head (an upstream that
does not take the body). ``close_idle()`` closes every connection that sits between
requests, as a server's keep-alive timer does. ``reset_idle_on_next_request()`` makes
every such connection end with a reset when its next request's bytes arrive, unread: the
keep-alive timer firing just as a request comes in.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import h11


#: Answered at once, before the body (an auth or size layer).
EARLY = (b"/early", b"/v1/files")


def chat_completion(request: bytes) -> bytes:
    """A chat completion that echoes the request's first message (unparsable: an empty one)."""
    try:
        content = json.loads(request)["messages"][0]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        content = ""
    return json.dumps({
        "id": "chatcmpl-echo", "object": "chat.completion", "created": 0, "model": "echo",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }).encode()


@dataclass
class Parsed:
    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""


@dataclass
class H11Upstream:
    no_read: bool = False
    requests: list[Parsed] = field(default_factory=list)  # parsed to their end
    cut: list[Parsed] = field(default_factory=list)  # the connection ended inside them
    errors: list[str] = field(default_factory=list)  # h11 could not parse the bytes
    connections: int = 0
    release_slow: asyncio.Event = field(default_factory=asyncio.Event)
    resets: int = 0  # connections ended with a reset, their next request unread
    _idle: set[asyncio.StreamWriter] = field(default_factory=set)
    _doomed: set[asyncio.StreamWriter] = field(default_factory=set)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    async def _respond(self, conn: h11.Connection, writer: asyncio.StreamWriter, req: Parsed) -> None:
        path = req.target.split(b"?")[0]
        if path == b"/hang":
            await self.release_slow.wait()  # set only when the server stops
            return
        if path == b"/slow":
            head = h11.Response(status_code=200, headers=[(b"content-length", b"8")])
            writer.write(conn.send(head) + conn.send(h11.Data(data=b"1234")))
            await self.release_slow.wait()
            writer.write(conn.send(h11.Data(data=b"5678")) + conn.send(h11.EndOfMessage()))
            return
        if path.startswith(b"/big/"):
            body = b"b" * int(path[5:])
        elif path in EARLY:
            body = b'{"error": "too large"}'
        elif path == b"/v1/chat/completions":
            body = chat_completion(req.body)
        else:
            body = req.body
        status = 413 if path in EARLY else 200
        head = h11.Response(status_code=status, headers=[(b"content-length", b"%d" % len(body))])
        writer.write(conn.send(head) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        self._idle.add(writer)
        conn = h11.Connection(h11.SERVER)
        current: Parsed | None = None
        responding: asyncio.Task[None] | None = None
        try:
            while True:
                try:
                    event = conn.next_event()
                except h11.RemoteProtocolError as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    return
                if event is h11.NEED_DATA:
                    if self.no_read and current is not None:
                        await asyncio.Event().wait()  # never reads again
                    data = await reader.read(65536)
                    if not data:  # closed: between requests a clean end, inside one a cut
                        return
                    if writer in self._doomed:
                        sock = writer.get_extra_info("socket")
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        writer.transport.abort()
                        self.resets += 1
                        return
                    conn.receive_data(data)
                    continue
                if isinstance(event, h11.Request):
                    self._idle.discard(writer)
                    current = Parsed(event.method, event.target, list(event.headers))
                    if current.target.split(b"?")[0] in (*EARLY, b"/slow", b"/hang"):
                        responding = asyncio.ensure_future(self._respond(conn, writer, current))
                elif isinstance(event, h11.Data):
                    assert current is not None
                    current.body += bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    assert current is not None
                    self.requests.append(current)
                    if responding is None:
                        responding = asyncio.ensure_future(self._respond(conn, writer, current))
                    await responding
                    await writer.drain()
                    current, responding = None, None
                    if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                        return
                    conn.start_next_cycle()
                    self._idle.add(writer)
                elif isinstance(event, h11.ConnectionClosed):
                    return
        except (ConnectionError, h11.LocalProtocolError):
            pass
        finally:
            if current is not None and current not in self.requests:
                self.cut.append(current)
            if responding is not None:
                responding.cancel()
            self._idle.discard(writer)
            self._doomed.discard(writer)
            self._writers.discard(writer)
            writer.close()

    def close_idle(self) -> int:
        """Close every connection that waits for its next request; how many there were."""
        idle = list(self._idle)
        for writer in idle:
            writer.close()
        return len(idle)

    def reset_idle_on_next_request(self) -> int:
        """Every connection now between requests resets when its next request arrives; how many."""
        self._doomed |= self._idle
        return len(self._idle)

    def busy(self) -> int:
        """Connections inside a request, or whose end it has not yet read."""
        return len(self._writers - self._idle)

    @contextlib.asynccontextmanager
    async def serving(self, **tls: object) -> AsyncIterator[int]:
        """Listen on 127.0.0.1 (with ``ssl=...`` for TLS); yield the port; close everything on exit."""
        listener = await asyncio.start_server(self._handle, "127.0.0.1", 0, **tls)  # type: ignore[arg-type]
        try:
            yield listener.sockets[0].getsockname()[1]
        finally:
            listener.close()
            for writer in list(self._writers):
                writer.close()
            self.release_slow.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(listener.wait_closed(), 5)
