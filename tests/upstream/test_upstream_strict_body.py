"""Upstream mode in front of a server that refuses a field it does not know, as Anthropic's
Messages API does (``400 invalid_request_error``, "Extra inputs are not permitted"): the body
it gets must be the client's, with no option asked for on the client's behalf.

In upstream mode cachetally asks a chat or completions stream for the usage chunk the client
did not request (``stream_options``); a Messages or Responses body has no such field, and
its stream reports usage in its own events. The upstream is a Starlette app on 127.0.0.1;
cachetally runs in a real uvicorn; the client is the official ``anthropic`` SDK.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anthropic
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy.server.app import CachetallyApp
from proxy.server.settings import Settings
from tests.servers import serving_in_thread

#: The fields this test's client sends; any other is refused, as Anthropic's API refuses it.
SENT = {"model", "max_tokens", "messages", "stream"}


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **data}) + b"\n\n"


async def strict_messages(request: Request) -> Response:
    body = await request.json()
    if extra := sorted(set(body) - SENT):
        return JSONResponse({"type": "error", "error": {"type": "invalid_request_error",
                                                        "message": f"{extra[0]}: Extra inputs are not permitted"}},
                            status_code=400)
    start = {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": body["model"],
             "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": 6, "cache_read_input_tokens": 4, "cache_creation_input_tokens": 0,
                       "output_tokens": 0}}
    events = [_event("message_start", {"message": start}),
              _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
              _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "Hello"}}),
              _event("content_block_stop", {"index": 0}),
              _event("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                       "usage": {"output_tokens": 2}}),
              _event("message_stop", {})]
    return Response(b"".join(events), media_type="text/event-stream")


def test_a_messages_stream_reaches_a_strict_upstream_as_the_client_sent_it_and_is_billed(tmp_path: Path) -> None:
    upstream = Starlette(routes=[Route("/v1/messages", strict_messages, methods=["POST"])])
    with serving_in_thread(upstream, "upstream") as upstream_url:
        settings = Settings(engine="upstream", upstream=upstream_url, model="m", usage_dir=str(tmp_path),
                            usage_flush_interval_s=0.05).validate()
        with serving_in_thread(CachetallyApp(settings), "cachetally") as url, anthropic.Anthropic(
            base_url=url, api_key="unused", max_retries=0, timeout=10
        ) as client:
            with client.messages.stream(model="m", max_tokens=8,
                                        messages=[{"role": "user", "content": "hi"}]) as stream:
                text = "".join(stream.text_stream)
                final = stream.get_final_message()
    assert text == "Hello"
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens, final.usage.output_tokens) == (6, 4, 2)
    deadline = time.monotonic() + 5
    while not (found := [orjson.loads(line) for path in tmp_path.glob("*.jsonl") for line in path.read_bytes().splitlines()]):
        assert time.monotonic() < deadline, "no record"
        time.sleep(0.05)
    assert [(r["route"], r["prompt_tokens"], r["cached_tokens"], r["completion_tokens"], r["outcome"])
            for r in found] == [("messages", 10, 4, 2, "completed")]
