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
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from proxy.server.app import CachetallyApp
from proxy.server.settings import Settings
from tests.servers import serving_in_thread

pytestmark = pytest.mark.loopback

SERVED = "m-real"
KEY = "sk-shared-key"
OVERRIDES = ("x-http-method-override", "x-http-method", "x-method-override")
_USAGE = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 3}}
#: The upstream's own count of the completions it generated, as vLLM's request counter: each is billed.
GENERATED: list[str] = []


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
        GENERATED.append(route)
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
    connection.request(method, path, body, {"content-type": "application/json", "authorization": f"Bearer {KEY}", **headers},
                       encode_chunked="transfer-encoding" in headers)
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
    *[("POST", f"{route}/", {}) for route in ("/v1/chat/completions", "/v1/completions", "/v1/responses",
                                               "/v1/messages", "/invocations")],
    ("POST", "/v1/chat/completions//", {}),
    *[(method, "/v1/chat/completions", {}) for method in ("PUT", "PATCH", "GET", "DELETE", "HEAD")],
    *[(method, "/v1/chat/completions", {header: "POST"}) for method, header in zip(("PUT", "GET", "PATCH"), OVERRIDES)],
    ("OPTIONS", "/v1/chat/completions", {"x-http-method-override": "POST"}),
    ("OPTIONS", "/v1/completions", {"origin": "http://a", "access-control-request-method": "POST",
                                    "x-http-method-override": "POST"}),  # a "preflight" with a body
    ("OPTIONS", "/v1/completions", {"origin": "http://a", "access-control-request-method": "POST",
                                    "x-http-method-override": "POST", "transfer-encoding": "chunked"}),
    ("PUT", "/v1/chat/completions/", {"x-http-method-override": "POST"}),
    ("POST", "/V1/Chat/Completions", {}),
    ("POST", "/v1/chat/completion%C5%BF", {}),  # ſ: ASP.NET Core's case-insensitive match reads ſ as S
    ("POST", "/api/v1/chat/completions/", {}),  # under the upstream's root path, unknown here
]


@pytest.mark.parametrize(("method", "path", "headers"), OTHER_FORMS, ids=lambda v: str(v) if v else "")
def test_no_form_of_a_metered_route_a_lenient_upstream_runs_goes_unbilled(
        tmp_path: Path, method: str, path: str, headers: dict[str, str]) -> None:
    """Each form reached the lenient upstream as no metered request: the client got a
    completion (200), with no record, no counter and the upstream's own cached figure. Now a
    trailing slash is a 307 to the route, as vLLM's router answers it; any other method but
    a bodiless CORS preflight a 405 (``Allow: POST``) in the route's error JSON; another
    letter case or a prefix a 403, as the other forms a hop may forward; and the
    redirect, followed, is metered. The upstream generates only the completions billed."""
    usage = tmp_path / "usage"
    GENERATED.clear()
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
    assert len(routes) == counted == len(GENERATED) == (followed == 200)


def test_what_vllm_serves_is_served_as_before(tmp_path: Path) -> None:
    """The official client's chat, a CORS preflight, the model list, health, metrics and
    stats are answered as before, and the chat is billed."""
    usage = tmp_path / "usage"
    with cachetally(usage) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
        chat = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "hi"}])
        assert chat.usage is not None and chat.usage.prompt_tokens == 7
        preflight = _request(url, "OPTIONS", "/v1/chat/completions",
                             {"origin": "http://a", "access-control-request-method": "POST"}, b"")
        assert (preflight.status, preflight.getheader("access-control-allow-origin")) == (204, "*")
        assert [m.id for m in client.models.list()] == [SERVED]
        for open_path in ("/health", "/metrics", "/stats"):
            assert httpx.get(f"{url}{open_path}").status_code == 200, open_path
        metrics = httpx.get(f"{url}/metrics").text
    assert _billing(usage, metrics) == (["chat"], 1)


def test_a_metered_post_runs_as_the_post_it_is_billed_as(tmp_path: Path) -> None:
    """Rack, ASP.NET Core and Express's ``method-override`` honour an override on a ``POST``:
    the upstream ran a metered ``POST`` as the ``PUT`` its header named (here a 404, billed
    as a request). The headers are not forwarded: each POST is the completion billed."""
    usage = tmp_path / "usage"
    with cachetally(usage) as url:
        for header in OVERRIDES:
            assert _request(url, "POST", "/v1/chat/completions", {header: "PUT"}).status == 200, header
        metrics = httpx.get(f"{url}/metrics").text
    assert _billing(usage, metrics) == (["chat"] * 3, 3)


@pytest.mark.parametrize("path", ["/INVOCATIONS", "/invocations/", "/x/../Invocations/", "/V1/models"])
def test_a_route_a_lenient_upstream_serves_needs_the_key_as_the_route(tmp_path: Path, path: str) -> None:
    """``/invocations`` is outside vLLM's guarded prefixes and ``/V1`` is none of them: a
    case-insensitive upstream served ``/INVOCATIONS`` (a completion) and ``/V1/models``
    without the key."""
    with cachetally(tmp_path / "usage") as url:
        assert _request(url, "POST" if "nvocations" in path else "GET", path, {"authorization": ""}).status == 401


