"""The canary hunt: a marker of its own in every secret a client or the operator hands
cachetally, every path driven (each route and shape, refusals, failures, a cut stream, an
upstream that dies mid-stream, a stop with a request in flight), and every output an
operator sees searched for every marker.

Two servers at ``--log-level debug`` (the most cachetally logs: uvicorn's access lines and
the per-request stats line), each writing usage records to a directory and exporting OTLP
spans to a test collector (which refuses one export) whose URL holds a password and a token, with
``OTEL_EXPORTER_OTLP_HEADERS`` holding a token in a well-formed entry and in a malformed one:

- upstream mode in front of the sim, with API keys (``CACHETALLY_API_KEY`` and a keys file);
- the sim engine with a trusted tenant header (refused beside keys).

Searched: the server's whole output, ``/stats``, ``/metrics``, the records, the spans,
``cachetally report`` (table and JSON), and every answer a client got. A record may hold
the model name the client asked for (``request_model``, the span's ``gen_ai.request.model``:
docs/ACCOUNTING.md), and an answer may name the model its own client asked for (the
engine's 404); nothing else holds a marker. Where the clients' query strings go, uvicorn's
WebSocket handshake lines included, the log shows ``?***``.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.otlp_receiver import otlp_receiver
from tests.servers import ROOT, running_server, running_servers

RUN = uuid.uuid4().hex[:12]


def canary(what: str) -> str:
    return f"CANARY{what}{RUN}"


# What clients hand over: prompt text in every field that holds it, the model, credentials.
SYSTEM, USER, TOOL_ARGS, TOOL_TEXT, PROMPT, INPUT = map(canary, ("system", "user", "toolargs", "tooltext",
                                                                 "prompt", "input"))
MSG_SYSTEM, MSG_USER, MODEL = map(canary, ("msgsystem", "msguser", "model"))
BAD_JSON, TOO_LARGE, REFUSED, CUT, IN_FLIGHT = map(canary, ("badjson", "toolarge", "refused", "cut", "inflight"))
FILE_KEY, SHARED_KEY, WRONG_KEY, X_API_KEY, UNCHECKED_KEY = map(canary, ("filekey", "sharedkey", "wrongkey",
                                                                         "xapikey", "uncheckedkey"))
TENANT, QUERY, COOKIE, WS_QUERY, WS_PROTOCOL = map(canary, ("tenant", "query", "cookie", "wsquery", "wsprotocol"))
# What the operator hands over.
OTLP_PASSWORD, OTLP_TOKEN, OTEL_HEADER, OTEL_BAD_HEADER = map(canary, ("otlppass", "otlptoken", "otelheader",
                                                                       "otelbadheader"))
ALL = (SYSTEM, USER, TOOL_ARGS, TOOL_TEXT, PROMPT, INPUT, MSG_SYSTEM, MSG_USER, MODEL, BAD_JSON, TOO_LARGE, REFUSED,
       CUT, IN_FLIGHT, FILE_KEY, SHARED_KEY, WRONG_KEY, X_API_KEY, UNCHECKED_KEY, TENANT, QUERY, COOKIE, WS_QUERY,
       WS_PROTOCOL, OTLP_PASSWORD, OTLP_TOKEN, OTEL_HEADER, OTEL_BAD_HEADER)

#: A token in a well-formed entry, and one in the form people write by mistake (a colon).
OTEL_HEADERS = f"authorization=Bearer%20{OTEL_HEADER},x-collector-token: {OTEL_BAD_HEADER}"


def found(text: str) -> set[str]:
    return {value for value in ALL if value in text}


Answers = list[tuple[bool, str]]  # (whether the request named MODEL, what its client got)


def _raw(url: str, answers: Answers, **request: object) -> int:
    response = httpx.post(url, timeout=30, **request)  # type: ignore[arg-type]
    answers.append((False, response.text))
    return response.status_code


def _ask_every_route(url: str, key: str, headers: dict[str, str], answers: Answers) -> None:
    """Each metered route, JSON and stream, through the official clients; the model's 404.
    The clients are closed here, while the server runs, not by the collector later."""
    with openai.OpenAI(base_url=f"{url}/v1", api_key=key, default_headers=headers,
                       default_query={"api_key": QUERY}, max_retries=0) as client, \
         anthropic.Anthropic(base_url=url, auth_token=key, default_headers=headers,
                             default_query={"api_key": QUERY}, max_retries=0) as claude:
        _ask_with(client, claude, answers)


def _ask_with(client: openai.OpenAI, claude: anthropic.Anthropic, answers: Answers) -> None:
    messages = [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": USER},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call-1", "type": "function", "function": {
            "name": "lookup", "arguments": json.dumps({"q": TOOL_ARGS})}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": TOOL_TEXT},
    ]
    for stream in (False, True):
        chat = client.chat.completions.create(model="sim-model", messages=messages, max_tokens=3, stream=stream)
        completion = client.completions.create(model="sim-model", prompt=PROMPT, max_tokens=3, stream=stream)
        response = client.responses.create(model="sim-model", input=INPUT, max_output_tokens=3, stream=stream)
        for answer in (chat, completion, response):
            answers.append((False, "".join(part.model_dump_json() for part in answer) if stream
                            else answer.model_dump_json()))
    message = claude.messages.create(model="sim-model", max_tokens=3, system=MSG_SYSTEM,
                                     messages=[{"role": "user", "content": MSG_USER}])
    answers.append((False, message.model_dump_json()))
    with claude.messages.stream(model="sim-model", max_tokens=3, system=MSG_SYSTEM,
                                messages=[{"role": "user", "content": MSG_USER}]) as events:
        answers.append((False, "".join(event.model_dump_json() for event in events)))
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    answers.append((True, missing.value.response.text))


def _refuse_and_fail(url: str, headers: dict[str, str], answers: Answers) -> None:
    """Bad JSON, a body over the limit, a refused route, a stream its client cuts, a
    WebSocket handshake with keys in its query, headers and subprotocol (a browser's
    WebSocket can set no header: OpenAI's Realtime API takes the key as a subprotocol)."""
    assert _raw(f"{url}/v1/chat/completions?api_key={QUERY}", answers, headers=headers,
                content=b'{"messages": [{"role": "user", "content": "' + BAD_JSON.encode()) == 400
    big = b'{"prompt": "' + TOO_LARGE.encode() + b"x" * (1 << 20) + b'"}'
    assert _raw(f"{url}/v1/completions", answers, headers=headers, content=big) == 413
    assert _raw(f"{url}/v1/embeddings", answers, headers=headers, json={"model": "sim-model", "input": REFUSED}) == 403
    body = {"model": "sim-model", "prompt": CUT, "max_tokens": 100_000, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=30) as cut:
        assert cut.status_code == 200
        next(cut.iter_raw())
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        handshake = [f"GET /v1/realtime?api_key={WS_QUERY} HTTP/1.1", "host: 127.0.0.1", "upgrade: websocket",
                     "connection: Upgrade", "sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==", "sec-websocket-version: 13",
                     f"sec-websocket-protocol: realtime, openai-insecure-api-key.{WS_PROTOCOL}",
                     *(f"{name}: {value}" for name, value in headers.items())]
        sock.sendall(("\r\n".join(handshake) + "\r\n\r\n").encode())
        answers.append((False, sock.recv(65536).decode(errors="replace")))


def _stream_in_flight(url: str, headers: dict[str, str]) -> threading.Thread:
    """A stream still running when the server is stopped (or its upstream dies)."""
    started = threading.Event()

    def read() -> None:
        body = {"model": "sim-model", "prompt": IN_FLIGHT, "max_tokens": 10_000_000, "stream": True}
        with contextlib.suppress(httpx.HTTPError), httpx.stream(
                "POST", f"{url}/v1/completions", json=body, headers=headers, timeout=30) as answer:
            for _ in answer.iter_raw():
                started.set()
        started.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    assert started.wait(30)
    return thread


@pytest.fixture(scope="module")
def hunt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    tmp = tmp_path_factory.mktemp("canaries")
    keys = tmp / "keys.toml"
    keys.write_text(f'"{FILE_KEY}" = "acme"\n')
    keys.chmod(0o600)
    debug = ["-m", "proxy.server.cli", "serve", "--log-level", "debug", "--usage-flush-interval", "0.1",
             "--otlp-timeout", "2"]
    answers: Answers = []
    out: dict[str, object] = {"answers": answers, "tmp": tmp}
    with otlp_receiver() as collector, running_server(["-m", "engine_adapter.sim"]) as (upstream, sim):
        endpoint = collector.url.replace("://", f"://cachetally:{OTLP_PASSWORD}@") + f"?token={OTLP_TOKEN}"
        collector.script = [(400, 0)]  # the first export fails: the drop is logged
        keyed = [*debug, "--upstream", upstream, "--api-keys", str(keys), "--usage-dir", str(tmp / "usage-keyed"),
                 "--otlp-endpoint", endpoint]
        tenants = [*debug, "--engine", "sim", "--tenant-header", "x-tenant", "--tenants", "acme",
                   "--usage-dir", str(tmp / "usage-tenants"), "--otlp-endpoint", endpoint]
        env = {"OTEL_EXPORTER_OTLP_HEADERS": OTEL_HEADERS, "CACHETALLY_SHUTDOWN_TIMEOUT_S": "1",
               "CACHETALLY_MAX_REQUEST_BYTES": str(1 << 16)}
        logs = [tmp / "keyed.log", tmp / "tenants.log"]
        specs = [(keyed, {**env, "CACHETALLY_API_KEY": SHARED_KEY}, logs[0]), (tenants, env, logs[1])]
        with running_servers(specs) as [(keyed_url, _), (tenant_url, _)]:
            for url, key, extra in ((keyed_url, FILE_KEY, {}), (tenant_url, UNCHECKED_KEY, {"x-tenant": TENANT})):
                headers = {"cookie": f"session={COOKIE}", "x-api-key": X_API_KEY, **extra}
                _ask_every_route(url, key, headers, answers)
                _refuse_and_fail(url, {**headers, "authorization": f"Bearer {key}"}, answers)
            for bad in (WRONG_KEY, None):
                assert _raw(f"{keyed_url}/v1/completions?api_key={QUERY}", answers, json={"prompt": PROMPT},
                            headers={"x-api-key": X_API_KEY} | ({"authorization": f"Bearer {bad}"} if bad else {})
                            ) == 401
            dying = _stream_in_flight(keyed_url, {"authorization": f"Bearer {SHARED_KEY}"})
            sim.send_signal(signal.SIGKILL)  # the upstream dies mid-stream, then is down
            dying.join(30)
            assert _raw(f"{keyed_url}/v1/completions?api_key={QUERY}", answers, json={"prompt": PROMPT},
                        headers={"authorization": f"Bearer {FILE_KEY}"}) == 502
            out["stats"] = [httpx.get(f"{url}/stats").text for url in (keyed_url, tenant_url)]
            out["metrics"] = [httpx.get(f"{url}/metrics").text for url in (keyed_url, tenant_url)]
            stopped = _stream_in_flight(tenant_url, {"x-tenant": TENANT})
        stopped.join(30)  # the stop (SIGTERM) ended it
        deadline = time.monotonic() + 10
        while len(collector.snapshot()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        out["spans"] = collector.snapshot()
    out["logs"] = [log.read_text(errors="replace") for log in logs]
    yield out


def test_no_log_line_holds_a_secret_and_queries_show_as_stars(hunt: dict[str, object]) -> None:
    keyed, tenants = hunt["logs"]  # type: ignore[misc]
    assert "usage records dropped: " in keyed + tenants  # the collector's refusal
    for log in (keyed, tenants):
        assert " DEBUG cachetally.stats: " in log and "Traceback" not in log, log[-3000:]
        assert not found(log), found(log)
        assert "OTLP spans to http://***@127.0.0.1:" in log and "/v1/traces?***" in log
        assert '"POST /v1/chat/completions?*** HTTP/1.1" 400' in log
        assert "WebSocket /v1/realtime?***" in log or "Unsupported upgrade request" in log
        # The malformed OTEL header entry is said, without its value.
        assert "OTEL_EXPORTER_OTLP_HEADERS" in log and "not name=value" in log


def test_stats_metrics_and_every_answer_hold_no_secret(hunt: dict[str, object]) -> None:
    for page in [*hunt["stats"], *hunt["metrics"]]:  # type: ignore[misc]
        assert not found(page), found(page)
    answers: Answers = hunt["answers"]  # type: ignore[assignment]
    assert len(answers) == 29  # every request above was answered, and read
    for named_model, text in answers:
        assert found(text) <= ({MODEL} if named_model else set()), (found(text), text[:300])


def test_records_spans_and_the_report_hold_no_secret_but_the_model_asked_for(hunt: dict[str, object]) -> None:
    tmp: Path = hunt["tmp"]  # type: ignore[assignment]
    records = [json.loads(line) for name in ("usage-keyed", "usage-tenants")
               for path in sorted((tmp / name).glob("*.jsonl")) for line in path.read_text().splitlines()]
    assert {r["tenant"] for r in records} == {"acme", "default", "other"}
    assert {r["outcome"] for r in records} >= {"completed", "disconnected", "error"}
    asked = {record.pop("request_model") or "" for record in records}
    assert MODEL in asked and found(" ".join(asked)) == {MODEL}
    for record in records:
        assert not found(json.dumps(record)), record
    spans = hunt["spans"]
    assert spans
    for span in spans:  # type: ignore[attr-defined]
        attributes = {k: v for k, v in span.attributes.items() if k != "gen_ai.request.model"}
        assert not found(repr((span.name, attributes, span.resource))), span
    for usage in ("usage-keyed", "usage-tenants"):
        for flags in ([], ["--json"]):
            report = subprocess.run([sys.executable, "-m", "proxy.server.cli", "report", str(tmp / usage), *flags],
                                    capture_output=True, text=True, cwd=ROOT, timeout=60)
            assert report.returncode == 0, report.stderr
            assert "sim-model" in report.stdout and not found(report.stdout + report.stderr)
