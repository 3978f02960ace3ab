"""An ``https://`` upstream: certificates are verified, by the system's CAs or ``--upstream-ca``.

The upstream is the h11 server of ``tests.h11_upstream`` behind TLS, with a certificate
issued by a private CA that ``trustme`` makes for each test.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trustme

from proxy.server.settings import SettingsError, load_settings
from proxy.upstream.client import Origin, UpstreamFailure
from proxy.upstream.pool import Http1Pool
from tests.h11_upstream import H11Upstream
from tests.servers import running_server_beside

pytestmark = pytest.mark.loopback


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def ca_file(ca: trustme.CA, tmp_path: Path) -> Iterator[str]:
    path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    yield str(path)


def server_context(ca: trustme.CA, *names: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*names).configure_cert(context)
    return context


def pool_for(port: int, ca_file: str | None) -> Http1Pool:
    return Http1Pool(
        Origin.parse(f"https://127.0.0.1:{port}"), max_connections=2, keepalive_s=30.0,
        connect_timeout_s=5.0, read_timeout_s=5.0, ca_file=ca_file,
    )


async def echo(pool: Http1Pool, body: bytes) -> tuple[int, bytes]:
    response = await pool.send("POST", b"/echo", [], body)
    out = b""
    while chunk := await response.read():
        out += chunk
    response.close()
    return response.status, out


@pytest.mark.asyncio
async def test_a_private_ca_named_by_upstream_ca_is_trusted(ca: trustme.CA, ca_file: str) -> None:
    upstream = H11Upstream()
    async with upstream.serving(ssl=server_context(ca, "127.0.0.1")) as port:
        pool = pool_for(port, ca_file)
        assert await echo(pool, b"over tls") == (200, b"over tls")
        assert await echo(pool, b"again") == (200, b"again")
        await pool.aclose()
    assert upstream.connections == 1  # kept alive over TLS too
    assert [r.body for r in upstream.requests] == [b"over tls", b"again"]


@pytest.mark.asyncio
@pytest.mark.parametrize("case", ["system CAs only", "another host's certificate"])
async def test_a_certificate_that_does_not_verify_is_a_502_and_nothing_is_sent(
    ca: trustme.CA, ca_file: str, case: str
) -> None:
    names = ("upstream.example",) if case == "another host's certificate" else ("127.0.0.1",)
    upstream = H11Upstream()
    async with upstream.serving(ssl=server_context(ca, *names)) as port:
        pool = pool_for(port, None if case == "system CAs only" else ca_file)
        with pytest.raises(UpstreamFailure) as info:
            await echo(pool, b"secret")
        assert pool.pool_state() == (0, 0, 0, 0)
        await pool.aclose()
    assert (info.value.status, info.value.reason) == (502, "SSLCertVerificationError")
    assert upstream.requests == []


def test_upstream_ca_is_checked_at_startup(ca_file: str, tmp_path: Path) -> None:
    settings = load_settings(overrides={"upstream": "https://127.0.0.1:9", "upstream_ca": ca_file}, env={})
    assert settings.upstream_ca == ca_file
    with pytest.raises(SettingsError, match="https:// upstream only"):
        load_settings(overrides={"upstream": "http://127.0.0.1:9", "upstream_ca": ca_file}, env={})
    with pytest.raises(SettingsError, match="no such file"):
        load_settings(overrides={"upstream": "https://127.0.0.1:9", "upstream_ca": str(tmp_path / "x")}, env={})
    # A file that holds no certificate: before, an ssl.SSLError traceback once the app was built.
    (not_pem := tmp_path / "not.pem").write_text("not a certificate\n")
    with pytest.raises(SettingsError, match="cannot load CA certificates from .*not.pem"):
        load_settings(overrides={"upstream": "https://127.0.0.1:9", "upstream_ca": str(not_pem)}, env={})


@pytest.mark.asyncio
async def test_the_proxy_reaches_an_https_upstream_with_upstream_ca(ca: trustme.CA, ca_file: str) -> None:
    upstream = H11Upstream()
    async with upstream.serving(ssl=server_context(ca, "127.0.0.1")) as port:
        args = ["-m", "proxy.server.cli", "serve", "--upstream", f"https://127.0.0.1:{port}", "--upstream-ca", ca_file,
                "--log-level", "warning"]
        async with running_server_beside(args) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:
                response = await client.post(f"{url}/echo", content=b'{"via": "cachetally"}')
    assert (response.status_code, response.content) == (200, b'{"via": "cachetally"}')
    # Beside the proxy's own GET /v1/models at startup (the model list), over the same TLS:
    assert [(r.target, r.body) for r in upstream.requests if r.method == b"POST"] == [(b"/echo", b'{"via": "cachetally"}')]
