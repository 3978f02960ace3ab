"""Data parallel on vLLM's own server: ``vllm serve MODEL --middleware ... --data-parallel-size 2``.

Two engine cores behind two API servers (vLLM defaults ``--api-server-count`` to the DP
size). Each API server's ``DPLBAsyncMPClient`` balances requests over both engines by
load, not by prefix, so a repeat may land on the engine that never saw the prompt. Every
response must still carry exactly what the engine that served it found: 0 cold, the
whole blocks warm. The test reads ``vllm:prompt_tokens_cached_total`` per ``engine``
label around each request, so it knows which engine served it and what its scheduler
counted; over the run, the reported sum equals the sum of both engines' deltas.
docs/DEPLOY.md ("Data parallel") traces the path through vLLM's code.

It runs in the default suite; most of its time is the start of two API servers and two
engines. On CUDA it needs two GPUs, one per engine (skipped on one).

Each engine's OpenMP threads are bound to a core of its own (``VLLM_CPU_OMP_THREADS_BIND``
takes one list per DP rank, split by ``|``).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import openai
import psutil
import pytest

from engine_adapter.vllm.cpu import machine_flags
from engine_adapter.vllm.model_store import ensure_default_model
from engine_adapter.vllm.serve import SHUTDOWN_TIMEOUT_S
from tests import clients
from tests.clients import fresh_prompt
from tests.load import report
from tests.servers import ENGINE_KV_FLAGS, Pace, assert_no_traceback_in_vllm_log, measure_pace, metric_value, running_server

pytestmark = [pytest.mark.vllm, pytest.mark.loopback]

MODEL = "SmolLM2-135M-Instruct"
MIDDLEWARE = "proxy.vllm_middleware.CachetallyMiddleware"
ENGINES = ("0", "1")
OURS = "cachetally_cached_tokens_total"


def core_binds() -> dict[str, str]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return {}
    half = len(cores) // 2
    return {"VLLM_CPU_OMP_THREADS_BIND": f"{','.join(map(str, cores[:half]))}|{','.join(map(str, cores[half:]))}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Pace]]:
    import torch  # vLLM's dependency

    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        # On CUDA each DP rank takes a GPU of its own: rank 1's worker asserts its cuda:1
        # exists and dies at the start (vllm/v1/worker/gpu_worker.py, init_device).
        pytest.skip("needs 2 GPUs for --data-parallel-size 2 on CUDA")
    log = tmp_path_factory.mktemp("dp") / "serve.log"
    args = [
        "-m", "engine_adapter.vllm.serve", str(ensure_default_model()), "--served-model-name", MODEL,
        "--middleware", MIDDLEWARE, "--data-parallel-size", "2", "--host", "127.0.0.1",
        "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--uvicorn-log-level", "warning", *ENGINE_KV_FLAGS, *machine_flags(ENGINE_KV_FLAGS),
    ]
    began = time.monotonic()
    with running_server(args, env=core_binds(), timeout_s=600, log_path=log) as (url, proc):
        report("dp-start", healthy_s=round(time.monotonic() - began, 1))
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "the API servers and engine cores run in child processes"
        yield url, measure_pace(url, MODEL)
    assert_no_traceback_in_vllm_log(log)
    assert proc.returncode in (0, -signal.SIGTERM), f"unclean exit {proc.returncode}"
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"engine processes left behind: {alive}"


def per_engine(url: str) -> dict[str, tuple[float, float]]:
    text = clients.scrape(url)
    return {
        e: (metric_value(text, "vllm:prompt_tokens_total", engine=e),
            metric_value(text, "vllm:prompt_tokens_cached_total", engine=e))
        for e in ENGINES
    }


def test_each_response_is_what_its_engine_found_and_the_sum_is_both_engines(server) -> None:
    url, pace = server
    block = clients.engine_block_size(url)  # both engines report theirs: one size
    documents = [fresh_prompt(100), fresh_prompt(120)]  # two lengths: the engine that served is told apart
    shapes = [("completions", False), ("chat", True), ("completions", True), ("chat", False)]
    start = per_engine(url)
    ours_start = metric_value(clients.scrape(url), OURS, tier="all")
    reported, served, hits = 0, [], []

    def checked(ask, document: int) -> int:
        """Send one request; its cached_tokens is exactly what the engine that served it found."""
        nonlocal reported
        before = per_engine(url)
        prompt_tokens, cached = ask()
        after = per_engine(url)
        moved = {e: (after[e][0] - before[e][0], after[e][1] - before[e][1]) for e in ENGINES}
        (engine,) = [e for e, (p, _) in moved.items() if p]
        assert moved[engine] == (prompt_tokens, cached), (cached, moved)
        assert all(moved[e] == (0, 0) for e in ENGINES if e != engine), moved
        assert cached % block == 0
        if (engine, document) not in served:  # the first time this engine sees this document
            assert cached == 0, (engine, document, cached)
        else:
            hits.append(cached)
        served.append((engine, document))
        reported += cached
        return cached

    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=pace.timeout(4)) as client:
        for i in range(8):  # each document four times: cold, then warm, on whichever engine
            route, stream = shapes[i % len(shapes)]

            def ask(route=route, stream=stream, prompt=documents[i % 2]) -> tuple[int, int]:
                usage = clients.ask(client, route, stream, prompt, model=MODEL, max_tokens=2, temperature=0)
                return usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens

            checked(ask, i % 2)

        def continuous() -> tuple[int, int]:
            """Continuous usage chunks: every one carries the same exact value."""
            result = client.completions.create(
                model=MODEL, prompt=documents[0], max_tokens=4, stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True},
            )
            usages = [chunk.usage for chunk in result if chunk.usage is not None]
            assert len(usages) >= 3 and len({u.prompt_tokens_details.cached_tokens for u in usages}) == 1
            return usages[-1].prompt_tokens, usages[-1].prompt_tokens_details.cached_tokens

        checked(continuous, 0)

    end = per_engine(url)
    assert {e for e, _ in served} == set(ENGINES), served  # both engines served
    assert hits and all(h > 0 for h in hits), hits
    assert reported == sum(end[e][1] - start[e][1] for e in ENGINES)
    # ... and cachetally's counter, summed over both API server processes (multiprocess mode).
    assert reported == metric_value(clients.scrape(url), OURS, tier="all") - ours_start
    report("dp", served=served, reported=reported)
