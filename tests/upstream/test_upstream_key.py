"""The upstream's own key (``upstream_api_key``): cachetally with tenants' keys of its own,
in front of an upstream that wants a key. The upstream is guarded by vLLM's own
``AuthenticationMiddleware`` (vLLM 0.32's), so what it accepts is what vLLM accepts.

A tenant's key is cachetally's credential: with the setting, it never reaches the upstream,
which gets its own key on every request, its model list included. Without keys of its own
(or the authenticating gateway a tenant header needs), cachetally lends no client that key."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

from proxy.server.app import CachetallyApp
from proxy.server.settings import SettingsError, load_settings
from tests.servers import serving_in_thread

UPSTREAM_KEY = "sk-upstream-7f3a91"
TENANT_KEYS = {"sk-acme-0123456789": "acme", "sk-globex-42": "globex"}
ACME = "sk-acme-0123456789"
SERVED = "served-model"
USAGE = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 3}}


async def _completion(request: Request) -> JSONResponse:
    await request.body()
    return JSONResponse({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": SERVED,
                         "choices": [{"index": 0, "text": "ok", "finish_reason": "length", "logprobs": None}],
                         "usage": USAGE})


async def _chat_stream(request: Request) -> StreamingResponse:
    await request.body()

    def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> bytes:
        choices = [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]
        body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": SERVED,
                "choices": choices, "usage": usage}
        return b"data: " + orjson.dumps(body) + b"\n\n"

    async def events():
        yield chunk({"role": "assistant", "content": ""})
        yield chunk({"content": "ok"})
        yield chunk({}, "length")
        yield chunk({}, usage=USAGE)
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [{"id": SERVED, "object": "model"}]})


def guarded_upstream(seen: list[tuple[str, dict[str, str]]]) -> ASGIApp:
    """The upstream behind vLLM's key check; ``seen`` gets each request's path and the
    credentials it came with, as the upstream received them."""
    app = AuthenticationMiddleware(Starlette(routes=[
        Route("/v1/completions", _completion, methods=["POST"]),
        Route("/v1/chat/completions", _chat_stream, methods=["POST"]),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/tokenize", _completion, methods=["POST"]),  # outside every prefix vLLM guards
    ]), tokens=[UPSTREAM_KEY])

    async def recording(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            credentials = {k.decode().lower(): v.decode() for k, v in scope["headers"]
                           if k.lower() in (b"authorization", b"x-api-key")}
            seen.append((scope["path"], credentials))
        await app(scope, receive, send)

    return recording


@contextlib.contextmanager
def keyed_proxy(tmp_path: Path, env: dict[str, str],
                tenant_keys: bool = True) -> Iterator[tuple[str, list[tuple[str, dict[str, str]]]]]:
    """cachetally, with the tenants' keys (unless not ``tenant_keys``) and ``env``, in front
    of the guarded upstream."""
    keys = tmp_path / "keys.toml"
    keys.write_text("".join(f'"{k}" = "{t}"\n' for k, t in TENANT_KEYS.items()))
    keys.chmod(0o600)
    seen: list[tuple[str, dict[str, str]]] = []
    with serving_in_thread(guarded_upstream(seen)) as upstream:
        settings = load_settings(env=env, overrides={
            "upstream": upstream, "usage_dir": str(tmp_path / "usage"), "usage_flush_interval_s": 0.05,
            **({"api_keys_file": str(keys)} if tenant_keys else {})})
        with serving_in_thread(CachetallyApp(settings)) as url:
            yield url, seen


def _records(tmp_path: Path) -> list[dict]:
    return [orjson.loads(line) for f in sorted((tmp_path / "usage").glob("*.jsonl")) for line in f.read_bytes().splitlines()]


def test_a_tenants_key_never_reaches_the_upstream_which_gets_its_own_on_every_request(tmp_path: Path) -> None:
    with keyed_proxy(tmp_path, {"CACHETALLY_UPSTREAM_API_KEY": UPSTREAM_KEY}) as (url, seen):
        with openai.OpenAI(base_url=f"{url}/v1", api_key=ACME, max_retries=0) as client:
            completion = client.completions.create(model=SERVED, prompt="hi", max_tokens=2)
            stream = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2, stream=True, stream_options={"include_usage": True})
            usages = [chunk.usage for chunk in stream if chunk.usage]
        # Anthropic's clients send their key as x-api-key: a second credential, kept here too.
        raw = httpx.post(f"{url}/v1/completions", json={"model": SERVED, "prompt": "hi", "max_tokens": 2},
                         headers={"authorization": f"Bearer {ACME}", "x-api-key": ACME}, timeout=10)
        refused = httpx.post(f"{url}/v1/completions", json={"model": SERVED, "prompt": "hi"},
                             headers={"authorization": "Bearer sk-wrong"}, timeout=10)
    assert completion.usage is not None and completion.usage.prompt_tokens_details.cached_tokens == 3
    assert [u.prompt_tokens_details.cached_tokens for u in usages] == [3]
    assert raw.status_code == 200, raw.text
    assert refused.status_code == 401  # cachetally's own check, before any upstream
    paths = [path for path, _ in seen]
    assert paths.count("/v1/completions") == 2 and paths.count("/v1/chat/completions") == 1
    assert "/v1/models" in paths  # the model list, fetched with the key too
    assert all(credentials == {"authorization": f"Bearer {UPSTREAM_KEY}"} for _, credentials in seen), seen
    records = _records(tmp_path)
    assert [(r["tenant"], r["model"], r["status"]) for r in records] == [("acme", SERVED, 200)] * 3


def test_a_request_no_key_of_cachetallys_guards_goes_upstream_without_the_upstreams_key(tmp_path: Path) -> None:
    """With tenants' keys, a request their guard lets by unchecked (a path outside the guarded
    prefixes, one in ``auth_exempt_paths``) was sent with the upstream's key too: an upstream
    that checks its key on every path was open there to anyone. Its credentials go as sent."""
    env = {"CACHETALLY_UPSTREAM_API_KEY": UPSTREAM_KEY, "CACHETALLY_AUTH_EXEMPT_PATHS": "/v1/completions"}
    with keyed_proxy(tmp_path, env) as (url, seen):
        body = {"model": SERVED, "prompt": "hi", "max_tokens": 2}
        unguarded = httpx.post(f"{url}/tokenize", json=body, timeout=10)
        exempt = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
        keyed = httpx.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {ACME}"}, timeout=10,
                           json={"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert unguarded.status_code == 200  # vLLM's check guards no such path either
    assert exempt.status_code == 401, exempt.text  # the upstream's own check, on the client's credentials
    assert keyed.status_code == 200, keyed.text
    sent = {path: credentials for path, credentials in seen if path != "/v1/models"}
    assert sent == {"/tokenize": {}, "/v1/completions": {},
                    "/v1/chat/completions": {"authorization": f"Bearer {UPSTREAM_KEY}"}}


def test_without_it_the_clients_key_goes_upstream_as_sent_and_the_log_names_the_setting(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING), keyed_proxy(tmp_path, {}) as (url, seen):
        answer = httpx.post(f"{url}/v1/completions", json={"model": SERVED, "prompt": "hi", "max_tokens": 2},
                            headers={"authorization": f"Bearer {ACME}"}, timeout=10)
    assert answer.status_code == 401  # vLLM's check refused the tenant's key
    assert ("/v1/completions", {"authorization": f"Bearer {ACME}"}) in seen
    warned = [r.getMessage() for r in caplog.records if "upstream's models" in r.getMessage()]
    assert warned and "set CACHETALLY_UPSTREAM_API_KEY" in warned[0]
    assert not any(key in caplog.text for key in (ACME, UPSTREAM_KEY))


def test_without_keys_of_its_own_cachetally_never_lends_a_client_the_upstreams_key(tmp_path: Path) -> None:
    """With no key checked here, the upstream's key in place of the client's credentials let
    any client that reached cachetally through the upstream's own check. The upstream checks
    each client itself then; its key serves cachetally's model list, so labels stay right."""
    with keyed_proxy(tmp_path, {"CACHETALLY_UPSTREAM_API_KEY": UPSTREAM_KEY}, tenant_keys=False) as (url, seen):
        body = {"model": SERVED, "prompt": "hi", "max_tokens": 2}
        keyless = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
        wrong = httpx.post(f"{url}/v1/completions", json=body, headers={"authorization": "Bearer sk-wrong"},
                           timeout=10)
        with openai.OpenAI(base_url=f"{url}/v1", api_key=UPSTREAM_KEY, max_retries=0) as client:
            completion = client.completions.create(**body)
    assert (keyless.status_code, wrong.status_code) == (401, 401)  # the upstream's own check
    assert completion.usage is not None and completion.usage.prompt_tokens_details.cached_tokens == 3
    assert ("/v1/models", {"authorization": f"Bearer {UPSTREAM_KEY}"}) in seen
    sent = [credentials for path, credentials in seen if path == "/v1/completions"]
    assert sent == [{}, {"authorization": "Bearer sk-wrong"}, {"authorization": f"Bearer {UPSTREAM_KEY}"}]
    records = _records(tmp_path)
    assert [(r["tenant"], r["model"], r["status"]) for r in records if r["status"] == 200] == [
        ("default", SERVED, 200)]


