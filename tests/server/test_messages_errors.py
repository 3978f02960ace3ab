"""The errors cachetally answers itself on the Messages API, read by the official ``anthropic``
client: Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``), the shape of
vLLM's own Messages errors, with the same status. Every other route keeps OpenAI's error JSON.

Before, every one of them was OpenAI's JSON: the SDK raised the right class (it goes by the
status) but its ``type`` read OpenAI's name (``AuthenticationError``), and a client that
reads Anthropic's ``error.type`` got two shapes from one server depending on who refused.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from proxy.server.app import CachetallyApp
from proxy.server.settings import Settings
from tests.servers import free_port, serving_in_thread

KEY = "k-messages"
LIMIT = 4096  # max_request_bytes
MESSAGE = [{"role": "user", "content": "hi"}]


def client(url: str, key: str = KEY) -> anthropic.Anthropic:
    # auth_token: cachetally's key is a bearer token (as vLLM's --api-key), not x-api-key.
    return anthropic.Anthropic(base_url=url, auth_token=key, max_retries=0)


def create(messages: anthropic.Anthropic, content: str = "hi") -> Any:
    return messages.messages.create(model="sim-model", max_tokens=2, messages=[{"role": "user", "content": content}])


def raised(url: str, call: Callable[[anthropic.Anthropic], object], key: str = KEY) -> anthropic.APIStatusError:
    with client(url, key) as messages, pytest.raises(anthropic.APIStatusError) as caught:
        call(messages)
    return caught.value


def assert_anthropic(error: anthropic.APIStatusError, cls: type, status: int, kind: str, message: str) -> None:
    assert type(error) is cls, repr(error)
    assert (error.status_code, error.type, error.api_message) == (status, kind, message)
    assert error.body == {"type": "error", "error": {"type": kind, "message": message}}


def refusals(url: str) -> None:
    """What a cachetally with the key ``KEY`` and ``max_request_bytes`` ``LIMIT`` refuses itself."""
    assert_anthropic(raised(url, create, key="wrong"), anthropic.AuthenticationError, 401,
                     "authentication_error", "Missing or invalid API key")
    assert_anthropic(raised(url, lambda c: create(c, "x" * LIMIT)), anthropic.ContentTooLargeError, 413,
                     "request_too_large", f"Request body exceeds {LIMIT} bytes")
    not_an_object = raised(url, lambda c: c.post("/v1/messages", body=["hi"], cast_to=object))
    assert_anthropic(not_an_object, anthropic.BadRequestError, 400, "invalid_request_error",
                     "Request body must be a JSON object")


@contextlib.contextmanager
def sim(**options: Any) -> Iterator[str]:
    app = CachetallyApp(Settings(engine="sim", api_key=KEY, max_request_bytes=LIMIT).validate())
    with serving_in_thread(app, "cachetally", **options) as url:
        yield url


def test_the_sims_refusals_on_the_messages_api_are_anthropics_shape() -> None:
    with sim() as url:
        refusals(url)
        with client(url) as messages:
            assert create(messages).usage.input_tokens > 0  # the key and a small body pass
        method = raised(url, lambda c: c.get("/v1/messages", cast_to=object))
        # The routes under /v1/messages (count_tokens, which the sim does not serve) are the API's too.
        unserved = raised(url, lambda c: c.messages.count_tokens(model="sim-model", messages=MESSAGE))
    assert_anthropic(method, anthropic.APIStatusError, 405, "invalid_request_error", "Method Not Allowed")
    assert method.response.headers["allow"] == "POST"
    assert_anthropic(unserved, anthropic.NotFoundError, 404, "not_found_error", "Not Found")


def test_under_the_root_path_the_messages_api_is_refused_in_anthropics_shape() -> None:
    """uvicorn's ``--root-path /api`` (a reverse proxy that strips it): the app sees
    ``/api/v1/messages``, the route ``/v1/messages``."""
    with sim(root_path="/api") as url:
        refusals(url)


class NotStarted:
    """The app as uvicorn serves it before its lifespan started the engine."""

    def __init__(self, app: CachetallyApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        await self.app(scope, receive, send)


def test_a_messages_request_before_the_engine_started_is_told_so_in_anthropics_shape() -> None:
    app = CachetallyApp(Settings(engine="sim").validate())
    with serving_in_thread(NotStarted(app), "cachetally") as url:
        error = raised(url, create)
        chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGE}, timeout=10)
    message = "cachetally is not running (engine not started)"
    assert_anthropic(error, anthropic.ServiceUnavailableError, 503, "overloaded_error", message)
    assert chat.json() == {"error": {"message": message, "type": "ServiceUnavailableError", "param": None,
                                     "code": 503}}


# -- upstream mode -----------------------------------------------------------------------------


@contextlib.contextmanager
def proxy(upstream: str, **settings: Any) -> Iterator[str]:
    app = CachetallyApp(Settings(engine="upstream", upstream=upstream, model="m", **settings).validate())
    with serving_in_thread(app, "cachetally") as url:
        yield url


def test_an_unreachable_upstream_and_the_proxys_refusals_are_anthropics_shape_on_messages() -> None:
    with proxy(f"http://127.0.0.1:{free_port()}", api_key=KEY, max_request_bytes=LIMIT) as url:
        refusals(url)
        unreachable = raised(url, create)
    assert_anthropic(unreachable, anthropic.InternalServerError, 502, "api_error",
                     "Upstream server unreachable or connection lost")


def test_the_messages_api_under_an_upstreams_root_path_is_refused_in_anthropics_shape() -> None:
    """Billing on, ``/api/v1/messages`` is the Messages API of an upstream behind
    ``--root-path /api``, which cachetally cannot meter there: its 403 was OpenAI's JSON
    (``ForbiddenError``), and a wrong key's 401 too (``AuthenticationError``), since both
    refusals named the raw path, not the route the upstream serves it as. A root path that
    itself begins with a guarded prefix (``/v1/x``) is one as well."""
    for root in ("/api", "/v1/x"):
        with proxy(f"http://127.0.0.1:{free_port()}", api_key=KEY) as url:
            refused = raised(f"{url}{root}", create)
            no_key = raised(f"{url}{root}", create, key="wrong")
            count_no_key = raised(f"{url}{root}", lambda c: c.messages.count_tokens(model="m", messages=MESSAGE),
                                  key="wrong")
        route = "/v1/messages"
        assert_anthropic(refused, anthropic.PermissionDeniedError, 403, "permission_error",
                         f"{route} runs the engine unmetered: it is refused while billing is on")
        for refused_key in (no_key, count_no_key):
            assert_anthropic(refused_key, anthropic.AuthenticationError, 401, "authentication_error",
                             "Missing or invalid API key")


async def _slow_messages(request: Any) -> JSONResponse:
    await asyncio.sleep(5)  # past the proxy's read timeout; cancelled when the upstream stops
    return JSONResponse({})


def test_an_upstream_timeout_and_its_unserved_route_are_anthropics_shape_on_messages() -> None:
    """An upstream that serves no Messages API answers a plain-text 404 (Starlette's), which
    cachetally rewrites in the route's shape; one that does not answer in time is a 504."""
    slow = Starlette(routes=[Route("/v1/messages", _slow_messages, methods=["POST"])])
    bare = Starlette(routes=[Route("/v1/models", lambda request: JSONResponse({"data": []}))])
    with serving_in_thread(slow, "upstream") as slow_url, proxy(slow_url, read_timeout_s=0.5) as url:
        late = raised(url, create)
    with serving_in_thread(bare, "upstream") as bare_url, proxy(bare_url) as url:
        unserved = raised(url, create)
    assert_anthropic(late, anthropic.GatewayTimeoutError, 504, "timeout_error", "Upstream server timed out")
    assert_anthropic(unserved, anthropic.NotFoundError, 404, "not_found_error", "Not Found")


# -- every other route: unchanged --------------------------------------------------------------


def openai_error(status: int, kind: str, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


@pytest.mark.parametrize("engine", ["sim", "upstream"])
def test_other_routes_keep_openais_error_json(engine: str) -> None:
    """Only ``/v1/messages`` and the routes under it: a path that merely starts with its
    letters (``/v1/messagesx``) is another route."""
    if engine == "sim":
        server = sim()
    else:
        server = proxy(f"http://127.0.0.1:{free_port()}", api_key=KEY, max_request_bytes=LIMIT)
    keyed = {"authorization": f"Bearer {KEY}"}
    with server as url, httpx.Client(base_url=url, timeout=10) as http:
        unkeyed = http.post("/v1/chat/completions", json={"messages": MESSAGE})
        large = http.post("/v1/chat/completions", json={"messages": MESSAGE, "x": "x" * LIMIT}, headers=keyed)
        not_object = http.post("/v1/completions", json=["hi"], headers=keyed)
        lookalike = http.post("/v1/messagesx", json={}, headers={"authorization": "Bearer wrong"})
    key = "Missing or invalid API key"
    assert (unkeyed.status_code, unkeyed.json()) == (401, openai_error(401, "AuthenticationError", key))
    assert (lookalike.status_code, lookalike.json()) == (401, openai_error(401, "AuthenticationError", key))
    too_large = f"Request body exceeds {LIMIT} bytes"
    assert (large.status_code, large.json()) == (413, openai_error(413, "RequestEntityTooLargeError", too_large))
    not_json_object = "Request body must be a JSON object"
    assert (not_object.status_code, not_object.json()) == (400, openai_error(400, "BadRequestError", not_json_object))
