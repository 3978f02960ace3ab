"""``client_receive_timeout_s``, as a state machine: the real protocol (uvicorn's httptools one,
so llhttp's parser and uvicorn's flow control) on a fake transport, in an event loop whose
clock is virtual (it jumps to the next timer when the loop would wait), fed by a client that
sends its requests in drawn pieces (split anywhere, pipelined, chunked, with
``Expect: 100-continue``) while an app reads and answers when told to.

The oracle is the rule, written from the transport's side (what bytes reached the server,
whether its reading is paused, what it wrote), not from the protocol's state: the client owes
the first header from the connection's start, a later header from its first byte, a body
from its last byte; time the server makes it wait (reading paused, a ``100 Continue`` not
sent, a header behind a response still running) is not the client's, and the client has a
whole bound from the wait's end. The connection is let go exactly when the client has owed
the same thing for the bound (aborted, a body with a reset); and otherwise only by uvicorn's
keep-alive timer (nothing owed, every request answered, no byte since the last answer) or a
``Connection: close`` request's answer. No ERROR is logged. A few sequences the search takes
long to draw (a server's wait that begins and ends between two of the protocol's timer
looks, a body in pieces, a header a byte at a time) run as scripts of the same machine.
"""

from __future__ import annotations

import asyncio
import logging
import selectors
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from uvicorn.config import Config
from uvicorn.server import ServerState

from proxy.server.client_bounds import ClientBoundsProtocol

BOUND_S = 10.0
HUNDRED = b"HTTP/1.1 100 Continue\r\n\r\n"
EPS = 1e-6
SIZES = st.sampled_from([0, 1, 300, 70_000, 200_000])  # over 64 KiB: uvicorn's reading pauses
READ_SIZE = 1 << 16  # what one read of the socket takes
LOGGERS = ("uvicorn.error", "cachetally")


class VirtualSelector(selectors.SelectSelector):
    """A selector whose wait is a jump of the virtual clock: the loop never sleeps for real."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[Any]:
        assert timeout is not None, "the loop would wait for good: nothing left to time"
        self.now += max(timeout, 0.0)
        return super().select(0)


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.clock = VirtualSelector()
        super().__init__(selector=self.clock)

    def time(self) -> float:
        return self.clock.now


class FakeTransport(asyncio.Transport):
    """A socket as the protocol sees it: what the client sent waits in the "kernel" while the
    protocol's reading is paused; the client takes every response byte at once."""

    def __init__(self, loop: VirtualLoop, protocol: asyncio.Protocol) -> None:
        super().__init__()
        self.loop, self.protocol = loop, protocol
        self.out = bytearray()
        self.kernel = bytearray()
        self.delivered = 0
        self.paused = False
        self.closing = False
        self.aborted = False
        self.closed_at: float | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self.closing:  # asyncio's drops what comes after close() too
            self.out += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self._let_go()

    def abort(self) -> None:
        self.aborted = True
        self._let_go()

    def _let_go(self) -> None:
        if not self.closing:
            self.closing, self.closed_at = True, self.loop.time()
            self.loop.call_soon(self.protocol.connection_lost, None)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False
        self.loop.call_soon(self._deliver)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol  # type: ignore[assignment]

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.protocol

    def send(self, data: bytes) -> None:
        self.kernel += data
        self._deliver()

    def _deliver(self) -> None:
        while not (self.paused or self.closing) and self.kernel:
            data = bytes(self.kernel[:READ_SIZE])
            del self.kernel[:READ_SIZE]
            self.delivered += len(data)
            self.protocol.data_received(data)


@dataclass
class Request:
    head: bytes
    body: bytes  # as sent: chunk framing included
    expect: bool
    closes: bool
    start: int = 0  # its offsets in the client's stream
    read_gate: asyncio.Event = field(default_factory=asyncio.Event)
    answer_gate: asyncio.Event = field(default_factory=asyncio.Event)
    read_whole: bool = False
    answered_at: float | None = None

    @property
    def head_end(self) -> int:
        return self.start + len(self.head)

    @property
    def end(self) -> int:
        return self.head_end + len(self.body)