def test_behind_the_gateway_a_tenant_header_needs_the_upstream_gets_its_key(tmp_path: Path) -> None:
    """A tenant header is trusted only behind a gateway that authenticates clients: there the
    upstream's key goes in place of what the client sent, as beside cachetally's own keys."""
    env = {"CACHETALLY_UPSTREAM_API_KEY": UPSTREAM_KEY, "CACHETALLY_TENANT_HEADER": "x-tenant",
           "CACHETALLY_TENANTS": "acme"}
    with keyed_proxy(tmp_path, env, tenant_keys=False) as (url, seen):
        answer = httpx.post(f"{url}/v1/completions", json={"model": SERVED, "prompt": "hi", "max_tokens": 2},
                            headers={"x-tenant": "acme", "authorization": "Bearer sk-gateway"}, timeout=10)
    assert answer.status_code == 200, answer.text
    assert all(credentials == {"authorization": f"Bearer {UPSTREAM_KEY}"} for _, credentials in seen), seen
    assert [(r["tenant"], r["model"], r["status"]) for r in _records(tmp_path)] == [("acme", SERVED, 200)]


def test_beside_cachetallys_single_key_the_upstream_gets_its_own(tmp_path: Path) -> None:
    """``CACHETALLY_API_KEY`` authenticates clients as a keys file does: the client's key is
    cachetally's, and the upstream gets its own in its place."""
    env = {"CACHETALLY_UPSTREAM_API_KEY": UPSTREAM_KEY, "CACHETALLY_API_KEY": ACME}
    with keyed_proxy(tmp_path, env, tenant_keys=False) as (url, seen):
        answer = httpx.post(f"{url}/v1/completions", json={"model": SERVED, "prompt": "hi", "max_tokens": 2},
                            headers={"authorization": f"Bearer {ACME}"}, timeout=10)
    assert answer.status_code == 200, answer.text
    assert all(credentials == {"authorization": f"Bearer {UPSTREAM_KEY}"} for _, credentials in seen), seen
    assert [(r["model"], r["cached_tokens"], r["status"]) for r in _records(tmp_path)] == [(SERVED, 3, 200)]


