"""The ghost hold over any ``n``, any interleaving of choices, and any cut of the bytes.

Upstream mode asks for a usage chunk the client did not and drops it; finishing chunks
wait for it to get its ``system_fingerprint`` back. Whatever Hypothesis draws, the client
must get: every chunk but the usage one, each choice's chunks in their order, the
finishing ones stamped, ``[DONE]`` last, and every chunk of a choice still generating as
soon as its bytes are complete, never held behind another choice's finish.
"""

from __future__ import annotations

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.types import Receive, Scope, Send

from proxy.patching.context import PatchConfig
from proxy.patching.middleware import UsagePatchMiddleware
from tests.patching.test_middleware import (
    DONE, GHOST_USAGE, ROLE, Client, Harness, _Records, chat_request, finishing, sse_payloads, start,
)


def token(index: int, k: int) -> bytes:
    payload = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m",
               "choices": [{"index": index, "delta": {"content": f"t{k}"}, "finish_reason": None}]}
    return b"data: " + orjson.dumps(payload) + b"\n\n"


@st.composite
def streams(draw: st.DrawFn, oversized: bool = False) -> tuple[list[bytes], list[int]]:
    """vLLM's events for n choices, interleaved as the engine steps them; and where to cut.
    ``oversized``: some choice chunks (finishing ones too) are past ``max_event_bytes``."""
    n = draw(st.integers(1, 3))
    left = [draw(st.integers(0, 2 if oversized else 3)) for _ in range(n)]
    order = draw(st.permutations([i for i in range(n) for _ in range(left[i] + 1)]))
    events, done = [ROLE], [0] * n
    for choice in order:
        finish = None if done[choice] < left[choice] else "length"
        if oversized and draw(st.booleans()):
            events.append(_oversized(choice, finish, padded_head=draw(st.booleans())))
        else:
            events.append(token(choice, done[choice]) if finish is None else finishing(choice))
        done[choice] += 1
    events += [GHOST_USAGE, DONE]
    size = sum(map(len, events))
    return events, sorted(set(draw(st.lists(st.integers(1, size - 1), max_size=8 if oversized else 6))))


@pytest.mark.asyncio
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(streams())
async def test_the_ghost_hold_holds_only_finishing_chunks(stream: tuple[list[bytes], list[int]]) -> None:
    events, cuts = stream
    wire = b"".join(events)
    h = Harness(PatchConfig(ghost_usage=True))
    client = Client(chat_request(stream=True))
    sent_so_far: list[tuple[int, bytes]] = []  # (bytes of the wire sent, what the client had then)

    async def respond(scope: Scope, receive: Receive, send: Send) -> None:
        await start(send, b"text/event-stream")
        at = 0
        for cut in [*cuts, len(wire)]:
            await send({"type": "http.response.body", "body": wire[at:cut], "more_body": True})
            at = cut
            sent_so_far.append((at, client.body))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    await h.call(h.middleware(respond), client)

    stamped = {e: finishing(orjson.loads(e[6:])["choices"][0]["index"], system_fingerprint="fp-1")
               for e in events if b'"finish_reason":"' in e}
    expected = [stamped.get(e, e) for e in events if e != GHOST_USAGE]
    got = client.body.split(b"\n\n")[:-1]
    got = [e + b"\n\n" for e in got]
    assert sorted(got) == sorted(expected)  # nothing lost, added or changed but the stamp
    assert got[-1] == DONE
    passing = [e for e in expected if e not in stamped.values()]
    assert [e for e in got if e not in stamped.values()] == passing  # in their order
    for choice in {orjson.loads(e[6:])["choices"][0]["index"] for e in events if e not in (ROLE, GHOST_USAGE, DONE)}:
        mine = [e for e in expected if e not in (ROLE, DONE) and orjson.loads(e[6:])["choices"][0]["index"] == choice]
        assert [e for e in got if e in mine] == mine  # each choice in its own order
    if len(stamped) == 1:
        assert client.body == b"".join(expected)  # n = 1: byte-identical to vLLM without usage
    # Liveness: a chunk that does not finish reaches the client once its bytes are all sent.
    offset = 0
    ends = []
    for e in events:
        offset += len(e)
        ends.append(offset)
    for at, seen in sent_so_far:
        for e, end in zip(events, ends, strict=True):
            if end <= at and e in passing and e not in (DONE,):
                assert e in seen


async def _client_gets(parts: list[bytes], *, n: int = 1, max_event_bytes: int = 1 << 20) -> bytes:
    """The client's body when the upstream sends ``parts`` to a ghost-usage request."""
    h = Harness(PatchConfig(ghost_usage=True, max_event_bytes=max_event_bytes))
    client = Client(chat_request(stream=True, n=n))

    async def respond(scope: Scope, receive: Receive, send: Send) -> None:
        await start(send, b"text/event-stream")
        for part in parts:
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    await h.call(h.middleware(respond), client)
    return client.body


def _oversized(index: int, finish: str | None, *, padded_head: bool = False) -> bytes:
    """A choice's chunk of over 250 bytes; ``padded_head``: a long field before its ``choices``."""
    choice = {"index": index, "delta": {"content": "x" * 200}, "finish_reason": finish}
    head = {"x_padding": "y" * 200} if padded_head else {}
    payload = {**head, "id": "chatcmpl-1", "choices": [choice]}
    return b"data: " + orjson.dumps(payload) + b"\n\n"


