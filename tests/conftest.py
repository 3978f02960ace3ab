"""Shared fixtures. The vLLM server is session-scoped: one engine start (half a minute or more
on CPU: docs/PERFORMANCE.md) serves every real-engine test module, and it is always
stopped at the end.

Order: tests without vLLM first, then the modules that start an engine of their own, then
those on the shared server, which lives to the end of the session. So at most one vLLM
engine runs at a time: vLLM binds every engine's OpenMP threads to the same core
(``VLLM_CPU_OMP_THREADS_BIND=auto``), and two at once halve each other's speed.

Lanes (``scripts/test`` runs ``pytest -n 2 --dist loadscope``): :func:`pytest_xdist_make_scheduler`
makes every test in ``tests/real_vllm/`` one unit of work, so one worker runs them all, in
the order above, one engine at a time; the other worker runs the rest, module by module,
on the core vLLM's OpenMP threads leave free."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from tests.clients import engine_block_size
from tests.in_flight import RequestsInFlight
from tests.load import report
from tests.otlp_receiver import Receiver, otlp_receiver
from tests.servers import ENGINE_KV_FLAGS, Pace, assert_no_traceback_in_vllm_log, measure_pace, running_server
from tests.vllm_preloaded import Script, vllm_scripts


#: A real-engine test's bound (pyproject.toml's ``timeout`` is every other test's), fixtures
#: included: the longest start a fixture allows, two engines at once (600 s) and then a
#: router (120 s), and the test's own few minutes on a slow machine.
REAL_ENGINE_TIMEOUT_S = 1200


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def phase(item: pytest.Item) -> int:
        if item.get_closest_marker("vllm") is None:
            return 0
        return 2 if "vllm_server" in getattr(item, "fixturenames", ()) else 1

    items.sort(key=phase)  # stable: file order within each phase
    for item in items:
        if phase(item) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(REAL_ENGINE_TIMEOUT_S))


#: The folder of the tests that run on a real engine: one xdist lane (module docstring).
REAL_ENGINE = "tests/real_vllm/"


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With ``--dist loadscope``: one unit for all of ``REAL_ENGINE``, one per module otherwise.

    (xdist's ``loadgroup`` would say the same with a mark, but xdist 3.8 writes the group
    into ``item._nodeid``, which pytest 9 no longer reads.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return REAL_ENGINE if nodeid.startswith(REAL_ENGINE) else nodeid.split("::", 1)[0]

    return Lanes(config, log)


@pytest.fixture(scope="session", autouse=True)
def vllm_ipc_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Where every vLLM engine of this session binds its ZeroMQ IPC sockets. vLLM puts them
    under ``VLLM_RPC_BASE_PATH`` (the system's temp folder by default) and leaves them
    there when it stops, cleanly or not: 7 per engine in 0.32.0, `vllm serve` as much as
    `cachetally serve`. Here they go with pytest's temp folders, not into the machine's /tmp."""
    path = tmp_path_factory.mktemp("vllm-ipc")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_RPC_BASE_PATH", str(path))
        yield path


@pytest.fixture(scope="session")
def vllm_usage_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the shared vLLM server writes its usage records (tests/real_vllm/test_vllm_records.py)."""
    return tmp_path_factory.mktemp("vllm-usage")


@pytest.fixture(scope="session")
def vllm_server_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared vLLM server's output (tests/real_vllm/test_vllm_api_servers.py reads it)."""
    return tmp_path_factory.mktemp("vllm") / "serve.log"


@pytest.fixture(scope="session")
def vllm_otlp() -> Iterator[Receiver]:
    """The OTLP collector the shared vLLM server exports its spans to (tests/real_vllm/test_vllm_hostile_billing.py)."""
    with otlp_receiver() as receiver:
        yield receiver


#: The shared vLLM server's tenant header and the tenants it names; a request without the
#: header is ``default``, as on a server without one.
VLLM_TENANT_HEADER = "x-tenant"
VLLM_TENANTS = ("acme", "globex")
#: The shared vLLM server lets go of a client that takes none of its response this long, or
#: sends nothing of its request (tests/real_vllm/test_vllm_records.py); every other test's
#: client reads as it goes, and sends its request at once.
CLIENT_SEND_TIMEOUT_S = 3.0
CLIENT_RECEIVE_TIMEOUT_S = 3.0


