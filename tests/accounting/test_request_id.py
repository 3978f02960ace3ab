"""Request-id keys: unique among in-flight requests of every process, with nothing that can fail.

Several processes behind one port keep one ledger each; a client's id gets the process's
tag as its last key component (:func:`proxy.accounting.request_id.process_tag`), so no shared state
(no claims directory, no I/O) is needed. The keys are held unique across processes for
arbitrary ids by Hypothesis, and through real HTTP a server whose multiprocess directory
suffers a full disk, no file descriptors left, or a tmp cleaner answers every request.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from proxy.accounting.request_id import RequestIds, is_valid_request_id, process_tag
from proxy.server.app import CachetallyApp
from proxy.server.settings import Settings
from tests.servers import serving_in_thread

_IDS = st.from_regex(r"[A-Za-z0-9._:-]{1,128}", fullmatch=True)
_TAGS = st.integers(min_value=1, max_value=2**22).map(lambda pid: f".p{pid}")


@given(_IDS, _IDS, _TAGS, _TAGS, st.integers(0, 3), st.integers(0, 3))
@example("a" * 128, "a" * 128, ".p4194304", ".p1", 0, 1)  # the longest ids: the tag, then a suffix, within 128
def test_two_processes_never_give_out_the_same_key(
    first: str, second: str, tag_a: str, tag_b: str, taken_a: int, taken_b: int
) -> None:
    """Whatever ids clients send, and however many keys each process already holds."""
    ids = RequestIds()

    def taking_after(misses: int) -> Any:
        left = [misses]

        def take(key: str) -> bool:
            left[0] -= 1
            return left[0] < 0

        return take

    key_a = ids.unique_key(first, taking_after(taken_a), tag_a)
    key_b = ids.unique_key(second, taking_after(taken_b), tag_b)
    assert all(is_valid_request_id(key) for key in (key_a, key_b))
    assert key_a.endswith(tag_a) and key_b.endswith(tag_b)
    if tag_a != tag_b:
        assert key_a != key_b


def test_a_minted_key_is_32_hex_digits_and_carries_no_tag() -> None:
    """128 random bits are unique without the process's tag (the record's ``request_id``)."""
    key = RequestIds().unique_key(None, lambda key: True, ".p101")
    assert len(key) == 32 and int(key, 16) >= 0


def test_the_tag_is_this_processes_own() -> None:
    assert process_tag() == f".p{os.getpid()}"


FAULTS = {
    "ENOSPC": OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
    "EMFILE": OSError(errno.EMFILE, os.strerror(errno.EMFILE)),
}


@pytest.mark.loopback
@pytest.mark.parametrize("fault", ["ENOSPC", "EMFILE", "directory-removed"])
def test_a_filesystem_fault_fails_no_request_with_an_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """Several processes' mode (a multiprocess directory); four requests share one id at once."""
    mp_dir = tmp_path / "mp"
    mp_dir.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(mp_dir))
    if fault in FAULTS:
        real_open = os.open

        def failing_open(path: Any, *args: Any, **kwargs: Any) -> int:
            if str(path).startswith(str(mp_dir)):
                raise FAULTS[fault]
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(os, "open", failing_open)
    usage = tmp_path / "usage"
    settings = Settings(engine="sim", usage_dir=str(usage), sim_token_delay_s=0.02).validate()
    body = {"model": "sim-model", "prompt": "one id for all", "max_tokens": 5}

    async def burst(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            return await asyncio.gather(*(
                client.post("/v1/completions", json=body, headers={"x-request-id": "shared-id"}) for _ in range(4)
            ))

    with serving_in_thread(CachetallyApp(settings)) as url:
        if fault == "directory-removed":
            for child in mp_dir.iterdir():
                if child.is_dir():
                    shutil.rmtree(child)
        responses = asyncio.run(burst(url))
    assert [(r.status_code, r.headers["x-request-id"]) for r in responses] == [(200, "shared-id")] * 4
    records = [orjson.loads(line) for path in usage.glob("*.jsonl") for line in path.read_bytes().splitlines()]
    keys = [record["request_id"] for record in records]
    assert len(set(keys)) == 4 and all(key.startswith("shared-id") and key.endswith(process_tag()) for key in keys)


def test_the_upstream_gets_the_key_as_its_one_x_request_id_not_the_clients_header_beside_it() -> None:
    """The key, not the raw header, reaches engines and upstreams; an engine names its request
    by the first ``X-Request-Id`` it reads (vLLM's ``cmpl-{X-Request-Id}-{i}``, by which the
    tap tells a completions batch's prompts apart), so the client's header, whose id it may
    reuse while another request holds it, must not reach them beside the key."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    seen: list[list[str]] = []

    async def chat(request: Request) -> JSONResponse:
        seen.append(request.headers.getlist("x-request-id"))
        return JSONResponse({"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                          "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

    upstream = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    with serving_in_thread(upstream, "upstream") as upstream_url:
        app = CachetallyApp(Settings(engine="upstream", upstream=upstream_url, model="m").validate())
        with serving_in_thread(app, "cachetally") as url:
            response = httpx.post(f"{url}/v1/chat/completions", headers={"x-request-id": "mine"}, timeout=10,
                                  json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200 and response.headers["x-request-id"] == "mine"
    assert seen == [["mine"]]  # the key: the client's id, no other request holding it
