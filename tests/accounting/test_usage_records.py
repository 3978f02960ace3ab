"""Usage records: one per request, whatever its end; completion tokens up to a disconnect;
the JSONL sink's rotation, cut-back and graceful stop; bounded queues and counted drops.

Requests run through the real app and the sim engine, in process, at the message level
(scripted ``receive``, list-collecting ``send``): that is where a disconnect can be placed
after an exact number of events. Records are read back from the JSONL files the real sink
wrote, after the app's graceful stop.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import json
import logging
import os
import re
import stat
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_adapter.events import Scheduled, current_request_key
from proxy.accounting.metrics import Metrics
from proxy.accounting.records.jsonl import JsonlSink
from proxy.accounting.records.queue import Delivery, DropCounts, SinkWorker
from proxy.accounting.records.record import MAX_TEXT_CHARS, UsageRecord, dumps
from proxy.asgi.errors import error_sse_event
from proxy.patching.context import PatchConfig
from proxy.patching.ledger import UsageLedger
from proxy.patching.middleware import UsagePatchMiddleware
from proxy.server.app import CachetallyApp
from proxy.server.settings import Settings
from tests.servers import metric_value


def read_records(directory: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for path in sorted(directory.glob("*.jsonl")) for line in path.read_bytes().splitlines()]


class Exchange:
    """One request at the message level; the client hangs up after ``hang_up_after`` body messages."""

    def __init__(self, body: dict[str, Any] | bytes, hang_up_after: int | None = None, path: str = "/v1/chat/completions",
                 half_body: bool = False, leave_after_s: float | None = None,
                 headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        self.headers = list(headers)
        raw = body if isinstance(body, bytes) else orjson.dumps(body)
        self.path, self.raw, self.half = path, raw, half_body
        self.hang_up_after = hang_up_after
        self.leave_after_s = leave_after_s  # hang up this long after the body went
        self.messages: list[dict[str, Any]] = []
        self.gone = asyncio.Event()
        self._sent_body = False

    def scope(self) -> dict[str, Any]:
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": "POST", "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
                "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
                "headers": [(b"content-type", b"application/json"), (b"x-request-id", b"req-1"),
                            (b"content-length", str(len(self.raw)).encode()), *self.headers]}

    async def receive(self) -> dict[str, Any]:
        if not self._sent_body:
            self._sent_body = True
            if self.leave_after_s is not None:
                asyncio.get_running_loop().call_later(self.leave_after_s, self.gone.set)
            if self.half:
                return {"type": "http.request", "body": self.raw[: len(self.raw) // 2], "more_body": True}
            return {"type": "http.request", "body": self.raw, "more_body": False}
        if self.half:
            return {"type": "http.disconnect"}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        bodies = sum(m["type"] == "http.response.body" for m in self.messages)
        if self.hang_up_after is not None and bodies >= self.hang_up_after:
            self.gone.set()

    def events(self) -> list[Any]:
        data = b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")
        return [orjson.loads(e[6:]) for e in data.split(b"\n\n") if e.startswith(b"data: {")]


async def serve(tmp_path: Path, *exchanges: Exchange, **settings: Any) -> tuple[list[dict[str, Any]], str]:
    values = {"engine": "sim", "usage_dir": str(tmp_path / "usage"), "sim_token_delay_s": 0.002, **settings}
    app = CachetallyApp(Settings(**values).validate())
    async with app.running():
        for exchange in exchanges:
            await app(exchange.scope(), exchange.receive, exchange.send)
        metrics = app.metrics.exposition().decode()
    return read_records(tmp_path / "usage"), metrics


def tokens_seen(events: list[Any]) -> int:
    """An oracle independent of the responder: choice events that carry generated text."""
    return sum(
        1 for e in events for c in e.get("choices", [])
        if c.get("text") is not None or (c.get("delta", {}).get("content") and "role" not in c["delta"])
    )


CHAT = {"messages": [{"role": "user", "content": "count these tokens please"}], "max_tokens": 40, "stream": True}


@pytest.mark.asyncio
async def test_a_stream_cut_by_the_client_records_the_tokens_sent_until_then(tmp_path: Path) -> None:
    cut = Exchange(CHAT, hang_up_after=8)
    records, metrics = await serve(tmp_path, cut)
    [record] = records
    sent = tokens_seen(cut.events())
    assert 0 < sent < 40
    assert record["outcome"] == "disconnected" and record["status"] == 200
    assert (record["completion_tokens"], record["completion_source"]) == (sent, "stream")
    assert record["prompt_tokens"] > 0 and record["cached_tokens"] == 0 and record["source"] == "engine"
    assert record["request_id"] == "req-1" and record["tenant"] == "default" and record["stream"] is True
    assert metric_value(metrics, "cachetally_completion_tokens_total") == sent
    assert record["response_id"].startswith("chatcmpl-") and record["ttft_s"] > 0
    assert "count these tokens" not in orjson.dumps(record).decode()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {**CHAT, "max_tokens": 7, "n": 2}),
        ("/v1/completions", {"prompt": ["one prompt", "and another one"], "max_tokens": 5, "stream": True}),
        ("/v1/completions", {"prompt": "plain", "max_tokens": 6, "stream": True}),
    ],
)
async def test_counted_stream_tokens_equal_the_engines_usage(tmp_path: Path, path: str, body: dict[str, Any]) -> None:
    with_usage = Exchange({**body, "stream_options": {"include_usage": True}}, path=path)
    without = Exchange(body, path=path)
    records, _ = await serve(tmp_path, with_usage, without)
    usage = with_usage.events()[-1]["usage"]["completion_tokens"]
    assert [(r["completion_tokens"], r["completion_source"]) for r in records] == [(usage, "usage"), (usage, "stream")]
    assert all(r["outcome"] == "completed" for r in records)


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
async def test_a_json_request_whose_client_leaves_while_it_decodes_is_disconnected(tmp_path: Path, path: str) -> None:
    """The engine answers a non-streaming request whose client left (vLLM: a 200 ``null``
    into the closed socket); the record says the client left, and bills the prompt the
    engine scheduled, with nothing delivered."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60} if "chat" in path else {
        "input": "hi", "max_output_tokens": 60}
    cut = Exchange(body, path=path, leave_after_s=0.03)  # the decode takes 60 x 2 ms
    records, _ = await serve(tmp_path, cut)
    [record] = records
    assert (record["outcome"], record["completion_tokens"], record["completion_source"]) == (
        "disconnected", 0, "none")
    assert record["prompt_tokens"] > 0 and record["source"] == "engine"


