"""An operator's own list of the upstream's routes that run no engine (``--forward-route``).

While billing is on, upstream mode refuses every path outside vLLM's route table
(``test_another_engines_routes``), llama.cpp's ``/props`` too, which generates nothing. Listed,
such a path reaches the upstream, by every method, and nothing else does: no form of a path a
hop or a lenient router may read otherwise (``/props/../completion``, ``//props/..//completion``,
``/props//..``, which Traefik forwards as ``/``: TGI's generating route). Through real HTTP
(uvicorn on loopback), cachetally in upstream mode in front of a stub that takes note of every
request it is sent.
"""

from __future__ import annotations

import contextlib
import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.server.app import CachetallyApp
from proxy.server.cli import main
from proxy.server.settings import Settings, SettingsError, load_settings
from tests.servers import metric_value, serving_in_thread

pytestmark = pytest.mark.loopback

KEY = "sk-shared-key"
PROPS = {"default_generation_settings": {"n_ctx": 4096}, "total_slots": 1}
#: What the upstream was sent, as (method, path, query): every request but cachetally's own
#: fetch of its model list (a route that runs no engine).
RECEIVED: list[tuple[str, str, bytes]] = []


async def llama_cpp_like(scope: Any, receive: Any, send: Any) -> None:
    """Notes every request it is sent; answers ``/props`` with llama.cpp's properties, and
    every other path but the model list as a route that generates."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    body: dict[str, Any] = {"object": "list", "data": [{"id": "m", "object": "model"}]}
    if (scope["method"], scope["path"]) != ("GET", "/v1/models"):
        RECEIVED.append((scope["method"], scope["path"], scope["query_string"]))
        body = PROPS if scope["path"] == "/props" else {"content": "generated", "tokens_predicted": 2}
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


@contextlib.contextmanager
def cachetally(forward: list[str]) -> Iterator[str]:
    """cachetally in upstream mode, billing on (an API key), before :func:`llama_cpp_like`."""
    RECEIVED.clear()
    with serving_in_thread(llama_cpp_like) as upstream:
        settings = Settings(engine="upstream", upstream=upstream, api_key=KEY, forward_routes=forward).validate()
        with serving_in_thread(CachetallyApp(settings)) as url:
            yield url


def _send_raw(url: str, method: str, path: str) -> int:
    """``method`` on ``path`` as written (httpx would remove its dot segments), with the key."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request(method, path, json.dumps({"prompt": "hi", "n_predict": 2}),
                           {"content-type": "application/json", "authorization": f"Bearer {KEY}"})
        return connection.getresponse().status
    finally:
        connection.close()


def test_a_listed_route_reaches_the_upstream_by_every_method_and_only_once_listed() -> None:
    """Unlisted, ``GET /props`` is a 403 in OpenAI's error JSON, counted as refused, and the
    upstream sees nothing. Listed, the client reads the upstream's own answer, for a ``POST``
    too (llama.cpp's ``POST /props`` sets properties: listing vouches for every method), and a
    query goes on as the query of ``/props``, never part of its path."""
    with cachetally([]) as url:
        refused = httpx.get(f"{url}/props")
        assert refused.status_code == 403 and refused.json()["error"]["code"] == 403
        metrics = httpx.get(f"{url}/metrics").text
        assert metric_value(metrics, "cachetally_refused_unmetered_total", route="unknown") == 1
    assert RECEIVED == []
    with cachetally(["/props"]) as url:
        assert httpx.get(f"{url}/props").json() == PROPS
        assert httpx.post(f"{url}/props", json={"n_ctx": 8192}).json() == PROPS
        assert httpx.get(f"{url}/props?x=/../completion").json() == PROPS
    assert RECEIVED == [("GET", "/props", b""), ("POST", "/props", b""), ("GET", "/props", b"x=/../completion")]


#: Paths that name ``/props`` and, as written or as a hop or lenient router reads them, another
#: route: llama.cpp's ``/completion``, the OpenAI routes without ``/v1``, TGI's ``POST /``.
SMUGGLED = [
    "/props/../completion", "/props/%2e%2e/completion", "/props/%2E%2E/completion", "//props/..//completion",
    "/props/..%2Fcompletion", "/props%2F..%2Fcompletion", "/props\\..\\completion", "/props%5C..%5Ccompletion",
    "/props/./../completion", "/props;/../completion", "/props%3Fx/../completion", "/props%23x/../completion",
    "/props/../chat/completions", "/props/../api/chat", "/props/../generate", "/completion/../props",
    "/props//..", "/props/..", "/props/.", "/props/", "/PROPS", "/Props/", "/props;x", "/x/props", "/props%00",
]


