"""Hostile clients against billing, through real HTTP, in upstream mode.

cachetally runs in a real uvicorn on 127.0.0.1 in front of a fake upstream (also a real
uvicorn) that behaves as llama.cpp and Ollama do: it answers any model name, echoing the
request's ``model`` back, and lists one model, ``m-real``, at ``/v1/models``. The clients
are the official ``openai`` client and raw httpx. Each test asserts what billing sees once
the instance has stopped (its records drained): the usage records, the counters and
``cachetally report``.

- a client cannot bill a tenant its credential does not give it, in any combination of
  ``--api-key``, ``--api-keys`` and ``--tenant-header``;
- a client that reuses one ``X-Request-Id``, in sequence and across two replicas, still
  gets one record per request, each with its own ``record_id``, and the report counts
  each once (and a file read twice still once);
- a client sending made-up model names cannot mint series or report rows, and a huge
  name does not make a huge record;
- ``/health`` answers without a key, as vLLM's does; ``/v1`` routes need one.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import posixpath
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy.accounting.records.report import read
from proxy.asgi.paths import normalized
from proxy.patching import served_models
from proxy.server.app import CachetallyApp
from proxy.server.settings import Settings, SettingsError
from tests.servers import ROOT, free_port, serving_in_thread

pytestmark = pytest.mark.loopback

SERVED = "m-real"
KEYS = {"sk-acme-0123456789": "acme", "sk-globex-42": "globex"}
SHARED = "sk-shared-key"


async def _completion(request: Request) -> JSONResponse:
    body = await request.json()
    return JSONResponse({
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": 0,
        "model": body.get("model"),  # echoed, as llama.cpp and Ollama do
        "choices": [{"index": 0, "text": "ok", "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9,
                  "prompt_tokens_details": {"cached_tokens": 3}},
    })


def echo_upstream(listed: list[str] | None) -> Starlette:
    """The echoing upstream; ``/v1/models`` lists ``listed`` as it is at each call (``None``:
    it answers 401, as an upstream guarding its model list with a key)."""

    async def models(request: Request) -> JSONResponse:
        if listed is None:
            return JSONResponse({"error": {"message": "no key", "code": 401}}, status_code=401)
        return JSONResponse({"object": "list", "data": [{"id": m, "object": "model"} for m in listed]})

    return Starlette(routes=[
        Route("/v1/completions", _completion, methods=["POST"]),
        Route("/invocations", _completion, methods=["POST"]),  # SageMaker's, a completions body here
        Route("/v1/models", models, methods=["GET"]),
    ])


@dataclass
class Billing:
    """What billing sees once the instance has stopped."""

    records: list[dict[str, Any]]
    metrics: str
    files: list[Path]

    def tenants(self) -> list[str]:
        return [r["tenant"] for r in self.records]

    def counter_labels(self, label: str) -> set[str]:
        return {
            s.labels[label]
            for family in text_string_to_metric_families(self.metrics)
            for s in family.samples
            if s.name.startswith("cachetally_") and label in s.labels
        }


@contextlib.contextmanager
def proxy(usage: Path, listed: list[str] | None = None, **overrides: Any) -> Iterator[tuple[str, Billing]]:
    """cachetally in upstream mode before the echoing upstream (listing ``listed``, by default
    ``[SERVED]``); the Billing is filled on exit."""
    billing = Billing([], "", [])
    with serving_in_thread(echo_upstream([SERVED] if listed is None else listed)) as upstream:
        settings = Settings(engine="upstream", upstream=upstream, usage_dir=str(usage),
                            usage_flush_interval_s=0.05, **overrides).validate()
        with serving_in_thread(CachetallyApp(settings)) as url:
            yield url, billing
            key = overrides.get("api_key") or next(iter(KEYS))  # /metrics needs none; a key is harmless
            billing.metrics = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {key}"}).text
    billing.files = sorted(usage.glob("*.jsonl"))
    billing.records = [orjson.loads(line) for f in billing.files for line in f.read_bytes().splitlines()]


def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.toml"
    path.write_text("".join(f'"{k}" = "{t}"\n' for k, t in KEYS.items()))
    path.chmod(0o600)
    return path


def complete(url: str, key: str | None, tenant: str | None = None, path: str = "/v1/completions",
             **extra: Any) -> int:
    headers = {"authorization": f"Bearer {key}"} if key is not None else {}
    if tenant is not None:
        headers["x-tenant"] = tenant
    body = {"model": SERVED, "prompt": "hi", "max_tokens": 2, **extra}
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=10).status_code


#: Every metered route the client may try: vLLM leaves SageMaker's /invocations open even
#: with its --api-key, but it runs the engine and is billed, so it needs a key here.
METERED = ("/v1/completions", "/invocations")


# -- tenants: a client cannot choose a tenant its credential does not give it ------------------

#: The rule of docs/ACCOUNTING.md, "Tenants": (credential sent, x-tenant sent) -> tenant, or
#: 401, for each configuration. The hostile client sends x-tenant: globex every time.
KEYED_RULE = {
    # --api-key only
    "shared": {SHARED: "default", "sk-acme-0123456789": 401, "wrong": 401, None: 401},
    # --api-keys only
    "file": {SHARED: 401, "sk-acme-0123456789": "acme", "sk-globex-42": "globex", "wrong": 401, None: 401},
    # both
    "both": {SHARED: "default", "sk-acme-0123456789": "acme", "sk-globex-42": "globex", "wrong": 401, None: 401},
}


@pytest.mark.parametrize("config", sorted(KEYED_RULE))
def test_no_credential_bills_a_tenant_it_does_not_name(tmp_path: Path, config: str) -> None:
    settings: dict[str, Any] = {}
    if config in ("shared", "both"):
        settings["api_key"] = SHARED
    if config in ("file", "both"):
        settings["api_keys_file"] = str(keys_file(tmp_path))
    rule = KEYED_RULE[config]
    with proxy(tmp_path / "usage", **settings) as (url, billing):
        answered = {(path, key): complete(url, key, tenant="globex", path=path) for path in METERED for key in rule}
        if config != "file":  # the official client: the shared key asking for acme, in a header
            with openai.OpenAI(base_url=f"{url}/v1", api_key=SHARED, default_headers={"x-tenant": "acme"}) as client:
                client.completions.create(model=SERVED, prompt="hi", max_tokens=2)
    expected = {(path, key): (200 if want != 401 else 401) for path in METERED for key, want in rule.items()}
    assert answered == expected
    billed = sorted(want for _ in METERED for want in rule.values() if want != 401)
    if config != "file":
        billed = sorted([*billed, "default"])  # the openai client's request, on the shared key
    assert sorted(billing.tenants()) == billed
    assert billing.counter_labels("tenant") == set(billed)


def test_without_keys_the_trusted_header_names_the_tenant(tmp_path: Path) -> None:
    with proxy(tmp_path / "usage", tenant_header="x-tenant", tenants=["acme", "globex"]) as (url, billing):
        for key, tenant in ((None, "globex"), ("anything", "acme"), (None, "initech"), (None, None)):
            assert complete(url, key, tenant) == 200
        # Only spaces and tabs pad a field value (RFC 9110 §5.5): a named tenant with a byte
        # Python's str.strip() also drops (NBSP, NEL: obs-text that passes the HTTP parser) is
        # another value, one a gateway that lets through values other than its own would pass.
        for padded in (b"acme\xa0", b"\x85globex", b"\xa0acme\x85"):
            answer = httpx.post(f"{url}/v1/completions", json={"model": SERVED, "prompt": "hi", "max_tokens": 2},
                                headers={"x-tenant": padded}, timeout=10)
            assert answer.status_code == 200
    assert sorted(billing.tenants()) == ["acme", "default", "globex", "other", "other", "other", "other"]


@pytest.mark.parametrize("keys", [{"api_key": SHARED}, {"api_keys_file": "keys.toml"}])
def test_a_tenant_header_beside_keys_is_refused(keys: dict[str, str]) -> None:
    with pytest.raises(SettingsError, match="tenant_header cannot be combined"):
        Settings(engine="sim", tenant_header="x-tenant", **keys).validate()


@pytest.mark.parametrize("named", ["other", "default"])
def test_a_header_tenant_named_as_the_catch_all_does_not_start(named: str) -> None:
    """With ``--tenants acme,other`` a client sending ``x-tenant: mallory`` was billed to the
    tenant ``other``, and with ``default`` named a request without the header was billed to
    ``default``: another client's requests on a named tenant's bill, which no record or
    counter could tell apart. Such names are refused at start."""
    argv = ["-m", "proxy.server.cli", "serve", "--upstream", "http://127.0.0.1:9", "--tenant-header", "x-tenant",
            "--tenants", f"acme,{named}", "--port", str(free_port())]
    run = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert run.returncode == 2
    assert f"tenants: {named} cannot be a tenant's name with a tenant header" in run.stderr


def test_the_spoofable_configuration_does_not_start(tmp_path: Path) -> None:
    """The configuration in which a shared key plus ``x-tenant: globex`` billed globex."""
    argv = ["-m", "proxy.server.cli", "serve", "--upstream", "http://127.0.0.1:9",
            "--api-key", SHARED, "--api-keys", str(keys_file(tmp_path)), "--tenant-header", "x-tenant",
            "--port", str(free_port())]
    run = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert run.returncode == 2
    assert "tenant_header cannot be combined with api_key or api_keys_file" in run.stderr
    assert SHARED not in run.stderr


def test_health_is_open_and_v1_needs_a_key(tmp_path: Path) -> None:
    with proxy(tmp_path / "usage", api_key=SHARED) as (url, _):
        assert httpx.get(f"{url}/health").status_code == 200  # a Kubernetes probe has no key
        assert httpx.get(f"{url}/metrics").status_code == 200
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {SHARED}"}).status_code == 200


# -- record identity: a reused X-Request-Id collapses nothing -------------------------------------


def test_a_reused_request_id_keeps_every_record_apart(tmp_path: Path) -> None:
    reused = {"x-request-id": "same-id"}
    usage = tmp_path / "usage"
    replicas = [usage / "a", usage / "b"]
    for replica in replicas:  # one after the other, each a fresh instance: two replicas, or a restart
        with proxy(replica) as (url, _):
            with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", default_headers=reused) as client:
                for _ in range(5):
                    client.completions.create(model=SERVED, prompt="hi", max_tokens=2)
    records = [orjson.loads(line) for f in sorted(usage.glob("*/*.jsonl")) for line in f.read_bytes().splitlines()]
    assert len(records) == 10
    assert {r["request_id"] for r in records} == {"same-id"}  # the client's id, kept as given
    assert len({r["record_id"] for r in records}) == 10
    assert all(uuid.UUID(r["record_id"]).version == 7 for r in records)
    files = sorted(usage.glob("*/*.jsonl"))
    report = read(files)
    assert (report.total().requests, report.total().prompt_tokens) == (10, 70)
    twice = read([*files, *files])  # the same files gathered twice: still each record once
    assert (twice.total().requests, twice.duplicates) == (10, 10)


# -- bounds: made-up model names mint no series, no rows, no huge records -------------------------


def test_made_up_model_names_mint_no_series_or_report_rows(tmp_path: Path) -> None:
    with proxy(tmp_path / "usage") as (url, billing), openai.OpenAI(base_url=f"{url}/v1", api_key="unused") as client:
        for _ in range(30):
            client.completions.create(model=f"mint-{uuid.uuid4().hex}", prompt="hi", max_tokens=2)
        for _ in range(3):
            client.completions.create(model=SERVED, prompt="hi", max_tokens=2)
        huge = "m" * (1 << 20)
        assert complete(url, None, model=huge) == 200
    assert billing.counter_labels("model") == {SERVED, "other"}
    report = read(billing.files)
    assert {model: t.requests for (_, model), t in report.rows.items()} == {SERVED: 3, "other": 31}
    assert max(len(r["request_model"]) for r in billing.records) == 256
    assert max(len(orjson.dumps(r)) for r in billing.records) < 4096


def _surrogate_upstream() -> Starlette:
    """An upstream that reads bodies with Python's ``json`` (a lone surrogate passes, as in vLLM
    and llama.cpp's Python peers), echoes the model, gives the response an id with a lone
    surrogate, and lists a model whose name has one."""

    async def completion(request: Request) -> Response:
        body = json.loads(await request.body())
        return Response(json.dumps({
            "id": "cmpl-\ud800", "object": "text_completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "text": "ok", "finish_reason": "length", "logprobs": None}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9,
                      "prompt_tokens_details": {"cached_tokens": 3}},
        }), media_type="application/json")  # json.dumps escapes the surrogate: valid UTF-8 on the wire

    async def models(request: Request) -> Response:
        listing = {"object": "list", "data": [{"id": m} for m in (SERVED, "\ud800")]}
        return Response(json.dumps(listing), media_type="application/json")

    return Starlette(routes=[Route("/v1/completions", completion, methods=["POST"]),
                             Route("/v1/models", models, methods=["GET"])])


def test_a_lone_surrogate_from_a_client_or_the_upstream_loses_no_record_and_fails_no_scrape(tmp_path: Path) -> None:
    """A model or id with a lone surrogate (``"\\ud800"``, valid JSON that orjson and UTF-8
    cannot hold) failed the JSONL flush of its record and of every fair record flushed with
    it, so the request was served and counted with no record; and a model the upstream
    listed with one became a label that failed every ``/metrics`` scrape with a 500."""
    usage = tmp_path / "usage"
    with serving_in_thread(_surrogate_upstream()) as upstream:
        settings = Settings(engine="upstream", upstream=upstream, usage_dir=str(usage),
                            usage_flush_interval_s=0.5).validate()
        with serving_in_thread(CachetallyApp(settings)) as url:
            for model in (f"{SERVED}\\ud800", SERVED, "\\ud800"):  # in one flush: the fair one among them
                body = '{"model": "%s", "prompt": "hi", "max_tokens": 2}' % model
                answer = httpx.post(f"{url}/v1/completions", content=body, timeout=10,
                                    headers={"content-type": "application/json"})
                assert answer.status_code == 200
            scrape = httpx.get(f"{url}/metrics")
    assert scrape.status_code == 200
    counted = sum(s.value for family in text_string_to_metric_families(scrape.text)
                  for s in family.samples if s.name == "cachetally_requests_total")
    records = [orjson.loads(line) for f in sorted(usage.glob("*.jsonl")) for line in f.read_bytes().splitlines()]
    assert counted == len(records) == 3
    assert [(r["model"], r["request_model"], r["response_id"]) for r in records] == [
        ("other", f"{SERVED}\\ud800", "cmpl-\\ud800"), (SERVED, SERVED, "cmpl-\\ud800"),
        ("other", "\\ud800", "cmpl-\\ud800")]
    assert sum(r["prompt_tokens"] for r in records) == 21


def test_an_upstream_that_hides_its_models_labels_only_the_configured_one(tmp_path: Path) -> None:
    billing = Billing([], "", [])
    with serving_in_thread(echo_upstream(None)) as upstream:
        settings = Settings(engine="upstream", upstream=upstream, model=SERVED).validate()
        with serving_in_thread(CachetallyApp(settings)) as url:
            with openai.OpenAI(base_url=f"{url}/v1", api_key="unused") as client:
                for model in (SERVED, "mint-1", "mint-2"):
                    client.completions.create(model=model, prompt="hi", max_tokens=2)
            billing.metrics = httpx.get(f"{url}/metrics").text
    assert billing.counter_labels("model") == {SERVED, "other"}


def test_a_model_the_upstream_lists_later_gets_its_label(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(served_models, "REFRESH_S", 0.05)
    listed = [SERVED]
    with (proxy(tmp_path / "usage", listed=listed) as (url, billing),
          openai.OpenAI(base_url=f"{url}/v1", api_key="unused") as client):
        client.completions.create(model="m-new", prompt="hi", max_tokens=2)  # not served yet: other
        listed.append("m-new")  # the upstream loads it
        deadline = time.monotonic() + 10
        while 'model="m-new"' not in httpx.get(f"{url}/metrics").text and time.monotonic() < deadline:
            client.completions.create(model="m-new", prompt="hi", max_tokens=2)
            time.sleep(0.05)
    assert billing.counter_labels("model") == {"other", "m-new"}
    assert [r["model"] for r in billing.records][0] == "other"


def test_a_proxy_in_the_environment_does_not_hide_the_upstreams_models(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests go to the upstream directly (the pool reads no proxy settings); its model
    list was fetched through ``HTTP_PROXY`` when one was set, as on a host whose other
    traffic leaves by a proxy: the list failed, and every model but ``--model`` was
    labelled ``other`` though the upstream served it."""
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    with (httpx.Client(trust_env=False, timeout=10) as direct,
          serving_in_thread(echo_upstream([SERVED, "m-listed"])) as upstream):
        settings = Settings(engine="upstream", upstream=upstream, model=SERVED).validate()
        with serving_in_thread(CachetallyApp(settings)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", http_client=direct)
            client.completions.create(model="m-listed", prompt="hi", max_tokens=2)
            metrics = direct.get(f"{url}/metrics").text
    assert Billing([], metrics, []).counter_labels("model") == {"m-listed"}


def test_an_upstream_listing_endless_models_mints_a_bounded_set() -> None:
    models = served_models.ServedModels(checked=True)
    models.update({"data": [{"id": f"m{i}"} for i in range(10_000)] + [{"id": "x" * 300}, {"id": 3}, "junk"]})
    assert len(models.names) == served_models.MAX_MODELS
    assert (models.label("m0"), models.label("m9999"), models.label("x" * 300)) == ("m0", "other", "other")
    with pytest.raises(ValueError):
        models.update({"object": "list"})
    assert models.label("m0") == "m0"  # a bad listing keeps the last good one


def test_no_record_field_grows_with_what_a_peer_sends() -> None:
    from proxy.accounting.records.record import UsageRecord, dumps

    huge = "x" * (1 << 20)
    record = UsageRecord(request_id="r", tenant="t", route="chat", stream=False, start_unix=0.0,
                         request_model=huge, response_id=huge)
    assert (len(record.request_model or ""), len(record.response_id or "")) == (256, 256)
    assert len(dumps(record)) < 2048


@pytest.mark.parametrize(("sent", "kept"), [(255, 255), (256, 256), (257, 256)])
def test_a_model_name_or_response_id_is_kept_up_to_256_characters(sent: int, kept: int) -> None:
    from proxy.accounting.records.record import UsageRecord

    record = UsageRecord(request_id="r", tenant="t", route="chat", stream=False, start_unix=0.0,
                         request_model="m" * sent, response_id="i" * sent)
    assert (record.request_model, record.response_id) == ("m" * kept, "i" * kept)


# -- routes: an upstream's root path runs nothing unmetered ---------------------------------------


def test_a_metered_route_under_the_upstreams_root_path_is_refused_not_run_unmetered(tmp_path: Path) -> None:
    """vLLM's ``--root-path /api`` routes ``/api/v1/completions`` as ``/v1/completions`` (the bare
    path too), and cachetally in front cannot know the prefix: such a path was forwarded as no
    route of its table, so the engine ran with no record, no counter and no key asked. It is
    refused, and counted under the route it names; without the key, it is a 401."""
    inner = echo_upstream([SERVED])

    async def under_api(scope: Any, receive: Any, send: Any) -> None:  # as FastAPI(root_path="/api")
        await inner({**scope, "root_path": "/api"} if scope["type"] == "http" else scope, receive, send)

    usage = tmp_path / "usage"
    with serving_in_thread(under_api) as upstream:
        settings = Settings(engine="upstream", upstream=upstream, usage_dir=str(usage),
                            usage_flush_interval_s=0.05, api_key=SHARED).validate()
        with serving_in_thread(CachetallyApp(settings)) as url:
            assert complete(url, SHARED) == 200  # the bare path: metered
            for path in ("/api/v1/completions", "/a/b/v1/completions", "/api/invocations"):
                assert complete(url, SHARED, path=path) == 403, path
                assert complete(url, None, path=path) == 401, path  # the key first, as on the bare path
            metrics = httpx.get(f"{url}/metrics").text
    records = [orjson.loads(line) for f in sorted(usage.glob("*.jsonl")) for line in f.read_bytes().splitlines()]
    assert [r["route"] for r in records] == ["completions"]
    refused = {s.labels["route"]: s.value for family in text_string_to_metric_families(metrics)
               for s in family.samples if s.name == "cachetally_refused_unmetered_total"}
    assert refused == {"/v1/completions": 2, "/invocations": 1}


def test_a_guarded_route_under_the_upstreams_root_path_needs_the_key(tmp_path: Path) -> None:
    """Behind vLLM's ``--root-path /api`` every route the key guards is also ``/api/v1/...``:
    the model list, the tokenizer, adapter loading. cachetally in front cannot know the prefix,
    so a guarded prefix after any leading segments needs the key as the bare path does; a
    route that is not guarded under vLLM's own key stays open."""
    inner = echo_upstream([SERVED])

    async def under_api(scope: Any, receive: Any, send: Any) -> None:  # as FastAPI(root_path="/api")
        await inner({**scope, "root_path": "/api"} if scope["type"] == "http" else scope, receive, send)

    with serving_in_thread(under_api) as upstream:
        settings = Settings(engine="upstream", upstream=upstream, api_key=SHARED).validate()
        with serving_in_thread(CachetallyApp(settings)) as url:
            keyed = {"authorization": f"Bearer {SHARED}"}
            for path in ("/v1/models", "/api/v1/models", "/a/b/v1/models", "/api/v1/load_lora_adapter",
                         "/api/v2/rerank", "/api/inference/v1/generate", "/api/cohere/v2/rerank"):  # every prefix
                assert httpx.get(f"{url}{path}").status_code == 401, path
            for path in ("/v1/models", "/api/v1/models"):
                assert httpx.get(f"{url}{path}", headers=keyed).status_code == 200, path
            assert httpx.get(f"{url}/health").status_code == 200
            assert httpx.get(f"{url}/api/health").status_code == 404  # not guarded: the upstream's own answer


def _post_raw_path(url: str, path: str, key: str | None) -> int:
    """POST a completions body to ``path`` as written: httpx would remove its dot segments and
    escape its backslashes, as a normalizing hop after cachetally does."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
        connection.request("POST", path, json.dumps({"model": SERVED, "prompt": "hi", "max_tokens": 2}), headers)
        return connection.getresponse().status
    finally:
        connection.close()


def _go_cleaned(path: str) -> str:
    """What Traefik's ``sanitizePath`` (on by default) forwards: Go's ``url.JoinPath``, that is
    ``path.Clean`` (as ``posixpath.normpath``: slashes merged as the dot segments go), a
    trailing slash kept only where the path ended with one."""
    cleaned = posixpath.normpath("/" + path.lstrip("/"))
    return cleaned + "/" if path.endswith("/") and cleaned != "/" else cleaned


#: How each hop rewrites the path it forwards: Envoy's ``normalize_path`` (Istio's ``BASE``),
#: then Istio's ``MERGE_SLASHES``, and Traefik (nginx's default ``merge_slashes`` likewise
#: merges while it removes dot segments, not after).
_HOPS = {
    "istio-base": normalized,
    "istio-merge-slashes": lambda path: re.sub("/{2,}", "/", normalized(path)),
    "traefik": lambda path: _go_cleaned(path.replace("\\", "/")),
}


@pytest.mark.parametrize("hop", list(_HOPS))
def test_a_route_a_normalizing_hop_before_the_upstream_would_serve_is_refused_or_needs_the_key(
        tmp_path: Path, hop: str) -> None:
    """A sidecar or gateway between cachetally and the upstream may normalize the path it
    forwards: Envoy's ``normalize_path``, on in Istio's default (``BASE``), reads backslashes
    as slashes and removes dot segments (RFC 3986), and Istio's ``MERGE_SLASHES`` (its advice
    against CVE-2021-31920) merges runs of slashes too. ``/v1/./completions`` was forwarded as
    no route of the table and reached the engine as ``/v1/completions``, with no record and no
    counter; ``/x\\..\\invocations``, not under a guarded prefix, reached ``/invocations``
    without the key too. Traefik (and nginx) merge the slashes as they remove dot segments, so
    ``/v1/x//../completions`` (``/v1/x/completions`` to Envoy) and ``/v1/completions/.`` (Go's
    ``path.Clean`` drops the slash a dot segment leaves) reached ``/v1/completions`` there.
    Each is refused (403, counted under the route it names) and needs the key, as the route
    under a root path is."""
    inner = echo_upstream([SERVED])
    forwarded_as = _HOPS[hop]

    async def behind_a_normalizing_hop(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            path = forwarded_as(scope["path"])
            scope = {**scope, "path": path, "raw_path": path.encode()}
        await inner(scope, receive, send)

    usage = tmp_path / "usage"
    refused = ["/v1/./completions", "/v1/x/../completions", "/v1\\completions", "/a/..\\invocations",
               "/v1/%2e/completions", "/v1/x/%2E%2e/completions", "/v1%5Ccompletions", "/a/.%2E%5cinvocations"]
    refused += ["/v1//completions", "/v1/.//completions"] if hop != "istio-base" else []
    refused += ["/v1/x//../completions", "/v1/completions/.", "/v1/completions/x/.."] if hop == "traefik" else []
    with serving_in_thread(behind_a_normalizing_hop) as upstream:
        settings = Settings(engine="upstream", upstream=upstream, usage_dir=str(usage),
                            usage_flush_interval_s=0.05, api_key=SHARED).validate()
        with serving_in_thread(CachetallyApp(settings)) as url:
            assert _post_raw_path(url, "/v1/completions", SHARED) == 200  # metered
            for path in refused:
                assert _post_raw_path(url, path, SHARED) == 403, path
            for path in ("/x\\..\\invocations", "/.\\invocations", "/x/..\\v1/completions", "/x//../invocations"):
                assert _post_raw_path(url, path, None) == 401, path
            metrics = httpx.get(f"{url}/metrics").text
    records = [orjson.loads(line) for f in sorted(usage.glob("*.jsonl")) for line in f.read_bytes().splitlines()]
    assert [r["route"] for r in records] == ["completions"]
    counted = {s.labels["route"]: s.value for family in text_string_to_metric_families(metrics)
               for s in family.samples if s.name == "cachetally_refused_unmetered_total"}
    assert counted == {"/v1/completions": len(refused) - 2, "/invocations": 2}


def _logprobs_upstream() -> Starlette:
    """Answers as vLLM does: with ``prompt_logprobs`` asked, an entry per prompt token after
    ``usage``, 20 choices each; a Responses body echoes the client's ``text`` (a JSON schema:
    any object, ``"usage"`` keys too) before its own ``usage``."""
    usage = {"prompt_tokens": 700, "completion_tokens": 9, "total_tokens": 709,
             "prompt_tokens_details": {"cached_tokens": 512}}

    async def chat(request: Request) -> Response:
        body = await request.json()
        top = body.get("prompt_logprobs") or 0
        answer = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": SERVED,
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                               "finish_reason": "length"}],
                  "usage": usage,
                  "prompt_logprobs": [None] + [{str(t): {"logprob": -1.5, "rank": t + 1, "decoded_token": "\"usage\":"}
                                               for t in range(top)} for _ in range(699)] if top else None}
        return Response(json.dumps(answer), media_type="application/json")

    async def responses(request: Request) -> Response:
        body = await request.json()
        answer = {"id": "resp_1", "object": "response", "created_at": 0, "metadata": body.get("metadata"),
                  "model": SERVED, "text": body.get("text"),
                  "output": [], "status": "completed",
                  "usage": {"input_tokens": 700, "output_tokens": 9, "total_tokens": 709,
                            "input_tokens_details": {"cached_tokens": 512}, "output_tokens_details": {},
                            "cost": 0.25}}  # a figure that is no integer (OpenRouter's usage has one)
        return Response(json.dumps(answer), media_type="application/json")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/responses", responses, methods=["POST"]),
                             Route("/v1/models", lambda _: JSONResponse({"data": [{"id": SERVED}]}), methods=["GET"])])


def test_an_answer_too_large_to_hold_is_still_billed_its_usage(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A JSON answer past ``max_response_bytes`` goes out as it comes, unpatched. It was also
    unread: the record had no prompt and 0 completion tokens, so a client that asked vLLM for
    ``prompt_logprobs`` (20 entries a prompt token: a prompt of some 50,000 tokens passes the
    64 MiB default) was billed nothing. Here the bound is 64 KiB. Its usage is read as it
    passes, the client's own ``"usage"`` objects echoed before it (a Responses body's schema)
    taken for none, nor an integer in them past int64 (it ended the read: ijson's fast number
    path is int64 and double), and the body reaches the client as the upstream sent it."""
    usage_dir = tmp_path / "usage"
    schema = {"format": {"type": "json_schema", "name": "s", "schema": {
        "usage": {"input_tokens": 1, "output_tokens": 0, "input_tokens_details": {"cached_tokens": 1}},
        "pad": "x" * 70_000, "maximum": 2**64}}}  # past int64 (a JSON schema's bound may be any integer)
    with serving_in_thread(_logprobs_upstream()) as upstream:
        settings = Settings(engine="upstream", upstream=upstream, usage_dir=str(usage_dir), usage_flush_interval_s=0.05,
                            api_keys_file=str(keys_file(tmp_path)), max_response_bytes=64 * 1024).validate()
        with serving_in_thread(CachetallyApp(settings)) as url:
            with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-acme-0123456789") as client:
                small = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "hi"}])
                large = client.chat.completions.with_raw_response.create(
                    model=SERVED, messages=[{"role": "user", "content": "hi"}], extra_body={"prompt_logprobs": 20})
                echoed = client.responses.with_raw_response.create(model=SERVED, input="hi", text=schema,
                                                                   metadata={"model": "m-listed"})
            metrics = httpx.get(f"{url}/metrics").text
    assert small.usage is not None and small.usage.prompt_tokens == 700
    assert len(large.http_response.content) > 64 * 1024 < len(echoed.http_response.content)
    assert json.loads(large.http_response.content)["prompt_logprobs"][1]["0"]["decoded_token"] == "\"usage\":"
    records = [orjson.loads(line) for f in sorted(usage_dir.glob("*.jsonl")) for line in f.read_bytes().splitlines()]
    billed = [(r["route"], r["tenant"], r["model"], r["prompt_tokens"], r["cached_tokens"], r["completion_tokens"],
               r["completion_source"]) for r in records]
    assert billed == [("chat", "acme", SERVED, 700, 512, 9, "usage")] * 2 + [
        ("responses", "acme", SERVED, 700, 512, 9, "usage")]  # not the metadata's model echoed before it
    assert 'cachetally_patch_skipped_total{reason="body_too_large"} 2.0' in metrics
    totals = read(sorted(usage_dir.glob("*.jsonl"))).total()
    assert (totals.prompt_tokens, totals.cached_tokens, totals.completion_tokens) == (2100, 1536, 27)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]  # nothing raised on the way


