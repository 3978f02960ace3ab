"""The responses one process holds to patch them are bounded (proxy.patching.response_budget).

In process, through the middleware: an engine answers each request's JSON body in parts, one
part whenever the schedule lets that request go on. However the answers interleave, the
process never holds more than ``max_response_bytes_held``; a response whose next part would
pass it goes on unpatched, as the upstream sent it, and is still billed its usage; every way
a request ends gives its share back. Over real HTTP, upstream mode:
tests/server/test_response_budget.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import types
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.types import Receive, Scope, Send

from proxy.accounting.metrics import Metrics
from proxy.patching.context import PatchConfig
from proxy.patching.ledger import UsageLedger
from proxy.patching.middleware import UsagePatchMiddleware
from proxy.patching import budget_warning
from proxy.patching.response_budget import BUDGET_FULL, ResponseBudget, ResponseHold
from tests.patching.test_middleware import Client, chat_request, http_scope
from tests.patching.test_middleware import _Records as Records

PART = 500
CONFIG = PatchConfig(max_response_bytes=4_000, max_response_bytes_held=6_000, max_event_bytes=1_000)
ENDINGS = ("served", "upstream_cut", "client_left", "cancelled")
RESPONSES = "/v1/responses"
RESPONSES_STREAM = orjson.dumps({"model": "m", "input": "hi", "stream": True})


def answer(i: int, size: int) -> bytes:
    """A chat completion of ``size`` bytes (or a little more) billing ``100 + i`` prompt tokens."""
    payload: dict[str, Any] = {"id": f"chatcmpl-{i}", "object": "chat.completion", "model": "m",
                               "choices": [{"index": 0, "message": {"role": "assistant", "content": ""},
                                            "finish_reason": "stop"}]}
    payload["usage"] = {"prompt_tokens": 100 + i, "completion_tokens": 2, "total_tokens": 102 + i}
    pad = max(0, size - len(orjson.dumps(payload)))
    payload["choices"][0]["message"]["content"] = "x" * pad
    return orjson.dumps(payload)


def parts_of(body: bytes) -> list[bytes]:
    return [body[i : i + PART] for i in range(0, len(body), PART)]


class Engine:
    """The inner app: request ``i`` (its ``x-client`` header) answers ``bodies[i]`` in parts,
    each when ``go(i, "part")`` lets it; ``upstream_cut`` raises, as a connection that broke;
    ``client_left`` stops sending, as the upstream client does once its client is gone."""

    def __init__(self, bodies: list[bytes], streamed: set[int] = set()) -> None:
        self.bodies = bodies
        self.streamed = streamed  # the requests answered as a Responses stream
        self.gates = [asyncio.Queue[str]() for _ in bodies]

    def go(self, i: int, how: str) -> None:
        self.gates[i].put_nowait(how)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        i = int(dict(scope["headers"])[b"x-client"])
        await receive()
        body = self.bodies[i]
        kind = b"text/event-stream" if i in self.streamed else b"application/json"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", kind), (b"content-length", b"%d" % len(body))]})
        parts = parts_of(body)
        for n, part in enumerate(parts):
            how = await self.gates[i].get()
            if how == "upstream_cut":
                raise RuntimeError("the upstream connection broke")
            if how == "client_left":
                return
            await send({"type": "http.response.body", "body": part, "more_body": n < len(parts) - 1})


def serving(engine: Engine, records: Records | None = None) -> tuple[UsagePatchMiddleware, Metrics]:
    ledger = UsageLedger()
    metrics = Metrics(ledger)
    return UsagePatchMiddleware(engine, ledger=ledger, metrics=metrics, config=CONFIG, recorder=records), metrics


def start(mw: UsagePatchMiddleware, n: int, streamed: set[int] = set()) -> tuple[list[Client], list[asyncio.Future[None]]]:
    """``n`` requests, chat completions or (``streamed``) Responses streams."""
    clients = [Client(RESPONSES_STREAM if i in streamed else chat_request()) for i in range(n)]
    scopes = [http_scope(*(RESPONSES,) if i in streamed else (), headers=[(b"x-client", b"%d" % i)]) for i in range(n)]
    return clients, [asyncio.ensure_future(mw(s, c.receive, c.send)) for s, c in zip(scopes, clients)]


async def settle() -> None:
    for _ in range(30):
        await asyncio.sleep(0)


async def all_but_the_last_parts(engine: Engine, mw: UsagePatchMiddleware, bodies: list[bytes]) -> None:
    """The upstream sends each of ``bodies`` (of one length) all but its last part, in turns;
    the budget is never past its limit on the way."""
    for _ in range(len(parts_of(bodies[0])) - 1):
        for i in range(len(bodies)):
            engine.go(i, "part")
            await settle()
            assert mw.context.responses.held <= CONFIG.max_response_bytes_held


def skipped(metrics: Metrics, reason: str) -> float:
    return metrics.registry.get_sample_value("cachetally_patch_skipped_total", {"reason": reason}) or 0.0


@pytest.mark.asyncio
async def test_answers_past_the_budget_go_on_unpatched_before_their_end_and_are_billed() -> None:
    """Three 3,000-byte answers against 6,000 held: once each has sent all but its last part,
    one at least is already going to its client, as the upstream sent it. Before the budget
    all three were held whole, and no client had a byte until its answer's end."""
    bodies = [answer(i, 3_000) for i in range(3)]
    engine, records = Engine(bodies), Records()
    mw, metrics = serving(engine, records)
    clients, tasks = start(mw, 3)
    await settle()
    await all_but_the_last_parts(engine, mw, bodies[:3])
    going = [c for c in clients if c.sent]
    assert going, "every answer is held whole at once"
    for i in range(3):
        engine.go(i, "part")
    await asyncio.gather(*tasks)
    assert mw.context.responses.held == 0
    for i, client in enumerate(clients):
        assert client.status == 200 and int(client.header("content-length") or -1) == len(client.body)
        if client in going:
            assert client.body == bodies[i]  # as the upstream sent it: no byte changed or lost
        else:
            assert orjson.loads(client.body)["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert skipped(metrics, BUDGET_FULL) == len(going)
    assert sorted((r.prompt_tokens, r.completion_tokens, r.outcome) for r in records.records) == [
        (100 + i, 2, "completed") for i in range(3)]


@pytest.mark.asyncio
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(200, 5_000), st.sampled_from(ENDINGS), st.integers(0, 9)), min_size=1, max_size=6),
       st.sets(st.integers(0, 5)), st.data())
