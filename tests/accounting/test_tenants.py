"""Tenants: API key name, then a trusted header bounded by --tenants, then ``default``.

In process (the app and the sim engine, no server): what a client sends decides the
``tenant`` label of every token and request counter, and the label values stay within
the configured names plus ``other`` and ``default``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.accounting.auth import ApiKeyGuard
from proxy.accounting.tenants import KeyTable, Tenancy
from proxy.asgi.headers import RequestHeaders
from proxy.server.app import CachetallyApp
from proxy.server.cli import build_parser
from proxy.server.serve_flags import serve_settings
from proxy.server.settings import Settings, SettingsError, load_settings
from tests.servers import metric_value
from tests.vllm_preloaded import Script

BODY = {"prompt": "the same words every time", "max_tokens": 3}


@contextlib.asynccontextmanager
async def in_process(**settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = CachetallyApp(Settings(engine="sim", **settings).validate())
    async with app.running():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client


def tenants_in(metrics: str, family: str = "cachetally_requests_total") -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics):
        for s in fam.samples:
            if s.name == family:
                out[s.labels["tenant"]] = out.get(s.labels["tenant"], 0) + s.value
    return out


def keys_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_a_keys_file_others_can_read_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "cachetally.tenants")
    path = keys_file(tmp_path, '"sk-1" = "a"\n')
    KeyTable.load(path)
    assert not caplog.records
    warning = f"API keys file {path} can be read by other users: chmod 600 it"
    for mode in (0o644, 0o640, 0o604):  # the group's members are other users too
        caplog.clear()
        path.chmod(mode)
        KeyTable.load(path)
        assert [r.getMessage() for r in caplog.records] == [warning], oct(mode)


@pytest.mark.asyncio
async def test_api_keys_name_the_tenant_and_never_appear_in_logs(tmp_path: Path, caplog) -> None:
    path = keys_file(tmp_path, '"sk-alpha-1" = "alpha"\n"sk-beta-22" = "beta"\n')
    caplog.set_level(logging.DEBUG)
    async with in_process(api_keys_file=str(path), api_key="sk-single") as client:
        for key, times in (("sk-alpha-1", 2), ("sk-beta-22", 1), ("sk-single", 1)):
            for _ in range(times):
                headers = {"authorization": f"Bearer {key}", "x-tenant": "beta"}
                assert (await client.post("/v1/completions", json=BODY, headers=headers)).status_code == 200
        for bad in ("sk-alpha-", "sk-alpha-11", "alpha", ""):
            resp = await client.post("/v1/completions", json=BODY, headers={"authorization": f"Bearer {bad}"})
            assert resp.status_code == 401
        two = [("authorization", "Bearer sk-alpha-1"), ("authorization", "Bearer sk-beta-22")]
        assert (await client.post("/v1/completions", json=BODY, headers=two)).status_code == 401  # which one?
        metrics = (await client.get("/metrics")).text
    assert tenants_in(metrics) == {"alpha": 2, "beta": 1, "default": 1}  # --api-key is default's
    assert tenants_in(metrics, "cachetally_completion_tokens_total") == {"alpha": 6, "beta": 3, "default": 3}
    for key in ("sk-alpha-1", "sk-beta-22", "sk-single"):
        assert key not in caplog.text


@pytest.mark.asyncio
async def test_the_bearer_scheme_is_read_in_any_case(tmp_path: Path) -> None:
    """An auth scheme is case-insensitive (RFC 9110, 11.1): ``bearer`` names the same key,
    and bills the same tenant, as ``Bearer``."""
    path = keys_file(tmp_path, '"sk-alpha-1" = "alpha"\n')
    async with in_process(api_keys_file=str(path)) as client:
        for scheme in ("Bearer", "bearer", "BEARER"):
            headers = {"authorization": f"{scheme} sk-alpha-1"}
            assert (await client.post("/v1/completions", json=BODY, headers=headers)).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert tenants_in(metrics) == {"alpha": 3}


@pytest.mark.asyncio
async def test_a_key_under_another_scheme_is_refused_and_bills_no_one(tmp_path: Path) -> None:
    """Only ``Bearer`` carries a key: the same key sent as ``Basic`` or ``Token`` credentials
    is a 401, and no tenant is billed for it."""
    path = keys_file(tmp_path, '"sk-alpha-1" = "alpha"\n')
    async with in_process(api_keys_file=str(path)) as client:
        for scheme in ("Basic", "Token", "Bearer-ish"):
            headers = {"authorization": f"{scheme} sk-alpha-1"}
            answer = await client.post("/v1/completions", json=BODY, headers=headers)
            assert (answer.status_code, answer.headers.get("www-authenticate")) == (401, "Bearer"), scheme
        metrics = (await client.get("/metrics")).text
    assert tenants_in(metrics) == {}
    assert resolved(Tenancy(KeyTable({"sk-alpha-1": "alpha"})), [(b"authorization", b"Basic sk-alpha-1")]) == "default"


@pytest.mark.asyncio
async def test_a_trusted_headers_value_is_read_without_its_surrounding_whitespace() -> None:
    """uvicorn's httptools parser keeps a header value's trailing whitespace, which is no part
    of the value (RFC 9110, 5.5): ``a `` from the gateway is tenant ``a``, not ``other``."""
    async with in_process(tenant_header="X-Team", tenants=["a"]) as client:
        for value in ("a ", "a\t", " a"):
            assert (await client.post("/v1/completions", json=BODY, headers=[("x-team", value)])).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert tenants_in(metrics) == {"a": 3}


@pytest.mark.parametrize("length", [1, 64, 65])
def test_a_tenant_name_is_1_to_64_characters(length: int) -> None:
    """What --tenants and the keys file say a name is; a longer one is refused at startup."""
    name = "t" * length
    if length <= 64:
        assert Tenancy(KeyTable({"sk-1": name}), None, [name]).named == {name}
        return
    with pytest.raises(ValueError, match="1-64 characters"):
        Tenancy(None, "x-team", [name])
    with pytest.raises(ValueError, match="1-64 characters"):
        KeyTable({"sk-1": name})

@pytest.mark.asyncio
async def test_only_a_cors_preflight_passes_a_guarded_path_without_a_key() -> None:
    """As vLLM's own ``--api-key``: a CORS preflight (``OPTIONS``) carries no credentials and
    reaches the app (here it answers 405 itself); every other method needs the key, ``HEAD``
    included."""
    preflight = {"origin": "https://app.example", "access-control-request-method": "POST"}
    async with in_process(api_key="sk-1") as client:
        for path in ("/v1/models", "/v1/chat/completions"):
            answer = await client.request("OPTIONS", path, headers=preflight)
            assert answer.status_code == 405, path  # the app's answer, not the guard's 401
        for method in ("HEAD", "GET"):
            answer = await client.request(method, "/v1/models")
            assert (answer.status_code, answer.headers["www-authenticate"]) == (401, "Bearer"), method
        keyed = await client.request("HEAD", "/v1/models", headers={"authorization": "Bearer sk-1"})
        assert keyed.status_code == 200


@pytest.mark.asyncio
async def test_in_front_of_its_own_engine_a_guarded_prefix_further_in_is_no_route_not_a_401() -> None:
    """The engine's root path is known here, as to vLLM's own key: ``/api/v1/models`` is no
    route (404). Only in front of an upstream, whose root path is not known, does it need a key."""
    async with in_process(api_key="sk-1") as client:
        for path in ("/api/v1/models", "/api/invocations"):
            assert (await client.get(path)).status_code == 404, path

@pytest.mark.asyncio
async def test_trusted_header_is_bounded_by_the_configured_tenants() -> None:
    async with in_process(tenant_header="X-Team", tenants=["a", "b", "c"]) as client:
        for value in ("a", "a", "b", "c", "zzz", "A", "a,b", "", "../../etc"):
            resp = await client.post("/v1/completions", json=BODY, headers={"x-team": value})
            assert resp.status_code == 200
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        two = [("x-team", "a"), ("x-team", "b")]
        assert (await client.post("/v1/completions", json=BODY, headers=two)).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert tenants_in(metrics) == {"a": 2, "b": 1, "c": 1, "other": 6, "default": 1}
    assert set(tenants_in(metrics, "cachetally_prompt_tokens_total")) == {"a", "b", "c", "other", "default"}
    assert metric_value(metrics, "cachetally_requests_total") == 11


@pytest.mark.asyncio
async def test_without_configuration_every_request_is_default() -> None:
    async with in_process() as client:
        resp = await client.post("/v1/completions", json=BODY, headers={"x-tenant": "a", "authorization": "Bearer x"})
        assert resp.status_code == 200
        assert tenants_in((await client.get("/metrics")).text) == {"default": 1}


_KEY_CHARS = st.characters(min_codepoint=0x21, max_codepoint=0x7E)
_KEYS = st.dictionaries(st.text(_KEY_CHARS, min_size=1, max_size=48), st.sampled_from(["a", "b", "c"]), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(keys=_KEYS, guess=st.binary(max_size=64), cut=st.integers(0, 48), flip=st.integers(0, 47))
def test_every_key_and_only_those_resolve(keys: dict[str, str], guess: bytes, cut: int, flip: int) -> None:
    """Each key of the table resolves to its tenant and is accepted; every other string is
    refused, whatever its length: a random guess, a prefix or extension of a key, a key with
    one byte changed."""
    table = KeyTable(keys)
    guard = ApiKeyGuard(table)

    def accepted(token: bytes) -> bool:
        scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                 "headers": [(b"authorization", b"Bearer " + token)]}
        return guard.allows(scope)

    for key, tenant in keys.items():
        assert table.tenant_for(key.encode()) == tenant and accepted(key.encode())
    raw = {k.encode() for k in keys}
    wrong = [guess]
    for key in raw:
        wrong += [key[:cut], key + key[:cut + 1], bytes(b ^ (i == flip % len(key)) for i, b in enumerate(key))]
    for token in wrong:
        if token.strip() not in raw:  # bearer_token strips, as every server does
            assert table.tenant_for(token) is None
            assert not accepted(token)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('"sk-secret-1" = 3\n', "every entry must be"),
        ('"sk-secret-1" = "no spaces allowed"\n', "tenant name"),
        # the entry's position, counted from 1, finds it among many keys without quoting it
        ('"sk-secret-1" = "a"\n"sk-secret-2" = "no spaces allowed"\n', "^API key #2: a tenant name"),
        ('"sk-secret-1 = "a"\n', "not valid TOML at line 1"),
        ('"sk-secret-1" = "a"\n"sk-secret-2" = "b"\n"sk-secret-1" = "c"\n', "not valid TOML at line 3: .* each key once"),
        ('"sk-secret-1" = "a"\nsk-secret-2 b\n', "not valid TOML at line 2"),
        ('[sk-secret-1]\n[sk-secret-1]\n', "not valid TOML at line 2"),  # tomllib quotes this key
        ("", "holds no keys"),
        ('"" = "a"\n', "is empty"),
    ],
)
def test_a_bad_keys_file_is_refused_without_quoting_a_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        KeyTable.load(keys_file(tmp_path, text))
    assert "sk-secret" not in str(info.value)


def test_flags_env_and_file_set_the_tenancy(tmp_path: Path) -> None:
    args = build_parser().parse_args(["serve", "--engine", "sim", "--tenant-header", "X-Team", "--tenants", "a,b,c"])
    settings = serve_settings(args)
    assert (settings.tenant_header, settings.tenants) == ("X-Team", ["a", "b", "c"])
    assert serve_settings(build_parser().parse_args(["serve", "--api-keys", "k.toml"])).api_keys_file == "k.toml"
    assert load_settings(env={"CACHETALLY_TENANT_HEADER": "t", "CACHETALLY_TENANTS": "x y,z"}).tenants == ["x", "y", "z"]
    with pytest.raises(SettingsError, match="tenant name"):
        load_settings(env={"CACHETALLY_TENANTS": "ok,not/ok"})
    with pytest.raises(SettingsError, match="header name"):
        load_settings(env={"CACHETALLY_TENANT_HEADER": "x tenant"})


def test_tenancy_resolves_in_the_documented_order() -> None:
    tenancy = Tenancy(KeyTable({"k1": "keyed", "k0": "default"}), "x-t", ["a"])
    assert resolved(tenancy, [(b"authorization", b"Bearer k1"), (b"x-t", b"a")]) == "keyed"
    # With keys, a credential decides and the header is never read, whatever the key.
    assert resolved(tenancy, [(b"authorization", b"Bearer k0"), (b"X-T", b"a")]) == "default"
    assert resolved(tenancy, [(b"authorization", b"Bearer k2"), (b"X-T", b"a")]) == "default"
    assert resolved(tenancy, [(b"x-t", b"a")]) == "default"
    header = Tenancy(None, "x-t", ["a"])
    assert resolved(header, [(b"authorization", b"Bearer k1"), (b"x-t", b"a")]) == "a"
    assert resolved(header, [(b"x-t", b"b")]) == "other"
    assert resolved(header, []) == "default"
    assert resolved(Tenancy(), [(b"x-t", b"a")]) == "default"
    # The token is read without the spaces around it, as the key check reads it.
    assert resolved(tenancy, [(b"authorization", b"Bearer   k1 ")]) == "keyed"


def resolved(tenancy: Tenancy, headers: list[tuple[bytes, bytes]]) -> str:
    """The tenant, with the request's headers read as the middleware reads them."""
    return tenancy.resolve(RequestHeaders(headers, tenancy.reads))


