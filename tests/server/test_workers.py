"""``cachetally serve --upstream URL --workers N``: /metrics and /stats sum every worker.

Loopback: the standalone sim (reporting cached_tokens) as the upstream, and cachetally with
two uvicorn workers, both subprocesses that are always stopped. Requests go out on fresh
connections until both workers have answered some (each worker's debug stats line names
its pid).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from proxy.server.workers import forget_dead_workers
from tests.clients import expected_stats
from tests.servers import ROOT, metric_value, running_server

pytestmark = pytest.mark.loopback
SIM = ["-m", "engine_adapter.sim", "--log-level", "warning", "--report-cached-tokens"]
MAX_REQUESTS = 240  # bounded: two workers each answer some long before this
_PID = re.compile(r"prefix cache stats: .* pid=(\d+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    with running_server(SIM, timeout_s=20) as (url, _):
        yield url


def serve_workers(
    upstream: str, log: Path, env: dict[str, str] | None = None
) -> contextlib.AbstractContextManager[tuple[str, subprocess.Popen[bytes]]]:
    args = ["-m", "proxy.server.cli", "serve", "--upstream", upstream, "--workers", "2", "--log-level", "debug"]
    return running_server(args, env=env, timeout_s=60, log_path=log)


def _pids(log: Path) -> set[int]:
    return {int(pid) for pid in _PID.findall(log.read_text(errors="replace"))}


def _one(url: str, i: int) -> dict[str, int]:
    """One request on a fresh connection; the usage it reported."""
    prompt = f"shared preamble {'alpha beta gamma ' * 8} question {i % 5}"  # hits after the first of each
    stream = i % 3 == 0
    path, body = (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]})
        if i % 2 else ("/v1/completions", {"prompt": prompt})
    )
    body |= {"model": "sim-model", "max_tokens": 4, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    with httpx.Client(timeout=10) as client:  # a new connection each time: the kernel picks the worker
        if not stream:
            response = client.post(url + path, json=body)
            response.raise_for_status()
            usage = response.json()["usage"]
        else:
            usage = None
            with client.stream("POST", url + path, json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        chunk = orjson.loads(line[6:])
                        usage = chunk.get("usage") or usage
            assert usage is not None
    return {"prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"]}


def test_two_workers_sum_into_metrics_and_stats(upstream: str, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with serve_workers(upstream, log) as (url, _):
        seen: list[dict[str, int]] = []
        deadline = time.monotonic() + 120
        while len(seen) < 40 or (len(_pids(log)) < 2 and len(seen) < MAX_REQUESTS):
            assert time.monotonic() < deadline, "out of time"
            seen.append(_one(url, len(seen)))
        assert len(_pids(log)) == 2, f"one worker answered all {len(seen)} requests"

        prompt = sum(u["prompt"] for u in seen)
        cached = sum(u["cached"] for u in seen)
        hits = sum(1 for u in seen if u["cached"] > 0)
        assert 0 < hits < len(seen)
        for _ in range(10):  # fresh connections: either worker answers
            text = httpx.get(f"{url}/metrics", timeout=10).text
            assert metric_value(text, "cachetally_requests_total") == len(seen)
            assert metric_value(text, "cachetally_prompt_tokens_total") == prompt
            assert metric_value(text, "cachetally_cached_tokens_total", tier="all") == cached
            assert metric_value(text, "cachetally_requests_total", cache="hit") == hits
            assert metric_value(text, "cachetally_ledger_open_slots") == 0
            stats = httpx.get(f"{url}/stats", timeout=10).json()
            assert stats == expected_stats((u["prompt"], u["cached"]) for u in seen)
        own_dir = _own_dir(log)
        assert own_dir.is_dir()
    assert not own_dir.exists()  # the instance's own directory goes with it


_STALE = """
from proxy.accounting.metrics import Metrics
from proxy.accounting.records.record import UsageRecord
from proxy.patching.ledger import UsageLedger
metrics = Metrics(UsageLedger())
for _ in range(1000):
    metrics.record(UsageRecord("r", "default", "chat", False, 0.0, model="sim-model", prompt_tokens=100,
                               cached_tokens=50))
