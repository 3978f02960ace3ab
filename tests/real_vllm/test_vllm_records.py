"""Usage records in embedded-vLLM mode: the shared `cachetally serve` (tests/conftest.py)
writes them to a session directory. Each request's record matches what its client got;
a stream without a usage chunk counts the same completion tokens as the same request
answered as JSON (temperature 0), which checks the stream's token-event count against
vLLM's own numbers; a client that leaves mid-stream gets a `disconnected` record."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from tests.load import DropPoint, dropping_client

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
    assert [record[n]["completion_source"] for n in ("json", "sse_usage", "sse_plain")] == ["usage", "usage", "stream"]

    cut = record["cut"]
    assert (cut["outcome"], cut["completion_source"]) == ("disconnected", "stream")
    assert 3 <= cut["completion_tokens"] < 200
