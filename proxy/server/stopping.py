"""uvicorn's server, whose force quit still ends the requests in flight and drains the records.

A second Ctrl-C during the graceful stop is uvicorn's force quit: it stops waiting for the
requests in flight and skips the app's shutdown, so the usage recorder is never drained.
With one process, asyncio's own teardown then cancelled the requests (uvicorn answered a
plain-text 500 and cut the streams, a traceback each) and the lifespan, which drained the
recorder by luck. With ``--workers N`` a worker that a terminal's Ctrl-C reaches twice
(and its parent's SIGTERM once) died by that SIGTERM, re-raised by uvicorn once its stop was
done: the records of the requests it was running, and those not yet flushed, were lost and
counted nowhere. Here a force quit still stops waiting at once, then ends each request
still running as the drain's end does (:mod:`proxy.patching.stopped`: the 503 or the SSE
error event, and its record) and runs the app's shutdown, which drains the recorder.

The workers of ``--workers N`` are spawned by uvicorn's own supervisor, which builds each
one's server itself (``uvicorn.supervisors.multiprocess.Process.server``):
:func:`run_workers` has it build this one.

That supervisor reads the signals it caught only between its rounds of health checks, and
replaces a worker it finds dead unless it is exiting. A terminal's Ctrl-C reaches the
workers too: one that had nothing to drain stopped while a round was checking the others,
and was replaced. Its replacement served nothing and was stopped, or the second Ctrl-C cut
it in the middle of its imports, a traceback in the log. Here a stop signal caught counts
as exiting at once (:class:`_StopAsked`).
"""

from __future__ import annotations

import signal
import socket
import threading

import uvicorn
from uvicorn.supervisors import multiprocess

from proxy.asgi.errors import UVICORN_STOP


class StoppingServer(uvicorn.Server):
    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        lifespan = self.lifespan
        if self.force_exit and not lifespan.shutdown_event.is_set():  # the app's shutdown was skipped
            for task in self.server_state.tasks:
                task.cancel(msg=UVICORN_STOP)  # answered as the drain's end is
            await lifespan.shutdown()


class _Worker(multiprocess.Process):
    """A worker process of uvicorn's supervisor, serving with :class:`StoppingServer`
    (pickled by reference into the spawned process, so the class must be importable)."""

    @property
    def server(self) -> uvicorn.Server:
        if self._server is None:
            self._server = StoppingServer(config=self.config)
        return self._server


class _StopAsked(threading.Event):
    """The supervisor's ``should_exit``, which also reads as set while a stop signal waits in
    its queue: a worker found dead then is not replaced. Only ``is_set`` reads the queue; the
    supervisor's loop, which waits on the event, still stops through its own handling (and
    log line) of the signal."""

    STOPS = frozenset({signal.SIGINT, signal.SIGTERM})

    def __init__(self, signals: list[int]) -> None:
        super().__init__()
        self._signals = signals

    def is_set(self) -> bool:
        return super().is_set() or not self.STOPS.isdisjoint(self._signals)


def _supervising(supervisor: multiprocess.Multiprocess) -> multiprocess.Multiprocess:
    supervisor.should_exit = _StopAsked(supervisor.signal_queue)
    return supervisor


def run_workers(config: uvicorn.Config) -> None:
    """``uvicorn.run(..., workers=N)``, with each worker serving with :class:`StoppingServer`."""
    sock = config.bind_socket()
    try:
        if not hasattr(multiprocess.Process, "server"):  # uvicorn 0.47 and before: it runs the target given
            _supervising(multiprocess.Multiprocess(config, target=StoppingServer(config).run, sockets=[sock])).run()
            return
        # 0.54 (0.48 to 0.53 unchecked) builds and rebuilds each worker by this module-level name.
        uvicorns, multiprocess.Process = multiprocess.Process, _Worker  # type: ignore[misc]
        try:
            _supervising(multiprocess.Multiprocess(config, sockets=[sock])).run()  # type: ignore[call-arg]
        finally:
            multiprocess.Process = uvicorns  # type: ignore[misc]
    finally:
        sock.close()