@pytest.mark.parametrize(("env", "overrides", "refusal"), [
    ({"CACHETALLY_UPSTREAM_API_KEY": ""}, {"upstream": "http://127.0.0.1:9"}, "empty"),
    ({"CACHETALLY_UPSTREAM_API_KEY": UPSTREAM_KEY}, {"engine": "sim"}, "applies to an upstream"),
    ({"CACHETALLY_UPSTREAM_API_KEY": UPSTREAM_KEY + "\r\nx-tenant: acme"}, {"upstream": "http://127.0.0.1:9"},
     "printable ASCII"),
    ({"CACHETALLY_UPSTREAM_API_KEY": "sk upstream"}, {"upstream": "http://127.0.0.1:9"}, "printable ASCII"),
])
def test_a_key_that_cannot_be_sent_is_refused_at_startup_and_never_echoed(
    env: dict[str, str], overrides: dict[str, str], refusal: str
) -> None:
    with pytest.raises(SettingsError, match=refusal) as refused:
        load_settings(env=env, overrides=overrides)
    assert UPSTREAM_KEY not in str(refused.value) and "sk upstream" not in str(refused.value)


def test_the_settings_never_print_the_key() -> None:
    settings = load_settings(env={"CACHETALLY_UPSTREAM_API_KEY": UPSTREAM_KEY},
                             overrides={"upstream": "http://127.0.0.1:9"})
    assert settings.upstream_api_key == UPSTREAM_KEY and UPSTREAM_KEY not in repr(settings)