@pytest.mark.parametrize(("first_prefilled", "prompt"), [(False, 927), (True, 300 + 927)])
def test_a_request_cut_before_its_prefill_ended_is_billed_its_prompt_with_its_cache_unknown(
        first_prefilled: bool, prompt: int) -> None:
    """vLLM reports nothing for a request aborted before its prefill ended; its tap announced
    the prompt when vLLM added it (``EventSink.added``). The client leaves before any byte: the
    record bills that prompt (with any other prompt of the request, prefilled before, once),
    its cache unknown, never 0; the counters count it as its record says, one request of
    unknown cache, whose prompt stays out of the hit rate's terms."""
    async def inner(scope: Any, receive: Any, send: Any) -> None:
        key = current_request_key.get()
        assert key is not None
        await receive()  # the body
        if first_prefilled:
            ledger.added(key, 300)
            ledger.publish(Scheduled(key, prompt_tokens=300, cached_tokens=256))
        ledger.added(key, 927)  # added, its prefill not ended
        await receive()  # the client leaves: vLLM aborts the request

    kept, ledger = _Kept(), UsageLedger()
    metrics = Metrics(ledger)
    mw = UsagePatchMiddleware(inner, ledger=ledger, metrics=metrics, recorder=kept)  # type: ignore[arg-type]
    exchange = Exchange({"messages": [{"role": "user", "content": "hi"}], "stream": True}, leave_after_s=0.01)
    asyncio.run(mw(exchange.scope(), exchange.receive, exchange.send))
    [record] = kept.records
    assert (record.outcome, record.prompt_tokens, record.cached_tokens, record.source) == (
        "disconnected", prompt, None, "engine")
    text = metrics.exposition().decode()
    assert metric_value(text, "cachetally_requests_total", cache="unknown") == 1
    assert metric_value(text, "cachetally_requests_total") == 1
    assert metric_value(text, "cachetally_prompt_tokens_total") == 0
    assert metric_value(text, "cachetally_cached_tokens_total") == 0


@pytest.mark.asyncio
@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {**CHAT, "n": 2}),
    ("/v1/completions", {"prompt": ["one prompt", "and another one"], "max_tokens": 5}),
    ("/v1/responses", {"input": "hi there", "max_output_tokens": 5}),
    ("/v1/messages", {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                      "stream": True}),
])
async def test_a_request_whose_client_leaves_during_the_sims_prefill_bills_its_prompt_with_its_cache_unknown(
        tmp_path: Path, path: str, body: dict[str, Any]) -> None:
    """The sim announces each prompt on arrival and schedules it after its prefill time, as
    vLLM's tap: a client gone in between leaves the prompt the same request bills when it
    completes (every prompt of it, once), its cache unknown, and its prompt out of the counters."""
    cut = Exchange(body, path=path, leave_after_s=0.01)
    whole = Exchange(body, path=path)
    records, metrics = await serve(tmp_path, cut, whole, sim_prefill_delay_s=0.3)
    assert [(r["outcome"], r["cached_tokens"], r["completion_tokens"]) for r in records] == [
        ("disconnected", None, 0), ("completed", 0, records[1]["completion_tokens"])]
    assert records[0]["prompt_tokens"] == records[1]["prompt_tokens"] > 0
    assert metric_value(metrics, "cachetally_requests_total", cache="unknown") == 1
    assert metric_value(metrics, "cachetally_prompt_tokens_total") == records[1]["prompt_tokens"]


@pytest.mark.parametrize(("steps", "outcome"), [
    (["whole", "left"], "completed"),  # the app read the ordinary disconnect after its answer
    (["left", "whole"], "disconnected"),  # vLLM's 200 null after the client left
    (["error event", "left"], "error"),  # a stream that failed, then lost its client
    (["left"], "disconnected"),
    ([], "error"),  # the server side ended it while the client was there
])
def test_the_outcome_follows_who_ended_the_request_first(steps: list[str], outcome: str) -> None:
    from proxy.accounting.records.notes import RequestNotes

    notes = RequestNotes("chat")
    for step in steps:
        if step == "whole":
            notes.body(b"{}", False)
        elif step == "left":
            notes.client_left()
        else:
            notes.sse_events(b'data: {"error": {"message": "engine failed"}}\n\n')
    assert notes.outcome(200) == outcome


