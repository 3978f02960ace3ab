"""The floor of ``cachetally bench proxy``: a bare TCP relay with no HTTP in it.

It copies bytes both ways between each client connection and one new connection to the
upstream, with flow control and nothing else (asyncio Protocols, uvloop when installed).
Pinned where the proxy runs, it measures what any extra hop costs on this machine (the
loopback round trip, a second process's wakeups, the cross-core traffic), so a figure the
relay cannot reach either is not the proxy's to reach.

Run as ``python -m proxy.bench.relay --upstream HOST:PORT --port P``.
"""

from __future__ import annotations

import argparse
import asyncio


class _Side(asyncio.Protocol):
    """One connection; ``peer`` is the other side's transport, once connected."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.pending: list[bytes] = []
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is None or peer.transport is None:
            self.pending.append(data)
        else:
            peer.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    # Flow control: a full outgoing buffer on our side stops reading from the peer.
    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def link(self, peer: _Side) -> None:
        self.peer, peer.peer = peer, self
        assert self.transport is not None
        for data in peer.pending:
            self.transport.write(data)
        peer.pending.clear()
        if peer.closed:
            self.transport.close()


async def serve(upstream_host: str, upstream_port: int, port: int) -> None:
    loop = asyncio.get_running_loop()
    connecting: set[asyncio.Task[None]] = set()  # strong references while they run

    def accepted() -> _Side:
        client = _Side()

        async def connect() -> None:
            try:
                _, upstream = await loop.create_connection(_Side, upstream_host, upstream_port)
            except OSError:
                if client.transport is not None:
                    client.transport.close()
                return
            upstream.link(client)

        task = loop.create_task(connect())
        connecting.add(task)
        task.add_done_callback(connecting.discard)
        return client

    server = await loop.create_server(accepted, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m proxy.bench.relay", description=__doc__.split("\n")[0].replace("``", ""))
    parser.add_argument("--upstream", required=True, help="HOST:PORT to relay to")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log-level", default="warning", help="accepted for symmetry; the relay logs nothing")
    args = parser.parse_args(argv)
    host, _, upstream_port = args.upstream.rpartition(":")
    try:
        from uvloop import run
    except ImportError:
        run = asyncio.run
    run(serve(host, int(upstream_port), args.port))


if __name__ == "__main__":
    main()
