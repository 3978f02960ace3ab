"""A SIGTERM or Ctrl-C during vLLM's engine-core start ends the start instead of being lost.

vLLM (0.32 and 0.33) starts its engine core inside ``launch_core_engines``, whose handshake
socket is a ``zmq_socket_ctx`` that catches ``KeyboardInterrupt`` and carries on. That is
what a stop raises there: ``run_server`` puts a SIGTERM handler in place that raises it
until uvicorn's own take over, and Python's SIGINT raises it too (asyncio's runner only
cancels the main task, which waits for the first ``await``, once the engine is up). So a
stop during the 20 to 60 s of the engine's load and warm-up was lost: the server went on
to serve. For the span of that launch, both signals raise :class:`_StopDuringStart`
instead, which that catch lets through; out of the launch it becomes the
``KeyboardInterrupt`` vLLM meant, which its client's failed construction answers by
shutting the engine processes down, and ``cachetally serve`` by its one-line stop.
"""

from __future__ import annotations

import contextlib
import importlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from engine_adapter.vllm import compat

_LAUNCH = "launch_core_engines"
_STOPS = (signal.SIGTERM, signal.SIGINT)


class _StopDuringStart(BaseException):
    """A stop signal during the engine's launch: not a ``KeyboardInterrupt``, which the launch swallows."""


def _raise_stop(signum: int, frame: object) -> None:
    # Once: a second signal while the first turns into a KeyboardInterrupt, or while the
    # launch unwinds, would escape as this private exception, a traceback.
    for stop in _STOPS:
        signal.signal(stop, signal.SIG_IGN)
    raise _StopDuringStart(signal.Signals(signum).name)


def _stoppable(launch: Callable[..., Any]) -> Callable[..., Any]:
    """``launch`` (a context manager), with SIGTERM and SIGINT ending it as a ``KeyboardInterrupt``."""

    @contextlib.contextmanager
    def launch_stoppable(*args: Any, **kwargs: Any) -> Iterator[Any]:
        if threading.current_thread() is not threading.main_thread():  # signal.signal() would refuse
            with launch(*args, **kwargs) as launched:
                yield launched
            return
        previous = {signum: signal.signal(signum, _raise_stop) for signum in _STOPS}
        try:
            with launch(*args, **kwargs) as launched:
                yield launched
        except _StopDuringStart as stop:
            raise KeyboardInterrupt(f"{stop} during the engine core's start") from None
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    return launch_stoppable


@contextlib.contextmanager
def engine_start_stoppable() -> Iterator[None]:
    """While this lasts, vLLM's engine client (``MPClient``, which looks the name up in its
    own module) launches its engine core with :func:`_stoppable`."""
    launch, module_name, _ = compat.lookup(_LAUNCH)
    if launch is None:  # named by compat.log_missing_once
        yield
        return
    module = importlib.import_module(module_name)  # type: ignore[arg-type]  # found, so named
    setattr(module, _LAUNCH, _stoppable(launch))
    try:
        yield
    finally:
        setattr(module, _LAUNCH, launch)