@pytest.mark.asyncio
async def test_every_end_leaves_exactly_one_record(tmp_path: Path) -> None:
    exchanges = [
        Exchange({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),  # JSON, completed
        Exchange(b"{not json"),  # refused by the middleware: 400
        Exchange({"prompt": "x", "max_tokens": -1}, path="/v1/completions"),  # refused by the engine: 400
        Exchange(CHAT, half_body=True),  # client gone before its body was complete
        Exchange(CHAT, hang_up_after=1),  # client gone after the headers
    ]
    records, metrics = await serve(tmp_path, *exchanges)
    summary = [(r["outcome"], r["status"], r["completion_source"]) for r in records]
    assert summary == [
        ("completed", 200, "usage"),
        ("error", 400, "none"),
        ("error", 400, "none"),
        ("disconnected", None, "none"),
        ("disconnected", 200, "stream"),
    ]
    assert records[0]["completion_tokens"] == 3 and records[1]["prompt_tokens"] is None
    for family in ("prompt", "cached", "completion"):
        total = sum(r[f"{family}_tokens"] or 0 for r in records)
        assert total == metric_value(metrics, f"cachetally_{family}_tokens_total",
                                     **({"tier": "all"} if family == "cached" else {}))


@pytest.mark.asyncio
async def test_a_streamed_request_the_engine_refuses_is_recorded_as_streamed(tmp_path: Path) -> None:
    """``stream`` is what the client asked for, also when the answer is a JSON error."""
    refused = Exchange({"prompt": "x", "max_tokens": -1, "stream": True}, path="/v1/completions")
    records, _ = await serve(tmp_path, refused)
    [record] = records
    assert (record["status"], record["outcome"], record["stream"]) == (400, "error", True)

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.asyncio
async def test_the_record_carries_the_clients_traceparent_only_when_the_whole_header_is_one(tmp_path: Path) -> None:
    """A record joins the client's trace by its W3C ``traceparent``; a header that only
    contains one (two joined by a comma, a prefix, a version-00 value with a fifth field) is
    not one, and its text never reaches the billing record."""
    sent = [TRACEPARENT, TRACEPARENT + "," + TRACEPARENT, "x" + TRACEPARENT, TRACEPARENT + "-00",
            TRACEPARENT + ";tenant=someone-else"]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    records, _ = await serve(tmp_path, *(Exchange(body, headers=((b"traceparent", v.encode()),)) for v in sent))
    assert [r["traceparent"] for r in records] == [TRACEPARENT, None, None, None, None]
    assert all(r["outcome"] == "completed" for r in records)  # refused as a trace, billed as a request


@pytest.mark.asyncio
async def test_a_prefix_cache_hit_is_recorded_and_counted_in_the_engines_own_tier(tmp_path: Path) -> None:
    """The sim's hits are all in its own prefix cache: the record bills them as ``local``, never
    as a KV connector's (``external``), and the tier counters say the same."""
    body = {"messages": [{"role": "user", "content": "a prompt long enough to fill a cache block " * 8}],
            "max_tokens": 2}
    records, metrics = await serve(tmp_path, Exchange(body), Exchange(body))
    hit = records[1]
    assert hit["cached_tokens"] > 0
    assert (hit["local_cached_tokens"], hit["external_cached_tokens"]) == (hit["cached_tokens"], 0)
    assert metric_value(metrics, "cachetally_cached_tokens_total", tier="local") == hit["cached_tokens"]
    assert metric_value(metrics, "cachetally_cached_tokens_total", tier="external") == 0

# -- the JSONL sink and the queue in front of it ---------------------------------------------


def record(n: int) -> UsageRecord:
    return UsageRecord(request_id=f"r{n}", tenant="t", route="chat", stream=False, start_unix=1.7e9, end_unix=1.7e9 + 1,
                       prompt_tokens=100, cached_tokens=n, completion_tokens=5)


def test_files_rotate_by_size_and_hold_every_record_once(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path, max_file_bytes=4096)
    for start in range(0, 200, 7):
        sink.write([record(n) for n in range(start, min(start + 7, 200))])
    sink.close()
    assert len(sink.paths) > 5
    assert all(p.stat().st_size <= 4096 for p in sink.paths)
    assert [r["request_id"] for r in read_records(tmp_path)] == [f"r{n}" for n in range(200)]


def test_a_file_is_filled_up_to_its_limit_exactly_before_the_next_one_starts(tmp_path: Path) -> None:
    """The limit is the most a file holds: two records that make it exactly stay together,
    and the third starts the next file."""
    records = [record(1) for _ in range(3)]
    size = len(dumps(records[0]))
    assert {len(dumps(r)) for r in records} == {size}
    sink = JsonlSink(tmp_path, max_file_bytes=2 * size)
    for rec in records:
        assert sink.write([rec]).written == 1
    sink.close()
    assert [p.stat().st_size for p in sink.paths] == [2 * size, size]


def test_each_figure_of_a_record_is_written_under_its_own_name(tmp_path: Path) -> None:
    """The JSONL line is the bill: every figure under its own key, the cache tiers not
    mixed up, durations to the microsecond (a 1.5 ms TTFT is not 0)."""
    rec = UsageRecord(request_id="r1", tenant="acme", route="chat", stream=True, start_unix=1.7e9,
                      end_unix=1.7e9 + 0.001234, model="m", request_model="asked", response_id="chatcmpl-1",
                      status=200, outcome="completed", prompt_tokens=100, cached_tokens=48, local_cached_tokens=32,
                      external_cached_tokens=16, cache_creation_tokens=52, source="engine", completion_tokens=7,
                      completion_source="usage", ttft_s=0.0015,
                      traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    sink = JsonlSink(tmp_path)
    sink.write([rec])
    sink.close()
    [line] = read_records(tmp_path)
    for name in ("record_id", "request_id", "tenant", "model", "request_model", "response_id", "route", "stream",
                 "status", "outcome", "prompt_tokens", "cached_tokens", "local_cached_tokens",
                 "external_cached_tokens", "cache_creation_tokens", "source", "completion_tokens",
                 "completion_source", "ttft_s", "traceparent"):
        assert line[name] == getattr(rec, name), name
    assert line["duration_s"] == 0.001234
    assert (line["start_time"], line["end_time"]) == ("2023-11-14T22:13:20Z", "2023-11-14T22:13:20.001234Z")

def test_a_failed_write_is_cut_back_and_retried_never_duplicated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = os.write
    failures = iter([True, False, False])

    def flaky(fd: int, data: Any) -> int:
        if next(failures, False):
            real_write(fd, bytes(data[: len(data) // 2]))  # a torn half line reaches the disk
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    drops = DropCounts()
    worker = SinkWorker(JsonlSink(tmp_path), drops, max_queued=100, interval_s=0.01)
    monkeypatch.setattr("proxy.accounting.records.jsonl.os.write", flaky)
    worker.submit(record(1))
    worker.submit(record(2))
    worker.start()
    worker.submit(record(3))
    assert worker.stop(timeout_s=5)
    assert sorted(r["request_id"] for r in read_records(tmp_path)) == ["r1", "r2", "r3"]
    assert drops.snapshot() == {}


def test_a_batch_over_the_limit_retried_after_a_failed_write_leaves_no_empty_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch larger than the limit gets a file of its own; when its first write fails the
    file is cut back to nothing, and the retry goes into that same file, not a second one."""
    real_write = os.write
    failures = iter([True])

    def flaky(fd: int, data: Any) -> int:
        if next(failures, False):
            real_write(fd, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr("proxy.accounting.records.jsonl.os.write", flaky)
    sink = JsonlSink(tmp_path, max_file_bytes=64)
    batch = [record(1), record(2)]
    assert len(sink.write(batch).retry) == 2
    assert sink.write(batch).written == 2
    sink.close()
    assert [p.name for p in sorted(tmp_path.iterdir())] == [sink.paths[0].name]
    assert [r["request_id"] for r in read_records(tmp_path)] == ["r1", "r2"]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc")
def test_a_new_file_whose_name_cannot_be_made_durable_is_removed_and_the_batch_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory's ``fsync`` (the new file's name) fails: the empty file goes, not one
    more empty file per retry, and the retry writes the batch into a file of its own."""
    real_fsync, fsyncs = os.fsync, iter([True])  # the first is the directory's

    def failing_once(fd: int) -> None:
        if next(fsyncs, False):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr("proxy.accounting.records.jsonl.os.fsync", failing_once)
    gc.collect()  # no earlier test's socket closed by the collector in between
    descriptors = len(os.listdir("/proc/self/fd"))
    sink = JsonlSink(tmp_path)
    batch = [record(1), record(2)]
    failed = sink.write(batch)
    # The cause the log gives (not a write to the closed descriptor's EBADF, or to whatever reused its number).
    assert (len(failed.retry), failed.detail) == (2, f"{tmp_path}: Input/output error")
    assert sink.write(batch).written == 2
    sink.close()
    assert len(os.listdir("/proc/self/fd")) == descriptors  # neither file's nor the directory's left open
    files = sorted(tmp_path.iterdir())
    assert len(files) == 1
    assert [r["request_id"] for r in read_records(tmp_path)] == ["r1", "r2"]
    assert stat.S_IMODE(files[0].stat().st_mode) & 0o007 == 0  # records are no other user's to read


def test_records_whose_fsync_failed_are_unconfirmed_even_if_a_later_fsync_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linux reports a failed writeback once: the next ``fsync`` succeeds whether or not the
    bytes reached the disk. When the file cannot be cut back either, the batch is counted
    ``unconfirmed`` (dropped, never offered again), not written."""
    real_fsync, fsyncs = os.fsync, iter([False, True])  # the directory's, then the batch's

    def failing_once(fd: int) -> None:
        if next(fsyncs, False):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    def no_cut(fd: int, size: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr("proxy.accounting.records.jsonl.os.fsync", failing_once)
    monkeypatch.setattr("proxy.accounting.records.jsonl.os.ftruncate", no_cut)
    drops, written = DropCounts(), []
    worker = SinkWorker(JsonlSink(tmp_path), drops, max_queued=10, interval_s=0.01)
    worker.on_written = written.append
    worker.submit(record(1))
    worker.submit(record(2))
    assert worker.stop(timeout_s=5)
    assert (written, drops.snapshot()) == ([], {("jsonl", "unconfirmed"): 2})


def test_a_record_whose_line_went_in_but_its_newline_is_written_once_not_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills one byte short of the first line and the cut back fails: that line's
    JSON object is whole in the file, so it counts written there (after an ``fsync``), and
    only the second record is offered again; offered again, it would be in two files."""
    real_write, writes = os.write, iter(["short", "full"])

    def one_byte_short(fd: int, data: Any) -> int:
        fault = next(writes, None)
        if fault == "short":  # as the kernel does: the bytes that fit, then ENOSPC
            return real_write(fd, bytes(data[: len(dumps(record(1))) - 1]))
        if fault == "full":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    def no_cut(fd: int, size: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr("proxy.accounting.records.jsonl.os.write", one_byte_short)
    monkeypatch.setattr("proxy.accounting.records.jsonl.os.ftruncate", no_cut)
    sink = JsonlSink(tmp_path)
    first = sink.write([record(1), record(2)])
    assert (first.written, [r.request_id for r in first.retry]) == (1, ["r2"])
    assert sink.write(first.retry).written == 1
    sink.close()
    assert sorted(r["request_id"] for r in read_records(tmp_path)) == ["r1", "r2"]


def test_a_process_that_finds_its_file_name_taken_never_writes_into_that_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A container restarted within the second gets the same pid, so the same first file
    name: the file its predecessor wrote is left as it was, and the records go to the next."""
    monkeypatch.setattr("proxy.accounting.records.jsonl.time.strftime", lambda fmt, t: "20261126T000000Z")
    taken = tmp_path / f"usage-20261126T000000Z-{os.getpid()}-0001.jsonl"
    taken.write_bytes(dumps(record(0)))
    before = taken.read_bytes()
    sink = JsonlSink(tmp_path)
    first = sink.write([record(1)])  # the name is taken: offered again at the next interval
    second = sink.write(first.retry)
    sink.close()
    assert taken.read_bytes() == before
    assert (first.written, second.written) == (0, 1)
    assert [r["request_id"] for r in read_records(tmp_path)] == ["r0", "r1"]


def test_a_full_queue_drops_and_counts_and_logs_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    drops = DropCounts(clock=lambda: now[0])

    class Stuck:
        name, failure = "stuck", "write_failed"

        def write(self, batch: list[UsageRecord]) -> Delivery:
            raise AssertionError("never started")

        def close(self) -> None: ...

    worker = SinkWorker(Stuck(), drops, max_queued=3, interval_s=1)
    caplog.set_level(logging.WARNING, "cachetally.records")
    for n in range(10):
        worker.submit(record(n))
        now[0] += 10
    assert drops.snapshot() == {("stuck", "queue_full"): 7}
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["usage records dropped: 1 (stuck: queue_full)", "usage records dropped: 6 (stuck: queue_full)"]


def test_records_kept_for_a_retry_count_against_the_queues_bound() -> None:
    """A sink that could not deliver (a full disk) keeps its batch for the next interval: those
    records are still waiting, so they fill the bound, and what comes past it is dropped and
    counted rather than held beyond ``max_queued``."""
    class FullDisk:
        name, failure = "full", "write_failed"

        def __init__(self) -> None:
            self.full, self.records = True, []

        def write(self, batch: list[UsageRecord]) -> Delivery:
            if self.full:
                return Delivery(retry=list(batch), detail="ENOSPC")
            self.records.extend(batch)
            return Delivery(written=len(batch))

        def close(self) -> None: ...

    sink, drops = FullDisk(), DropCounts()
    worker = SinkWorker(sink, drops, max_queued=3, interval_s=3600)
    for n in range(3):
        worker.submit(record(n))
    worker.flush()  # the thread's step: nothing delivered, all three kept for a retry
    for n in range(3, 5):
        worker.submit(record(n))
    assert drops.snapshot() == {("full", "queue_full"): 2}
    sink.full = False
    worker.flush()
    assert [r.request_id for r in sink.records] == ["r0", "r1", "r2"]

def test_an_unwritable_directory_drops_at_stop_and_never_hangs(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the directory should be")
    drops = DropCounts()
    worker = SinkWorker(JsonlSink(blocker / "usage"), drops, max_queued=4, interval_s=0.01)
    worker.start()
    for n in range(6):
        worker.submit(record(n))
    assert worker.stop(timeout_s=5)
    snapshot = drops.snapshot()
    assert sum(snapshot.values()) == 6
    assert set(snapshot) <= {("jsonl", "queue_full"), ("jsonl", "write_failed")}


# -- stream token events counted however the engine's bytes are cut --------------------------


def _chat_stream(tokens: int, choices: int, include_usage: bool, crlf: bool, error: str | None = None) -> bytes:
    """A vLLM-shaped chat stream: role events, one event per token per choice, usage, [DONE].
    ``error``: the stream fails after its tokens, and the usage chunk is replaced by an error
    event as vLLM writes it (Python's ``json``) or as cachetally's upstream relay does (orjson)."""
    nl = b"\r\n" if crlf else b"\n"

    def event(payload: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps({"id": "chatcmpl-9", "model": "m", **payload}) + nl + nl

    out = [event({"choices": [{"index": i, "delta": {"role": "assistant", "content": ""}}]}) for i in range(choices)]
    for k in range(tokens):
        for i in range(choices):
            text = 'data: {"role": x}\n\n' if k % 3 == 0 else f" t{k}"  # generated text that looks like SSE
            out.append(event({"choices": [{"index": i, "delta": {"content": text}, "finish_reason": None}]}))
    if error is not None:
        failure = {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}}
        data = json.dumps(failure).encode() if error == "vllm" else orjson.dumps(failure)
        out.append(b"data: " + data + nl + nl)
    elif include_usage:
        usage = {"prompt_tokens": 9, "completion_tokens": tokens * choices, "total_tokens": 9 + tokens * choices}
        out.append(event({"choices": [], "usage": usage}))
    return b"".join(out) + b"data: [DONE]" + nl + nl


def _cut(stream: bytes, cuts: list[int] | None) -> list[bytes]:
    """``stream`` cut at ``cuts``; ``None``: one event per piece, as engines send them."""
    if cuts is None:
        return re.findall(rb".*?(?:\r\n\r\n|\n\n)", stream, re.S)
    bounds = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    return [stream[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


class _Kept:
    """A recorder that keeps what it is given."""

    def __init__(self) -> None:
        self.records: list[UsageRecord] = []

    def submit(self, record: UsageRecord) -> None:
        self.records.append(record)


def _streaming(pieces: list[bytes]) -> Any:
    """An app that streams ``pieces`` as one SSE response."""
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for piece in pieces:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def _record_of(pieces: list[bytes], include_usage: bool, ghost: bool, path: str = "/v1/chat/completions") -> UsageRecord:
    kept, ledger = _Kept(), UsageLedger()
    config = PatchConfig(ghost_usage=ghost)
    mw = UsagePatchMiddleware(_streaming(pieces), ledger=ledger, metrics=Metrics(ledger), config=config, recorder=kept)  # type: ignore[arg-type]
    exchange = Exchange({"messages": [{"role": "user", "content": "hi"}], "stream": True,
                         "stream_options": {"include_usage": include_usage}}, path=path)
    asyncio.run(mw(exchange.scope(), exchange.receive, exchange.send))
    [record] = kept.records
    return record


#: Chat streams of 0 to 12 tokens for 1 to 3 choices, LF or CRLF, cut anywhere or per event.
STREAMS = {
    "tokens": st.integers(0, 12),
    "choices": st.integers(1, 3),
    "crlf": st.booleans(),
    "cuts": st.none() | st.lists(st.integers(1, 4000), max_size=40),
}


@settings(max_examples=60, deadline=None)
@given(**STREAMS)
def test_stream_token_events_are_counted_the_same_however_the_bytes_are_cut(
    tokens: int, choices: int, crlf: bool, cuts: list[int] | None
) -> None:
    expected = tokens * choices
    plain = _record_of(_cut(_chat_stream(tokens, choices, False, crlf), cuts), include_usage=False, ghost=False)
    assert (plain.completion_tokens, plain.completion_source) == (expected, "stream")
    with_usage = _chat_stream(tokens, choices, True, crlf)
    for include_usage, ghost in ((True, False), (False, True)):  # the client's usage chunk, or a ghost one
        record = _record_of(_cut(with_usage, cuts), include_usage, ghost)
        assert (record.completion_tokens, record.completion_source) == (expected, "usage")


@settings(max_examples=60, deadline=None)
@given(**STREAMS, writer=st.sampled_from(["vllm", "cachetally"]))
def test_a_stream_that_fails_bills_only_its_tokens_and_is_an_error(
    tokens: int, choices: int, crlf: bool, cuts: list[int] | None, writer: str
) -> None:
    """An error event is no token, and the request failed, though the stream ends with [DONE]."""
    stream = _chat_stream(tokens, choices, False, crlf, error=writer)
    record = _record_of(_cut(stream, cuts), include_usage=False, ghost=False)
    assert (record.completion_tokens, record.completion_source, record.outcome) == (tokens * choices, "stream", "error")
    assert record.status == 200  # what was sent


@pytest.mark.parametrize("cut", [None, 7, 23, 1 << 20], ids=["per-event", "every-7-bytes", "every-23-bytes", "whole"])
def test_a_stream_whose_lines_end_in_cr_alone_has_its_tokens_counted(cut: int | None) -> None:
    """SSE allows a bare CR as the line end; a stream cut before its usage chunk is billed its
    token events however its lines end."""
    stream = _chat_stream(5, 2, include_usage=False, crlf=False).replace(b"\n", b"\r")
    pieces = re.findall(rb".*?\r\r", stream, re.S) if cut is None else [
        stream[i : i + cut] for i in range(0, len(stream), cut)]
    record = _record_of(pieces, include_usage=False, ghost=False)
    assert (record.completion_tokens, record.completion_source) == (10, "stream")

def test_a_messages_stream_that_fails_is_an_error_with_the_tokens_it_sent() -> None:
    def event(name: str, payload: dict[str, Any]) -> bytes:
        return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **payload}) + b"\n\n"

    delta = {"index": 0, "delta": {"type": "text_delta", "text": "hi"}}
    stream = [
        event("message_start", {"message": {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                                            "content": [], "usage": {"input_tokens": 9, "output_tokens": 0}}}),
        event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
        event("content_block_delta", delta), event("content_block_delta", delta),
        event("error", {"error": {"type": "api_error", "message": "boom"}}),
    ]
    record = _record_of(stream, include_usage=False, ghost=False, path="/v1/messages")
    assert (record.completion_tokens, record.completion_source, record.outcome) == (2, "stream", "error")


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_a_named_stream_ended_by_the_upstream_relays_error_is_an_error(path: str) -> None:
    """Upstream mode: the relay ends a stream whose upstream died with its own error event;
    before, it was unnamed, and these routes, which read ``event: error``, recorded the cut
    stream as ``completed``."""
    def event(name: str, payload: dict[str, Any]) -> bytes:
        return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **payload}) + b"\n\n"

    token = "content_block_delta" if path == "/v1/messages" else "response.output_text.delta"
    stream = [event(token, {"index": 0, "delta": "hi"}), event(token, {"index": 0, "delta": "hi"}),
              error_sse_event(path, 502, "Upstream server unreachable or connection lost")]
    record = _record_of(stream, include_usage=False, ghost=False, path=path)
    assert (record.completion_tokens, record.completion_source, record.outcome) == (2, "stream", "error")


@pytest.mark.parametrize("completion", [-1, True, None, "3"], ids=["negative", "true", "null", "string"])
@pytest.mark.parametrize(("include_usage", "ghost"), [(True, False), (False, True)], ids=["clients", "ghost"])
def test_a_usage_chunk_without_a_count_is_not_billed_as_a_token(completion: Any, include_usage: bool,
                                                                ghost: bool) -> None:
    """A peer's usage-only chunk whose ``completion_tokens`` is no count: the record falls
    back to the stream's token events, and that chunk is not one of them."""
    stream = _chat_stream(3, 1, include_usage=True, crlf=False)
    stream = stream.replace(b'"completion_tokens":3', b'"completion_tokens":' + orjson.dumps(completion))
    record = _record_of(_cut(stream, None), include_usage, ghost)
    assert (record.completion_tokens, record.completion_source) == (3, "stream")


def test_the_record_keeps_the_responses_id_not_a_later_one_in_the_stream() -> None:
    """The response id is the stream's first ``id``; a tool call's own ``id`` comes later,
    in a body message the model name may still be looked for in (the first was cut before
    it)."""
    def event(payload: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m",
                                         **payload}) + b"\n\n"

    call = {"index": 0, "id": "call_9", "type": "function", "function": {"name": "f", "arguments": ""}}
    stream = (event({"choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [call]}}]})
              + event({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {
                  "arguments": "{}"}}]}}]})
              + event({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}) + b"data: [DONE]\n\n")
    cut = stream.index(b'"model"')  # the first body message ends before the model name
    record = _record_of([stream[:cut], stream[cut:]], include_usage=False, ghost=False)
    assert record.response_id == "chatcmpl-1"
    # However the first event's bytes are cut, its id included (a relay passes on the reads it got).
    ids = {cut: _record_of([stream[:cut], stream[cut:]], include_usage=False, ghost=False).response_id
           for cut in range(1, stream.index(b"\n\n"))}
    assert {cut: found for cut, found in ids.items() if found != "chatcmpl-1"} == {}


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_a_named_stream_ended_by_an_unnamed_error_event_is_an_error(path: str) -> None:
    """vLLM's and an upstream relay's ``data: {"error"...}``: in a Messages or Responses stream
    it was counted as a completed request."""
    stream = [b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","type":"message",'
              b'"role":"assistant","model":"m","content":[],"usage":{"input_tokens":9,"output_tokens":0}}}\n\n',
              b'data: {"error":{"message":"Upstream server unreachable or connection lost",'
              b'"type":"BadGatewayError","param":null,"code":502}}\n\n']
    record = _record_of(stream, include_usage=False, ghost=False, path=path)
    assert record.outcome == "error"


def test_a_json_body_too_large_to_hold_is_recorded_as_unknown_completion_not_zero() -> None:
    """Past ``max_response_bytes`` a JSON body passes unpatched, and only its usage is read
    as it passes (``tests/accounting/test_hostile_billing.py::test_an_answer_too_large_to_hold_is_still_billed_its_usage``):
    one that has none must not be recorded as having delivered no tokens."""
    body = orjson.dumps({"id": "chatcmpl-1", "object": "chat.completion", "model": "m",
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * 8000},
                                      "finish_reason": "length"}]})

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        for i in range(0, len(body), 1024):
            await send({"type": "http.response.body", "body": body[i : i + 1024], "more_body": i + 1024 < len(body)})

    kept, ledger = _Kept(), UsageLedger()
    mw = UsagePatchMiddleware(inner, ledger=ledger, metrics=Metrics(ledger), recorder=kept,  # type: ignore[arg-type]
                              config=PatchConfig(max_response_bytes=4096))
    exchange = Exchange({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    asyncio.run(mw(exchange.scope(), exchange.receive, exchange.send))
    assert b"".join(m.get("body", b"") for m in exchange.messages if m["type"] == "http.response.body") == body
    [record] = kept.records
    assert (record.completion_tokens, record.completion_source, record.outcome) == (0, "unknown", "completed")


@pytest.mark.parametrize("text", ["\ud800" * 300, "m" * 255 + "\ud800"], ids=["surrogates", "one-at-the-end"])
def test_a_peer_string_with_lone_surrogates_is_kept_escaped_within_the_records_bound(text: str) -> None:
    """Kept as its escape, and still at most MAX_TEXT_CHARS: the escape is longer than what it
    stands for, and no client may make a record (or its OTLP span) larger than the bound."""
    record = UsageRecord(request_id="r", tenant="t", route="chat", stream=False, start_unix=0.0,
                         request_model=text, response_id=text)
    line = orjson.loads(dumps(record))
    escaped = text.encode("utf-8", "backslashreplace").decode()
    for field in ("request_model", "response_id"):
        assert line[field] == escaped[:MAX_TEXT_CHARS], field


@pytest.mark.parametrize("together", [False, True], ids=["an-event-a-message", "one-message"])
def test_a_named_responses_stream_counts_its_delta_events_by_name_whatever_its_datas_key_order(together: bool) -> None:
    """A server that writes its data's keys sorted puts ``type`` last: its ``event:`` lines
    name the token events, in a body message of one event as in one of many."""
    def event(name: str, payload: dict[str, Any]) -> bytes:
        data = orjson.dumps({**payload, "type": name}, option=orjson.OPT_SORT_KEYS)
        return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"

    delta = {"content_index": 0, "delta": "hi", "item_id": "msg_1", "output_index": 0}
    stream = [event("response.created", {"response": {"id": "resp_1", "object": "response", "model": "m"}}),
              *(event("response.output_text.delta", delta | {"sequence_number": i}) for i in range(3))]
    record = _record_of([b"".join(stream)] if together else stream, include_usage=False, ghost=False,
                        path="/v1/responses")
    assert (record.completion_tokens, record.completion_source) == (3, "stream")


def test_a_stream_whose_client_hangs_up_at_a_done_sent_alone_is_completed() -> None:
    """vLLM sends ``data: [DONE]`` as a body message of its own, and the openai SDK hangs up
    there, before the HTTP body ends: the stream was whole for the client."""
    pieces = _cut(_chat_stream(3, 1, include_usage=True, crlf=False), None)
    assert pieces[-1] == b"data: [DONE]\n\n"

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for piece in pieces:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        assert (await receive())["type"] == "http.disconnect"

    kept, ledger = _Kept(), UsageLedger()
    mw = UsagePatchMiddleware(inner, ledger=ledger, metrics=Metrics(ledger), recorder=kept)  # type: ignore[arg-type]
    exchange = Exchange({"messages": [{"role": "user", "content": "hi"}], "stream": True,
                         "stream_options": {"include_usage": True}}, hang_up_after=len(pieces))
    asyncio.run(mw(exchange.scope(), exchange.receive, exchange.send))
    [record] = kept.records
    assert (record.outcome, record.completion_tokens) == ("completed", 3)


def test_a_llama_cpp_role_event_with_null_content_is_not_billed_as_a_token() -> None:
    """llama.cpp opens a chat stream with ``"content": null`` beside the role: no token."""
    def event(delta: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps({"id": "chatcmpl-1", "model": "m", "choices": [
            {"index": 0, "delta": delta, "finish_reason": None}]}) + b"\n\n"

    stream = [event({"role": "assistant", "content": None}), *(event({"content": "hi"}) for _ in range(3)),
              b"data: [DONE]\n\n"]
    record = _record_of(stream, include_usage=False, ghost=False)
    assert (record.completion_tokens, record.completion_source) == (3, "stream")


@pytest.mark.parametrize("body", [{"prompt": ["a", "b"]}, {"prompt": "a", "prompt_embeds": "AAAA"}],
                         ids=["two-prompts", "a-prompt-and-an-embedding"])
def test_a_choices_continuous_usage_is_not_billed_for_a_stream_of_two_prompts(body: dict[str, Any]) -> None:
    """vLLM's continuous usage on a choice's chunk covers that choice's prompt alone when the
    stream makes several: cut before its whole-request usage, the record counts the events."""
    def event(index: int, completion: int) -> bytes:
        return b"data: " + orjson.dumps({"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [
            {"index": index, "text": "x", "finish_reason": None}],
            "usage": {"prompt_tokens": 5, "completion_tokens": completion, "total_tokens": 5 + completion}}) + b"\n\n"

    pieces = [event(0, 1), event(1, 1), event(0, 2), event(1, 2)]

    kept, ledger = _Kept(), UsageLedger()
    mw = UsagePatchMiddleware(_streaming(pieces), ledger=ledger, metrics=Metrics(ledger), recorder=kept)  # type: ignore[arg-type]
    exchange = Exchange({"model": "m", **body, "stream": True,
                         "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
                        path="/v1/completions")
    asyncio.run(mw(exchange.scope(), exchange.receive, exchange.send))
    [record] = kept.records
    assert (record.completion_tokens, record.completion_source) == (4, "stream")
