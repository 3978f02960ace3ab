"""Clients that ask for large answers cannot make the server hold more than
``max_response_bytes_held`` of them (proxy.patching.response_budget): upstream mode, over real
HTTP, through the ``openai`` client.

Six clients each get a 700 KiB answer whose last bytes the upstream sends only once the test
says so. Before the budget the server held all six (4.2 MiB against 1 MiB each at most, at
the default limits six times 64 MiB) and no client had a byte until its answer ended; now it
holds what fits in 2 MiB and the rest go on to their clients before their end, as the
upstream sent them, each still billed its usage.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from prometheus_client.parser import text_string_to_metric_families

from proxy.server.app import CachetallyApp
from proxy.server.settings import Settings
from tests.servers import serving_in_thread

pytestmark = pytest.mark.loopback

SERVED = "m-large"
KIB = 1 << 10
MAX, HELD = 1024 * KIB, 2048 * KIB
FIRST = 700 * KIB  # what each answer sends before it waits
CLIENTS = 6
#: At most this many answers are held whole at once (each held 700 KiB): the others go on.
AT_MOST_HELD = HELD // FIRST


def answer(i: int) -> bytes:
    usage = {"prompt_tokens": 100 + i, "completion_tokens": 2, "total_tokens": 102 + i,
             "prompt_tokens_details": {"cached_tokens": 64}}
    return orjson.dumps({"id": f"chatcmpl-{i}", "object": "chat.completion", "created": 0, "model": SERVED,
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * FIRST},
                                      "finish_reason": "length"}], "usage": usage})


def upstream(finish: threading.Event) -> Starlette:
    """Answers ``client i`` with :func:`answer`, its last bytes once ``finish`` is set."""

    async def chat(request: Request) -> StreamingResponse:
        body = answer(int((await request.json())["messages"][0]["content"].split()[-1]))

        async def parts() -> AsyncIterator[bytes]:
            yield body[:FIRST]
            await asyncio.to_thread(finish.wait)
            yield body[FIRST:]

        return StreamingResponse(parts(), media_type="application/json")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                            Route("/v1/models", lambda _: JSONResponse({"data": [{"id": SERVED}]}), methods=["GET"])])


def test_answers_past_the_budget_go_on_before_their_end_exactly_and_billed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    finish = threading.Event()
    started = threading.Semaphore(0)
    usage_dir = tmp_path / "usage"

    def ask(client: openai.OpenAI, i: int) -> tuple[bool, bytes]:
        messages = [{"role": "user", "content": f"client {i}"}]
        with client.chat.completions.with_streaming_response.create(model=SERVED, messages=messages) as response:
            early = not finish.is_set()  # its answer went on before the upstream sent its end
            started.release()
            return early, response.read()

    with serving_in_thread(upstream(finish)) as up:
        settings = Settings(engine="upstream", upstream=up, usage_dir=str(usage_dir), usage_flush_interval_s=0.05,
                            max_response_bytes=MAX, max_response_bytes_held=HELD).validate()
        with serving_in_thread(CachetallyApp(settings)) as url, \
                openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=120) as client, \
                ThreadPoolExecutor(CLIENTS) as pool:
            asked = [pool.submit(ask, client, i) for i in range(CLIENTS)]
            # Not a timing: each answer not held reaches its client before its end; the bound
            # is only there to fail, rather than hang, where every answer is held whole.
            deadline = time.monotonic() + 60
            gone_on = sum(started.acquire(timeout=max(0.0, deadline - time.monotonic()))
                          for _ in range(CLIENTS - AT_MOST_HELD))
            finish.set()
            got = [future.result() for future in asked]
            metrics = httpx.get(f"{url}/metrics").text
    assert gone_on == CLIENTS - AT_MOST_HELD, "every answer was held whole at once"
    assert [body for _, body in got] == [answer(i) for i in range(CLIENTS)]  # byte for byte, held or not
    skipped = [s.value for family in text_string_to_metric_families(metrics) for s in family.samples
               if s.name == "cachetally_patch_skipped_total" and s.labels == {"reason": "response_budget_full"}]
    assert skipped and skipped[0] >= sum(early for early, _ in got) >= CLIENTS - AT_MOST_HELD
    records = [orjson.loads(line) for f in sorted(usage_dir.glob("*.jsonl")) for line in f.read_bytes().splitlines()]
    assert sorted((r["prompt_tokens"], r["cached_tokens"], r["completion_tokens"], r["outcome"]) for r in records) \
        == [(100 + i, 64, 2, "completed") for i in range(CLIENTS)]
    warned = [r.getMessage() for r in caplog.records if "passed on unpatched" in r.getMessage()]
    assert len(warned) == 1 and "client" not in json.dumps(warned)  # once a minute, and no prompt text


def responses_upstream(instructions: str) -> Starlette:
    """A Responses stream whose terminal event echoes ``instructions``, as vLLM's does (its
    first event does too: left out here, so that one event only is too large to hold)."""
    usage = {"input_tokens": 700, "output_tokens": 2, "total_tokens": 702,
             "input_tokens_details": {"cached_tokens": 512}, "output_tokens_details": {"reasoning_tokens": 0}}
    head = {"id": "resp_1", "object": "response", "created_at": 0, "model": SERVED, "output": [],
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}

    def event(kind: str, n: int, **response: object) -> bytes:
        data = {"response": {**head, **response}, "sequence_number": n, "type": kind}  # vLLM's order: type last
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    async def responses(request: Request) -> StreamingResponse:
        await request.body()
        done = event("response.completed", 1, status="completed", usage=usage, instructions=instructions)

        async def parts() -> AsyncIterator[bytes]:
            yield event("response.created", 0, status="in_progress", usage=None)
            for start in range(0, len(done), 64 * KIB):
                yield done[start : start + 64 * KIB]

        return StreamingResponse(parts(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/responses", responses, methods=["POST"]),
                            Route("/v1/models", lambda _: JSONResponse({"data": [{"id": SERVED}]}), methods=["GET"])])


def test_a_responses_terminal_event_too_large_to_hold_is_still_billed(tmp_path: Path) -> None:
    """Past ``max_response_bytes`` (1 MiB here), a Responses stream's terminal event goes out
    as it comes, unpatched; it went out unread too, and its record had no prompt, so a client
    could keep its prompt off the bill with 1 MiB of ``instructions`` echoed. Its figures are
    now read as it passes, as they are past the budget
    (tests/patching/test_response_budget.py): the record bills the upstream's usage."""
    usage_dir = tmp_path / "usage"
    size = 1536 * KIB
    with serving_in_thread(responses_upstream("x" * size)) as up:
        settings = Settings(engine="upstream", upstream=up, usage_dir=str(usage_dir), usage_flush_interval_s=0.05,
                            max_response_bytes=MAX).validate()
        with serving_in_thread(CachetallyApp(settings)) as url, \
                openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client:
            events = list(client.responses.create(model=SERVED, input="hi", stream=True))
            metrics = httpx.get(f"{url}/metrics").text
    final = events[-1].response
    assert final.usage is not None and final.usage.input_tokens == 700 and len(final.instructions or "") == size
    assert 'cachetally_patch_skipped_total{reason="event_too_large"} 1.0' in metrics
    records = [orjson.loads(line) for f in sorted(usage_dir.glob("*.jsonl")) for line in f.read_bytes().splitlines()]
    assert [(r["prompt_tokens"], r["cached_tokens"], r["completion_tokens"], r["model"], r["outcome"])
            for r in records] == [(700, 512, 2, SERVED, "completed")]