"""


def test_a_preset_multiprocess_dir_is_wiped_at_start(upstream: str, tmp_path: Path) -> None:
    mp_dir = tmp_path / "prometheus"
    mp_dir.mkdir()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(mp_dir)}
    # A previous run's files: 1,000 requests counted by a process that is gone.
    subprocess.run([sys.executable, "-c", _STALE], env={**os.environ, **env, "PYTHONPATH": str(ROOT)}, check=True)
    assert list(mp_dir.glob("*.db"))
    log = tmp_path / "serve.log"
    with serve_workers(upstream, log, env) as (url, _):
        usage = _one(url, 1)
        text = httpx.get(f"{url}/metrics", timeout=10).text
        assert metric_value(text, "cachetally_requests_total") == 1
        assert metric_value(text, "cachetally_prompt_tokens_total") == usage["prompt"]
        assert httpx.get(f"{url}/stats", timeout=10).json()["total_requests"] == 1
    assert re.search(r"PROMETHEUS_MULTIPROC_DIR=\S+; removed \d+ \*\.db file", log.read_text())
    assert mp_dir.is_dir()  # the operator's directory is theirs: kept


_OPEN_SLOTS = """
from proxy.accounting.metrics import Metrics
from proxy.patching.ledger import UsageLedger
ledger = UsageLedger()
metrics = Metrics(ledger)
for i in range(3):
    ledger.open(f"k{i}")