def test_an_engine_apps_own_router_still_answers_inside_it(tmp_path: Path) -> None:
    """Where cachetally runs the engine's app (the sim here, vLLM's server with the middleware:
    both built by ``Accounting.patch`` without ``upstream``), that app's router answers a
    trailing slash (307, its absolute ``Location``) and another method (405) as before."""
    settings = Settings(engine="sim", api_key=KEY, usage_dir=str(tmp_path / "usage")).validate()
    with serving_in_thread(CachetallyApp(settings)) as url:
        redirected = _request(url, "POST", "/v1/chat/completions/", {})
        assert (redirected.status, redirected.getheader("location")) == (307, f"{url}/v1/chat/completions")
        assert _request(url, "PUT", "/v1/chat/completions", {}).status == 405


def test_a_trailing_slash_is_redirected_here_not_to_the_upstream(tmp_path: Path) -> None:
    """A Starlette upstream, as vLLM's server, answers ``/v1/completions/`` with a 307 whose
    absolute ``Location`` names the ``Host`` it was sent: the upstream's, in upstream mode.
    Forwarded, it sent the client past cachetally to the upstream (unmetered, and without
    cachetally's key check); the redirect is to the route here."""
    async def completion(request: Request) -> JSONResponse:
        return JSONResponse({"id": "c", "object": "text_completion", "created": 0, "model": SERVED,
                             "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}], "usage": _USAGE})

    usage = tmp_path / "usage"
    with serving_in_thread(Starlette(routes=[Route("/v1/completions", completion, methods=["POST"])])) as upstream:
        settings = Settings(engine="upstream", upstream=upstream, usage_dir=str(usage),
                            usage_flush_interval_s=0.05).validate()
        with serving_in_thread(CachetallyApp(settings)) as url:
            redirected = _request(url, "POST", "/v1/completions/?x=1", {})
            assert (redirected.status, redirected.getheader("location")) == (307, "/v1/completions?x=1")
            body = {"model": SERVED, "prompt": "hi"}
            assert httpx.post(f"{url}/v1/completions/", json=body, follow_redirects=True).status_code == 200
            metrics = httpx.get(f"{url}/metrics").text
    assert _billing(usage, metrics) == (["completions"], 1)


def test_a_redirect_keeps_the_connection_for_the_route(tmp_path: Path) -> None:
    """A client follows the 307 on the connection it came on (HTTP/1.1 keep-alive): the
    redirect is a whole response, so the route's completion comes back on it and is billed."""
    usage = tmp_path / "usage"
    with cachetally(usage) as url:
        host, port = url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        body = json.dumps({"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
        statuses = []
        for path in ("/v1/chat/completions/", "/v1/chat/completions"):
            connection.request("POST", path, body, headers)
            response = connection.getresponse()
            statuses.append((response.status, response.read()[:1]))
        connection.close()
        metrics = httpx.get(f"{url}/metrics").text
    assert statuses == [(307, b""), (200, b"{")]
    assert _billing(usage, metrics) == (["chat"], 1)


def test_a_bodiless_request_with_a_preflights_headers_is_a_preflight_only_as_options(tmp_path: Path) -> None:
    """A ``PUT`` without a body that names ``Origin`` and ``Access-Control-Request-Method`` is
    no CORS preflight: a method-override upstream runs it as the ``POST`` it names. It is a 405."""
    usage = tmp_path / "usage"
    GENERATED.clear()
    with cachetally(usage) as url:
        response = _request(url, "PUT", "/v1/chat/completions", {
            "origin": "http://a", "access-control-request-method": "POST", "x-http-method-override": "POST"}, b"")
        metrics = httpx.get(f"{url}/metrics").text
    assert (response.status, response.getheader("allow")) == (405, "POST")
    assert (GENERATED, _billing(usage, metrics)) == ([], ([], 0))


def test_a_preflight_naming_no_header_but_its_two_is_still_forwarded(tmp_path: Path) -> None:
    """An HTTP/1.0 preflight needs no ``Host``: ``Origin`` and ``Access-Control-Request-Method``
    may be its only headers, and it is a preflight all the same, answered by the upstream's
    CORS middleware (204), not a 405."""
    import socket

    with cachetally(tmp_path / "usage") as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as connection:
            connection.sendall(b"OPTIONS /v1/chat/completions HTTP/1.0\r\nOrigin: http://a\r\n"
                               b"Access-Control-Request-Method: POST\r\n\r\n")
            answer = b""
            while chunk := connection.recv(65536):
                answer += chunk
    head = answer.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 204 ") and b"\r\naccess-control-allow-origin: *" in head, head
