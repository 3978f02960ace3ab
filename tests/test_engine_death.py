"""`cachetally serve` (vLLM's own server with the middleware), on its own: logs stay free of
secrets at debug level, and when the engine core process dies requests fail at once with
an OpenAI error instead of hanging, and the server exits for its supervisor to restart.

Not the shared ``vllm_server``: this module kills its engine. Its server runs with
``--log-level debug`` (and vLLM's own logger at DEBUG), an API key, and its output in a
file that the first test greps for prompt and completion text, the ``Authorization``
value and the key.
"""

from __future__ import annotations

import contextlib
import re
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests import clients
from tests.clients import VLLM_CPU_BLOCK, fresh_prompt
from tests.load import report
from tests.servers import Pace, measure_pace, metric_value, running_server

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


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("engine-death") / "server.log"
    env = {
        "CACHETALLY_API_KEY": KEY,
        "CACHETALLY_AUTH_EXEMPT_PATHS": "/health /metrics",
        "VLLM_LOGGING_LEVEL": "DEBUG",
    }
    args = ["-m", "proxy.server.cli", "serve", "--log-level", "debug"]
    with running_server(args, env=env, timeout_s=600, log_path=log) as (url, proc):
        model = httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"][0]["id"]
        yield Server(url, psutil.Process(proc.pid), log, measure_pace(url, model, headers=AUTH))


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
    cached = warm.prompt_tokens_details.cached_tokens
    assert cached == ((warm.prompt_tokens - 1) // VLLM_CPU_BLOCK) * VLLM_CPU_BLOCK
    for name, labels in (("vllm:prompt_tokens_cached_total", {}), ("cachetally_cached_tokens_total", {"tier": "all"})):
        assert metric_value(after, name, **labels) - metric_value(before, name, **labels) == cached, name
    stats = httpx.get(f"{server.url}/stats", headers=AUTH).json()
    assert stats["total_cached_tokens"] == metric_value(after, "cachetally_cached_tokens_total", tier="all")
    lines = stats_lines(server.log)
    assert lines and not any("pid=" in line for line in lines)  # one process: no line names one


def test_engine_death_fails_requests_at_once_and_the_server_exits_clean(server: Server) -> None:
    """What a supervisor (Kubernetes, systemd) needs: no hung request, then an exit to restart.

    The 503 with OpenAI error JSON on the patched routes is the middleware's; ``/health``
    and the exit are vLLM's own (its watchdog stops the server about 5 s after the engine
    died, unless ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1``).
    """
    assert httpx.get(f"{server.url}/health").status_code == 200
    model = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]["id"]
    children = server.proc.children(recursive=True)
    core = engine_core(server)
    core.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    core.wait(timeout=10)
    timings = {}
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi", "stream": True}),
    ):
        started = time.monotonic()
        resp = httpx.post(f"{server.url}{path}", json={**body, "model": model, "max_tokens": 4},
                          headers=AUTH, timeout=server.pace.timeout())
        timings[path] = time.monotonic() - started
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["type"] == "ServiceUnavailableError"
        assert timings[path] < 5.0
    code = server.proc.wait(timeout=60)
    exited = time.monotonic() - killed
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"engine processes left behind: {alive}"
    report("engine-death", request_503_s={k: round(v, 3) for k, v in timings.items()},
           server_exit_s=round(exited, 1), exit_code=code)
