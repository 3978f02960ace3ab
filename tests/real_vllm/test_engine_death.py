"""`cachetally serve` (vLLM's own server with the middleware), on its own: logs stay free of
secrets at debug level, requests vLLM's ``--api-key`` refuses cost no body read and leave
no record, and when the engine core process dies requests fail at once with an OpenAI
error instead of hanging, and the server exits for its supervisor to restart.

Not the shared ``vllm_server``: this module kills its engine. Its server runs with
``--log-level debug`` (and vLLM's own logger at DEBUG), vLLM's own ``--api-key`` (which
vLLM checks inside the middleware's layer), usage records, and its output in a file that
the first test greps for prompt and completion text, the ``Authorization`` value and the key.
"""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import psutil
import pytest

from tests import clients
from tests.clients import engine_block_size, fresh_prompt, warm_hit
from tests.load import report
from tests.servers import ENGINE_KV_FLAGS, Pace, measure_pace, metric_value, running_server

pytestmark = [pytest.mark.vllm, pytest.mark.loopback]

KEY = "sk-KEYMARKER-" + uuid.uuid4().hex
AUTH = {"authorization": f"Bearer {KEY}"}
PROMPT_MARKER = "PROMPTMARKER" + uuid.uuid4().hex[:8]


@dataclass
class Server:
    url: str
    proc: psutil.Process
    log: Path
    pace: Pace
    usage: Path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("engine-death") / "server.log"
    usage = tmp_path_factory.mktemp("engine-death-usage")
    env = {"VLLM_LOGGING_LEVEL": "DEBUG"}
    args = ["-m", "proxy.server.cli", "serve", "--log-level", "debug", "--usage-dir", str(usage),
            "--usage-flush-interval", "0.2", "--", "--api-key", KEY, *ENGINE_KV_FLAGS]
    with running_server(args, env=env, timeout_s=600, log_path=log) as (url, proc):
        model = httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"][0]["id"]
        yield Server(url, psutil.Process(proc.pid), log, measure_pace(url, model, headers=AUTH), usage)


def engine_core(server: Server) -> psutil.Process:
    children = server.proc.children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            if "EngineCore" in child.name() or any("EngineCore" in part for part in child.cmdline()):
                return child
    candidates = [c for c in server.proc.children() if "resource_tracker" not in " ".join(c.cmdline())]
    assert len(candidates) == 1, [(c.pid, c.name(), c.cmdline()) for c in children]
    return candidates[0]


def stats_lines(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if "prefix cache stats:" in line]


def test_debug_logs_hold_no_prompt_completion_authorization_or_key(server: Server) -> None:
    model = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]["id"]
    texts = []
    before = len(stats_lines(server.log))
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=server.pace.timeout()) as client:
        assert client.post("/v1/completions", json={"prompt": "x"}, headers={"authorization": "Bearer no"}).status_code == 401
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"{PROMPT_MARKER} say hi"}]}),
            ("/v1/completions", {"prompt": f"{PROMPT_MARKER} once upon a time"}),
        ):
            for stream in (False, True):
                payload = {**body, "model": model, "max_tokens": 12, "temperature": 0, "stream": stream}
                resp = client.post(path, json=payload)
                assert resp.status_code == 200
                if not stream:
                    choice = resp.json()["choices"][0]
                    texts.append(choice.get("text") or choice["message"]["content"])
    time.sleep(1.0)  # let the engine's periodic log lines land
    text = server.log.read_text(errors="replace")
    assert " DEBUG " in text
    # vLLM resets the root logger while it builds its app: cachetally's lines survive it.
    assert text.count("cachetally ready on http://") == 1
    # The wait for the engine is announced before it starts, with what to wait for.
    assert text.find("starting vLLM with ") < text.find("cachetally ready on http://")
    assert text.count("starting vLLM with ") == 1
    assert re.search(r"engine vllm \(model SmolLM2-135M-Instruct, dtype \w+, (cpu|cuda)\), started in", text)
    lines = stats_lines(server.log)
    assert len(lines) == before + 4  # one per chat or completions request; not the 401
    assert f"total_requests={len(lines)} " in lines[-1]
    completions = [t.strip() for t in texts if len(t.strip()) >= 12]
    leaked = [s for s in (KEY, "KEYMARKER", PROMPT_MARKER, *completions) if s in text]
    assert not leaked, leaked
    assert "Traceback" not in text


def test_one_api_server_reports_what_vllm_counted_on_metrics_and_stats(server: Server) -> None:
    """The default, one API server process: cachetally's series in prometheus_client's default
    registry, beside vLLM's, with no multiprocess mode (the shared server runs two)."""
    model = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]["id"]
    prompt = fresh_prompt()
    before = clients.scrape(server.url)
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=server.pace.timeout(2)) as client:
        cold, warm = (clients.ask(client, "chat", False, prompt, model=model, max_tokens=2) for _ in range(2))
    after = clients.scrape(server.url)
    assert cold.prompt_tokens_details.cached_tokens == 0
    cached, block = warm.prompt_tokens_details.cached_tokens, engine_block_size(server.url)
    assert cached == warm_hit(warm.prompt_tokens, block)
    for name, labels in (("vllm:prompt_tokens_cached_total", {}), ("cachetally_cached_tokens_total", {"tier": "all"})):
        assert metric_value(after, name, **labels) - metric_value(before, name, **labels) == cached, name
    stats = httpx.get(f"{server.url}/stats", headers=AUTH).json()
    assert stats["total_cached_tokens"] == metric_value(after, "cachetally_cached_tokens_total", tier="all")
    lines = stats_lines(server.log)
    assert lines and not any("pid=" in line for line in lines)  # one process: no line names one


