"""The route table (:mod:`proxy.patching.routes`) classifies every route of every supported vLLM.

The installed vLLM's real app is built (every task, every optional router) and its
``app.routes`` walked; the 0.33.0 wheel, which cannot be installed here, and the installed
vLLM's own files are read for the paths their routers declare. A route the table does not
know fails the test, so a new vLLM cannot add a route, generating or not, unnoticed; the
fake route shows that it does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.patching.routes import PATCHED, kind
from tests.engine_adapter.vllm.test_vllm_wheel_033 import installed_site_packages, vllm_033_wheel
from tests.vllm_routes import declared_paths

ROOT = Path(__file__).resolve().parents[2]


def app_routes(*fakes: str) -> list[str]:
    """The installed vLLM's ``app.routes`` paths, with ``fakes`` added as POST routes."""
    done = subprocess.run([sys.executable, "-m", "tests.vllm_routes", *fakes], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def unclassified(paths: list[str] | set[str]) -> list[str]:
    return sorted(path for path in paths if kind(path) is None)


@pytest.mark.vllm
def test_every_route_of_the_installed_vllm_app_is_classified_and_a_fake_one_is_caught() -> None:
    """One app build (about 25 s): the fake route must be the only unclassified one."""
    paths = app_routes("/v1/fake/generate")
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
