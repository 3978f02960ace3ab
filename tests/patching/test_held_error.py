"""A framework's 404 or 405 on a metered route is held to be rewritten as the route's error
JSON (proxy.patching.held_error): bounded as a held JSON body is, over real HTTP.

Before the bound, the responder held such a body whole, counted neither against
``max_response_bytes`` nor the process's response budget: an inner app's 16 MiB 404 was held
whole (the budget's figure 0 throughout) and the client had nothing until its end, and an
upstream's 404 that never ends was held for as long as it came.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from proxy.accounting.metrics import Metrics
from proxy.asgi.error_guard import HELD_ERROR_BYTES, ErrorGuard
from proxy.patching.context import PatchConfig
from proxy.patching.ledger import UsageLedger
from proxy.patching.middleware import UsagePatchMiddleware
from proxy.server.app import CachetallyApp
from proxy.server.settings import Settings
from tests.servers import serving_in_thread

pytestmark = pytest.mark.loopback

CHAT = "/v1/chat/completions"
SERVED = "m-404"
KIB = 1 << 10
MIB = 1 << 20
PART = 64 * KIB
#: The framework's body: far past the bound either way.
TOTAL = 16 * MIB
BOUND = 1 * MIB


class FrameworkError:
    """A POST on the metered route answered ``status`` with a plain-text body of :data:`TOTAL`
    bytes in parts (a framework's error page, not its JSON), noting at each part what the
    process's response budget holds; and, at the start the client gets, how much of that body
    the inner app had sent."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.sent = 0
        self.sent_at_answer: int | None = None
        self.budget_held: list[int] = []
        self.mw: UsagePatchMiddleware | None = None

    def parts(self) -> Iterator[bytes]:
        assert self.mw is not None
        while self.sent < TOTAL:
            self.budget_held.append(self.mw.context.responses.held)
            self.sent += PART
            yield b"n" * PART

    async def answer(self, request: Request) -> StreamingResponse:
        await request.body()
        headers = {"allow": "GET"} if self.status == 405 else None
        return StreamingResponse(self.parts(), self.status, headers, media_type="text/plain")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """What uvicorn runs: the middleware, the start it sends noted."""

        async def noted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.sent_at_answer = self.sent
            await send(message)

        assert self.mw is not None
        await self.mw(scope, receive, noted)


def embedded(inner: FrameworkError, config: PatchConfig) -> None:
    """The middleware as ``vllm serve --middleware`` and ``cachetally serve`` wire it
    (proxy.server.instance.Accounting.patch): in front of the error guard."""
    ledger = UsageLedger()
    app = Starlette(routes=[Route(CHAT, inner.answer, methods=["POST"])])
    inner.mw = UsagePatchMiddleware(ErrorGuard(app), ledger=ledger, metrics=Metrics(ledger), config=config)


CHAT_BODY = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}]}
BOUNDS = {
    "max_response_bytes": PatchConfig(max_response_bytes=BOUND),
    "max_response_bytes_held": PatchConfig(max_response_bytes_held=BOUND),
}


@pytest.mark.parametrize("status", [404, 405])
@pytest.mark.parametrize("bound", BOUNDS)
def test_a_framework_error_past_the_bound_is_answered_without_holding_its_body(
        status: int, bound: str, caplog: pytest.LogCaptureFixture) -> None:
    app = FrameworkError(status)
    embedded(app, BOUNDS[bound])
    with serving_in_thread(app) as url:
        response = httpx.post(f"{url}{CHAT}", json=CHAT_BODY, headers={"x-request-id": "req-1"}, timeout=60)
    phrase = "Not Found" if status == 404 else "Method Not Allowed"
    kind = "NotFoundError" if status == 404 else "MethodNotAllowedError"
    assert response.status_code == status
    assert response.json() == {"error": {"message": phrase, "type": kind, "param": None, "code": status}}
    assert response.headers["x-request-id"] == "req-1"
    assert response.headers["content-length"] == str(len(response.content))
    if status == 405:
        assert response.headers["allow"] == "GET"
    # The answer went out once the bound was reached, not at the body's end: what was held
    # counted in the process's budget, never past the bound, and given back.
    assert app.sent_at_answer is not None and app.sent_at_answer <= BOUND + PART
    assert 0 < max(app.budget_held) <= BOUND
    assert app.mw is not None and app.mw.context.responses.held == 0
    warned = [r.getMessage() for r in caplog.records if "max_response_bytes_held" in r.getMessage()]
    assert len(warned) == (bound == "max_response_bytes_held")