def test_the_single_key_is_default_and_cannot_be_given_a_second_tenant(tmp_path: Path) -> None:
    path = keys_file(tmp_path, '"sk-1" = "a"\n')
    table = KeyTable.load(path, shared="sk-0")
    assert (table.tenant_for(b"sk-0"), table.tenant_for(b"sk-1"), len(table)) == ("default", "a", 2)
    with pytest.raises(ValueError, match="also in API keys file") as info:
        KeyTable.load(path, shared="sk-1")
    assert "sk-1" not in str(info.value)


_VLLM_SHAPED = """
import argparse, sys
import uvicorn
from starlette.applications import Starlette
from proxy.vllm_middleware import CachetallyMiddleware
from tests.servers import free_port

app = Starlette()
app.state.args = argparse.Namespace(api_key=sys.argv[1:] or None)  # vLLM's own --api-key
app.add_middleware(CachetallyMiddleware)  # as vLLM adds it: outermost, the lifespan runs through it
uvicorn.run(app, host="127.0.0.1", port=free_port(), log_level="error")
"""


@pytest.mark.parametrize(
    ("vllm_key", "env"),
    [(["sk-vllm"], {}), ([], {"VLLM_API_KEY": "sk-vllm"})],
    ids=["--api-key", "VLLM_API_KEY"],
)
def test_inside_vllm_a_tenant_header_beside_vllms_own_key_refuses_to_start(vllm_key: list[str], env: dict[str, str]) -> None:
    """vLLM's ``--api-key`` is a credential whose tenant is ``default``: with a tenant header
    beside it, any holder of that key could bill any tenant, so the server does not start."""
    import os
    import subprocess
    import sys

    from tests.servers import ROOT

    base = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"} | {"CACHETALLY_TENANT_HEADER": "x-tenant",
                                                                             "CACHETALLY_TENANTS": "acme"}
    run = subprocess.run(
        [sys.executable, "-c", _VLLM_SHAPED, *vllm_key], cwd=ROOT, env=base | env,
        capture_output=True, text=True, timeout=30,
    )
    assert run.returncode != 0
    assert "CACHETALLY_TENANT_HEADER cannot be combined with vLLM's --api-key" in run.stderr
    assert "sk-vllm" not in run.stderr


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["/v1/chat/completions/batch", "/v1/embeddings"])
async def test_tenants_from_a_trusted_header_turn_billing_on(path: str) -> None:
    """Per-tenant counters are billing: with tenants named by a gateway's header and no usage
    records, a route that runs the engine unmetered is still refused (403), not passed on."""
    async with in_process(tenant_header="x-tenant", tenants=["acme"]) as client:
        resp = await client.post(path, json=BODY, headers={"x-tenant": "acme"})
        assert resp.status_code == 403, resp.text
        metrics = (await client.get("/metrics")).text
    assert metric_value(metrics, "cachetally_refused_unmetered_total", route=path) == 1


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--tenant-header", "X-Team"], "tenant_header X-Team with no tenants would bill every request to 'other'"),
        (["--tenants", "red,blue"], "tenants name the values of a tenant header, and none is set"),
    ],
)
def test_a_tenant_header_or_tenants_alone_fails_the_start_in_one_line(
    tmp_path: Path, argv: list[str], says: str
) -> None:
    """Alone, the header billed every request to 'other' (records too) and the names labelled
    nothing: a server that started, and a bill without tenants."""
    import subprocess
    import sys

    from tests.servers import ROOT, free_port

    usage = tmp_path / "usage"
    run = subprocess.run(
        [sys.executable, "-m", "proxy.server.cli", "serve", "--engine", "sim", "--port", str(free_port()),
         "--usage-dir", str(usage), *argv], cwd=ROOT, capture_output=True, text=True, timeout=30,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.splitlines()[-1].startswith(f"cachetally: {says}")
    assert "Traceback" not in run.stderr and "ready on" not in run.stderr


#: vLLM's own server as far as its --api-key goes: vLLM's AuthenticationMiddleware registered
#: with its tokens, then cachetally's outermost, as ``vllm serve --api-key K --middleware`` builds it.
_VLLM_WITH_ITS_KEY = """
import argparse, json, sys
import httpx
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware
from proxy.vllm_middleware import CachetallyMiddleware
from tests.servers import serving_in_thread

class Client:  # vLLM's engine client, as far as the tap needs one
    errored = False
    model_config = argparse.Namespace(served_model_name="m", model="m", dtype="float32", runner_type="generate")
    async def generate(self, *args, **kwargs):
        yield None

async def completion(request):  # vLLM's /invocations and /v1/completions: a completions answer
    return JSONResponse({"id": "cmpl-1", "object": "text_completion", "model": "m",
                         "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}],
                         "usage": {"prompt_tokens": 81, "completion_tokens": 2, "total_tokens": 83}})

app = Starlette(routes=[Route(path, completion, methods=["POST"]) for path in ("/invocations", "/v1/completions")])
app.state.args = argparse.Namespace(api_key=["sk-vllm"], host="127.0.0.1", port=0, api_server_count=1)
app.state.engine_client = Client()
app.add_middleware(AuthenticationMiddleware, tokens=["sk-vllm"])
app.add_middleware(CachetallyMiddleware)
body = {"model": "m", "prompt": "hello", "max_tokens": 2}
answers = {}
with serving_in_thread(app, start_timeout_s=240) as url:  # the lifespan taps vLLM: its imports take a while
    for name, path, headers in [("invocations, no key", "/invocations", {}),
                                ("invocations, a wrong key", "/invocations", {"authorization": "Bearer sk-guess"}),
                                ("invocations, vLLM's key", "/invocations", {"authorization": "Bearer sk-vllm"}),
                                ("completions, no key", "/v1/completions", {})]:
        answer = httpx.post(url + path, json=body, headers={**headers, "x-request-id": name.replace(" ", "")
                            .replace(",", "-").replace("'", "")}, timeout=120)
        answers[name] = [answer.status_code, answer.json()]
print(json.dumps(answers))
"""


@pytest.mark.parametrize("exempt", [False, True], ids=["guarded", "auth_exempt_paths"])
def test_inside_vllm_its_own_key_guards_invocations_too(vllm_script: Script, tmp_path: Path, exempt: bool) -> None:
    """vLLM checks its ``--api-key`` under ``/v1``, ``/v2``, ``/inference`` and ``/cohere`` only;
    SageMaker's ``/invocations`` runs the engine and is billed, so a keyless request there ran and
    was billed to ``default``, the tenant of vLLM's key: a tenant no credential gave it. It needs
    vLLM's key too (401, no record), as it needs cachetally's own, unless ``auth_exempt_paths``
    opens it (a SageMaker endpoint that sends none); ``/v1`` keeps vLLM's own 401."""
    import json
    import os

    from proxy.accounting.records.report import read

    usage = tmp_path / "usage"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHETALLY_", "VLLM_API_KEY"))}
    env |= {"CACHETALLY_USAGE_DIR": str(usage)} | ({"CACHETALLY_AUTH_EXEMPT_PATHS": "/invocations"} if exempt else {})
    run = vllm_script(_VLLM_WITH_ITS_KEY, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    answers = json.loads(run.stdout.splitlines()[-1])
    assert [answers[name][0] for name in answers] == [200 if exempt else 401, 200 if exempt else 401, 200, 401], answers
    assert answers["completions, no key"][1] == {"error": "Unauthorized"}  # vLLM's own refusal
    billed = (["invocations-nokey", "invocations-awrongkey"] if exempt else []) + ["invocations-vLLMskey"]
    records = [json.loads(line) for path in usage.glob("*.jsonl") for line in path.read_text().splitlines()]
    assert sorted((r["request_id"], r["tenant"], r["prompt_tokens"]) for r in records) == [
        (rid, "default", 81) for rid in sorted(billed)]
    report = read(sorted(usage.glob("*.jsonl")))
    assert {key: (row.requests, row.prompt_tokens) for key, row in report.rows.items()} == {
        ("default", "m"): (len(billed), 81 * len(billed))}
