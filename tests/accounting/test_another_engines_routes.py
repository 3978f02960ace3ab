"""Another engine's server behind cachetally: its own routes that run the engine.

Upstream mode fronts any OpenAI-compatible server, and those serve more than vLLM's routes:
llama.cpp's server also serves ``/chat/completions``, ``/completions``, ``/completion``,
``/responses`` and ``/infill`` (no ``/v1``), SGLang ``/generate``, Ollama ``/api/chat`` and
``/api/generate``, TGI ``POST /``; gateways OpenAI's ``POST /v1/responses/compact``, which runs a
model and fills the parameter of vLLM's ``GET /v1/responses/{response_id}``. Outside vLLM's
guarded prefixes and route table, or by another method, each was forwarded unmetered (the
first without the key): the official client pointed at the server's root
(``base_url`` without ``/v1``, as llama.cpp's docs allow) generated with no key and no
record. Through real HTTP (uvicorn on loopback), cachetally in upstream mode with billing on
in front of a stub of such a server.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.server.app import CachetallyApp
from proxy.server.settings import Settings
from tests.servers import serving_in_thread

pytestmark = pytest.mark.loopback

SERVED = "m-real"
KEY = "sk-shared-key"
#: The routes of other servers that run the engine (llama.cpp, SGLang, Ollama, TGI, gateways).
NATIVE = ("/chat/completions", "/completions", "/completion", "/responses", "/infill",
          "/generate", "/api/chat", "/api/generate", "/", "/v1/responses/compact")
_USAGE = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
#: The upstream's own count of what it generated, by route: each must be billed.
GENERATED: list[str] = []


async def other_engine(scope: Any, receive: Any, send: Any) -> None:
    """Generates a chat completion on ``/v1/chat/completions`` and on every route of
    :data:`NATIVE`; answers ``/v1/models``, ``/tokenize`` and a stored response, which run no engine."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    path, status, body = scope["path"], 404, b'{"error": "not found"}'
    if scope["method"] == "POST" and path in (*NATIVE, "/v1/chat/completions"):
        GENERATED.append(path)
        status, body = 200, json.dumps({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": SERVED, "usage": _USAGE,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}],
        }).encode()
    elif path == "/v1/models":
        status, body = 200, json.dumps({"object": "list", "data": [{"id": SERVED, "object": "model"}]}).encode()
    elif path == "/tokenize":
        status, body = 200, b'{"tokens": [1, 2]}'
    elif path == "/v1/responses/resp_1" and scope["method"] == "GET":
        status, body = 200, b'{"id": "resp_1", "object": "response"}'
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def cachetally(usage: Path | None, key: str | None) -> Iterator[str]:
    """cachetally in upstream mode before :func:`other_engine`: billing on with ``usage`` or ``key``."""
    with serving_in_thread(other_engine) as upstream:
        settings = Settings(engine="upstream", upstream=upstream, usage_dir=str(usage) if usage else None,
                            usage_flush_interval_s=0.05, api_key=key).validate()
        with serving_in_thread(CachetallyApp(settings)) as url:
            yield url


def _billing(usage: Path, metrics: str) -> tuple[list[str], float, float]:
    """The records' routes, the requests counted, and those refused as no route of the table."""
    records = [orjson.loads(line) for f in sorted(usage.glob("*.jsonl")) for line in f.read_bytes().splitlines()]
    samples = [s for family in text_string_to_metric_families(metrics) for s in family.samples]
    counted = sum(s.value for s in samples if s.name == "cachetally_requests_total")
    refused = sum(s.value for s in samples
                  if s.name == "cachetally_refused_unmetered_total" and s.labels["route"] == "unknown")
    return [r["route"] for r in records], counted, refused


def test_the_official_client_at_the_servers_root_generates_nothing_unbilled(tmp_path: Path) -> None:
    """With ``base_url`` the server's root the client posts ``/chat/completions``: llama.cpp
    answers it, so it got a completion, with or without the key, and no record. Now it is
    refused (403) and generates nothing; at ``/v1`` the same client is served and billed."""
    usage = tmp_path / "usage"
    GENERATED.clear()
    with cachetally(usage, KEY) as url:
        for key in (KEY, "not-a-key"):
            root = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
            with pytest.raises(openai.PermissionDeniedError):
                root.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "hi"}])
        v1 = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        chat = v1.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "hi"}])
        assert chat.usage is not None and chat.usage.prompt_tokens == 7
        metrics = httpx.get(f"{url}/metrics").text
    assert GENERATED == ["/v1/chat/completions"]
    assert _billing(usage, metrics) == (["chat"], 1, 2)


@pytest.mark.parametrize("path", NATIVE)
@pytest.mark.parametrize("key", [KEY, None], ids=["key", "no-key"])
def test_no_route_of_another_engines_server_runs_it_unbilled(tmp_path: Path, path: str, key: str | None) -> None:
    """Each route, with the key (or, but for ``/v1``, none), reached the upstream and generated
    (200) with no record and no counter. Now it is a 403 in OpenAI's error JSON, counted as
    refused (a 401 without the key under ``/v1``)."""
    usage = tmp_path / "usage"
    GENERATED.clear()
    with cachetally(usage, KEY) as url:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        response = httpx.post(f"{url}{path}", json={"model": SERVED, "prompt": "hi", "messages": []}, headers=headers)
        refused = 401 if key is None and path.startswith("/v1/") else 403
        assert response.status_code == refused, response.text
        assert response.json()["error"]["code"] == refused
        metrics = httpx.get(f"{url}/metrics").text
    assert GENERATED == []
    assert _billing(usage, metrics) == ([], 0, refused == 403)


def test_routes_that_run_no_engine_are_still_forwarded(tmp_path: Path) -> None:
    """The model list, the tokenizer and a stored response, bare or under the upstream's root
    path, reach the upstream as before; without billing, every route is forwarded as it was."""
    with cachetally(tmp_path / "usage", KEY) as url:
        keyed = {"authorization": f"Bearer {KEY}"}
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
        assert [m.id for m in client.models.list()] == [SERVED]
        assert httpx.get(f"{url}/v1/responses/resp_1", headers=keyed).json()["id"] == "resp_1"
        assert httpx.post(f"{url}/tokenize", json={"prompt": "hi"}).json() == {"tokens": [1, 2]}
        assert httpx.get(f"{url}/api/v1/models", headers=keyed).status_code == 404  # the upstream's answer
    GENERATED.clear()
    with cachetally(None, None) as url:
        assert httpx.post(f"{url}/generate", json={"text": "hi"}).status_code == 200
    assert GENERATED == ["/generate"]


@pytest.mark.parametrize("path", ["/v1/responses/resp_1", "/v1/responses/resp_1/cancel", "/api/v1/responses/resp_1"])
def test_a_browsers_preflight_for_a_stored_response_reaches_the_upstream(tmp_path: Path, path: str) -> None:
    """A browser asks ``OPTIONS`` (no body, no key) before it reads or cancels a stored response
    with its key: refused as no ``GET`` of the route (403), the browser could read none, where
    its preflight for the chat route it made the response with was answered. The upstream's
    CORS middleware answers it (here the stub's 404, as it has none); one with a body is still
    refused, as any other method but the route's."""
    preflight = {"origin": "https://app.example", "access-control-request-method": "GET"}
    with cachetally(tmp_path / "usage", KEY) as url:
        assert httpx.options(f"{url}{path}", headers=preflight).json() == {"error": "not found"}
        with_body = httpx.request("OPTIONS", f"{url}{path}", headers=preflight, content=b"{}")
        assert with_body.status_code == 403 and with_body.json()["error"]["code"] == 403
