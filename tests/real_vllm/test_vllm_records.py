"""Usage records in embedded-vLLM mode: the shared `cachetally serve` (tests/conftest.py)
writes them to a session directory. Each request's record matches what its client got;
a stream without a usage chunk counts the same completion tokens as the same request
answered as JSON (temperature 0), which checks the tokens the tap counted against vLLM's
own numbers; a client that leaves mid-stream gets a `disconnected` record, one that leaves a JSON
request while it is decoding is billed the prefill vLLM counted, and one that leaves while its
prompt is prefilled is billed that prompt with its cache unknown."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.clients import fresh_prompt
from tests.load import DropPoint, dropping_client
from tests.conftest import CLIENT_RECEIVE_TIMEOUT_S, CLIENT_SEND_TIMEOUT_S
from tests.servers import Pace, metric_value

pytestmark = [pytest.mark.vllm, pytest.mark.loopback]


def records_for(usage: Path, ids: set[str], timeout_s: float = 10.0) -> dict[str, list[dict[str, Any]]]:
    """Every record of ``ids``, waiting for the sink's flush (0.2 s) to write them."""
    deadline = time.monotonic() + timeout_s
    while True:
        found: dict[str, list[dict[str, Any]]] = {}
        for path in sorted(usage.glob("*.jsonl")):
            for line in path.read_bytes().splitlines():
                record = orjson.loads(line)
                client_id = record["request_id"].split(".")[0]  # then the API server's tag, .p<pid>
                if client_id in ids:
                    found.setdefault(client_id, []).append(record)
        if set(found) == ids or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


async def _vllm_counters(server: str, pace: Pace, *names: str) -> dict[str, float]:
    """vLLM's own metrics ``names``, as the server's /metrics shows them now."""
    async with httpx.AsyncClient(timeout=pace.timeout()) as http:
        text = (await http.get(f"{server}/metrics")).text
    return {name: metric_value(text, name) for name in names}


def test_each_request_leaves_one_record_matching_its_usage(vllm_server: str, vllm_usage_dir: Path) -> None:
    prompt = f"{uuid.uuid4().hex} Count from one to ten in words, please."
    ids = {name: uuid.uuid4().hex for name in ("json", "sse_usage", "sse_plain", "cut")}
    with openai.OpenAI(base_url=f"{vllm_server}/v1", api_key="unused", max_retries=0) as client:
        model = client.models.list().data[0].id
        common: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}],
                                  "max_tokens": 12, "temperature": 0}
        answer = client.chat.completions.create(**common, extra_headers={"x-request-id": ids["json"]})
        chunks = list(client.chat.completions.create(
            **common, stream=True, stream_options={"include_usage": True},
            extra_headers={"x-request-id": ids["sse_usage"]},
        ))
        list(client.chat.completions.create(**common, stream=True, extra_headers={"x-request-id": ids["sse_plain"]}))
    port = int(vllm_server.rsplit(":", 1)[1])
    body = orjson.dumps({**common, "max_tokens": 200, "stream": True})
    mid_stream = DropPoint("mid-stream", lambda seen: seen.count(b"data:") >= 4)
    asyncio.run(dropping_client(port, "/v1/chat/completions", body, mid_stream,
                                headers=f"x-request-id: {ids['cut']}\r\n".encode()))

    found = records_for(vllm_usage_dir, set(ids.values()))
    assert {name: len(found.get(rid, [])) for name, rid in ids.items()} == dict.fromkeys(ids, 1)
    record = {name: found[rid][0] for name, rid in ids.items()}

    json_usage = answer.usage
    assert json_usage is not None
    for name in ("json", "sse_usage", "sse_plain"):
        r = record[name]
        assert (r["outcome"], r["status"], r["tenant"], r["model"]) == ("completed", 200, "default", model)
        assert r["prompt_tokens"] == json_usage.prompt_tokens
        assert r["completion_tokens"] == json_usage.completion_tokens, name
    assert record["json"]["response_id"] == answer.id
    assert record["json"]["cached_tokens"] == json_usage.prompt_tokens_details.cached_tokens
    assert record["sse_usage"]["cached_tokens"] == chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert [record[n]["completion_source"] for n in ("json", "sse_usage", "sse_plain")] == ["usage", "usage", "engine"]

    cut = record["cut"]
    assert (cut["outcome"], cut["completion_source"]) == ("disconnected", "engine")
    assert 3 <= cut["completion_tokens"] < 200


