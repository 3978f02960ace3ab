"""The sim at its default, no delay between tokens, through `cachetally serve` on loopback:
a client that leaves its stream is seen to leave, as with any engine.

Before, a stream with no delay never gave the event loop a turn: it ran to its last token
into a closed connection, holding every other request, and its record said ``completed``
with every token billed (2,000,000 here, after 6 s).
"""

from __future__ import annotations

import socket
from pathlib import Path

import orjson
import pytest

from tests.servers import running_server
from tests.upstream.test_upstream_reports import records

pytestmark = pytest.mark.loopback

MAX_TOKENS = 2_000_000
BODIES = {  # one route per stream generator of the sim
    "/v1/completions": {"prompt": "hi", "stream": True},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "stream": True},
}


@pytest.mark.parametrize("path", BODIES)
def test_a_client_that_leaves_a_stream_is_billed_what_it_was_sent_up_to_then(tmp_path: Path, path: str) -> None:
    usage = tmp_path / "usage"
    args = ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--usage-dir", str(usage),
            "--usage-flush-interval", "0.05"]
    body = orjson.dumps({"model": "sim-model", "max_tokens": MAX_TOKENS, **BODIES[path]})
    with running_server(args, env={"CACHETALLY_SIM_TOKEN_DELAY_S": "0"}) as (url, _):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as client:
            client.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body))
            assert client.recv(4096).startswith(b"HTTP/1.1 200")
        (record,) = records(usage, 1, timeout_s=60.0)
    assert record["outcome"] == "disconnected"
    assert 0 < record["completion_tokens"] < MAX_TOKENS
