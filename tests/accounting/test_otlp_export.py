"""The OTLP sink exports every record, whatever the caller's trace flags or the
environment's OpenTelemetry settings, and counts what the collector did not take.

The real SDK exporter sends to the test receiver on loopback (:mod:`tests.otlp_receiver`,
which decodes the protobuf with opentelemetry-proto); the counters are read from a real
Prometheus registry. Sampling is for traces, not for billing data: a client sending
``traceparent: 00-...-00`` (not sampled) must still be billed, and its span must still
join its trace.
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from importlib.metadata import version
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from proxy.accounting.records.otlp import MAX_BATCH, OtlpSink
from proxy.accounting.records.record import UsageRecord
from proxy.accounting.records.recorder import Recorder
from proxy.server.app import CachetallyApp
from proxy.server.settings import Settings
from tests.otlp_receiver import RESET, Receiver, otlp_receiver
from tests.servers import metric_value, running_server, serving_in_thread
from tests.sink_counts import counters, watched

pytestmark = pytest.mark.loopback


def usage(n: int, traceparent: str | None = None) -> UsageRecord:
    return UsageRecord(request_id=f"r{n}", tenant="t", route="chat", stream=False, start_unix=1.7e9,
                       end_unix=1.7e9 + 1, prompt_tokens=100, cached_tokens=n, completion_tokens=5,
                       traceparent=traceparent)


def export(receiver: Receiver, records: list[UsageRecord], timeout_s: float = 5.0) -> tuple[float, dict[str, float]]:
    recorder = Recorder([OtlpSink(receiver.url, timeout_s=timeout_s)], interval_s=3600)
    metrics = watched(recorder)
    recorder.start()
    for record in records:
        recorder.submit(record)
    recorder.stop(timeout_s=60)
    return counters(metrics, "otlp")


ENVIRONMENTS = {
    "none": {},
    "sdk disabled": {"OTEL_SDK_DISABLED": "true"},
    "ratio 0": {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"},
    "always off": {"OTEL_TRACES_SAMPLER": "always_off"},
    "parent-based always off": {"OTEL_TRACES_SAMPLER": "parentbased_always_off"},
    "two attributes": {"OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "2", "OTEL_ATTRIBUTE_COUNT_LIMIT": "2"},
}


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_every_record_is_exported_whatever_the_flags_or_the_environment(
    environment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in ENVIRONMENTS[environment].items():
        monkeypatch.setenv(name, value)
    trace, parent = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    records = [
        usage(0, f"00-{trace}-{parent}-00"),  # the caller's trace, not sampled
        usage(1, f"00-{trace}-{parent}-01"),  # sampled
        usage(2),  # no trace context
        usage(3, "00-not-a-valid-traceparent-01"),
    ]
    with otlp_receiver() as receiver:
        written, dropped = export(receiver, records)
    spans = {s.attributes["cachetally.request_id"]: s for s in receiver.snapshot()}
    assert sorted(spans) == ["r0", "r1", "r2", "r3"] and len(receiver.spans) == 4
    assert (written, dropped) == (4, {})
    for rid in ("r0", "r1"):
        assert (spans[rid].trace_id, spans[rid].parent_span_id) == (trace, parent)
    for rid in ("r2", "r3"):
        assert spans[rid].trace_id not in ("", "0" * 32, trace) and spans[rid].parent_span_id == ""
    assert len({s.span_id for s in spans.values()}) == 4
    for span in spans.values():  # every attribute, whatever the environment's limits
        assert span.attributes["gen_ai.usage.cache_read.input_tokens"] == int(span.attributes["cachetally.request_id"][1:])
        assert span.attributes["gen_ai.usage.input_tokens"] == 100
        assert span.attributes["cachetally.tenant"] == "t"


def test_a_span_names_the_model_asked_for_and_the_one_that_answered_and_marks_a_failure() -> None:
    """What a trace viewer shows of a request: the model the client asked for (the served one
    when the body named none), the model that answered, how long it took, and an error status
    exactly when the request failed."""
    asked = UsageRecord(request_id="asked", tenant="t", route="chat", stream=False, start_unix=1.7e9,
                        end_unix=1.7e9 + 1.5, model="served", request_model="alias", outcome="completed")
    failed = UsageRecord(request_id="failed", tenant="t", route="chat", stream=False, start_unix=1.7e9,
                         end_unix=1.7e9 + 0.5, model="served", outcome="error")
    with otlp_receiver() as receiver:
        assert export(receiver, [asked, failed]) == (2, {})
    spans = {s.attributes["cachetally.request_id"]: s for s in receiver.snapshot()}
    seen = {rid: (s.attributes["gen_ai.request.model"], s.attributes["gen_ai.response.model"], s.status_code,
                  s.end_ns - s.start_ns) for rid, s in spans.items()}
    assert seen == {"asked": ("alias", "served", 0, 1_500_000_000),  # status UNSET
                    "failed": ("served", "served", 2, 500_000_000)}  # status ERROR


#: Each route's records, with every field set or none of the optional ones: (record, the
#: span name, every attribute the collector holds). docs/ACCOUNTING.md lists them.
FULL = dict(tenant="acme", stream=True, start_unix=1.7e9, end_unix=1.7e9 + 2, model="served",
            request_model="alias", response_id="resp-1", status=200, outcome="completed", prompt_tokens=90,
            cached_tokens=64, cache_creation_tokens=16, source="engine", completion_tokens=7,
            completion_source="usage")
SPANS = [
    (UsageRecord(request_id="chat", route="chat", **FULL), "chat served", "chat"),
    (UsageRecord(request_id="completions", route="completions", **FULL), "text_completion served", "text_completion"),
    (UsageRecord(request_id="responses", route="responses", **FULL), "chat served", "chat"),
    (UsageRecord(request_id="messages", route="messages", **FULL), "chat served", "chat"),
    (UsageRecord(request_id="invocations", route="invocations", **FULL), "invocations served", "invocations"),
]


def test_a_span_holds_every_attribute_the_docs_name_under_its_operations_name() -> None:
    """What a pipeline reading the collector bills from: the span's name, kind, resource and
    scope, and each documented attribute with the record's value; an unknown figure (a
    request that failed before any response) is absent, not 0."""
    bare = UsageRecord(request_id="bare", tenant="t", route="chat", stream=False, start_unix=1.7e9)
    with otlp_receiver() as receiver:
        assert export(receiver, [record for record, _, _ in SPANS] + [bare]) == (len(SPANS) + 1, {})
    spans = {s.attributes["cachetally.request_id"]: s for s in receiver.snapshot()}
    for record, name, operation in SPANS:
        span = spans[record.request_id]
        assert (span.name, span.kind, span.resource["service.name"]) == (name, 2, "cachetally")  # 2: SERVER
        assert span.scope == ("cachetally", version("cachetally"))
        assert span.attributes == {
            "gen_ai.operation.name": operation, "gen_ai.request.model": "alias", "gen_ai.response.model": "served",
            "gen_ai.response.id": "resp-1", "gen_ai.usage.input_tokens": 90,
            "gen_ai.usage.cache_read.input_tokens": 64, "gen_ai.usage.cache_write.input_tokens": 16,
            "gen_ai.usage.output_tokens": 7, "http.response.status_code": 200, "cachetally.tenant": "acme",
            "cachetally.record_id": record.record_id, "cachetally.request_id": record.request_id,
            "cachetally.outcome": "completed", "cachetally.stream": True, "cachetally.cached_tokens.source": "engine",
            "cachetally.completion_tokens.source": "usage",
        }
    assert spans["bare"].name == "chat unknown"
    assert spans["bare"].attributes == {
        "gen_ai.operation.name": "chat", "gen_ai.request.model": "unknown", "gen_ai.response.model": "unknown",
        "gen_ai.usage.output_tokens": 0, "cachetally.tenant": "t", "cachetally.record_id": bare.record_id,
        "cachetally.request_id": "bare", "cachetally.outcome": "error", "cachetally.stream": False,
        "cachetally.completion_tokens.source": "none",
    }


@pytest.mark.parametrize("status", [400, 503, 300, 302, 308])
def test_a_collector_that_refuses_gets_each_flush_once_and_every_record_is_counted_dropped(status: int) -> None:
    """400 and 503 refuse; a redirect (an http URL sent to https, a sign-in page) delivers
    nothing either, though the SDK's exporter takes any status below 400 for a success."""
    records = [usage(n) for n in range(2 * MAX_BATCH + 10)]
    with otlp_receiver() as receiver:
        receiver.status = status
        written, dropped = export(receiver, records, timeout_s=1.0)
    assert receiver.spans == []
    if status != 503:  # not retryable: one request for the whole flush, not one per span batch
        assert (written, dropped) == (0, {"export_failed": len(records)})
        assert receiver.requests == 1
    else:  # retried within the timeout, then the rest of the flush is not tried
        # A retry the SDK sends with little of the second left may go unanswered on a loaded
        # machine: those records are unconfirmed (RELIABILITY.md), each still counted once.
        assert written == 0 and set(dropped) <= {"export_failed", "unconfirmed"}
        assert sum(dropped.values()) == len(records)
        assert receiver.requests >= 1