def test_a_json_request_cut_during_decode_is_billed_the_prompt_vllm_prefilled(
    vllm_server: str, vllm_usage_dir: Path, vllm_pace: Pace
) -> None:
    """A non-streaming client that hangs up while its answer is being generated: vLLM has
    prefilled the prompt (its counters say how much, and how much of it was cached), the
    client got nothing. The record bills that prefill and says the client left.

    Nothing reaches vLLM's handler before a ``FINAL_ONLY`` request ends, so the figures must
    be taken at the prefill. The hang-up comes once vLLM's own counters show the request
    decoding: its generation tokens have grown past the first."""
    prompt = fresh_prompt()
    request_id = uuid.uuid4().hex
    model = httpx.get(f"{vllm_server}/v1/models", timeout=None).json()["data"][0]["id"]
    messages = [{"role": "user", "content": prompt}]
    with openai.OpenAI(base_url=f"{vllm_server}/v1", api_key="unused", max_retries=0) as client:
        client.chat.completions.create(model=model, messages=messages, max_tokens=1)  # cache the prefix
    body = orjson.dumps({"model": model, "messages": messages, "max_tokens": 4000, "ignore_eos": True,
                         "temperature": 0})
    port = int(vllm_server.rsplit(":", 1)[1])

    async def cut() -> tuple[dict[str, float], dict[str, float]]:
        def counters() -> Awaitable[dict[str, float]]:
            return _vllm_counters(vllm_server, vllm_pace, "vllm:prompt_tokens_total", "vllm:prompt_tokens_cached_total",
                                  "vllm:generation_tokens_total", "vllm:num_requests_running")

        before = await counters()
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                     b"content-type: application/json\r\nx-request-id: %s\r\ncontent-length: %d\r\n\r\n%s"
                     % (request_id.encode(), len(body), body))
        await writer.drain()
        deadline = time.monotonic() + vllm_pace.timeout()
        while (now := await counters())["vllm:generation_tokens_total"] < before["vllm:generation_tokens_total"] + 2:
            assert time.monotonic() < deadline, "vLLM never began decoding the request"
            await asyncio.sleep(0.02)
        writer.transport.abort()  # hang up, with no byte of the answer received
        while (after := await counters())["vllm:num_requests_running"] != 0:
            assert time.monotonic() < deadline, "vLLM kept running the request after its client left"
            await asyncio.sleep(0.05)
        assert now["vllm:num_requests_running"] >= 1
        return before, after

    before, after = asyncio.run(cut())
    found = records_for(vllm_usage_dir, {request_id})
    assert len(found.get(request_id, [])) == 1
    record = found[request_id][0]
    prefilled = after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    cached = after["vllm:prompt_tokens_cached_total"] - before["vllm:prompt_tokens_cached_total"]
    assert cached > 0  # the prefix was warm: this checks a figure, not a 0 by default
    assert (record["outcome"], record["prompt_tokens"], record["cached_tokens"]) == (
        "disconnected", prefilled, cached)
    assert (record["completion_tokens"], record["completion_source"]) == (0, "none")  # the client got nothing


