"""The README's two commands, and the setup they run, as a reader of a fresh clone meets them."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh_clone(tmp_path: Path) -> Path:
    """The scripts in a folder with no .venv, and a Python that makes any setup fail."""
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    return tmp_path


def run(clone: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": str(clone / "no-python-here")}
    return subprocess.run([str(clone / "scripts" / script), *args], capture_output=True, text=True, env=env,
                          timeout=60)


@pytest.mark.parametrize("script", ["serve", "test", "setup"])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_explains_the_script_without_setting_anything_up(fresh_clone: Path, script: str, flag: str) -> None:
    """On a fresh clone, --help was minutes of install (3.5 GB) before any word of help."""
    out = run(fresh_clone, script, flag)
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout.startswith(f"usage: scripts/{script} ")
    assert "scripts/setup" in out.stdout
    assert not (fresh_clone / ".venv").exists()


def test_setup_given_an_argument_it_does_not_take_refuses_it_without_setting_anything_up(fresh_clone: Path) -> None:
    out = run(fresh_clone, "setup", "--gpu")
    assert out.returncode == 2
    assert out.stderr.startswith("scripts/setup: takes no argument: --gpu\nusage: scripts/setup [-h]\n")
    assert not (fresh_clone / ".venv").exists()


@pytest.mark.parametrize(("pytest_status", "script_status"), [(0, 0), (1, 1), (5, 1)])
def test_the_suite_fails_when_pytest_collects_nothing(fresh_clone: Path, pytest_status: int,
                                                      script_status: int) -> None:
    (fresh_clone / "scripts" / "setup").write_text("#!/usr/bin/env bash\n")  # set up already
    python = fresh_clone / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/usr/bin/env bash\nexit {pytest_status}\n")
    python.chmod(0o755)
    out = run(fresh_clone, "test", "-m", "no_such_marker")
    assert out.returncode == script_status
    assert ("collected no tests" in out.stderr) == (pytest_status == 5)
