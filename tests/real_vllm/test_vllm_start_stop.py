"""A stop during vLLM's engine-core start, on a real engine: `cachetally serve` ends there.

vLLM 0.32 starts its engine core inside a ZeroMQ context manager that catches
``KeyboardInterrupt``, which is what vLLM's own SIGTERM handler raises there: the stop was
lost, and the server went on to serve once the engine was up
(``engine_adapter/vllm/engine_start.py``). One engine start, cut short.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import psutil
import pytest

from tests.servers import ENGINE_KV_FLAGS, ROOT, free_port, stop

pytestmark = pytest.mark.vllm

#: The engine core logs it once the handshake gave it its config, as it begins to load the
#: model; the server is then waiting for the engine's ready message, seconds away.
ENGINE_CORE_STARTING = "Initializing a V1 LLM engine"
#: Only ends a start that hangs (then the assertions say what was seen): a slow CI machine
#: takes a minute or more to get this far.
HUNG_S = 600


def test_a_sigterm_during_the_engine_core_start_stops_the_server_and_its_engine() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHETALLY_")}
    env["VLLM_LOGGING_LEVEL"] = "INFO"  # the engine core's line above
    argv = [sys.executable, "-m", "proxy.server.cli", "serve", "--port", str(free_port()), "--", *ENGINE_KV_FLAGS]
    lines: list[str] = []
    engine: list[psutil.Process] = []
    names: list[str] = []
    with subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:  # its pipe closed at the end
        hung = threading.Timer(HUNG_S, proc.kill)
        hung.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:  # the log, to the process's end (or to the ready line, which must not come)
                lines.append(line.rstrip("\n"))
                if ENGINE_CORE_STARTING in line and not engine:
                    engine = psutil.Process(proc.pid).children(recursive=True)
                    names = [p.name() for p in engine]
                    proc.send_signal(signal.SIGTERM)
                if "cachetally ready on http" in line:
                    break  # served after the stop: stopped below, and failed
            else:
                proc.wait(timeout=60)
        finally:
            hung.cancel()
            stop(proc)
    log = "\n".join(lines)
    assert "VLLM::EngineCore" in names, log[-3000:]
    assert not any("cachetally ready on http" in line for line in lines), log[-3000:]
    assert (proc.returncode, "cachetally: stopped" in lines) == (0, True), log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    _, alive = psutil.wait_procs(engine, timeout=60)  # the resource tracker ends just after the server
    assert alive == [], names