def test_no_form_of_a_listed_route_reaches_the_upstream() -> None:
    """With ``/props`` listed, each of :data:`SMUGGLED` is a 403 counted as refused, and the
    official client whose ``base_url`` climbs out of ``/props`` generates nothing: the upstream
    is sent not one of these requests."""
    with cachetally(["/props"]) as url:
        for path in SMUGGLED:
            assert _send_raw(url, "POST", path) == 403, path
        climbing = openai.OpenAI(base_url=f"{url}/props/%2e%2e", api_key=KEY, max_retries=0)
        with pytest.raises(openai.PermissionDeniedError):
            climbing.completions.create(model="m", prompt="hi", max_tokens=2)
        with pytest.raises(openai.PermissionDeniedError):
            climbing.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        metrics = httpx.get(f"{url}/metrics").text
    assert RECEIVED == []
    assert metric_value(metrics, "cachetally_refused_unmetered_total", route="unknown") == len(SMUGGLED) + 2


_SEGMENTS = st.sampled_from(["props", "prop%73", "PROPS", "completion", "generate", "v1", "models", "chat",
                             "completions", "..", ".", "", "%2e%2e", "%2E", ";x", "props;x", "%3F", "%00", "x"])
_SEPARATORS = st.sampled_from(["/", "\\", "%2F", "%5C", "//"])
_PATHS = st.tuples(_SEGMENTS, st.lists(st.tuples(_SEPARATORS, _SEGMENTS), max_size=5)).map(
    lambda parts: "/" + parts[0] + "".join(separator + segment for separator, segment in parts[1]))


def test_listing_a_route_forwards_that_one_path_and_nothing_else() -> None:
    """Hypothesis over paths built of ``props``, generating routes, dot segments, escapes and
    separators: with ``/props`` listed, the upstream is sent exactly what it is sent without
    the list, and ``/props`` itself (as a client may escape it: ``/prop%73``)."""
    with cachetally([]) as plain, cachetally(["/props"]) as listed:

        @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(path=_PATHS)
        def forwards_only_props(path: str) -> None:
            RECEIVED.clear()
            _send_raw(plain, "GET", path)
            unlisted = list(RECEIVED)
            RECEIVED.clear()
            _send_raw(listed, "GET", path)
            assert RECEIVED == unlisted or RECEIVED == [("GET", "/props", b"")], path

        forwards_only_props()


@pytest.mark.parametrize(("listed", "says"), [
    (["/v1/chat/completions"], "forward_routes: /v1/chat/completions is a metered route: it is metered already"),
    (["/props", "/api/v1/messages"], "/api/v1/messages ends with /v1/messages, which is a metered route"),
    (["/invocations"], "/invocations is a metered route"),
    (["/v1/embeddings"], "/v1/embeddings runs the engine unmetered: it is refused while billing is on"),
    (["/props/../completion"], "'/props/../completion' is no plain path"),
    (["props"], "'props' is no plain path: list it from the root"),
    (["/p%72ops"], "percent-escape"),
    (["/props?x"], "'/props?x' is no plain path"),
    (["/Props"], "in lower case"),
])
def test_a_metered_route_or_a_path_read_otherwise_fails_the_start(
        listed: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each listed path fails ``cachetally serve`` (exit 2, one line saying why) before it binds."""
    flags = [arg for path in listed for arg in ("--forward-route", path)]
    assert main(["serve", "--upstream", "http://127.0.0.1:9", *flags]) == 2
    assert says in capsys.readouterr().err


def test_the_list_is_read_from_the_file_and_the_environment_and_applies_to_an_upstream_only(tmp_path: Path) -> None:
    """As ``auth_exempt_paths``: a TOML list, or ``CACHETALLY_FORWARD_ROUTES`` (paths between
    spaces), which a flag's list replaces. Beside the vLLM or sim engine, whose routes are
    vLLM's own, it fails the start."""
    config = tmp_path / "cachetally.toml"
    config.write_text('[cachetally]\nforward_routes = ["/props", "/slots"]\n')
    upstream = {"upstream": "http://127.0.0.1:9"}
    assert load_settings(config, env={}, overrides=upstream).forward_routes == ["/props", "/slots"]
    from_env = {"CACHETALLY_FORWARD_ROUTES": "/api/tags /api/version"}
    assert load_settings(config, env=from_env, overrides=upstream).forward_routes == ["/api/tags", "/api/version"]
    flags = {**upstream, "forward_routes": ["/get_model_info"]}
    assert load_settings(config, env=from_env, overrides=flags).forward_routes == ["/get_model_info"]
    with pytest.raises(SettingsError, match="/v1/completions is a metered route"):
        load_settings(None, env={"CACHETALLY_FORWARD_ROUTES": "/props /v1/completions"}, overrides=upstream)
    for engine in ("sim", "vllm"):
        with pytest.raises(SettingsError, match=r"forward_routes applies to an upstream \(--upstream URL\)"):
            load_settings(config, env={}, overrides={"engine": engine})
