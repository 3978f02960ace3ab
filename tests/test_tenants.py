"""Tenants: API key name, then a trusted header bounded by --tenants, then ``default``.

In process (the app and the sim engine, no server): what a client sends decides the
``tenant`` label of every token and request counter, and the label values stay within
the configured names plus ``other`` and ``default``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.app import CachetallyApp
from proxy.cli import build_parser, serve_settings
from proxy.settings import Settings, SettingsError, load_settings
from proxy.tenants import KeyTable, Tenancy
from tests.servers import metric_value

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
    path.chmod(0o644)
    KeyTable.load(path)
    assert [r.getMessage() for r in caplog.records] == [f"API keys file {path} can be read by other users: chmod 600 it"]


@pytest.mark.asyncio
async def test_api_keys_name_the_tenant_and_unknown_keys_are_refused(tmp_path: Path, caplog) -> None:
    path = keys_file(tmp_path, '"sk-alpha-1" = "alpha"\n"sk-beta-22" = "beta"\n')
    caplog.set_level(logging.DEBUG)
    async with in_process(api_keys_file=str(path), api_key="sk-single", tenant_header="x-tenant") as client:
        for key, times in (("sk-alpha-1", 2), ("sk-beta-22", 1), ("sk-single", 1)):
            for _ in range(times):
                # The header never overrides a key's tenant.
                headers = {"authorization": f"Bearer {key}", "x-tenant": "beta"}
                assert (await client.post("/v1/completions", json=BODY, headers=headers)).status_code == 200
        for bad in ("sk-alpha-", "sk-alpha-11", "alpha", ""):
            resp = await client.post("/v1/completions", json=BODY, headers={"authorization": f"Bearer {bad}"})
            assert resp.status_code == 401
        metrics = (await client.get("/metrics", headers={"authorization": "Bearer sk-beta-22"})).text
    # sk-single is the old single key: accepted, and the header decides (beta is not configured: other).
    assert tenants_in(metrics) == {"alpha": 2, "beta": 1, "other": 1}
    assert tenants_in(metrics, "cachetally_completion_tokens_total") == {"alpha": 6, "beta": 3, "other": 3}
    for key in ("sk-alpha-1", "sk-beta-22", "sk-single"):
        assert key not in caplog.text


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


def test_keys_are_held_as_digests_and_confirmed_with_compare_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    import proxy.tenants

    compared: list[tuple[bytes, bytes]] = []
    real = proxy.tenants.hmac.compare_digest
    monkeypatch.setattr(proxy.tenants.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))
    table = KeyTable({"sk-one": "one"})
    assert table.tenant_for(b"sk-one") == "one"
    assert table.tenant_for(b"sk-on") is None
    assert compared == [(hashlib.sha256(b"sk-one").digest(),) * 2]
    assert b"sk-one" not in repr(table._by_digest).encode()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('"sk-secret-1" = 3\n', "every entry must be"),
        ('"sk-secret-1" = "no spaces allowed"\n', "tenant name"),
        ('"sk-secret-1 = "a"\n', "not valid TOML"),
        ("", "holds no keys"),
        ('"" = "a"\n', "is empty"),
    ],
)
def test_a_bad_keys_file_is_refused_without_quoting_a_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        KeyTable.load(keys_file(tmp_path, text))
    assert "sk-secret" not in str(info.value)


def test_flags_env_and_file_set_the_tenancy(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["serve", "--engine", "sim", "--tenant-header", "X-Team", "--tenants", "a,b,c", "--api-keys", "k.toml"]
    )
    settings = serve_settings(args)
    assert (settings.tenant_header, settings.tenants, settings.api_keys_file) == ("X-Team", ["a", "b", "c"], "k.toml")
    assert load_settings(env={"CACHETALLY_TENANTS": "x y,z"}).tenants == ["x", "y", "z"]
    with pytest.raises(SettingsError, match="tenant name"):
        load_settings(env={"CACHETALLY_TENANTS": "ok,not/ok"})
    with pytest.raises(SettingsError, match="header name"):
        load_settings(env={"CACHETALLY_TENANT_HEADER": "x tenant"})


def test_tenancy_resolves_in_the_documented_order() -> None:
    tenancy = Tenancy(KeyTable({"k1": "keyed"}), "x-t", ["a"])
    assert tenancy.resolve([(b"authorization", b"Bearer k1"), (b"x-t", b"a")]) == "keyed"
    assert tenancy.resolve([(b"authorization", b"Bearer k2"), (b"X-T", b"a")]) == "a"
    assert tenancy.resolve([(b"x-t", b"b")]) == "other"
    assert tenancy.resolve([]) == "default"
    assert Tenancy().resolve([(b"x-t", b"a")]) == "default"
