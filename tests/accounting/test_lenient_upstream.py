"""A lenient upstream behind cachetally: one that runs a metered route for a trailing slash,
another letter case, any method, and a method-override header.

vLLM answers ``/v1/chat/completions/`` with a 307 and ``PUT`` with a 405, and generates
nothing; Express and Fiber (non-strict, case-insensitive routing by default), a route
declared for every method, or a method-override middleware generate. Through real HTTP
(uvicorn on loopback), cachetally in upstream mode with billing on in front of such a stub:
every completion a client receives is billed, and vLLM's own answers are kept.
"""

from __future__ import annotations

import contextlib
import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.server.app import CachetallyApp
from proxy.server.settings import Settings
from tests.servers import serving_in_thread

pytestmark = pytest.mark.loopback

SERVED = "m-real"
KEY = "sk-shared-key"
OVERRIDES = ("x-http-method-override", "x-http-method", "x-method-override")
_USAGE = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 3}}


async def lenient_upstream(scope: Any, receive: Any, send: Any) -> None:
    """Serves a chat completion on every metered route with any trailing slash and in any
    letter case, for ``POST`` or any method a method-override header names ``POST``; answers
    a CORS preflight itself, and lists ``SERVED``."""
    if scope["type"] != "http":
        return
    headers = {name.decode().lower(): value.decode() for name, value in scope["headers"]}
    method = next((headers[h] for h in OVERRIDES if h in headers), scope["method"]).upper()
    route = scope["path"].rstrip("/").lower()
    status, body, extra = 404, b'{"error": "not found"}', []
    if method == "OPTIONS" and "access-control-request-method" in headers:
        status, body, extra = 204, b"", [(b"access-control-allow-origin", b"*"), (b"access-control-allow-methods", b"POST")]
    elif route.endswith(("/completions", "/responses", "/messages", "/invocations")) and method == "POST":
        status = 200
        body = json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": SERVED,
                           "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                        "finish_reason": "length"}], "usage": _USAGE}).encode()
    elif route == "/v1/models":
        status, body = 200, json.dumps({"object": "list", "data": [{"id": SERVED, "object": "model"}]}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *extra]})
    await send({"type": "http.response.body", "body": body})


def _request(url: str, method: str, path: str, headers: dict[str, str], body: bytes | None = None) -> http.client.HTTPResponse:
    """``method`` on ``path`` as written (httpx would normalize it), with a chat body by default."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    if body is None:
        body = json.dumps({"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    connection.request(method, path, body, {"content-type": "application/json", "authorization": f"Bearer {KEY}", **headers})
    response = connection.getresponse()
    response.read()
    connection.close()
    return response


def _billing(usage: Path, metrics: str) -> tuple[list[str], float]:
    """The records' routes and the requests the counters hold, once the instance stopped."""
    records = [orjson.loads(line) for f in sorted(usage.glob("*.jsonl")) for line in f.read_bytes().splitlines()]
    counted = sum(s.value for family in text_string_to_metric_families(metrics) for s in family.samples
                  if s.name == "cachetally_requests_total")
    return [r["route"] for r in records], counted


@contextlib.contextmanager
def cachetally(usage: Path) -> Iterator[str]:
    """cachetally in upstream mode, billing on (records, a key), before the lenient upstream."""
    with serving_in_thread(lenient_upstream) as upstream:
        settings = Settings(engine="upstream", upstream=upstream, usage_dir=str(usage),
                            usage_flush_interval_s=0.05, api_key=KEY).validate()
        with serving_in_thread(CachetallyApp(settings)) as url:
            yield url


#: (method, path, extra headers): what a lenient upstream runs as a metered route.
OTHER_FORMS = [
    ("POST", "/V1/Chat/Completions", {}),
    ("POST", "/v1/chat/completion%C5%BF", {}),  # ſ: ASP.NET Core's case-insensitive match reads it as S
    ("POST", "/api/v1/chat/completions/", {}),  # under the upstream's root path, unknown here
]


@pytest.mark.parametrize(("method", "path", "headers"), OTHER_FORMS, ids=lambda v: str(v) if v else "")
def test_no_form_of_a_metered_route_a_lenient_upstream_runs_goes_unbilled(
        tmp_path: Path, method: str, path: str, headers: dict[str, str]) -> None:
    """Each form reached the lenient upstream as no metered request: the client got a
    completion (200), with no record, no counter and the upstream's own cached figure. Now
    another letter case, or a trailing slash under a prefix, is a 403, as the other forms a
    hop may forward."""
    usage = tmp_path / "usage"
    with cachetally(usage) as url:
        response = _request(url, method, path, headers)
        assert response.status in (307, 403, 405), response.status
        if response.status == 405:
            assert response.getheader("allow") == "POST"
        followed = 0
        if response.status == 307:
            location = response.getheader("location")
            assert location == path.rstrip("/")
            followed = _request(url, method, location, headers).status
            assert followed in (200, 405)
        metrics = httpx.get(f"{url}/metrics").text
    routes, counted = _billing(usage, metrics)
    assert len(routes) == counted == (followed == 200)


@pytest.mark.parametrize("path", ["/INVOCATIONS", "/invocations/", "/x/../Invocations/", "/V1/models"])
def test_a_route_a_lenient_upstream_serves_needs_the_key_as_the_route(tmp_path: Path, path: str) -> None:
    """``/invocations`` is outside vLLM's guarded prefixes and ``/V1`` is none of them: a
    case-insensitive upstream served ``/INVOCATIONS`` (a completion) and ``/V1/models``
    without the key."""
    with cachetally(tmp_path / "usage") as url:
        assert _request(url, "POST" if "nvocations" in path else "GET", path, {"authorization": ""}).status == 401