def test_a_framework_error_within_the_bound_is_rewritten_from_its_body_and_counted() -> None:
    """A FastAPI ``{"detail": ...}`` in parts, within the bound: its detail is the message, as
    ever, and its parts were counted while held."""
    held: list[int] = []
    mw: UsagePatchMiddleware

    async def answer(request: Request) -> StreamingResponse:
        await request.body()

        def parts() -> Iterator[bytes]:
            for part in (b'{"detail": "', b"d" * PART, b'"}'):
                held.append(mw.context.responses.held)
                yield part

        return StreamingResponse(parts(), 404, media_type="application/json")

    ledger = UsageLedger()
    mw = UsagePatchMiddleware(ErrorGuard(Starlette(routes=[Route(CHAT, answer, methods=["POST"])])), ledger=ledger, metrics=Metrics(ledger),
                              config=PatchConfig(max_response_bytes=BOUND))
    with serving_in_thread(mw) as url:
        response = httpx.post(f"{url}{CHAT}", json=CHAT_BODY, timeout=60)
    assert response.status_code == 404
    assert response.json() == {"error": {"message": "d" * PART, "type": "NotFoundError", "param": None, "code": 404}}
    assert held[-1] == len(b'{"detail": "') + PART and mw.context.responses.held == 0


def endless_404_upstream(sent: list[int], methods: list[str] | None = None) -> Starlette:
    """An upstream whose 404 on the chat route never ends (a misrouted upstream's error page
    streamed forever), stopped only when its client goes, or at 64 MiB."""

    async def chat(request: Request) -> StreamingResponse:
        await request.body()

        async def parts() -> AsyncIterator[bytes]:
            while sent[0] < 64 * MIB:
                sent[0] += PART
                yield b"n" * PART
                await asyncio.sleep(0)  # lets Starlette see its client leave (a send after it is dropped)

        return StreamingResponse(parts(), 404, media_type="text/html")

    return Starlette(routes=[Route(CHAT, chat, methods=methods or ["POST"]),
                             Route("/v1/models", lambda _: JSONResponse({"data": [{"id": SERVED}]}), methods=["GET"])])


def test_an_upstreams_endless_404_is_answered_and_let_go() -> None:
    sent = [0]
    with serving_in_thread(endless_404_upstream(sent)) as up:
        settings = Settings(engine="upstream", upstream=up, max_response_bytes=BOUND).validate()
        with serving_in_thread(CachetallyApp(settings)) as url, \
                openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=60) as client:
            with pytest.raises(openai.NotFoundError) as raised:
                client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "hi"}])
            models = client.models.list()  # the server goes on serving
    assert raised.value.response.json() == {
        "error": {"message": "Not Found", "type": "NotFoundError", "param": None, "code": 404}}
    assert [m.id for m in models.data] == [SERVED]
    # The upstream's connection was let go once the client had its answer: its body was not
    # read to the end (socket buffers hold a few MiB at most).
    assert sent[0] < 32 * MIB


def test_an_unmetered_routes_framework_error_past_the_guards_bound_is_answered_without_holding_its_body() -> None:
    """A request the responder does not see (any route but a metered POST): the error guard's
    own hold, bounded by ``HELD_ERROR_BYTES``; the 16 MiB error page was held whole before."""
    app = FrameworkError(404)
    ledger = UsageLedger()
    inner = Starlette(routes=[Route("/v1/files", app.answer, methods=["GET"])])
    app.mw = UsagePatchMiddleware(ErrorGuard(inner), ledger=ledger, metrics=Metrics(ledger))
    with serving_in_thread(app) as url:
        response = httpx.get(f"{url}/v1/files", timeout=60)
    assert response.status_code == 404
    assert response.json() == {"error": {"message": "Not Found", "type": "NotFoundError", "param": None, "code": 404}}
    assert response.headers["content-length"] == str(len(response.content))
    assert app.sent_at_answer is not None and app.sent_at_answer <= HELD_ERROR_BYTES + PART


def test_an_upstreams_endless_404_to_a_preflight_is_answered_and_let_go() -> None:
    """A CORS preflight on a metered route, forwarded in upstream mode, reaches the error
    guard's own hold: the upstream's endless 404 was read for as long as it came."""
    sent = [0]
    upstream = endless_404_upstream(sent, methods=["POST", "OPTIONS"])
    with serving_in_thread(upstream) as up:
        settings = Settings(engine="upstream", upstream=up).validate()
        with serving_in_thread(CachetallyApp(settings)) as url:
            response = httpx.options(f"{url}{CHAT}", timeout=60, headers={
                "origin": "https://app.example", "access-control-request-method": "POST"})
            models = httpx.get(f"{url}/v1/models", timeout=60)
    assert response.status_code == 404
    assert response.json() == {"error": {"message": "Not Found", "type": "NotFoundError", "param": None, "code": 404}}
    assert models.json()["data"][0]["id"] == SERVED
    assert sent[0] < 32 * MIB