def request(size: int, expect: bool, chunked: bool, closes: bool, method: bytes, blank_line: bool) -> Request:
    payload = b"x" * size
    # A blank line before a request line is skipped by the parser; the client owes a header from it.
    head = b"\r\n" * blank_line + b"%s /r HTTP/1.1\r\nHost: x\r\n" % method
    if expect:
        head += b"Expect: 100-continue\r\n"
    if closes:
        head += b"Connection: close\r\n"
    if chunked:
        head += b"Transfer-Encoding: chunked\r\n"
        cut = size // 3
        body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (payload[:cut], payload[cut:]) if p) + b"0\r\n\r\n"
    elif method == b"POST":
        head += b"Content-Length: %d\r\n" % size
        body = payload
    else:
        body = b""
    return Request(head + b"\r\n", body, expect, closes)


class ErrorsLogged(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class ClientTimeouts(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = VirtualLoop()
        asyncio.set_event_loop(self.loop)
        self.requests: list[Request] = []
        self.served = 0  # requests whose app has started
        self.errors = ErrorsLogged()
        for name in LOGGERS:  # not the root: a uvicorn.Config run before may have cut propagation
            logging.getLogger(name).addHandler(self.errors)
        # The oracle's own state: what the client owes, and since when it is the client's.
        self.owed: tuple[str, int] = ("header", 0)
        self.since = 0.0
        self.server_waits = False
        self.seen_delivered = 0

    @initialize(keep_alive_s=st.sampled_from([4.0, 25.0]), first=st.tuples(SIZES, st.booleans(), st.booleans()))
    def connect(self, keep_alive_s: float, first: tuple[int, bool, bool]) -> None:
        self.keep_alive_s = keep_alive_s
        config = Config(app=self.app, timeout_keep_alive=keep_alive_s, log_config=None, lifespan="off",
                        interface="asgi3")
        self.protocol = ClientBoundsProtocol(config=config, server_state=ServerState(), app_state={},
                                               _loop=self.loop, send_timeout_s=BOUND_S, receive_timeout_s=BOUND_S)
        self.transport = FakeTransport(self.loop, self.protocol)
        self.protocol.connection_made(self.transport)
        self.plan(*first, closes=1, method=b"POST")

    def teardown(self) -> None:
        for name in LOGGERS:
            logging.getLogger(name).removeHandler(self.errors)
        self.transport.close()  # the client leaves: each app still running ends as a disconnect
        self.settle_loop()
        for r in self.requests:
            r.read_gate.set()
            r.answer_gate.set()
        self.settle_loop()
        self.loop.close()
        asyncio.set_event_loop(None)

    async def app(self, scope: dict, receive: Any, send: Any) -> None:
        mine = self.requests[self.served]
        self.served += 1
        await mine.read_gate.wait()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            more = message["more_body"]
        mine.read_whole = True
        await mine.answer_gate.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})
        mine.answered_at = self.loop.time()

    # -- the client -----------------------------------------------------------------------

    @property
    def stream_end(self) -> int:
        return self.requests[-1].end if self.requests else 0

    @property
    def sent(self) -> int:
        return self.transport.delivered + len(self.transport.kernel)

    def sendable(self) -> int:
        """How far the client may send: a body that asked for ``100 Continue`` waits for it."""
        hundreds = self.transport.out.count(HUNDRED)
        asked = 0
        for r in self.requests:
            if r.expect:
                if r.body and asked >= hundreds:
                    return r.head_end
                asked += 1
        return self.stream_end

    @precondition(lambda self: len(self.requests) < 4 and not (self.requests and self.requests[-1].closes))
    @rule(size=SIZES, expect=st.booleans(), chunked=st.booleans(),
          closes=st.integers(0, 5), method=st.sampled_from([b"POST", b"GET"]), blank_line=st.integers(0, 3))
    def plan(self, size: int, expect: bool, chunked: bool, closes: int, method: bytes, blank_line: int = 1) -> None:
        r = request(size, expect, chunked and method == b"POST", closes == 0, method, blank_line == 0)
        r.start = self.stream_end
        self.requests.append(r)

    @precondition(lambda self: not self.transport.closing)
    @rule(share=st.one_of(st.integers(1, 3), st.integers(1, 40), st.integers(41, 250_000)))
    def send_a_piece(self, share: int) -> None:
        self.send(share)

    @precondition(lambda self: not self.transport.closing)
    @rule()
    def send_what_it_may(self) -> None:
        self.send(1 << 30)

    def send(self, most: int) -> None:
        room = self.sendable() - self.sent
        if room > 0:
            start = self.sent
            whole = b"".join(r.head + r.body for r in self.requests)
            self.transport.send(whole[start : start + min(room, most)])
            self.settle()

    # -- the app --------------------------------------------------------------------------

    @rule()
    def app_goes_on(self) -> None:
        """The first app waiting to read its body reads it; else the first that read it answers."""
        started = self.requests[: self.served]
        gate = next((r.read_gate for r in started if not r.read_gate.is_set()), None)
        gate = gate or next((r.answer_gate for r in started if r.read_whole and not r.answer_gate.is_set()), None)
        if gate is not None:
            gate.set()
            self.settle()

    # -- time -----------------------------------------------------------------------------

    @rule(seconds=st.one_of(st.floats(0.01, 0.4 * BOUND_S), st.floats(0.01, 0.4 * BOUND_S),
                            st.sampled_from([0.75 * BOUND_S, BOUND_S - 0.01, BOUND_S, BOUND_S + 0.01, 2.5 * BOUND_S])))
    def wait(self, seconds: float) -> None:
        if self.transport.closing:
            return
        start, end = self.loop.time(), self.loop.time() + seconds
        due, how = self.next_let_go()
        self.loop.run_until_complete(asyncio.sleep(seconds))
        closed_at = self.transport.closed_at
        if due is None or due > end + EPS:
            assert closed_at is None, f"let go at {closed_at} ({self.describe()})"
        elif due < end - EPS:
            assert closed_at is not None, f"held past {due} for {how} ({self.describe()})"
            assert abs(closed_at - due) < EPS, f"let go at {closed_at}, not {due}, for {how}"
            # The bound aborts (over TLS a close waits 30 s more for the client); keep-alive is uvicorn's close.
            assert self.transport.aborted == (how != "keep-alive"), f"{how}: aborted={self.transport.aborted}"
        assert start <= self.loop.time()

    # -- the oracle -----------------------------------------------------------------------

    def settle_loop(self) -> None:
        async def turns() -> None:
            for _ in range(40):
                await asyncio.sleep(0)

        self.loop.run_until_complete(turns())

    def settle(self) -> None:
        closed_before = self.transport.closing
        self.settle_loop()
        self.observe()
        if self.transport.closing and not closed_before:  # let go by something just done
            closer = next((r for r in self.requests if r.closes), None)
            assert closer is not None and closer.answered_at is not None, f"let go ({self.describe()})"

    def observe(self) -> None:
        now, delivered = self.loop.time(), self.transport.delivered
        owed = self.owed_at(delivered)
        waits = self.server_waiting(owed)
        if owed != self.owed:
            self.since = 0.0 if owed == ("header", 0) else now
        elif owed[0] == "body" and delivered != self.seen_delivered:
            self.since = now  # a read
        if self.server_waits and not waits:
            self.since = now  # a whole bound from the wait's end
        self.owed, self.server_waits, self.seen_delivered = owed, waits, delivered

    def owed_at(self, delivered: int) -> tuple[str, int]:
        for i, r in enumerate(self.requests):
            if r.start < delivered < r.head_end or (delivered == r.start == 0):
                return ("header", i)
            if r.head_end <= delivered < r.end:
                return ("body", i)
        if delivered == 0:
            return ("header", 0)
        return ("nothing", sum(r.end <= delivered for r in self.requests))

    def server_waiting(self, owed: tuple[str, int]) -> bool:
        what, i = owed
        if what == "header":
            return any(r.answered_at is None for r in self.requests[:i])
        if what == "body":
            r = self.requests[i]
            hundreds = self.transport.out.count(HUNDRED)
            rank = sum(q.expect for q in self.requests[:i])
            return self.transport.paused or (r.expect and hundreds <= rank)
        return False

    def next_let_go(self) -> tuple[float | None, str]:
        what, i = self.owed
        if what != "nothing":
            return (None, what) if self.server_waits else (self.since + BOUND_S, what)
        complete = self.requests[:i]
        if complete and all(r.answered_at is not None for r in complete):
            idle_since = max(r.answered_at for r in complete)  # type: ignore[type-var]
            return idle_since + self.keep_alive_s, "keep-alive"
        return None, what

    def describe(self) -> str:
        return (f"t={self.loop.time():.3f} owed={self.owed} since={self.since:.3f} server_waits={self.server_waits} "
                f"delivered={self.transport.delivered} paused={self.transport.paused}")

    @invariant()
    def no_error_is_logged(self) -> None:
        assert not self.errors.records, [r.getMessage() for r in self.errors.records]


