"""The request bodies one process holds at once are bounded (proxy.patching.body_budget).

In process, through the middleware: clients hold parts of their bodies, and the ones that do
not fit are answered 503 with ``Retry-After`` before they are read further; every way a
request can end gives its share back, which the last step of each schedule checks the way an
operator would see it: bodies that fill the whole budget at once are all served afterwards.
Over real HTTP, with memory measured: tests/server/test_body_budget.py.
"""

from __future__ import annotations

import asyncio
import contextlib

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.types import Message, Receive, Scope, Send

from proxy.accounting.metrics import Metrics
from proxy.asgi.errors import UVICORN_STOP
from proxy.patching.context import PatchConfig
from proxy.patching.ledger import UsageLedger
from proxy.patching.middleware import UsagePatchMiddleware
from tests.patching.test_middleware import Client, chat_completion, http_scope

SIZE = 1000  # every body here is this long, padded JSON
CONFIG = PatchConfig(max_request_bytes=SIZE, max_request_bytes_held=3 * SIZE)


def body_of(size: int = SIZE) -> bytes:
    head = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]'
    return head + b" " * (size - len(head) - 1) + b"}"


class Stalled(Client):
    """A client that sends ``sent`` bytes of a ``SIZE``-byte body, then waits: for ``finish``
    (the rest comes) or ``leave`` (it hangs up)."""

    def __init__(self, sent: int, length_header: bool = True) -> None:
        body = body_of()
        super().__init__([body[:sent]])
        self.pending[0]["more_body"] = True
        self.rest = body[sent:]
        self.go_on = asyncio.Event()
        self.scope = http_scope(headers=[(b"content-length", b"%d" % SIZE)] if length_header else [])

    def finish(self) -> None:
        self.go_on.set()

    async def receive(self) -> Message:
        if self.pending:
            return self.pending.pop(0)
        if self.rest:
            gone = asyncio.ensure_future(self.gone.wait())
            on = asyncio.ensure_future(self.go_on.wait())
            await asyncio.wait((gone, on), return_when=asyncio.FIRST_COMPLETED)
            gone.cancel(), on.cancel()
            if self.go_on.is_set() and not self.gone.is_set():
                rest, self.rest = self.rest, b""
                return {"type": "http.request", "body": rest, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}


def middleware() -> UsagePatchMiddleware:
    """An engine that reads the body and answers, or as a request's ``x-engine`` header says:
    ``ignores`` (answers without reading it) or ``raises``."""

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        how = dict(scope["headers"]).get(b"x-engine")
        if how != b"ignores":
            await receive()
        if how == b"raises":
            raise RuntimeError("the engine failed")
        body = chat_completion()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    ledger = UsageLedger()
    return UsagePatchMiddleware(inner, ledger=ledger, metrics=Metrics(ledger), config=CONFIG)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def assert_nothing_held(mw: UsagePatchMiddleware) -> None:
    """Nothing is held: three whole bodies at once fill the budget, and all are served."""
    clients = [Stalled(SIZE - 1) for _ in range(3)]
    tasks = [asyncio.ensure_future(mw(c.scope, c.receive, c.send)) for c in clients]
    await settle()
    for c in clients:
        c.finish()
    await asyncio.gather(*tasks)
    assert [c.status for c in clients] == [200, 200, 200], [orjson.loads(c.body) for c in clients]


def refused(client: Client) -> bool:
    if not client.sent or client.status != 503:
        return False
    assert client.header("retry-after") == "1"
    error = client.json()["error"]
    assert (error["type"], error["message"]) == (
        "ServiceUnavailableError", "The server is receiving as many request bodies as it may hold; retry")
    return True


@pytest.mark.asyncio
async def test_a_body_that_does_not_fit_beside_those_arriving_is_503_and_a_freed_share_is_reused() -> None:
    mw = middleware()
    holders = [Stalled(900) for _ in range(3)]  # 2,700 of 3,000 held
    tasks = [asyncio.ensure_future(mw(c.scope, c.receive, c.send)) for c in holders]
    await settle()
    assert not any(c.sent for c in holders)

    late = Stalled(900, length_header=False)  # 900 more do not fit: refused as they arrive
    await mw(late.scope, late.receive, late.send)
    announced = Stalled(10)  # its Content-Length does not fit: refused before it is read
    await mw(announced.scope, announced.receive, announced.send)
    assert refused(late) and refused(announced)
    assert announced.pending  # its first bytes were never read

    holders[0].leave()  # a client that hangs up gives its share back
    holders[1].finish()  # and one whose body is handed to the engine
    await asyncio.gather(*tasks[:2])
    assert holders[1].status == 200
    fits = [Stalled(900), Stalled(900)]
    more = [asyncio.ensure_future(mw(c.scope, c.receive, c.send)) for c in fits]
    await settle()
    assert not any(c.sent for c in fits)
    for c in (*fits, holders[2]):
        c.finish()
    await asyncio.gather(*more, tasks[2])
    assert [c.status for c in (*fits, holders[2])] == [200, 200, 200]


