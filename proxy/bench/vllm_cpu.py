"""What ``CachetallyMiddleware`` adds to the CPU of vLLM's API server per request, in process.

``python -m proxy.bench.vllm_cpu [REQUESTS] [ROUNDS] [PAUSE_S]``: the middleware as ``vllm serve
--middleware proxy.vllm_middleware.CachetallyMiddleware`` builds it, around an ASGI app
that answers as vLLM's chat route does for ``max_tokens`` 1 (vLLM 0.32's bytes: a JSON
body, or the role, token, finish and usage chunks and ``[DONE]``) and publishes the
engine's ``Scheduled`` event as the tap would. JSON and streamed requests alternate, as
in ``api-server-cpu``. Each round calls the bare app, then the middleware,
``REQUESTS`` times each, and counts the process's CPU time (``time.process_time``: every
thread's, the usage-record writer's included), with a pause (default 1.3 s) inside each
window so that the writer's 1 s flush falls where its records were made. The pause also
leaves the caches as cold as a real API server's between requests at a few per second;
``PAUSE_S`` 0 is a hot loop. Accounting is what the environment says
(``CACHETALLY_USAGE_DIR``, ``CACHETALLY_TENANT_HEADER`` with ``CACHETALLY_TENANTS``; load_settings), so the same
command measures the middleware alone and with records. Prints one JSON line: the medians
of the rounds in µs per request, and what the middleware adds.

Beside the times, ``added_opcodes_json`` and ``added_opcodes_sse``: how many more Python
opcodes one JSON and one streamed request execute through the middleware than through the
bare app (``sys.settrace`` with ``f_trace_opcodes``, the event loop's thread only). Unlike a
CPU time it reads the same on every run and every machine, so it tells a change of a few
per cent from noise; it leaves out work done in C (``orjson``, ``re``) and the writer's thread.

No engine, no sockets, no HTTP parsing: this is the part of the API server's work that
cachetally adds, without the noise of the rest (``api-server-cpu`` measures the whole).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from types import FrameType
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from engine_adapter.events import EventSink, Scheduled
from proxy.asgi.headers import only_header
from proxy.bench.inprocess import call

MODEL = "SmolLM2-135M-Instruct"
_MESSAGES = [{"role": "user", "content": "hi there, how are you"}]
JSON_BODY = orjson.dumps({"model": MODEL, "max_tokens": 1, "messages": _MESSAGES})
SSE_BODY = orjson.dumps({"model": MODEL, "max_tokens": 1, "messages": _MESSAGES, "stream": True,
                         "stream_options": {"include_usage": True}})
_USAGE = {"prompt_tokens": 36, "total_tokens": 37, "completion_tokens": 1, "prompt_tokens_details": None}


def _chunk(delta: dict[str, Any] | None, finish: str | None = None, usage: dict[str, Any] | None = None) -> bytes:
    event: dict[str, Any] = {"id": "chatcmpl-b", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    event["choices"] = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    if usage is not None:
        event["usage"] = usage
    return b"data: " + orjson.dumps(event) + b"\n\n"


SSE_CHUNKS = [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Hello"}),
              _chunk({"content": ""}, "length"), _chunk(None, usage=_USAGE), b"data: [DONE]\n\n"]
JSON_RESPONSE = orjson.dumps({
    "id": "chatcmpl-b", "object": "chat.completion", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello", "refusal": None, "tool_calls": []},
                 "logprobs": None, "finish_reason": "length", "stop_reason": None}],
    "usage": _USAGE, "prompt_logprobs": None, "kv_transfer_params": None,
})


class VllmLikeChat:
    """vLLM's chat route for ``max_tokens`` 1, with the tap's ``Scheduled`` event."""

    def __init__(self) -> None:
        self.sink: EventSink | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = (await receive())["body"]
        key = only_header(scope["headers"], b"x-request-id")
        if self.sink is not None and key:
            self.sink.publish(Scheduled(request_id=key.decode(), prompt_tokens=36, cached_tokens=32))
        if b'"stream":true' in body:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
            for chunk in SSE_CHUNKS:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"application/json"), (b"content-length", b"%d" % len(JSON_RESPONSE))]})
            await send({"type": "http.response.body", "body": JSON_RESPONSE, "more_body": False})


def _scope(body: bytes) -> Scope:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http", "root_path": "",
        "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000), "method": "POST",
        "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
        "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                    (b"content-length", b"%d" % len(body)), (b"x-tenant", b"acme"),
                    (b"user-agent", b"OpenAI/Python 1.99.0")],
    }


async def _cpu_us(app: Any, requests: int, pause_s: float) -> float:
    start = time.process_time()
    for i in range(requests):
        body = SSE_BODY if i % 2 else JSON_BODY
        await call(app, _scope(body), body)
    await asyncio.sleep(pause_s)  # the record writer's flush inside the window
    return (time.process_time() - start) / requests * 1e6


async def _opcodes(app: Any, body: bytes) -> int:
    """The Python opcodes one request with ``body`` executes (only frames it starts are traced)."""
    count = 0

    def count_opcodes(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "opcode":
            count += 1
        return count_opcodes

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        return count_opcodes

    sys.settrace(trace)
    try:
        await call(app, _scope(body), body)
    finally:
        sys.settrace(None)
    return count


async def measure(requests: int = 1000, rounds: int = 7, pause_s: float = 1.3) -> dict[str, float]:
    from proxy.vllm_middleware import CachetallyMiddleware

    app = VllmLikeChat()
    middleware = CachetallyMiddleware(app)
    app.sink = middleware.accounting.ledger
    bare, patched = [], []
    async with middleware.accounting.running():
        await _cpu_us(middleware, 100, 0)  # warm-up
        opcodes = {kind: await _opcodes(middleware, body) - await _opcodes(app, body)
                   for kind, body in (("json", JSON_BODY), ("sse", SSE_BODY))}
        for _ in range(rounds):
            bare.append(await _cpu_us(app, requests, pause_s))
            patched.append(await _cpu_us(middleware, requests, pause_s))
    return {
        "requests": requests, "rounds": rounds, "pause_s": pause_s,
        "bare_cpu_us": round(statistics.median(bare), 1),
        "middleware_cpu_us": round(statistics.median(patched), 1),
        "added_cpu_us": round(statistics.median(patched) - statistics.median(bare), 1),
        "added_opcodes_json": opcodes["json"],
        "added_opcodes_sse": opcodes["sse"],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m proxy.bench.vllm_cpu",
        description="CPU and Python opcodes that CachetallyMiddleware adds per request to an app answering as "
        "vLLM's chat route does, in process; accounting as CACHETALLY_* says. Prints one JSON line.")
    parser.add_argument("requests", type=int, nargs="?", default=1000, help="requests per round (default: 1000)")
    parser.add_argument("rounds", type=int, nargs="?", default=7, help="rounds of each app (default: 7)")
    parser.add_argument("pause_s", type=float, nargs="?", default=1.3,
                        help="pause inside each round, so the records' 1 s flush lands in it (default: 1.3; 0: a hot loop)")
    args = parser.parse_args()
    print(orjson.dumps(asyncio.run(measure(args.requests, args.rounds, args.pause_s))).decode())