def test_a_stream_cut_before_its_prefill_ended_is_billed_its_prompt_with_its_cache_unknown(
    vllm_server: str, vllm_usage_dir: Path, vllm_pace: Pace
) -> None:
    """A client that hangs up while vLLM prefills its prompt, in several engine steps: vLLM
    reports no figure for the request (its counters leave it out), yet may have cached part of
    the prompt. The record bills the prompt as vLLM counts it (its usage for the same prompt,
    answered), with its cached tokens unknown, never 0.

    The prompt is over one engine step (2,048 tokens on a CPU); the hang-up comes once vLLM
    runs the request, and vLLM's prompt counter, which counts a prompt when its prefill ends,
    shows it never did (else there is no cut to check: skipped)."""
    prompt = fresh_prompt(960)  # about 2,800 tokens: two steps
    request_id = uuid.uuid4().hex
    model = httpx.get(f"{vllm_server}/v1/models", timeout=None).json()["data"][0]["id"]
    messages = [{"role": "user", "content": prompt}]
    body = orjson.dumps({"model": model, "messages": messages, "max_tokens": 16, "stream": True})
    port = int(vllm_server.rsplit(":", 1)[1])

    async def cut() -> tuple[dict[str, float], dict[str, float]]:
        def counters() -> Awaitable[dict[str, float]]:
            return _vllm_counters(vllm_server, vllm_pace, "vllm:prompt_tokens_total", "vllm:num_requests_running",
                                  "vllm:num_requests_waiting")

        deadline = time.monotonic() + vllm_pace.timeout(4)
        while (before := await counters())["vllm:num_requests_running"] + before["vllm:num_requests_waiting"]:
            assert time.monotonic() < deadline, "vLLM is still running an earlier request"
            await asyncio.sleep(0.05)
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                     b"content-type: application/json\r\nx-request-id: %s\r\ncontent-length: %d\r\n\r\n%s"
                     % (request_id.encode(), len(body), body))
        await writer.drain()
        while (await counters())["vllm:num_requests_running"] < 1:
            assert time.monotonic() < deadline, "vLLM never ran the request"
            await asyncio.sleep(0.02)
        writer.transport.abort()  # hang up while it prefills, with no byte of the answer received
        while (after := await counters())["vllm:num_requests_running"] + after["vllm:num_requests_waiting"]:
            assert time.monotonic() < deadline, "vLLM kept running the request after its client left"
            await asyncio.sleep(0.05)
        return before, after

    before, after = asyncio.run(cut())
    if after["vllm:prompt_tokens_total"] != before["vllm:prompt_tokens_total"]:
        # A faster engine, or one whose step holds the whole prompt: there is no cut to check.
        pytest.skip("the prefill ended before the hang-up")
    with openai.OpenAI(base_url=f"{vllm_server}/v1", api_key="unused", max_retries=0) as client:
        answered = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert answered.usage is not None and answered.usage.prompt_tokens > 2048
    found = records_for(vllm_usage_dir, {request_id})
    assert len(found.get(request_id, [])) == 1
    record = found[request_id][0]
    assert (record["outcome"], record["prompt_tokens"], record["cached_tokens"], record["source"]) == (
        "disconnected", answered.usage.prompt_tokens, None, "engine")
    assert (record["completion_tokens"], record["local_cached_tokens"]) == (0, None)


MAX_TOKENS = 2000  # 16 choices of it fit the shared server's KV cache