"""


def test_a_dead_workers_open_slots_leave_the_gauge(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    dead = subprocess.run([sys.executable, "-c", _OPEN_SLOTS], env=env, check=True)
    assert dead.returncode == 0
    registry = CollectorRegistry()
    MultiProcessCollector(registry, str(tmp_path))
    assert registry.get_sample_value("cachetally_ledger_open_slots") == 3
    assert len(forget_dead_workers(str(tmp_path))) == 1
    assert registry.get_sample_value("cachetally_ledger_open_slots") in (None, 0)


def test_workers_are_refused_with_vllm() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "proxy.server.cli", "serve", "--workers", "2"], cwd=ROOT, capture_output=True, text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--api-server-count" in result.stderr


def test_a_killed_workers_open_slot_leaves_the_gauge_when_uvicorn_replaces_it(tmp_path: Path) -> None:
    import signal

    import psutil

    log = tmp_path / "serve.log"
    with (
        running_server([*SIM, "--token-delay-s", "1.0"], timeout_s=20) as (slow, _),
        serve_workers(slow, log) as (url, proc),
    ):
        port = int(url.rsplit(":", 1)[1])
        body = {"model": "sim-model", "prompt": "a slow stream", "max_tokens": 30, "stream": True}
        with httpx.Client(timeout=10) as client, client.stream("POST", f"{url}/v1/completions", json=body) as response:
            chunks = response.iter_raw()  # kept: a dropped generator would close the stream
            next(chunks)  # the stream has started: its slot is open
            assert metric_value(httpx.get(f"{url}/metrics", timeout=10).text, "cachetally_ledger_open_slots") == 1
            holders = [
                child for child in psutil.Process(proc.pid).children()
                if any(c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED
                       for c in child.net_connections("tcp"))
            ]
            assert len(holders) == 1
            dead = holders[0].pid
            os.kill(dead, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while metric_value(httpx.get(f"{url}/metrics", timeout=10).text, "cachetally_ledger_open_slots") != 0:
            assert time.monotonic() < deadline, "the dead worker's open slot never left the gauge"
            time.sleep(0.2)
        assert f"dead worker(s) [{dead}]" in log.read_text()


def test_a_worker_killed_before_its_metrics_file_was_sized_breaks_no_scrape(upstream: str, tmp_path: Path) -> None:
    """prometheus_client creates a process's file empty and sizes it a moment later; a
    worker killed in between leaves the empty file for good, under a pid that never comes
    back (prometheus/client_python#1199). Every scrape after it must still sum the rest."""
    log = tmp_path / "serve.log"
    with serve_workers(upstream, log) as (url, _):
        seen = [_one(url, i) for i in range(6)]
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout.strip()
        for kind in ("counter", "histogram", "gauge_livesum"):  # the files a worker opens first
            (_own_dir(log) / f"{kind}_{dead}.db").touch()
        for _ in range(6):  # fresh connections: either worker answers
            metrics = httpx.get(f"{url}/metrics", timeout=10)
            assert metrics.status_code == 200, metrics.text
            assert metric_value(metrics.text, "cachetally_requests_total") == len(seen)
            assert metric_value(metrics.text, "cachetally_ledger_open_slots") == 0
            stats = httpx.get(f"{url}/stats", timeout=10)
            assert stats.status_code == 200, stats.text
            assert stats.json() == expected_stats((u["prompt"], u["cached"]) for u in seen)


def test_one_request_id_in_flight_on_both_workers_leaves_distinct_records(tmp_path: Path) -> None:
    """Clients reusing one ``X-Request-Id`` at once: each worker has its own ledger, yet the
    usage records (what billing deduplicates on) must never share a ``request_id``."""
    import asyncio

    usage = tmp_path / "usage"
    log = tmp_path / "serve.log"
    n = 16
    with (
        running_server([*SIM, "--token-delay-s", "0.05"], timeout_s=20) as (slow, _),
        running_server(["-m", "proxy.server.cli", "serve", "--upstream", slow, "--workers", "2", "--log-level", "info",
                        "--usage-dir", str(usage), "--usage-flush-interval", "0.2"],
                       timeout_s=60, log_path=log) as (url, _),
    ):
        async def burst(client_id: str) -> list[httpx.Response]:
            body = {"model": "sim-model", "prompt": "one id for all", "max_tokens": 10}  # 0.5 s each
            async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_connections=n)) as client:
                return await asyncio.gather(*(
                    client.post("/v1/completions", json=body, headers={"x-request-id": client_id}) for _ in range(n)
                ))

        # Bursts until the kernel has given both workers some of one. Which worker accepts a
        # connection is the kernel's choice: on a loaded machine one worker can take several
        # bursts whole, so the bound is time, not a count of bursts.
        deadline = time.monotonic() + 90
        for attempt in itertools.count(1):
            client_id = f"shared-{attempt}"
            responses = asyncio.run(burst(client_id))
            assert [(r.status_code, r.headers["x-request-id"]) for r in responses] == [(200, client_id)] * n
            records = _records(usage, client_id, n)
            assert len({record_id for record_id, _ in records}) == n, records
            if len({pid for _, pid in records}) == 2:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"one worker took every request of {attempt} bursts")
        # Each worker's keys end with its own tag: no two processes can give out the same one.
        assert all(record_id.endswith(f".p{pid}") for record_id, pid in records), records
    # Each worker says where its records go; the parent, which only checked the settings, does not.
    assert log.read_text().count(f"usage records: JSONL files in {usage}") == 2


def _own_dir(log: Path) -> Path:
    """The instance's own multiprocess directory, as its log names it."""
    found = re.search(r"summed through (\S+) \(removed at exit\)", log.read_text())
    assert found is not None
    return Path(found[1])


