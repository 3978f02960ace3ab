"""The route table (:mod:`proxy.patching.routes`) classifies every route of every supported vLLM.

The installed vLLM's real app is built (every task, every optional router) and its
``app.routes`` walked; the 0.33.0 wheel, which cannot be installed here, and the installed
vLLM's own files are read for the paths their routers declare. A route the table does not
know fails the test, so a new vLLM cannot add a route, generating or not, unnoticed; the
fake route shows that it does."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from proxy.patching.routes import PATCHED, kind
from tests.engine_adapter.vllm.test_vllm_wheel_033 import installed_site_packages, vllm_033_wheel
from tests.vllm_routes import declared_paths
from tests.vllm_preloaded import Script

def app_routes(vllm_script: Script, *fakes: str) -> list[str]:
    """The installed vLLM's ``app.routes`` paths, with ``fakes`` added as POST routes
    (``python -m tests.vllm_routes``, in a process of its own)."""
    done = vllm_script("import sys; from tests.vllm_routes import main; main(sys.argv[1:])", *fakes,
                       env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def unclassified(paths: list[str] | set[str]) -> list[str]:
    return sorted(path for path in paths if kind(path) is None)


@pytest.mark.vllm
def test_every_route_of_the_installed_vllm_app_is_classified_and_a_fake_one_is_caught(vllm_script: Script) -> None:
    """One app build: the fake route must be the only unclassified one."""
    paths = app_routes(vllm_script, "/v1/fake/generate")
    assert set(PATCHED) <= set(paths)
    assert unclassified(paths) == ["/v1/fake/generate"]


@pytest.mark.parametrize("which", [
    pytest.param("wheel", id="vllm-0.33.0-wheel"),
    pytest.param("installed", id="installed-vllm", marks=pytest.mark.vllm),
])
def test_every_route_a_vllm_release_declares_is_classified(which: str) -> None:
    paths = declared_paths(vllm_033_wheel() if which == "wheel" else installed_site_packages())
    assert {"/v1/messages", "/v1/responses", "/v1/chat/completions"} <= paths
    assert unclassified(paths) == []


_POOLING_VLLM = """
import argparse, sys
import httpx
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from proxy.vllm_middleware import CachetallyMiddleware
from tests.servers import serving_in_thread

class Client:  # vLLM's engine client, as far as the tap needs one
    errored = False
    model_config = argparse.Namespace(served_model_name="m", model="m", dtype="float32", runner_type=sys.argv[1])
    async def generate(self, *args, **kwargs):
        yield None

async def invocations(request):  # vLLM's /invocations: a pooling model's embeddings handler
    return JSONResponse({"object": "list", "data": [{"index": 0, "embedding": [0.0]}],
                         "usage": {"prompt_tokens": 81, "total_tokens": 81}})

app = Starlette(routes=[Route("/invocations", invocations, methods=["POST"])])
app.state.args = argparse.Namespace(api_key=None, host="127.0.0.1", port=0, api_server_count=1)
app.state.engine_client = Client()  # vLLM's --runner: pooling (an embedding model) or generate
app.add_middleware(CachetallyMiddleware)
with serving_in_thread(app, start_timeout_s=240) as url:  # the lifespan taps vLLM: its imports take a while
    print(httpx.post(f"{url}/invocations", json={"model": "m", "input": "hello"}, timeout=120).status_code)
"""


@pytest.mark.parametrize(("model", "status"), [("pooling", 403), ("generate", 200)])
def test_invocations_on_a_pooling_model_is_refused_while_billing(
        vllm_script: Script, tmp_path: Path, model: str, status: int) -> None:
    """On a model without the generate task, vLLM's ``/invocations`` dispatches any body to the
    pooling handlers (embeddings, classify, score, pooling), whose own routes are refused: it ran
    them as a metered route whose cache figures the tap never sees (no ``generate()``), billed
    with ``cached_tokens`` unknown and left out of the tenant's token totals. Inside vLLM, it is
    refused while billing is on."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHETALLY_", "VLLM_API_KEY"))}
    env["CACHETALLY_USAGE_DIR"] = str(tmp_path / "usage")
    run = vllm_script(_POOLING_VLLM, model, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-1] == str(status)