async def test_the_budget_holds_and_is_given_back_however_answers_interleave_and_end(
    answers: list[tuple[int, str, int]], streamed: set[int], data: st.DataObject
) -> None:
    """JSON answers and Responses streams (``streamed``), their parts interleaved as drawn."""
    bodies = [responses_stream(i, size) if i in streamed else answer(i, size) for i, (size, _, _) in enumerate(answers)]
    engine, records = Engine(bodies, streamed), Records()
    mw, metrics = serving(engine, records)
    budget = mw.context.responses
    clients, tasks = start(mw, len(bodies), streamed)
    try:
        await settle()
        await run_schedule(answers, engine, tasks, budget, data)
    finally:  # Hypothesis may stop an example at any draw: no request is left running
        for task in tasks:
            task.cancel()
            with contextlib.suppress(RuntimeError, asyncio.CancelledError):
                await task
    assert budget.held == 0
    billed = {r.prompt_tokens: r.completion_tokens for r in records.records}
    unpatched = 0
    for i, client in enumerate(clients):
        if answers[i][1] != "served":
            continue
        assert client.complete and billed[100 + i] == 2
        if client.body == bodies[i]:  # went on as the upstream sent it
            unpatched += 1
            continue
        if i in streamed:  # the event's data, its usage patched
            got, sent = (orjson.loads(b.split(b"data: ", 1)[1]) for b in (client.body, bodies[i]))
            assert got["response"].pop("usage") == {**sent["response"].pop("usage"),
                                                    "input_tokens_details": {"cached_tokens": 0}}
        else:
            assert int(client.header("content-length") or -1) == len(client.body)
            got, sent = orjson.loads(client.body), orjson.loads(bodies[i])
            assert got.pop("usage") == {**sent.pop("usage"), "prompt_tokens_details": {"cached_tokens": 0}}
        assert got == sent
    reasons = (BUDGET_FULL, "body_too_large", "event_too_large")
    assert unpatched <= sum(skipped(metrics, reason) for reason in reasons)


