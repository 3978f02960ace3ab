"""The sinks behind a real ``cachetally serve``.

OTLP: the real SDK exporter into a test receiver that decodes the protobuf with
opentelemetry-proto; one span per request, whose GenAI attributes equal the usage the
client got. Failures: a collector that is down, or a usage directory that cannot be
created, cost requests nothing: they succeed, the drops are counted and logged once, and
the server stops promptly. The time bounds are liveness checks (a request that waited on
an export would take the export timeout), not performance targets."""

from __future__ import annotations

import contextlib
import shutil
import time
import uuid

import httpx
import anthropic
import openai
import pytest

from collections.abc import Callable
from pathlib import Path

from tests.otlp_receiver import otlp_receiver
from tests.servers import free_port
from tests.servers import metric_value, running_server

pytestmark = pytest.mark.loopback

SERVE = ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--log-level", "warning", "--usage-flush-interval", "0.2"]


def test_one_span_per_request_with_the_responses_usage() -> None:
    with otlp_receiver() as receiver:
        args = [*SERVE, "--otlp-endpoint", receiver.url, "--tenant-header", "x-team", "--tenants", "red,blue"]
        expected: dict[str, dict] = {}
        traced: set[str] = set()
        with running_server(args) as (url, _):
            with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
                shared = "a long shared preamble that the prefix cache will keep " * 8
                for i in range(12):
                    rid, team = uuid.uuid4().hex, ("red", "blue", "green")[i % 3]
                    headers = {"x-request-id": rid, "x-team": team}
                    if i % 4 == 0:  # a caller's trace: the usage span joins it
                        headers["traceparent"] = f"00-{rid}-{rid[:16]}-01"
                        traced.add(rid)
                    if i % 2:
                        stream = client.chat.completions.create(
                            model="sim-model", messages=[{"role": "user", "content": f"{shared} q{i}"}],
                            max_tokens=4 + i, stream=True, stream_options={"include_usage": True},
                            extra_headers=headers,
                        )
                        chunks = list(stream)
                        usage, response_id, model = chunks[-1].usage, chunks[-1].id, chunks[-1].model
                        operation = "chat"
                    else:
                        completion = client.completions.create(
                            model="sim-model", prompt=f"{shared} q{i}", max_tokens=3 + i, extra_headers=headers
                        )
                        usage, response_id, model = completion.usage, completion.id, completion.model
                        operation = "text_completion"
                    expected[rid] = {
                        "gen_ai.operation.name": operation,
                        "gen_ai.request.model": "sim-model",
                        "gen_ai.response.model": model,
                        "gen_ai.response.id": response_id,
                        "gen_ai.usage.input_tokens": usage.prompt_tokens,
                        "gen_ai.usage.cache_read.input_tokens": usage.prompt_tokens_details.cached_tokens,
                        "gen_ai.usage.cache_write.input_tokens": usage.prompt_tokens_details.created_cache_tokens,
                        "gen_ai.usage.output_tokens": usage.completion_tokens,
                        "cachetally.tenant": team if team != "green" else "other",
                        "cachetally.outcome": "completed",
                    }
            with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as claude:
                for i in range(2):  # cold, then warm: the Messages API's figures, Anthropic's split
                    rid = uuid.uuid4().hex
                    message = claude.messages.create(
                        model="sim-model", max_tokens=3, messages=[{"role": "user", "content": shared}],
                        extra_headers={"x-request-id": rid, "x-team": "red"})
                    u = message.usage
                    expected[rid] = {
                        "gen_ai.operation.name": "chat",
                        "gen_ai.response.id": message.id,
                        "gen_ai.usage.input_tokens": u.input_tokens + u.cache_read_input_tokens
                        + u.cache_creation_input_tokens,
                        "gen_ai.usage.cache_read.input_tokens": u.cache_read_input_tokens,
                        "gen_ai.usage.cache_write.input_tokens": u.cache_creation_input_tokens,
                        "gen_ai.usage.output_tokens": u.output_tokens,
                        "cachetally.tenant": "red",
                    }
            deadline = time.monotonic() + 15
            while len(receiver.snapshot()) < len(expected) and time.monotonic() < deadline:
                time.sleep(0.05)
        spans = receiver.snapshot()
    by_id = {s.attributes["cachetally.request_id"]: s for s in spans}
    assert len(spans) == len(by_id) == len(expected)  # one span per request, none twice
    assert any(e["gen_ai.usage.cache_read.input_tokens"] > 0 for e in expected.values())
    assert any(e["gen_ai.usage.cache_write.input_tokens"] > 0 for e in expected.values())
    for rid, attrs in expected.items():
        span = by_id[rid]
        assert {k: span.attributes.get(k) for k in attrs} == attrs
        assert span.name == f"{attrs['gen_ai.operation.name']} sim-model"
        assert span.kind == 2  # SPAN_KIND_SERVER
        assert span.resource["service.name"] == "cachetally"
        assert 0 < span.start_ns < span.end_ns
        parent = (rid, rid[:16]) if rid in traced else (span.trace_id, "")
        assert (span.trace_id, span.parent_span_id) == parent