def test_a_client_that_takes_none_of_its_stream_is_let_go_and_vllm_stops_its_request(
    vllm_server: str, vllm_server_log: Path, vllm_usage_dir: Path, vllm_pace: Pace
) -> None:
    """A client that opens a stream and never reads: vLLM's uvicorn waits on it for as long
    as its connection stays, and vLLM's engine goes on generating for it. The shared server
    runs with ``--client-send-timeout`` (tests/conftest.py): once its writes make no progress
    for that long, the connection is let go, vLLM aborts the request, and the record says
    the client left, all while the client's socket is still open.

    The server's kernel takes up to 4 MiB before uvicorn's own buffer fills and its writes
    pause (when the bound starts): 16 choices with 20 top logprobs each fill it in seconds."""
    request_id = uuid.uuid4().hex
    model = httpx.get(f"{vllm_server}/v1/models", timeout=None).json()["data"][0]["id"]
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": fresh_prompt()}],
                         "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True, "n": 16,
                         "logprobs": True, "top_logprobs": 20})
    port = int(vllm_server.rsplit(":", 1)[1])
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", port))
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                       b"content-type: application/json\r\nx-request-id: %s\r\ncontent-length: %d\r\n\r\n%s"
                       % (request_id.encode(), len(body), body))
        found = records_for(vllm_usage_dir, {request_id}, timeout_s=vllm_pace.timeout(16) + CLIENT_SEND_TIMEOUT_S)
        running = asyncio.run(_vllm_counters(vllm_server, vllm_pace, "vllm:num_requests_running"))
        deadline = time.monotonic() + vllm_pace.timeout()
        while running["vllm:num_requests_running"] != 0:  # the engine's gauge follows at its next step
            assert time.monotonic() < deadline, "vLLM kept generating for the client it let go"
            time.sleep(0.05)
            running = asyncio.run(_vllm_counters(vllm_server, vllm_pace, "vllm:num_requests_running"))
    assert len(found.get(request_id, [])) == 1, "the request never ended while its client stayed"
    record = found[request_id][0]
    assert (record["outcome"], record["status"]) == ("disconnected", 200)
    assert 0 < record["completion_tokens"] < 16 * MAX_TOKENS
    assert "client_send_timeout_s" in vllm_server_log.read_text()


def test_a_client_that_stops_sending_its_request_is_let_go(
    vllm_server: str, vllm_server_log: Path, vllm_usage_dir: Path
) -> None:
    """vLLM's uvicorn times nothing a client sends: a socket with no request, or half a body,
    was held for good. The shared server runs with ``--client-receive-timeout``: both are
    closed, and the request that stopped halfway leaves one record, with nothing to bill."""
    request_id = uuid.uuid4().hex
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": fresh_prompt()}]})
    port = int(vllm_server.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as silent, \
            socket.create_connection(("127.0.0.1", port)) as stalled:
        stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                        b"content-type: application/json\r\nx-request-id: %s\r\ncontent-length: %d\r\n\r\n%s"
                        % (request_id.encode(), len(body), body[: len(body) // 2]))
        for client in (silent, stalled):
            client.settimeout(10 * CLIENT_RECEIVE_TIMEOUT_S)  # held on: the test fails, never hangs
            with contextlib.suppress(ConnectionResetError):
                assert client.recv(1 << 16) == b""
        found = records_for(vllm_usage_dir, {request_id})
    assert [(r["outcome"], r["prompt_tokens"], r["completion_tokens"]) for r in found[request_id]] == [
        ("disconnected", None, 0)]
    assert "client_receive_timeout_s" in vllm_server_log.read_text()


def test_vllms_own_header_limits_hold_on_the_server_it_runs(vllm_server: str, vllm_usage_dir: Path) -> None:
    """vLLM sets uvicorn's header limits (4 MiB, 256 fields) for uvicorn's h11 protocol, but
    serves with httptools, which ignored them: a request with 300 header fields was served
    and billed. The middleware's protocol holds them: a 431 in OpenAI error JSON, no record."""
    request_id = uuid.uuid4().hex
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    fields = [("x-request-id", request_id), *((f"x-field-{i}", "v") for i in range(300))]
    answer = httpx.post(f"{vllm_server}/v1/chat/completions", content=body, timeout=60,
                        headers=[("content-type", "application/json"), *fields])
    assert (answer.status_code, answer.json()["error"]["code"]) == (431, 431)
    time.sleep(1.0)  # the sinks flush every 0.2 s: a record would be written by now
    assert request_id not in records_for(vllm_usage_dir, {request_id}, timeout_s=0)
