"""The processes ``cachetally bench proxy`` runs: servers, the load generator, core placement.

Every process is started as a child on 127.0.0.1 and registered with :class:`Servers`
(an ``ExitStack``), so leaving the ``with`` block stops it, whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (Linux ``/proc``), or None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class Placement:
    """Which cores the proxy side and the rest get (no pinning with one core or no API)."""

    def __init__(self) -> None:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.pinned = len(cores) >= 2
        self.proxy = {cores[0]} if self.pinned else None
        self.rest = set(cores[1:]) if self.pinned else None

    def pin(self, pid: int, cores: set[int] | None) -> None:
        if cores is not None:
            os.sched_setaffinity(pid, cores)


class Servers(contextlib.ExitStack):
    def __init__(self, placement: Placement) -> None:
        super().__init__()
        self.placement = placement

    def start(self, args: list[str], cores: set[int] | None) -> tuple[int, subprocess.Popen[bytes]]:
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, *args, "--port", str(port), "--log-level", "warning"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.callback(stop, proc)
        self.placement.pin(proc.pid, cores)
        return port, proc


def stop(proc: subprocess.Popen[Any], timeout_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if ``proc`` has not exited within ``timeout_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen[Any], timeout_s: float = 60.0) -> None:
    """Poll ``url``/health until it answers 200; fail at once if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server {proc.args} exited with code {proc.returncode}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


class LoadGen:
    def __init__(self, servers: Servers) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "proxy.bench.loadgen"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        servers.callback(stop, self.proc)
        servers.callback(self._exit)
        servers.placement.pin(self.proc.pid, servers.placement.rest)

    def _exit(self) -> None:
        try:
            with contextlib.suppress(OSError, ValueError):
                self.send({"op": "exit"})
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        finally:
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()

    def send(self, job: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"load generator exited with code {self.proc.wait()}")
        return json.loads(line)

    def run(self, port: int, path: str, body: str, conns: int, per_conn: int) -> dict[str, Any]:
        self.send({"op": "run", "port": port, "path": path, "body": body, "conns": conns, "per_conn": per_conn})
        result = self.answer()
        if result["errors"]:
            raise RuntimeError(f"{result['errors']} failed request(s) against port {port}")
        return result
