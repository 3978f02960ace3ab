"""An upstream that dies in a body whose start has gone out: the client sees the body short,
and the log says so in lines, with no traceback (docs/RELIABILITY.md §3).

Once a response's start has reached the client nothing can tell it of the failure but the
connection's end before the body's. The forwarder's warning says what happened; uvicorn's
"Exception in ASGI application" with a traceback is for a bug, and an upstream's death is
none. Two such bodies: a route cachetally passes through (``/tokenize``), and an answer too
large to hold (``max_response_bytes``), which goes on as it comes.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from proxy.server.app import CachetallyApp
from proxy.server.settings import Settings
from tests.servers import serving_in_thread

pytestmark = pytest.mark.loopback

SERVED = "m-cut"
KIB = 1 << 10


def dying(first: bytes) -> StreamingResponse:
    """A JSON body that sends ``first`` and then dies: its server drops the connection."""

    async def parts() -> AsyncIterator[bytes]:
        yield first
        raise RuntimeError("the upstream died")  # uvicorn ends the chunked body unfinished

    return StreamingResponse(parts(), media_type="application/json")


async def tokenize(request: Request) -> StreamingResponse:
    await request.body()
    return dying(b'{"tokens": [1, 2, 3')


async def chat(request: Request) -> StreamingResponse:
    await request.body()
    usage = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}
    head = orjson.dumps({"id": "chatcmpl-1", "object": "chat.completion", "model": SERVED, "usage": usage})
    return dying(head[:-1] + b', "choices": [{"index": 0, "message": {"content": "' + b"x" * (64 * KIB))


UPSTREAM = Starlette(routes=[
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/v1/chat/completions", chat, methods=["POST"]),
    Route("/v1/models", lambda _: JSONResponse({"object": "list", "data": [{"id": SERVED}]}), methods=["GET"]),
])


@pytest.mark.parametrize(("path", "body"), [
    ("/tokenize", {"model": SERVED, "prompt": "hi"}),
    ("/v1/chat/completions", {"model": SERVED, "messages": [{"role": "user", "content": "hi"}]}),
], ids=["passed-through", "too-large-to-hold"])
def test_a_body_the_upstream_cuts_after_its_start_ends_short_with_no_traceback(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, path: str, body: dict) -> None:
    usage_dir = tmp_path / "usage"
    uvicorns = logging.getLogger("uvicorn.error")  # it does not propagate to the root's handler
    with caplog.at_level(logging.WARNING), serving_in_thread(UPSTREAM, "dying-upstream") as up:
        settings = Settings(engine="upstream", upstream=up, usage_dir=str(usage_dir), usage_flush_interval_s=0.05,
                            max_response_bytes=16 * KIB).validate()
        with serving_in_thread(CachetallyApp(settings), "cachetally") as url:
            uvicorns.addHandler(caplog.handler)  # once both started: uvicorn's logging config drops it
            with pytest.raises(httpx.RemoteProtocolError):  # the body ends short: the client knows
                httpx.post(f"{url}{path}", json=body, timeout=10)
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    uvicorns.removeHandler(caplog.handler)
    ours = [r for r in caplog.records if r.threadName.startswith("cachetally")]
    assert any("failed mid-response" in r.getMessage() for r in ours)
    assert not [r.getMessage() for r in ours if r.exc_info], "a traceback for an upstream's death"
    records = [orjson.loads(line) for f in sorted(usage_dir.glob("*.jsonl")) for line in f.read_bytes().splitlines()]
    # One record for the metered route, as before: its start went out, its answer was cut (a route passed through has none).
    assert [(r["route"], r["status"], r["outcome"]) for r in records] == (
        [] if path == "/tokenize" else [("chat", 200, "error")])
