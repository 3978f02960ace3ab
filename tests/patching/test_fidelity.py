"""Fidelity under load: 200 concurrent streams through the proxy, each byte-identical to
what the engine emits for the same request, except the usage patch.

The reference is a standalone sim started with ``--report-cached-tokens``: it writes the
exact ``prompt_tokens_details.cached_tokens`` itself, where the patch puts it (and, on
chat, its writes under vLLM's name, which the patch also writes under OpenAI's; on
completions it reports no writes, as vLLM, and the embedded sim's patch adds the engine's,
which the comparison leaves out). The embedded sim reports nothing, so there every
``cached_tokens`` the clients see was written by the proxy from the engine's event. In
upstream mode the proxy has no engine event and keeps the upstream's own report, so that
sim reports too; what is checked there is that nothing else changes and that the ghost
usage chunk (asked for when the client did not) never reaches the client, its
``system_fingerprint`` back on the finishing chunk where vLLM puts it. Each
request has its own warmed prefix, so cached counts do not depend on the order in which
the 200 concurrent requests reach the engine. Response ids and ``created`` differ by
construction and are masked.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.load import count, report
from tests.servers import running_server

pytestmark = pytest.mark.loopback

STREAMS = count(200, 1000)
SIM = ["-m", "engine_adapter.sim", "--log-level", "warning", "--token-delay-s", "0.005"]


def masked(raw: bytes) -> bytes:
    raw = re.sub(rb'"id":"[^"]*"', b'"id":"X"', raw)
    return re.sub(rb'"created":\d+', b'"created":0', raw)


def with_openais_writes(raw: bytes) -> bytes:
    """The reference sim's bytes as the patch leaves them: its cache writes (vLLM's
    ``created_cache_tokens``) under OpenAI's name too, ``cache_write_tokens``."""
    return re.sub(rb'"created_cache_tokens":(\d+)', rb'"created_cache_tokens":\1,"cache_write_tokens":\1', raw)


#: The writes the patch adds from the engine's event where the engine reports none (vLLM's
#: completions route reports reads alone).
ENGINE_WRITES = re.compile(rb',"created_cache_tokens":\d+,"cache_write_tokens":\d+')


def without_added_writes(have: bytes, want: bytes) -> bytes:
    """``have`` less the writes the patch added (each usage chunk's, when there is one)
    where the reference reports none."""
    if b'"created_cache_tokens"' in want or b'"usage"' not in have:
        return have
    stripped, added = ENGINE_WRITES.subn(b"", have)
    assert added == have.count(b'"prompt_tokens_details"')
    return stripped


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    logs = tmp_path_factory.mktemp("fidelity")
    with contextlib.ExitStack() as stack:
        reference, _ = stack.enter_context(
            running_server([*SIM, "--report-cached-tokens"], log_path=logs / "reference.log")
        )
        upstream_sim, _ = stack.enter_context(running_server([*SIM, "--report-cached-tokens"]))
        upstream, _ = stack.enter_context(
            running_server(["-m", "proxy.server.cli", "serve", "--upstream", upstream_sim, "--log-level", "warning"])
        )
        embedded, _ = stack.enter_context(
            running_server(
                ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--log-level", "warning"],
                env={"CACHETALLY_SIM_TOKEN_DELAY_S": "0.005"},
            )
        )
        yield {"reference": reference, "upstream": upstream, "sim": embedded}


def plan(n: int) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(path, warm-up body, streamed body) per request: a private prefix, then more."""
    out = []
    for i in range(n):
        prefix = " ".join([uuid.uuid4().hex, *(f"w{j}" for j in range(16 + 8 * (i % 9)))])
        rest = " ".join([uuid.uuid4().hex, *(f"x{j}" for j in range(i % 23))])
        stream: dict[str, Any] = {"max_tokens": 1 + i % 16, "stream": True}
        if i % 3:
            stream["stream_options"] = {"include_usage": True}
        if i % 2:
            path, warm = "/v1/chat/completions", {"messages": [{"role": "user", "content": prefix}]}
            stream["messages"] = [{"role": "user", "content": prefix + " " + rest}]
        else:
            path, warm = "/v1/completions", {"prompt": prefix}
            stream["prompt"] = prefix + " " + rest
        out.append((path, {**warm, "max_tokens": 1}, stream))
    return out


async def run(url: str, requests: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> list[bytes]:
    # A fresh client per phase: a keep-alive connection left idle by the warm-up may be
    # closed by the server (uvicorn: 5 s) just as the stream phase reuses it.
    limits = httpx.Limits(max_connections=len(requests))
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def warm(path: str, body: dict[str, Any]) -> None:
            assert (await client.post(path, json=body)).status_code == 200

        await asyncio.gather(*(warm(path, body) for path, body, _ in requests))

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def stream(path: str, body: dict[str, Any]) -> bytes:
            async with client.stream("POST", path, json=body) as response:
                assert response.status_code == 200
                return b"".join([chunk async for chunk in response.aiter_raw()])

        return await asyncio.gather(*(stream(path, body) for path, _, body in requests))


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["upstream", "sim"])
async def test_concurrent_streams_are_the_engines_bytes_plus_the_usage_patch(
    servers: dict[str, str], mode: str
) -> None:
    requests = plan(STREAMS)
    expected = await run(servers["reference"], requests)
    got = await run(servers[mode], requests)
    cached = []
    for want, have in zip(expected, got, strict=True):
        if mode == "sim":
            have = without_added_writes(have, want)
        assert masked(have) == with_openais_writes(masked(want))
        usage = [e for e in have.split(b"\n\n") if b'"usage"' in e]
        cached += [orjson.loads(e[len(b"data: "):])["usage"]["prompt_tokens_details"]["cached_tokens"] for e in usage]
    assert len(cached) == sum(1 for _, _, body in requests if "stream_options" in body)
    assert sum(1 for value in cached if value > 0) == len(cached)  # every prefix was a hit
    report("fidelity", mode=mode, streams=len(requests), identical=len(requests), usage_chunks=len(cached))
