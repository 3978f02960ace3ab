"""Scripts that build vLLM's app in a process of their own, without importing vLLM each time.

Several tests run a short script with vLLM's API-server app and cachetally's middleware in it:
a process of its own, because the middleware registers its metrics in the process's
Prometheus registry and taps the engine client it finds. Each such script spent about
10 s of CPU importing vLLM before it ran for one. Here the script runs in a child forked
from :mod:`multiprocessing`'s fork server, which has imported vLLM's modules once
(``set_forkserver_preload``): the child starts with vLLM in memory and nothing else done,
as a fresh ``python -c`` would after its imports. Only vLLM's modules are preloaded, never
this project's, so each script reads its settings from the environment it is given.

:func:`vllm_scripts` (the ``vllm_script`` fixture, tests/conftest.py) stops the fork server at
the end of the session; each child is waited for, and killed past its timeout.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.servers import ROOT

#: What the scripts import from vLLM: its API server (most of vLLM), its auth middleware, and
#: what the tap reads (docs/ARCHITECTURE.md, "What `proxy` takes from `engine_adapter`").
PRELOAD = ["vllm.entrypoints.openai.api_server", "vllm.entrypoints.serve.middleware.authenticate",
           "vllm.outputs", "vllm.sampling_params"]

Script = Callable[..., "subprocess.CompletedProcess[str]"]


def _run(code: str, argv: list[str], env: dict[str, str], out: str, err: str) -> None:
    """In the forked child: ``python -c code *argv`` in ``ROOT`` with exactly ``env``."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY), fd)
    sys.argv = ["-c", *argv]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 - the test's own script


def vllm_scripts() -> Iterator[Script]:
    """Yield ``run(code, *argv, env=..., timeout=300)``, which answers as
    ``subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, env=env,
    capture_output=True, text=True, timeout=timeout)`` would; stop the fork server after."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)

    def run(code: str, *argv: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
        with tempfile.TemporaryDirectory(prefix="vllm-script-") as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            out.touch()
            err.touch()
            child = context.Process(target=_run, args=(code, list(argv), env, str(out), str(err)))
            child.start()
            child.join(timeout)
            if child.exitcode is None:
                child.kill()
                child.join()
                raise subprocess.TimeoutExpired(["-c", *argv], timeout, out.read_text(), err.read_text())
            return subprocess.CompletedProcess(["-c", *argv], child.exitcode, out.read_text(), err.read_text())

    try:
        yield run
    finally:
        # The fork server would exit with this process (it reads the end of a pipe that this
        # one holds); stopped here, it is gone with the session that started it.
        multiprocessing.forkserver._forkserver._stop()  # noqa: SLF001 - the stdlib's own stop, for tests