ENDINGS = ("served", "leaves_mid_body", "too_large", "bad_json", "engine_raises", "engine_ignores_body",
           "stopped_mid_body", "cancelled_mid_body", "leaves_after_answer")


async def end_one_way(mw: UsagePatchMiddleware, ending: str, sent: int) -> None:
    """One request, ended as ``ending``; whatever it was answered."""
    client = Stalled(sent)
    if ending == "too_large":
        client.rest += b"x"
        client.scope = http_scope()
    elif ending == "bad_json":
        client.rest = client.rest[:-1] + b","
    elif ending in ("engine_raises", "engine_ignores_body"):
        client.scope["headers"].append((b"x-engine", ending.rsplit("_", 1)[-1].encode()))
    task = asyncio.ensure_future(mw(client.scope, client.receive, client.send))
    await settle()
    if ending == "leaves_mid_body":
        client.leave()
    elif ending == "stopped_mid_body":
        task.cancel(UVICORN_STOP)  # the server's stop: answered 503
    elif ending == "cancelled_mid_body":
        task.cancel()
    else:
        client.finish()
        if ending == "leaves_after_answer":
            await settle()
            client.leave()
    with contextlib.suppress(RuntimeError, asyncio.CancelledError):
        await task


@pytest.mark.asyncio
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(ENDINGS), st.integers(1, SIZE - 1)), min_size=1, max_size=12),
       st.data())
async def test_every_way_a_request_ends_gives_its_share_back(
    schedule: list[tuple[str, int]], data: st.DataObject
) -> None:
    mw = middleware()
    while schedule:  # in groups run at once, as drawn
        n = data.draw(st.integers(1, len(schedule)))
        group, schedule = schedule[:n], schedule[n:]
        await asyncio.gather(*(end_one_way(mw, ending, sent) for ending, sent in group))
    await assert_nothing_held(mw)


@pytest.mark.asyncio
async def test_a_body_handed_to_the_engine_holds_nothing_while_its_answer_runs() -> None:
    answering = asyncio.Event()

    async def slow_engine(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await answering.wait()  # a long generation
        body = chat_completion()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    ledger = UsageLedger()
    mw = UsagePatchMiddleware(slow_engine, ledger=ledger, metrics=Metrics(ledger), config=CONFIG)
    running = [Client(body_of()) for _ in range(6)]  # twice the budget, handed in turn
    tasks = [asyncio.ensure_future(mw(http_scope(), c.receive, c.send)) for c in running]
    await settle()
    answering.set()
    await asyncio.gather(*tasks)
    assert [c.status for c in running] == [200] * 6


def stalled_leg() -> Stalled:
    """A P/D decode leg past ``SIZE`` in its first bytes, its ``kv_transfer_params`` (900
    bytes, which ``pd_legs`` keeps) among them, the rest still to come."""
    head = b'{"model": "m", "messages": [], "kv_transfer_params": {"x": "'
    client = Stalled(1, length_header=False)
    client.pending[0]["body"] = head + b"a" * (900 - len(head)) + b'"}, "pad": "' + b" " * 200
    client.rest = b'"}'
    return client


@pytest.mark.asyncio
async def test_the_transfer_params_an_oversized_leg_keeps_count_against_the_budget() -> None:
    ledger = UsageLedger()
    inner = middleware().app
    mw = UsagePatchMiddleware(inner, ledger=ledger, metrics=Metrics(ledger),
                              config=PatchConfig(max_request_bytes=SIZE, max_request_bytes_held=3 * SIZE, pd_legs=True))
    legs = [stalled_leg() for _ in range(4)]
    tasks = [asyncio.ensure_future(mw(c.scope, c.receive, c.send)) for c in legs]
    await settle()
    assert [refused(c) for c in legs] == [False, False, False, True]  # 900 more do not fit beside 2,700
    for c in legs[:3]:
        c.finish()
    await asyncio.gather(*tasks)
    assert [c.status for c in legs] == [413, 413, 413, 503]
    await assert_nothing_held(mw)  # every leg gave its share back
