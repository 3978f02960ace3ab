"""A server out of file descriptors: idle client connections fill its RLIMIT_NOFILE.

`cachetally serve --engine sim` runs with RLIMIT_NOFILE 256, and a client opens idle
connections until the server's descriptor table stops growing (uvicorn's uvloop accepts
and closes what it has no room for: no busy loop, no log line). A client that connected
before goes on sending requests on its kept-alive connection. What it was answered must
be answered as on a server with room, and recorded once; nothing the server makes while
it is out of descriptors may be left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.servers import running_server, running_servers
from tests.sink_counts import ids_in_files

pytestmark = [pytest.mark.loopback, pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc")]

NOFILE = 256
#: ``python -c`` in place of ``-m proxy.server.cli``: the limit set before anything opens.
LIMITED_CLI = ["-c", f"import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({NOFILE}, {NOFILE})); "
                     "from proxy.server.cli import main; sys.exit(main(sys.argv[1:]))"]


@contextlib.contextmanager
def descriptors_filled(port: int, pid: int) -> Iterator[None]:
    """Idle connections until the server's descriptor table stops growing; closed on exit."""
    def table() -> int:
        return len(os.listdir(f"/proc/{pid}/fd"))

    idle: list[socket.socket] = []
    try:
        unchanged = 0
        while unchanged < 3:
            before = table()
            idle += [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(10)]
            time.sleep(0.05)
            unchanged = unchanged + 1 if table() == before else 0
            assert len(idle) < 4 * NOFILE, "the server's table never filled"
        assert table() >= NOFILE - 1
        yield
    finally:
        for sock in idle:
            sock.close()


def complete(client: httpx.Client, url: str, stream: bool) -> tuple[str, int]:
    """(request id, status), 0 for no answer: a connection the server could not accept."""
    request_id = uuid.uuid4().hex
    body = {"model": "sim-model", "prompt": f"hello {request_id}", "max_tokens": 4, "stream": stream}
    try:
        response = client.post(f"{url}/v1/completions", json=body, headers={"x-request-id": request_id})
    except httpx.TransportError:
        return request_id, 0
    return request_id, response.status_code


def kept_alive() -> httpx.Client:
    """One connection, opened before the table fills (uvicorn keeps it 5 s between requests)."""
    return httpx.Client(timeout=30, limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))


def test_streams_are_answered_by_a_sim_that_ran_out_of_descriptors_before_its_first() -> None:
    """starlette's StreamingResponse imports anyio's task groups and asyncio backend at the
    first stream, and an import opens files: every stream was a 500 with a traceback while
    the table was full (OSError EMFILE on anyio/_core/_tasks.py), until one got through."""
    with running_server([*LIMITED_CLI, "serve", "--engine", "sim", "--log-level", "warning"]) as (url, proc):
        with kept_alive() as client:
            assert client.get(f"{url}/health").status_code == 200
            with descriptors_filled(int(url.rsplit(":", 1)[1]), proc.pid):
                statuses = [complete(client, url, stream=True)[1] for _ in range(4)]
    assert statuses == [200] * 4


def test_usage_records_while_out_of_descriptors_are_written_once_and_leave_no_empty_file(tmp_path: Path) -> None:
    """A new usage file needs two descriptors (the file, its directory to fsync its name),
    and rotation frees one, the old file's: the file was created, the directory's open
    failed, and the empty file was left, a new one at every flush until descriptors came
    back (8 in 1.6 s at a 0.2 s flush interval)."""
    usage = tmp_path / "usage"
    args = [*LIMITED_CLI, "serve", "--engine", "sim", "--log-level", "warning", "--usage-dir", str(usage),
            "--usage-flush-interval", "0.1", "--usage-max-file-bytes", "4096"]  # a rotation every few records
    with running_server(args) as (url, proc):
        with kept_alive() as client:
            answered = [complete(client, url, stream=False)]
            with descriptors_filled(int(url.rsplit(":", 1)[1]), proc.pid):
                answered += [complete(client, url, stream=False) for _ in range(20)]
                time.sleep(1.0)  # ten flushes while the table is full
        assert {status for _, status in answered} == {200}
        deadline = time.monotonic() + 30
        while set(ids_in_files(usage)) != {request_id for request_id, _ in answered} and time.monotonic() < deadline:
            time.sleep(0.1)
    assert ids_in_files(usage) == {request_id: 1 for request_id, _ in answered}
    assert [path.name for path in usage.iterdir() if path.stat().st_size == 0] == []


SOFT = 128
#: The soft limit lowered, the hard one kept: as a shell's usual 1,024 under a higher hard limit.
SOFT_LIMITED_CLI = ["-c", "import resource, sys; hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]; "
                          f"resource.setrlimit(resource.RLIMIT_NOFILE, ({SOFT}, hard)); "
                          "from proxy.server.cli import main; sys.exit(main(sys.argv[1:]))"]
STREAMS = 100


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 4 * STREAMS, reason="a hard limit this low")
@pytest.mark.asyncio
async def test_concurrent_upstream_streams_are_not_capped_by_a_soft_descriptor_limit_below_the_hard_one() -> None:
    """Each stream holds a client's socket and, in upstream mode, a pooled upstream connection
    (up to 1,024). Under the usual soft RLIMIT_NOFILE of 1,024 (vLLM raises its own to 65,535),
    800 concurrent streams got 590 502s, logged "OSError" (EMFILE at connect). Here a soft
    limit of 128 and 100 streams."""
    upstream = (["-m", "proxy.server.cli", "serve", "--engine", "sim", "--log-level", "warning"],
                {"CACHETALLY_SIM_TOKEN_DELAY_S": "0.05"}, None)
    with running_servers([upstream]) as [(upstream_url, _)]:
        proxy = ([*SOFT_LIMITED_CLI, "serve", "--upstream", upstream_url, "--log-level", "warning"], None, None)
        with running_servers([proxy]) as [(url, _)]:
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=STREAMS)) as client:
                async def stream(i: int) -> tuple[int, bytes]:
                    body = {"model": "sim-model", "prompt": f"p {i}", "max_tokens": 20, "stream": True}
                    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                        return response.status_code, await response.aread()

                answers = await asyncio.gather(*(stream(i) for i in range(STREAMS)))
    assert [status for status, _ in answers] == [200] * STREAMS
    assert all(text.endswith(b"data: [DONE]\n\n") for _, text in answers)