@pytest.fixture(scope="session")
def vllm_server(vllm_server_log: Path, vllm_usage_dir: Path, vllm_otlp: Receiver) -> Iterator[str]:
    """`cachetally serve` on the default model with two API server processes (usage records on).

    ``--api-server-count 2``, so every real-engine test on it also runs where vLLM goes
    multi-process: each request is answered by either process, each with its own tap, and
    the metrics are summed through prometheus_client's multiprocess mode. The one-process
    default is what tests/real_vllm/test_engine_death.py and tests/real_vllm/test_fleet.py's replicas run.
    Debug level: one stats line per request, naming its process.

    Billing as it runs in production: usage records in a directory and OTLP spans to a
    collector (``vllm_otlp``), in an environment whose OpenTelemetry sampler drops every
    trace (which must not drop a span of ours), and a trusted tenant header.
    ``--enable-prompt-embeds``: completions' ``prompt_embeds`` reach the engine with no token ids.
    ``--block-size 32``: CUDA's default is 16 and CPU's 128 would hide off-by-block errors at
    16; vLLM on a CPU refuses 16 (its attention takes multiples of 32), so 32 is the nearest.
    The modules that start an engine of their own keep the CPU's default, 128: both are run.
    Its stop comes with a JSON request and a stream in flight (:mod:`tests.in_flight`).
    """
    log = vllm_server_log
    args = ["-m", "proxy.server.cli", "serve", "--log-level", "debug", "--usage-dir", str(vllm_usage_dir),
            "--usage-flush-interval", "0.2", "--otlp-endpoint", vllm_otlp.url,
            "--tenant-header", VLLM_TENANT_HEADER, "--tenants", ",".join(VLLM_TENANTS),
            "--client-send-timeout", str(CLIENT_SEND_TIMEOUT_S),
            "--client-receive-timeout", str(CLIENT_RECEIVE_TIMEOUT_S),
            "--", "--api-server-count", "2", "--enable-prompt-embeds", "--block-size", "32", *ENGINE_KV_FLAGS]
    env = {"OTEL_TRACES_SAMPLER": "always_off"}
    with running_server(args, env=env, timeout_s=600, log_path=log) as (url, proc):
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "the engine core runs in a child process"
        yield url
        in_flight = RequestsInFlight(url, timeout_s=60)
        in_flight.start()  # stopped with them in flight (RELIABILITY §14)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal it captured.
    assert proc.returncode in (0, -signal.SIGTERM), f"unclean exit {proc.returncode}"
    in_flight.check(vllm_usage_dir)
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"engine processes left behind: {alive}"
    assert_no_traceback_in_vllm_log(log)


@pytest.fixture(scope="session")
def vllm_block(vllm_server: str) -> int:
    """The shared vLLM server's prefix-cache block size, as its engine reports it: a warm
    prompt reports the whole blocks of all but its last token."""
    return engine_block_size(vllm_server)


@pytest.fixture(scope="session")
def vllm_pace(vllm_server: str) -> Pace:
    """One cold request on the shared vLLM server, timed: the base of every vLLM test's timeout."""
    model = httpx.get(f"{vllm_server}/v1/models", timeout=None).json()["data"][0]["id"]
    pace = measure_pace(vllm_server, model)
    report("vllm-pace", request_s=round(pace.request_s, 3), timeout_1_s=round(pace.timeout(), 1))
    return pace


@pytest.fixture(scope="session")
def sim_server() -> Iterator[str]:
    """`cachetally serve --engine sim` on loopback, shared by the tests that only add to it."""
    args = ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--log-level", "warning"]
    with running_server(args) as (url, _):
        yield url


@pytest.fixture
def sim_client(sim_server: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{sim_server}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="session")
def vllm_script() -> Iterator[Script]:
    """Run a script with vLLM's app in a process of its own, vLLM already imported
    (:mod:`tests.vllm_preloaded`); the fork server is stopped at the end of the session."""
    yield from vllm_scripts()