def test_a_refusing_collector_draws_no_line_from_the_exporter_per_export(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each failed export made the SDK's exporter log a line of its own; the recorder's
    rate-limited line says the same, once."""
    with otlp_receiver() as receiver, caplog.at_level(logging.DEBUG):
        receiver.status = 400
        sink = OtlpSink(receiver.url, timeout_s=1.0)
        for n in range(3):
            assert sink.write([usage(n)]).lost == 1
    assert [r.getMessage() for r in caplog.records if r.name.startswith("opentelemetry")] == []


@pytest.mark.parametrize("answer", [{"status": 202}, {"status": 299}, {"body": b"OK"}, {"reject": -3}])
def test_a_collector_answering_any_2xx_took_the_spans_whatever_the_body_says(answer: dict) -> None:
    """Any 2xx takes the request; its body is read only for a partial success. A body that is
    no OTLP answer (a proxy's ``OK``) or a negative ``rejected_spans`` rejects nothing: no
    record at the collector is counted dropped, none is counted written twice."""
    with otlp_receiver() as receiver:
        for name, value in answer.items():
            setattr(receiver, name, value)
        written, dropped = export(receiver, [usage(n) for n in range(5)])
    assert sorted(s.attributes["cachetally.request_id"] for s in receiver.snapshot()) == [f"r{n}" for n in range(5)]
    assert (written, dropped) == (5, {})


def test_the_log_gives_the_collectors_reason_for_a_partial_success_cut_to_200_characters(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The operator reads why records were dropped: the collector's own message, however long
    a collector makes it, cut to 200 characters, though a later chunk of the flush was taken
    whole."""
    with otlp_receiver() as receiver, caplog.at_level(logging.WARNING, logger="cachetally.records"):
        receiver.script, receiver.message = [(200, 3)], "x" * 1000
        assert export(receiver, [usage(n) for n in range(MAX_BATCH + 10)]) == (MAX_BATCH + 7, {"export_failed": 3})
    reason = f"last error: the collector rejected 3 of {MAX_BATCH} spans: {'x' * 200!r}"
    assert [r.getMessage() for r in caplog.records] == [f"usage records dropped: 3 (otlp: export_failed); {reason}"]


@pytest.mark.parametrize("collector", ["takes the spans, then resets", "answers after the timeout", "is not there"])
def test_records_a_collector_may_hold_are_unconfirmed_and_only_those_it_cannot_are_export_failed(
    collector: str,
) -> None:
    """An export that got no answer after its request went out may be at the collector: it
    was counted export_failed (certainly not delivered), so a pipeline reconciling the
    collector's spans with the counters would take them for records to send again."""
    records = [usage(n) for n in range(5)]
    with otlp_receiver() as receiver:
        if collector == "takes the spans, then resets":
            receiver.status = RESET
        elif collector == "answers after the timeout":
            receiver.delay_s = 2.0
        else:
            with socket.socket() as unused:  # a port nothing listens on: the connection is refused
                unused.bind(("127.0.0.1", 0))
                receiver.url = f"http://127.0.0.1:{unused.getsockname()[1]}/v1/traces"
        written, dropped = export(receiver, records, timeout_s=0.5)
    held = {s.span_id: s.attributes["cachetally.request_id"] for s in receiver.snapshot()}  # resends deduplicated
    if collector == "is not there":
        assert (written, dropped, held) == (0, {"export_failed": 5}, {})
    else:
        assert sorted(held.values()) == [f"r{n}" for n in range(5)]
        assert (written, dropped) == (0, {"unconfirmed": 5})


def test_a_chunk_refused_after_one_taken_on_a_retry_is_export_failed_not_unconfirmed() -> None:
    """The first chunk of a flush is taken when sent again after a reset; the second is
    refused (400), and no attempt at it went unanswered: its records certainly are not at
    the collector. Counted ``unconfirmed``, a pipeline reconciling with the collector would
    take them for records it may hold, not for ones to send again."""
    with otlp_receiver() as receiver:
        receiver.script = [(RESET, 0), (200, 0), (400, 0)]
        written, dropped = export(receiver, [usage(n) for n in range(MAX_BATCH + 10)])
    held = {s.attributes["cachetally.request_id"] for s in receiver.snapshot()}
    assert held == {f"r{n}" for n in range(MAX_BATCH)}
    assert (written, dropped) == (MAX_BATCH, {"export_failed": 10})


def test_spans_rejected_in_part_after_an_unanswered_attempt_are_unconfirmed_and_counted_once() -> None:
    """The collector takes a chunk and resets; the retry is a partial success rejecting 3:
    those 3 may be held from the first attempt, so they are ``unconfirmed``, each once, and
    the other 2 written."""
    with otlp_receiver() as receiver:
        receiver.script = [(RESET, 0), (200, 3)]
        written, dropped = export(receiver, [usage(n) for n in range(5)])
    assert {s.attributes["cachetally.request_id"] for s in receiver.snapshot()} == {f"r{n}" for n in range(5)}
    assert (written, dropped) == (2, {"unconfirmed": 3})


def test_a_chunk_too_large_for_the_collector_is_sent_in_parts_and_one_clients_long_names_lose_no_other_record() -> None:
    """A collector, or a proxy in front of it, refuses a request over its size limit with
    413, which the SDK does not retry. A chunk of 512 fair spans is under 300 KB here; a
    client sending 128-character request ids and asking for models named with 256 emoji
    (each such request has a record, a 404 included) makes its spans 1.6 KB each, and every
    tenant's records flushed with its own were dropped under a 512 KiB limit."""
    hostile = [UsageRecord(request_id=f"h{n}".ljust(128, "x"), tenant="hostile", route="chat", stream=False,
                           start_unix=1.7e9, end_unix=1.7e9 + 1, request_model="\U0001f600" * 256, status=404)
               for n in range(400)]
    fair = [usage(n) for n in range(MAX_BATCH + 100 - len(hostile))]
    with otlp_receiver() as receiver:
        receiver.max_body = 512 << 10
        written, dropped = export(receiver, [*hostile[:350], *fair, *hostile[350:]])
    held = [s.attributes["cachetally.request_id"] for s in receiver.snapshot()]
    assert sorted(held) == sorted(r.request_id for r in [*hostile, *fair])
    assert (written, dropped) == (MAX_BATCH + 100, {})


def test_a_span_larger_than_the_collector_takes_is_dropped_alone_and_the_flush_goes_on() -> None:
    hostile = UsageRecord(request_id="h".ljust(128, "x"), tenant="hostile", route="chat", stream=False,
                          start_unix=1.7e9, end_unix=1.7e9 + 1, request_model="\U0001f600" * 256, status=404)
    with otlp_receiver() as receiver:
        receiver.max_body = 1200  # one fair span, not the hostile one
        written, dropped = export(receiver, [hostile, *(usage(n) for n in range(5))])
    assert sorted(s.attributes["cachetally.request_id"] for s in receiver.snapshot()) == [f"r{n}" for n in range(5)]
    assert (written, dropped) == (5, {"export_failed": 1})


def test_a_collector_answering_a_byte_at_a_time_is_given_up_on_at_the_timeout_and_the_next_flush_exported() -> None:
    """The SDK's timeout bounds each read of the socket, not the answer: a collector
    sending a byte now and then held the sink's thread past any timeout (an export with a
    2 s timeout took 18 s for a 38-byte answer; a longer one without end), so every later
    record was dropped as ``queue_full`` or at the stop, not exported."""
    with otlp_receiver() as receiver:
        receiver.drip = 1
        recorder = Recorder([OtlpSink(receiver.url, timeout_s=1.0)], interval_s=0.05)
        metrics = watched(recorder)
        recorder.start()
        for n in range(3):
            recorder.submit(usage(n))
        deadline = time.monotonic() + 30
        while len(receiver.snapshot()) < 3 and time.monotonic() < deadline:  # the first flush meets the drip
            time.sleep(0.01)
        for n in range(3, 6):
            recorder.submit(usage(n))
        recorder.stop(timeout_s=10)
        written, dropped = counters(metrics, "otlp")
    held = sorted(s.attributes["cachetally.request_id"] for s in receiver.snapshot())
    assert held == [f"r{n}" for n in range(6)]  # the first flush's spans were taken, then not answered
    assert (written, dropped) == (3, {"unconfirmed": 3})


@pytest.mark.parametrize(("count", "reject"), [(25, 3), (25, 25), (3, 7), (2 * MAX_BATCH + 10, 4)])
def test_spans_a_collector_rejects_in_a_partial_success_are_counted_dropped_not_written(
    count: int, reject: int
) -> None:
    """OTLP/HTTP: a collector may take part of a request, answer 200 and say in the body how
    many spans it rejected. The SDK's exporter reads only the 200; those records were lost."""
    records = [usage(n) for n in range(count)]
    with otlp_receiver() as receiver:
        receiver.reject = reject
        written, dropped = export(receiver, records)
    kept = receiver.snapshot()
    chunks = [min(MAX_BATCH, count - start) for start in range(0, count, MAX_BATCH)]
    rejected = sum(min(reject, size) for size in chunks)
    assert receiver.requests == len(chunks)  # a partial success is not sent again
    assert (written, dropped) == (count - rejected, {"export_failed": rejected})
    assert len(kept) == len({s.attributes["cachetally.request_id"] for s in kept}) == written


def test_a_collector_that_recovers_gets_the_rest_and_the_counts_add_up() -> None:
    with otlp_receiver() as receiver:
        recorder = Recorder([OtlpSink(receiver.url, timeout_s=1.0)], interval_s=3600)
        metrics = watched(recorder)
        worker = recorder.workers[0]
        receiver.status = 400
        for n in range(10):
            recorder.submit(usage(n))
        worker.flush()
        receiver.status = 200
        for n in range(10, 25):
            recorder.submit(usage(n))
        recorder.stop(timeout_s=60)
    assert sorted(int(s.attributes["cachetally.request_id"][1:]) for s in receiver.spans) == list(range(10, 25))
    assert counters(metrics, "otlp") == (15, {"export_failed": 10})


def test_a_client_sending_an_unsampled_traceparent_is_still_billed_in_its_trace() -> None:
    """A hostile client over real HTTP, against a server whose environment samples nothing."""
    trace, parent = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    env = {"OTEL_TRACES_SAMPLER": "always_off"}
    with otlp_receiver() as receiver:
        args = ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--log-level", "warning",
                "--usage-flush-interval", "0.1", "--otlp-endpoint", receiver.url]
        with running_server(args, env=env) as (url, _), httpx.Client(base_url=url, timeout=30) as client:
            answers = []
            for i, flags in enumerate(("00", "00", "01")):
                headers = {"traceparent": f"00-{trace}-{parent}-{flags}", "x-request-id": f"hostile-{i}"}
                body: dict = {"prompt": f"bill me {i}", "max_tokens": 3 + i}
                if i == 1:
                    body |= {"stream": True, "stream_options": {"include_usage": True}}
                response = client.post("/v1/completions", json=body, headers=headers)
                assert response.status_code == 200
                answers.append(response)
            # A span reaches the collector before its export call returns and is counted:
            # wait until each of the three is settled, written or dropped.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                metrics = client.get("/metrics").text
                settled = sum(metric_value(metrics, f"cachetally_usage_records_{fate}_total", sink="otlp")
                              for fate in ("written", "dropped"))
                if settled >= 3 and len(receiver.snapshot()) >= 3:
                    break
                time.sleep(0.05)
    spans = {s.attributes["cachetally.request_id"]: s for s in receiver.snapshot()}
    assert sorted(spans) == ["hostile-0", "hostile-1", "hostile-2"]
    for i in range(3):
        span = spans[f"hostile-{i}"]
        assert (span.trace_id, span.parent_span_id) == (trace, parent)
        assert span.attributes["gen_ai.usage.output_tokens"] == 3 + i
    assert metric_value(metrics, "cachetally_usage_records_written_total", sink="otlp") == 3
    assert metric_value(metrics, "cachetally_usage_records_dropped_total") == 0


def test_a_flush_whose_last_attempt_went_unanswered_is_not_logged_as_an_earlier_attempts_answer() -> None:
    """The collector answers 503, then takes the retry and resets: the reason logged for the
    unconfirmed records is the unanswered attempt, not the 503 that came before it."""
    with otlp_receiver() as receiver:
        receiver.script, receiver.status = [(503, 0)], RESET
        delivery = OtlpSink(receiver.url, timeout_s=2.5).write([usage(n) for n in range(3)])
    assert (delivery.written, delivery.unconfirmed, delivery.lost) == (0, 3, 0)
    assert delivery.detail == "export failed; an attempt went unanswered"


def test_a_token_in_the_collectors_url_stays_out_of_the_log_when_urllib3_quotes_that_url(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """urllib3 (under the SDK's ``requests`` session) logs a collector's answer whose header it
    cannot parse with the whole URL, query and all. Its logger has a NullHandler, so the line is
    seen where the operator's logging config gives the root logger a handler, as caplog does."""
    with otlp_receiver() as receiver, caplog.at_level(logging.DEBUG):
        receiver.malformed = True
        delivery = OtlpSink(f"{receiver.url}?token=SECRET-TOKEN", timeout_s=5.0).write([usage(0)])
    assert delivery.written == 1  # the collector took the span: its odd header is no failure
    assert "/v1/traces?***" in caplog.text
    assert "SECRET" not in caplog.text


TRACE, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
#: What W3C Trace Context says to ignore though it has a traceparent's shape: version ff,
#: an all-zero trace id, an all-zero parent id.
IGNORED = {"version ff": f"ff-{TRACE}-{PARENT}-01", "zero trace": f"00-{'0' * 32}-{PARENT}-01",
           "zero parent": f"00-{TRACE}-{'0' * 16}-01"}


def test_a_record_names_a_traceparent_only_when_its_span_is_that_callers_child(tmp_path: Path) -> None:
    """A record's ``traceparent`` says its span joined that trace. One W3C says to ignore
    starts a trace of its own, and so names none in the record: a pipeline joining the
    JSONL to the traces by trace id found no such span, and an all-zero trace id put the
    records of every client that sent one in one trace."""
    sent = {"valid": f"00-{TRACE}-{PARENT}-01", **IGNORED}
    with otlp_receiver() as receiver:
        settings = Settings(engine="sim", usage_dir=str(tmp_path), usage_flush_interval_s=0.05,
                            otlp_endpoint=receiver.url).validate()
        with serving_in_thread(CachetallyApp(settings)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            for name, traceparent in sent.items():
                headers = {"traceparent": traceparent, "x-request-id": name.replace(" ", "-")}
                client.completions.create(model="sim-model", prompt="trace me", max_tokens=2, extra_headers=headers)
        spans = {s.attributes["cachetally.request_id"]: s for s in receiver.snapshot()}
    lines = [line for f in tmp_path.glob("*.jsonl") for line in f.read_bytes().splitlines()]
    records = {r["request_id"]: r for r in map(orjson.loads, lines)}
    assert sorted(records) == sorted(spans) == sorted(name.replace(" ", "-") for name in sent)
    assert records["valid"]["traceparent"] == sent["valid"]
    assert (spans["valid"].trace_id, spans["valid"].parent_span_id) == (TRACE, PARENT)
    for name in IGNORED:
        rid = name.replace(" ", "-")
        assert records[rid]["traceparent"] is None, name
        assert spans[rid].parent_span_id == "" and spans[rid].trace_id not in (TRACE, "0" * 32), name