def _records(usage: Path, client_id: str, n: int) -> list[tuple[str, int]]:
    """(request_id, writing worker's pid) of the records for ``client_id``, once all ``n`` are written."""
    deadline = time.monotonic() + 20
    while True:
        found = [
            (record["request_id"], int(path.name.split("-")[-2]))  # usage-<stamp>-<pid>-<n>.jsonl
            for path in usage.glob("*.jsonl")
            for record in map(orjson.loads, path.read_bytes().splitlines())
            if record["request_id"].split(".")[0] == client_id
        ]
        if len(found) >= n or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_the_upstream_pool_gauges_sum_every_worker(tmp_path: Path) -> None:
    """Each worker has its own pool: the gauges are every worker's together, whichever
    worker answers the scrape (each answered with its own pool alone: 3, 0, 0, 3, ...)."""
    open_streams = 3
    body = {"model": "sim-model", "prompt": "a slow stream", "max_tokens": 300, "stream": True}
    with (
        running_server([*SIM, "--token-delay-s", "0.1"], timeout_s=20) as (slow, _),
        serve_workers(slow, tmp_path / "serve.log") as (url, _),
        contextlib.ExitStack() as streams,
    ):
        def checked_out() -> float:
            text = httpx.get(f"{url}/metrics", timeout=10).text  # a fresh connection: either worker answers
            return metric_value(text, "cachetally_upstream_connections_checked_out")

        held = []  # each stream's chunks: a dropped generator would close its stream
        for _ in range(open_streams):  # each on its own connection, so on either worker
            client = streams.enter_context(httpx.Client(timeout=30))
            response = streams.enter_context(client.stream("POST", f"{url}/v1/completions", json=body))
            held.append(response.iter_raw())
            next(held[-1])  # its upstream connection is checked out
        deadline = time.monotonic() + 30
        while checked_out() != open_streams:  # each worker writes its share within a second
            assert time.monotonic() < deadline, "the gauge never summed the open streams"
            time.sleep(0.2)
        assert [checked_out() for _ in range(20)] == [open_streams] * 20


def test_the_sim_engines_own_counters_sum_every_worker() -> None:
    """``--engine sim --workers 2``: two simulators; ``sim_requests_total`` counts both, on
    every scrape (one worker's alone went 2, 8, 2, 8: a counter Prometheus reads as resets)."""
    args = ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--workers", "2", "--log-level", "warning"]
    with running_server(args, timeout_s=60) as (url, _):
        sent = 12
        for i in range(sent):
            with httpx.Client(timeout=10) as client:  # a new connection each time: the kernel picks the worker
                client.post(f"{url}/v1/completions", json={"prompt": f"request {i}", "max_tokens": 1}).raise_for_status()

        def scraped() -> float:
            return metric_value(httpx.get(f"{url}/metrics", timeout=10).text, "sim_requests_total")

        deadline = time.monotonic() + 30
        while scraped() != sent:  # each worker writes its share within a second
            assert time.monotonic() < deadline, "the counter never summed both workers"
            time.sleep(0.2)
        assert [scraped() for _ in range(20)] == [sent] * 20


def _children(pid: int) -> set[int]:
    return set(map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split()))


def test_a_worker_that_exits_whole_leaves_none_of_its_engine_gauges_in_the_sum() -> None:
    """SIGHUP: uvicorn starts each new worker before it stops the old one, so the new one's
    check finds the old alive, and nothing dropped the old one's gauge files:
    ``sim_prefix_cache_blocks`` read the old simulators' blocks (200 of 300) for good, where
    two fresh simulators hold none."""
    args = ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--workers", "2", "--log-level", "warning"]
    with running_server(args, timeout_s=60) as (url, proc):
        for i in range(12):
            with httpx.Client(timeout=10) as client:  # a new connection each time: the kernel picks the worker
                client.post(f"{url}/v1/completions", json={"prompt": f"request {i} " * 200, "max_tokens": 1})

        def cached_blocks() -> float:
            return metric_value(httpx.get(f"{url}/metrics", timeout=10).text, "sim_prefix_cache_blocks")

        deadline = time.monotonic() + 30
        while cached_blocks() == 0:  # each worker writes its share within a second
            assert time.monotonic() < deadline, "the gauge never showed the cached blocks"
            time.sleep(0.2)
        old = _children(proc.pid)  # the two workers and multiprocessing's resource tracker
        os.kill(proc.pid, signal.SIGHUP)
        while len(_children(proc.pid) - old) < 2 or len(_children(proc.pid)) > len(old):  # both old workers gone
            assert time.monotonic() < deadline + 60, "uvicorn never replaced the workers"
            time.sleep(0.2)
        assert [cached_blocks() for _ in range(10)] == [0] * 10