def test_an_answer_too_large_to_hold_that_ijson_cannot_decode_still_reaches_its_client_whole(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A surrogate written in UTF-8 in an answer: Python's ``json`` takes it, the client's and
    that of an answer held whole, and yajl lets it by, but ijson's decoding of the string raises
    ``UnicodeDecodeError``. The read of an answer too large to hold (or, past
    ``max_response_bytes_held``, of any size) raised it out of the app, and the client had the
    connection closed on it, no byte of its answer come. The answer now goes on whole, its
    figures unknown, as those of a body not JSON are."""
    body = (b'{"id": "c", "object": "chat.completion", "created": 0, "model": "m-real", "system_fingerprint": '
            b'"fp\xed\xa0\x80", "choices": [{"index": 0, "message": {"role": "assistant", "content": "'
            + b"x" * 100_000 + b'"}, "finish_reason": "length"}], '
            b'"usage": {"prompt_tokens": 700, "completion_tokens": 9, "total_tokens": 709}}')

    async def chat(_: Request) -> Response:
        return Response(body, media_type="application/json")

    upstream_app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                                     Route("/v1/models", lambda _: JSONResponse({"data": [{"id": SERVED}]}))])
    usage_dir = tmp_path / "usage"
    with serving_in_thread(upstream_app) as upstream:
        settings = Settings(engine="upstream", upstream=upstream, usage_dir=str(usage_dir), usage_flush_interval_s=0.05,
                            api_keys_file=str(keys_file(tmp_path)), max_response_bytes=64 * 1024).validate()
        with serving_in_thread(CachetallyApp(settings)) as url:
            with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-acme-0123456789", max_retries=0) as client:
                answer = client.chat.completions.with_raw_response.create(
                    model=SERVED, messages=[{"role": "user", "content": "hi"}])
    assert answer.http_response.content == body
    assert answer.parse().usage is not None and answer.parse().usage.prompt_tokens == 700
    records = [orjson.loads(line) for f in sorted(usage_dir.glob("*.jsonl")) for line in f.read_bytes().splitlines()]
    assert [(r["route"], r["tenant"], r["outcome"], r["prompt_tokens"]) for r in records] == [
        ("chat", "acme", "completed", None)]
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