def records(usage: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for path in sorted(usage.glob("*.jsonl")) for line in path.read_bytes().splitlines()]


def recorded_ids_after_one_accepted(server: Server, payload: dict[str, Any]) -> list[str]:
    """Every recorded request id once an authenticated request's record is written.

    Records leave in order: by then, a record of any request that ended before it is written too.
    """
    accepted = uuid.uuid4().hex
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=payload,
                      headers={**AUTH, "x-request-id": accepted}, timeout=server.pace.timeout())
    assert resp.status_code == 200
    deadline = time.monotonic() + server.pace.timeout()
    while not any(r["request_id"] == accepted for r in records(server.usage)) and time.monotonic() < deadline:
        time.sleep(0.1)
    ids = [r["request_id"] for r in records(server.usage)]
    assert ids.count(accepted) == 1
    return ids


def chat_payload(server: Server) -> dict[str, Any]:
    model = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]["id"]
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def test_requests_vllm_refuses_leave_no_record_and_no_count(server: Server) -> None:
    """vLLM's ``--api-key`` check runs inside the middleware's layer: the middleware makes the
    same check first, so a refused request gets vLLM's own 401 and is neither recorded nor
    counted; an authenticated one is both."""
    payload = chat_payload(server)
    before = clients.scrape(server.url)
    refused = [uuid.uuid4().hex for _ in range(3)]
    for rid, headers in zip(refused, ({}, {"authorization": "Bearer no"}, {"authorization": f"Basic {KEY}"})):
        resp = httpx.post(f"{server.url}/v1/chat/completions", json=payload,
                          headers={**headers, "x-request-id": rid}, timeout=server.pace.timeout())
        assert (resp.status_code, resp.json()) == (401, {"error": "Unauthorized"})
    assert not set(refused) & set(recorded_ids_after_one_accepted(server, payload))
    after = clients.scrape(server.url)
    assert metric_value(after, "cachetally_requests_total") - metric_value(before, "cachetally_requests_total") == 1


def refused_before_body(server: Server, headers: bytes, length: int) -> bytes:
    """The status line of the answer to a request whose ``length``-byte body is never sent."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=server.pace.timeout()) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     + headers + f"content-length: {length}\r\n\r\n".encode() + b'{"model": "x", ')
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(65536)  # a socket timeout here: the server waits for the body
            assert chunk, answer
            answer += chunk
    return answer.split(b"\r\n", 1)[0]


def test_a_huge_body_vllm_refuses_is_answered_before_it_is_read(server: Server) -> None:
    """A 30 MiB body (under the 32 MiB limit) without a valid key: the 401 comes from the
    headers alone, while the body is still unsent, and leaves no record."""
    refused = [uuid.uuid4().hex for _ in range(2)]
    for rid, auth in zip(refused, (b"", b"authorization: Bearer no\r\n")):
        status = refused_before_body(server, auth + f"x-request-id: {rid}\r\n".encode(), 30 << 20)
        assert status == b"HTTP/1.1 401 Unauthorized"
    assert not set(refused) & set(recorded_ids_after_one_accepted(server, chat_payload(server)))


def test_engine_death_fails_requests_at_once_and_the_server_exits_clean(server: Server) -> None:
    """What a supervisor (Kubernetes, systemd) needs: no hung request, then an exit to restart.

    The 503 with OpenAI error JSON on the patched routes is the middleware's; ``/health``
    and the exit are vLLM's own (the first request to meet the dead engine, or its watchdog
    about 5 s after the engine died, stops the server, unless ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1``).
    """
    assert httpx.get(f"{server.url}/health").status_code == 200
    model = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]["id"]
    children = server.proc.children(recursive=True)
    core = engine_core(server)
    core.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    core.wait(timeout=10)
    timings = {}

    def ask(path: str, body: dict[str, Any]) -> httpx.Response:
        started = time.monotonic()
        resp = httpx.post(f"{server.url}{path}", json={**body, "model": model, "max_tokens": 4},
                          headers=AUTH, timeout=server.pace.timeout())
        timings[path] = time.monotonic() - started
        return resp

    # At once: vLLM begins its exit at the first request that meets the dead engine (it
    # closes its listener then), so a request sent after that answer found no server.
    asked = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
             ("/v1/completions", {"prompt": "hi", "stream": True}))
    with ThreadPoolExecutor(len(asked)) as pool:
        answers = list(pool.map(lambda request: ask(*request), asked))
    for (path, _), resp in zip(asked, answers):
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["type"] == "ServiceUnavailableError"
        assert timings[path] < 5.0
    code = server.proc.wait(timeout=60)
    exited = time.monotonic() - killed
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"engine processes left behind: {alive}"
    report("engine-death", request_503_s={k: round(v, 3) for k, v in timings.items()},
           server_exit_s=round(exited, 1), exit_code=code)
