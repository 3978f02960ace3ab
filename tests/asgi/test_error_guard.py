"""A framework's own 404, 405 and exceptions reach the client as OpenAI error JSON, the same
whether the request went through the usage responder (a POST to a patched route, where the
responder rewrites and the guard only answers exceptions) or through the guard's own send
wrapper (every other request).

The inner apps are what the engines' frameworks answer: Starlette's router (the sim's
framework) with its plain-text 404 and 405, and FastAPI's ``{"detail": ...}`` (vLLM's app).
"""

from __future__ import annotations

import asyncio

import pytest
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route, Router
from starlette.types import Receive, Scope, Send

from proxy.accounting.metrics import Metrics
from proxy.asgi.error_guard import ErrorGuard
from proxy.patching.ledger import UsageLedger
from proxy.patching.middleware import UsagePatchMiddleware
from tests.patching.test_middleware import CHAT, Client, chat_request, http_scope


async def _ok(request: object) -> PlainTextResponse:
    return PlainTextResponse("ok")


#: Starlette's router: only GET on /v1/chat/completions, nothing on /v1/completions.
STARLETTE = Router([Route(CHAT, _ok, methods=["GET"])])


async def fastapi_style(scope: Scope, receive: Receive, send: Send) -> None:
    """What FastAPI answers a route it does not have (vLLM's app)."""
    await JSONResponse({"detail": "Not Found"}, status_code=404)(scope, receive, send)


async def openai_404(scope: Scope, receive: Receive, send: Send) -> None:
    """vLLM's own answer to an unknown model: already an OpenAI error, passed on as it is."""
    await JSONResponse({"error": {"message": "The model `x` does not exist.", "type": "NotFoundError",
                                  "param": "model", "code": 404}}, status_code=404)(scope, receive, send)


def chain(inner: object) -> tuple[UsagePatchMiddleware, UsageLedger]:
    ledger = UsageLedger()
    return UsagePatchMiddleware(ErrorGuard(inner), ledger=ledger, metrics=Metrics(ledger)), ledger  # type: ignore[arg-type]


async def answer(inner: object, method: str, path: str) -> Client:
    mw, ledger = chain(inner)
    client = Client(chat_request() if method == "POST" else b"")
    await mw(http_scope(path, method=method, headers=[(b"x-request-id", b"req-1")]), client.receive, client.send)
    assert len(ledger) == 0
    return client


# POST to a patched route: the responder rewrites. The others: the guard's own wrapper.
VIA = {"responder": ("POST", "/v1/completions"), "guard": ("GET", "/v1/completions")}


@pytest.mark.asyncio
@pytest.mark.parametrize("via", VIA)
async def test_a_starlette_404_is_an_openai_404_with_the_request_id(via: str) -> None:
    client = await answer(STARLETTE, *VIA[via])
    assert client.status == 404
    assert client.json() == {"error": {"message": "Not Found", "type": "NotFoundError", "param": None, "code": 404}}
    assert client.header("x-request-id") == "req-1"
    assert client.header("content-length") == str(len(client.body))


@pytest.mark.asyncio
@pytest.mark.parametrize("via", ["responder", "guard"])
async def test_a_starlette_405_keeps_its_allow_header(via: str) -> None:
    method = "POST" if via == "responder" else "PUT"
    client = await answer(STARLETTE, method, CHAT)
    assert client.status == 405
    assert client.json()["error"]["message"] == "Method Not Allowed"
    assert client.header("allow") is not None and "GET" in client.header("allow")  # type: ignore[operator]
    assert client.header("x-request-id") == "req-1"


@pytest.mark.asyncio
@pytest.mark.parametrize("via", VIA)
async def test_a_fastapi_detail_becomes_the_message(via: str) -> None:
    client = await answer(fastapi_style, *VIA[via])
    assert client.status == 404
    assert client.json()["error"]["message"] == "Not Found"


@pytest.mark.asyncio
@pytest.mark.parametrize("via", VIA)
async def test_an_openai_error_passes_byte_for_byte(via: str) -> None:
    client = await answer(openai_404, *VIA[via])
    direct = Client()
    await openai_404(http_scope(), direct.receive, direct.send)
    assert client.status == 404
    assert client.body == direct.body
    assert client.header("content-length") == str(len(direct.body))  # framed as it came


@pytest.mark.asyncio
@pytest.mark.parametrize("via", VIA)
async def test_an_exception_before_the_response_is_an_openai_500(via: str) -> None:
    async def fails(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("secret prompt text")

    client = await answer(fails, *VIA[via])
    assert client.status == 500
    assert client.json()["error"]["message"] == "Internal server error"
    assert client.header("x-request-id") == "req-1"


@pytest.mark.asyncio
@pytest.mark.parametrize("via", VIA)
async def test_an_exception_after_the_start_reaches_the_server(via: str) -> None:
    async def fails(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        raise RuntimeError("engine died")

    mw, ledger = chain(fails)
    method, path = VIA[via]
    client = Client(chat_request(stream=True) if method == "POST" else b"")
    with pytest.raises(RuntimeError, match="engine died"):
        await mw(http_scope(path, method=method), client.receive, client.send)
    assert client.status == 200 and client.body == b"data: {}\n\n" and not client.complete
    assert len(ledger) == 0


#: Starts the client has not had yet: a JSON body the responder holds to patch (on the
#: patched route only), and a 404 held to be rewritten (by either).
HELD = {"json via responder": ("responder", 200, b"application/json"),
        "404 via responder": ("responder", 404, b"text/plain"),
        "404 via guard": ("guard", 404, b"text/plain")}


@pytest.mark.asyncio
@pytest.mark.parametrize("held", HELD)
async def test_an_exception_after_a_held_start_is_an_openai_500_and_its_only_start(held: str) -> None:
    via, status, content_type = HELD[held]

    async def fails(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
        await send({"type": "http.response.body", "body": b'{"id":"chatcmpl-1","choi', "more_body": True})
        raise RuntimeError("engine died")

    client = await answer(fails, *VIA[via])
    assert client.status == 500  # one start: the held one never goes out
    assert client.json()["error"] == {"message": "Internal server error", "type": "InternalServerError",
                                      "param": None, "code": 500}
    assert client.complete and client.header("x-request-id") == "req-1"
    assert client.header("content-length") == str(len(client.body))


@pytest.mark.asyncio
async def test_a_passed_through_request_cancelled_by_its_caller_is_not_told_the_server_stopped() -> None:
    """Only the server's stop is answered with a 503 (tests/server/test_stop.py): a caller's
    own timeout around the app goes on, and the client gets no answer from the guard."""

    async def hangs(scope: Scope, receive: Receive, send: Send) -> None:
        timeout.reschedule(asyncio.get_running_loop().time())  # the caller's deadline passes now
        await asyncio.Event().wait()

    mw, ledger = chain(hangs)
    client = Client(b"")
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(None) as timeout:
            await mw(http_scope("/v1/completions", method="GET"), client.receive, client.send)
    assert client.sent == []