ClientTimeouts.TestCase.settings = settings(max_examples=400, stateful_step_count=40, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
test_client_timeouts = ClientTimeouts.TestCase


def run(script: Callable[[ClientTimeouts], None]) -> None:
    machine = ClientTimeouts()
    try:
        script(machine)
    finally:
        machine.teardown()


def whole_first_and_a_header_piece(m: ClientTimeouts) -> None:
    m.send(len(m.requests[0].head) + len(m.requests[0].body) + 5)


# Sequences the search above takes long to draw, each asserted by the same oracle: a server's
# wait that begins and ends between two of the timer's looks, or that spans them.
SCRIPTS: dict[str, Callable[[ClientTimeouts], None]] = {
    "a body behind paused reading has a whole bound from the app's read": lambda m: (
        m.connect(keep_alive_s=25.0, first=(200_000, False, False)), m.send(100_000), m.wait(25.0),
        m.app_goes_on(), m.wait(BOUND_S - 0.01), m.wait(0.02)),
    "a client has a whole bound from its 100 Continue": lambda m: (
        m.connect(keep_alive_s=25.0, first=(300, True, False)), m.send_what_it_may(), m.wait(0.9 * BOUND_S),
        m.app_goes_on(), m.wait(BOUND_S - 0.01), m.send_what_it_may(), m.app_goes_on(), m.app_goes_on(),
        m.wait(30.0)),
    "a pipelined header has a whole bound from the answer before it, keep-alive or not": lambda m: (
        m.connect(keep_alive_s=4.0, first=(1, False, False)), m.plan(1, False, False, 1, b"POST"),
        whole_first_and_a_header_piece(m), m.wait(0.5 * BOUND_S), m.app_goes_on(), m.app_goes_on(),
        m.wait(0.75 * BOUND_S), m.wait(0.3 * BOUND_S)),
    "a body is timed between two reads": lambda m: (
        m.connect(keep_alive_s=25.0, first=(300, False, False)), m.send(len(m.requests[0].head) + 100),
        m.wait(0.6 * BOUND_S), m.send(100), m.wait(0.6 * BOUND_S), m.send(50), m.wait(0.6 * BOUND_S),
        m.send(50), m.app_goes_on(), m.app_goes_on(), m.wait(30.0)),
    "a chunked body that stalls in a chunk-size line is reset": lambda m: (
        m.connect(keep_alive_s=25.0, first=(300, False, True)), m.send(len(m.requests[0].head) + 1),
        m.app_goes_on(), m.wait(BOUND_S - 0.01), m.wait(0.02)),
    "a header sent a byte at a time, whole within the bound": lambda m: (
        m.connect(keep_alive_s=25.0, first=(0, False, False)),
        *[(m.send(1), m.wait(BOUND_S / 100)) for _ in m.requests[0].head], m.app_goes_on(), m.app_goes_on(),
        m.wait(30.0)),
    "a header trickled past the bound is closed at the bound": lambda m: (
        m.connect(keep_alive_s=25.0, first=(0, False, False)),
        *[(m.send(1), m.wait(BOUND_S / 10)) for _ in range(15)]),
    "a blank line between requests owes a header": lambda m: (
        m.connect(keep_alive_s=25.0, first=(1, False, False)), m.send_what_it_may(), m.app_goes_on(),
        m.app_goes_on(), m.plan(1, False, False, 1, b"POST", blank_line=0), m.send(2),
        m.wait(BOUND_S - 0.01), m.wait(0.02)),
}


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_drawn_sequence(name: str) -> None:
    run(SCRIPTS[name])