async def run_schedule(answers: list[tuple[int, str, int]], engine: Engine, tasks: list[asyncio.Future[None]],
                       budget: ResponseBudget, data: st.DataObject) -> None:
    """Let the answers go on a part at a time, in an order drawn, each ending as drawn; the
    budget is checked after each step."""
    left = {i: len(parts_of(body)) for i, body in enumerate(engine.bodies)}
    # where an answer that does not end served ends: after this many of its parts
    ends = {i: at % left[i] for i, (_, ending, at) in enumerate(answers) if ending != "served"}
    while left:
        i = data.draw(st.sampled_from(sorted(left)))
        if ends.get(i) == len(parts_of(engine.bodies[i])) - left[i]:
            if answers[i][1] == "cancelled":
                tasks[i].cancel()
            else:
                engine.go(i, answers[i][1])
            del left[i]
        else:
            engine.go(i, "part")
            left[i] -= 1
            if not left[i]:
                del left[i]
        await settle()
        assert 0 <= budget.held <= budget.limit
    await asyncio.wait(tasks)


def responses_stream(i: int, pad: int) -> bytes:
    """A Responses stream whose terminal event (its usage) is ``pad`` bytes larger than usual."""
    usage = {"input_tokens": 100 + i, "output_tokens": 2, "total_tokens": 102 + i}
    done = {"type": "response.completed", "response": {"id": f"resp_{i}", "object": "response", "model": "m",
                                                        "instructions": "x" * pad, "output": [], "usage": usage}}
    return b"event: response.completed\ndata: " + orjson.dumps(done) + b"\n\n"


@pytest.mark.asyncio
async def test_a_partial_event_past_the_budget_goes_on_as_an_oversized_one_and_an_ordinary_one_is_always_held() -> None:
    """A Responses stream's terminal event is held up to ``max_response_bytes``; what it holds
    past ``max_event_bytes`` is counted in the budget. Two 3,500-byte events fit in 6,000 past
    their free 1,000 each; the third goes on unpatched, counted as the budget's, as an event
    past its bound does, its figures read as it passes and billed; a small event is held and
    patched whatever the others hold."""
    bodies = [responses_stream(i, 3_300) for i in range(3)] + [responses_stream(3, 0)]
    engine, records = Engine(bodies, set(range(4))), Records()
    mw, metrics = serving(engine, records)
    clients, tasks = start(mw, 4, set(range(4)))
    await settle()
    await all_but_the_last_parts(engine, mw, bodies[:3])
    for _ in parts_of(bodies[3]):
        engine.go(3, "part")
    for i in range(3):
        engine.go(i, "part")
    await asyncio.gather(*tasks)
    assert mw.context.responses.held == 0
    assert sum(c.body == body for c, body in zip(clients, bodies)) == 1  # as the upstream sent it
    assert clients[3].body != bodies[3] and skipped(metrics, BUDGET_FULL) == 1
    assert b'"cached_tokens"' in clients[3].body  # the small one was read and patched
    # and every one billed, the one that went on unheld too: its figures read as it passed
    assert sorted((r.prompt_tokens, r.completion_tokens, r.model) for r in records.records) == [
        (100 + i, 2, "m") for i in range(4)]


def test_the_budget_holds_up_to_its_limit_and_warns_once_a_minute_with_the_count_since_the_last(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """``max_response_bytes_held`` bytes are held, not one more; a body is held up to
    ``max_response_bytes``, not one more; the warning that responses went on unheld comes at
    most once a minute and says how many went since the last one (the clock is moved, not waited)."""
    now = [1000.0]
    monkeypatch.setattr(budget_warning, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    budget = ResponseBudget(100)
    first, second = ResponseHold(budget), ResponseHold(budget)
    assert (first.keeps(60, 1_000), second.keeps(40, 1_000), budget.held) == (None, None, 100)
    assert (second.keeps(1, 1_000), first.keeps(1, 1_000), budget.held) == (BUDGET_FULL, BUDGET_FULL, 100)
    now[0] += budget_warning.LOG_EVERY_S
    assert first.keeps(1, 1_000) == BUDGET_FULL
    first.release()
    assert budget.held == 40
    warned = [r.getMessage() for r in caplog.records if "passed on unpatched" in r.getMessage()]
    assert [message.split()[0] for message in warned] == ["1", "2"]
    alone = ResponseHold(ResponseBudget(10_000))
    assert (alone.keeps(1_000, 1_000), alone.keeps(1, 1_000)) == (None, "body_too_large")