def unwritable_dir(tmp_path: Path) -> tuple[list[str], Callable[[], None]]:
    """A usage directory that took a file at start (else the start fails), then is
    replaced by a file: every write fails, even as root."""
    usage = tmp_path / "usage"

    def replace_with_a_file() -> None:
        shutil.rmtree(usage)
        usage.write_text("a file where the usage directory should be")

    return ["--usage-dir", str(usage)], replace_with_a_file


def unreachable_collector(tmp_path: Path) -> tuple[list[str], Callable[[], None]]:
    return ["--otlp-endpoint", f"http://127.0.0.1:{free_port()}/v1/traces", "--otlp-timeout", "1"], lambda: None


@pytest.mark.parametrize("failing", [unwritable_dir, unreachable_collector])
def test_a_failing_sink_costs_requests_nothing(tmp_path: Path, failing) -> None:
    sink_args, fail = failing(tmp_path)
    args = [*SERVE, *sink_args, "--usage-queue-size", "4"]
    log = tmp_path / "serve.log"
    with running_server(args, log_path=log) as (url, proc):
        fail()
        with httpx.Client(base_url=url, timeout=10) as client:
            for i in range(40):
                body = {"prompt": f"p{i}", "max_tokens": 2, "stream": i % 2 == 1}
                assert client.post("/v1/completions", json=body).status_code == 200
            deadline = time.monotonic() + 10
            dropped = 0.0
            while dropped < 1 and time.monotonic() < deadline:
                metrics = client.get("/metrics").text
                dropped = metric_value(metrics, "cachetally_usage_records_dropped_total")
                time.sleep(0.1)
        assert dropped >= 1
        assert metric_value(metrics, "cachetally_usage_records_written_total") == 0
    # Each request answered within the client's timeout; that submitting a record never waits
    # on a stuck sink is held without timings by test_a_full_queue_drops_and_counts_and_logs_once_a_minute.
    # A stop stuck on the sink would have been ended by SIGKILL (-9) after tests.servers.stop's 30 s.
    assert proc.returncode == 0
    text = log.read_text()
    assert "Traceback" not in text
    assert 1 <= text.count("usage records dropped") <= 2  # the first drop, and the rest at stop


def _records(usage: Path) -> list[dict]:
    import orjson

    return [orjson.loads(line) for p in sorted(usage.glob("*.jsonl")) for line in p.read_bytes().splitlines()]


@pytest.mark.parametrize("stop", ["graceful", "crash"])
def test_a_graceful_stop_loses_nothing_and_a_crash_at_most_one_flush_interval(tmp_path: Path, stop: str) -> None:
    import signal

    usage = tmp_path / "usage"
    # Graceful: a flush interval longer than the test, so only the stop can write the records.
    interval = "600" if stop == "graceful" else "0.2"
    args = [*SERVE[:-2], "--usage-flush-interval", interval, "--usage-dir", str(usage)]
    with running_server(args) as (url, proc):
        with httpx.Client(base_url=url, timeout=10) as client:
            for i in range(20):
                assert client.post("/v1/completions", json={"prompt": f"p{i}", "max_tokens": 2}).status_code == 200
        if stop == "graceful":
            assert _records(usage) == []  # nothing flushed yet
            proc.send_signal(signal.SIGTERM)
        else:
            time.sleep(1.0)  # more than one flush interval after the last request
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert len(_records(usage)) == 20


def test_a_stop_waits_for_requests_in_flight_as_long_as_shutdown_timeout_s_and_records_them(tmp_path: Path) -> None:
    """An operator sets how long a SIGTERM drains (shorter than a Kubernetes grace period,
    longer than most streams): a stream still running then is ended and recorded as such."""
    import signal
    import threading

    usage = tmp_path / "usage"
    env = {"CACHETALLY_SIM_TOKEN_DELAY_S": "0.1", "CACHETALLY_SHUTDOWN_TIMEOUT_S": "0.5"}
    got: list[bytes] = []
    with running_server([*SERVE, "--usage-dir", str(usage)], env=env) as (url, proc):
        started = threading.Event()

        def stream() -> None:
            body = {"prompt": "drain me", "max_tokens": 40, "stream": True}  # about 4 s of tokens
            with contextlib.suppress(httpx.HTTPError), httpx.stream("POST", f"{url}/v1/completions", json=body,
                                                                    timeout=30) as response:
                for chunk in response.iter_bytes():
                    got.append(chunk)
                    started.set()

        client = threading.Thread(target=stream)
        client.start()
        assert started.wait(10)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        client.join(timeout=30)
    [record] = _records(usage)
    assert record["outcome"] == "error" and 0 < record["completion_tokens"] < 40
    assert b"[DONE]" not in b"".join(got)