@pytest.mark.asyncio
async def test_an_oversized_finishing_chunk_whose_start_went_out_is_not_cut_by_another_choice() -> None:
    """n=2, an event past ``max_event_bytes`` goes out in parts: once its start went out, its
    rest (here with the finish_reason) follows it. Before, the rest was held for the usage
    chunk, and choice 1's chunk landed inside choice 0's: the client read broken JSON."""
    big = _oversized(0, "length")
    body = await _client_gets([ROLE, big[:50], big[50:120], big[120:], token(1, 0), finishing(1), GHOST_USAGE, DONE],
                              n=2, max_event_bytes=64)
    assert body == ROLE + big + token(1, 0) + finishing(1, system_fingerprint="fp-1") + DONE


@pytest.mark.asyncio
async def test_an_oversized_chunk_held_in_part_is_held_whole() -> None:
    """n=2, choice 0's finishing chunk is held; choice 1's oversized chunk goes out in parts, the
    first without its ``choices``: it is held, and so is the rest of it, in one piece."""
    big = _oversized(1, None, padded_head=True)
    body = await _client_gets([ROLE, finishing(0), big[:50], big[50:120], big[120:], finishing(1), GHOST_USAGE, DONE],
                              n=2, max_event_bytes=64)
    stamped = [finishing(0, system_fingerprint="fp-1"), finishing(1, system_fingerprint="fp-1")]
    assert body == ROLE + stamped[0] + big + stamped[1] + DONE


@pytest.mark.asyncio
async def test_a_finishing_chunk_with_usage_on_it_releases_what_was_held_first() -> None:
    """An upstream that puts usage on a choice's chunk (the last one's) stands the hold down:
    choice 0's finishing chunk, held until then, goes out before it, as the upstream sent it."""
    usage = {"prompt_tokens": 64, "completion_tokens": 2, "total_tokens": 66}
    body = await _client_gets([ROLE, finishing(0), finishing(1, usage=usage), DONE], n=2)
    assert body.startswith(ROLE + finishing(0))  # released, unstamped, before the chunk that stood it down
    [_, _, last, done] = sse_payloads(body)
    assert (last["choices"][0]["index"], last["usage"]["prompt_tokens"], done) == (1, 64, "[DONE]")


@pytest.mark.asyncio
async def test_a_finishing_chunk_that_has_a_fingerprint_gets_no_second_one() -> None:
    """An upstream that stamps every chunk (as OpenAI does): the client gets it unchanged,
    never a duplicate ``system_fingerprint`` key."""
    stamped = finishing(0, system_fingerprint="fp-1")
    assert await _client_gets([ROLE, stamped, GHOST_USAGE, DONE]) == ROLE + stamped + DONE


@pytest.mark.asyncio
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(streams(oversized=True))
async def test_every_chunk_reaches_the_client_whole_when_some_are_too_large_to_patch(
    stream: tuple[list[bytes], list[int]],
) -> None:
    """Whatever is held or passed, each event the client reads is one the upstream sent (its
    fingerprint aside), whole, and ``[DONE]`` comes last."""
    events, cuts = stream
    wire = b"".join(events)
    parts = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True)]
    body = await _client_gets(parts, n=3, max_event_bytes=250)

    def unstamped(payloads: list) -> list[bytes]:
        return sorted(orjson.dumps({k: v for k, v in p.items() if k != "system_fingerprint"})
                      if isinstance(p, dict) else b"[DONE]" for p in payloads)

    got = sse_payloads(body)
    assert got[-1] == "[DONE]"
    assert unstamped(got) == unstamped(sse_payloads(b"".join(e for e in events if e != GHOST_USAGE)))


@pytest.mark.asyncio
async def test_a_client_that_leaves_while_done_is_held_is_recorded_disconnected() -> None:
    """The upstream's ``[DONE]`` came, but held behind a finishing chunk (no usage chunk yet):
    the client never got it, so a client that leaves then did not see a completed stream."""
    h, records = Harness(PatchConfig(ghost_usage=True)), _Records()
    client = Client(chat_request(stream=True))

    async def respond(scope: Scope, receive: Receive, send: Send) -> None:
        assert (await receive())["type"] == "http.request"
        await start(send, b"text/event-stream")
        for event in (ROLE, finishing(0), DONE):
            await send({"type": "http.response.body", "body": event, "more_body": True})
        client.leave()
        assert (await receive())["type"] == "http.disconnect"

    mw = UsagePatchMiddleware(respond, ledger=h.ledger, metrics=h.metrics, config=h.config,
                              recorder=records)  # type: ignore[arg-type]
    await h.call(mw, client)
    assert client.body == ROLE
    [record] = records.records
    assert record.outcome == "disconnected"


_HEAD, _TAIL = GHOST_USAGE.split(b'"usage":')


@pytest.mark.asyncio
@pytest.mark.parametrize("usage_chunk", [
    GHOST_USAGE.replace(b"\n", b"\r\n"),  # sse-starlette's default line end
    GHOST_USAGE.replace(b"\n", b"\r"),
    _HEAD + b'\ndata: "usage":' + _TAIL,  # its JSON over two data lines
], ids=["crlf", "cr", "two-data-lines"])
async def test_the_usage_chunk_the_client_did_not_ask_for_is_dropped_however_the_upstream_frames_it(
    usage_chunk: bytes,
) -> None:
    """Any SSE framing an upstream may use: the usage chunk asked for on the client's behalf
    never reaches it (it was sent on, re-serialized, or the response failed)."""
    body = await _client_gets([ROLE, finishing(0), usage_chunk, DONE])
    assert body == ROLE + finishing(0, system_fingerprint="fp-1") + DONE
