"""``cachetally serve --workers N``: several processes on one listening socket, one set of metrics.

uvicorn's own supervisor runs the workers (``workers=N``): it binds the socket, spawns N
fresh interpreters that accept on it, and restarts one that dies. A spawned worker gets
no Python object from the parent, so the parent writes its final :class:`Settings` to the
environment as ``CACHETALLY_*`` variables (:func:`proxy.server.settings.settings_environment`,
the same channel that reaches vLLM's API server processes) and each worker loads them
back in :func:`app_from_env`, the factory uvicorn imports. The API key, if any, is then in
the workers' environment, as ``CACHETALLY_API_KEY`` would put it: readable by the same
user only (``/proc/PID/environ``), never in the process list. The upstream and sim engines only:
vLLM runs its own API server processes (``--api-server-count``).

Metrics are summed across workers by prometheus_client's multiprocess mode, in a directory
of the instance's own (:func:`multiprocess_dir_for`): a fresh temporary one, removed at
exit, or the operator's ``PROMETHEUS_MULTIPROC_DIR``, whose ``*.db`` files are wiped at
start so a previous run's counts never leak in. A worker that dies leaves its
``cachetally_ledger_open_slots`` (a ``livesum`` gauge) behind; the worker uvicorn starts
in its place drops every dead pid's live-gauge files (:func:`forget_dead_workers`), so the
gauge is right again once the replacement is up. Its counters stay, as they must.

Each worker's engine is its own: with ``--engine sim`` each has its own prefix cache. The
engine's series on ``/metrics`` (the sim's counters, the upstream pool's gauges) are
summed as well, each worker writing its own to the files (:mod:`proxy.server.engine_series`).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator

from prometheus_client.multiprocess import mark_process_dead

from proxy.server.heap import settle_heap
from proxy.server.logs import configure_logging
from proxy.server.settings import load_settings

logger = logging.getLogger("cachetally.workers")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_LIVE_GAUGE = re.compile(r"gauge_live[a-z]*_(\d+)\.db")


@contextlib.contextmanager
def multiprocess_dir_for(workers: int) -> Iterator[str | None]:
    """The instance's multiprocess directory, ready before any worker starts; ``None``: one process.

    An operator's ``PROMETHEUS_MULTIPROC_DIR`` is used (its ``*.db`` files wiped, and said
    so); else, with more than one worker, a fresh temporary directory, removed at exit.
    """
    preset = os.environ.get(MULTIPROC_ENV)
    if preset:
        stale = glob.glob(os.path.join(preset, "*.db"))
        for path in stale:
            os.remove(path)
        logger.info("metrics: PROMETHEUS_MULTIPROC_DIR=%s; removed %d *.db file(s) of an earlier run",
                    preset, len(stale))
        yield preset
        return
    if workers == 1:
        yield None
        return
    path = tempfile.mkdtemp(prefix="cachetally-metrics-")
    os.environ[MULTIPROC_ENV] = path
    logger.info("metrics: %d workers, summed through %s (removed at exit)", workers, path)
    try:
        yield path
    finally:
        del os.environ[MULTIPROC_ENV]
        shutil.rmtree(path, ignore_errors=True)


def app_from_env() -> object:
    """uvicorn's factory in each worker: the app for the settings the parent exported."""
    from proxy.server.app import CachetallyApp

    settings = load_settings()  # the parent's, exported as CACHETALLY_* variables
    configure_logging(settings.log_level)
    mp_dir = os.environ.get(MULTIPROC_ENV)
    if mp_dir:
        forget_dead_workers(mp_dir)
    return CachetallyApp(settings, on_started=settle_heap)


def forget_dead_workers(mp_dir: str) -> list[int]:
    """``mark_process_dead`` for each pid with live-gauge files and no process; returns them."""
    dead = []
    for name in os.listdir(mp_dir):
        match = _LIVE_GAUGE.fullmatch(name)
        if match is None:
            continue
        pid = int(match[1])
        if pid not in dead and not _alive(pid):
            mark_process_dead(pid, mp_dir)
            dead.append(pid)
    if dead:
        logger.warning("metrics: dropped the open-slot gauge of dead worker(s) %s", sorted(dead))
    return dead


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True  # (uvicorn reaps a dead worker before it starts the next, so no zombie passes here)
