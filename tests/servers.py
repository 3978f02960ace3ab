"""Real servers on 127.0.0.1 for loopback tests: started as subprocesses, always stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from proxy.bench.processes import free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent


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
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(log_path, "wb") if log_path else None  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [sys.executable, *args, "--port", str(port)],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=log or None,
        stderr=subprocess.STDOUT if log else None,
    )
    try:
        wait_healthy(url, proc, timeout_s)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if log:
            log.close()


def metric_value(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of the samples ``name`` whose labels include ``labels``; 0.0 when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
