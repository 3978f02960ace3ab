"""The vLLM flags ``cachetally serve`` adds on a machine without CUDA (engine_adapter/vllm/cpu.py).

The dtype default matters most: emulated bf16 made a cold prompt about 6 times slower on an
AVX2-only CPU. Whether this CPU has bf16 in hardware is checked against the kernel's own
CPU flags, an oracle independent of torch.
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from engine_adapter.vllm import cpu

pytestmark = pytest.mark.vllm  # torch comes with vLLM


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)


@pytest.mark.skipif(platform.machine() != "x86_64" or not Path("/proc/cpuinfo").exists(), reason="x86 Linux")
def test_native_bf16_is_what_the_kernel_says_this_cpu_has() -> None:
    flags = set(Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split())
    assert cpu.native_bf16() == bool(flags & {"avx512_bf16", "amx_bf16"})


@pytest.mark.parametrize(
    ("native", "user", "dtype"),
    [
        (False, [], ["--dtype", "float32"]),
        (True, [], []),  # the model's own bf16
        (False, ["--dtype=bfloat16"], []),  # the user's, whatever the form
        (False, ["--dtype", "half"], []),
    ],
)
def test_float32_only_without_native_bf16_and_never_over_the_users_dtype(
    monkeypatch: pytest.MonkeyPatch, no_cuda: None, native: bool, user: list[str], dtype: list[str]
) -> None:
    monkeypatch.setattr(cpu, "native_bf16", lambda: native)
    flags = cpu.machine_flags(user)
    assert flags[0] == "--enforce-eager"
    assert (flags[flags.index("--dtype"):] if "--dtype" in flags else []) == dtype


@pytest.mark.parametrize(
    "user",
    [["--kv-cache-memory-bytes", "1073741824"], ["--gpu-memory-utilization=0.5"],
     # Spellings vLLM's parser reads as the same settings, which a match on flag names missed:
     ["--gpu_memory_utilization", "0.5"], ["--device-memory-utilization=0.5"], ["--num-gpu-blocks", "64"],
     ["--kv_cache_memory_bytes=1073741824"]],
)
def test_the_kv_cache_default_yields_to_any_size_the_user_gave(no_cuda: None, user: list[str]) -> None:
    assert "--kv-cache-memory-bytes" in cpu.machine_flags([])
    assert "--kv-cache-memory-bytes" not in cpu.machine_flags(user)


@pytest.mark.parametrize(("setting", "default"), [("gpu-memory-utilization: 0.5", "--kv-cache-memory-bytes"),
                                                  ("dtype: bfloat16", "--dtype")])
def test_a_setting_in_the_users_vllm_config_file_is_not_overridden(
    monkeypatch: pytest.MonkeyPatch, no_cuda: None, tmp_path: Path, setting: str, default: str
) -> None:
    """vLLM ranks a --config file below every command-line flag, so a default added there
    silently replaced the file's value (vLLM's own parse shows which one it keeps)."""
    monkeypatch.setattr(cpu, "native_bf16", lambda: False)
    config = tmp_path / "vllm.yaml"
    config.write_text(setting + "\n")
    assert default in cpu.machine_flags([])
    assert default not in cpu.machine_flags(["--config", str(config)])


def test_a_bad_flag_is_refused_as_vllm_serve_refuses_it(no_cuda: None, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cpu.machine_flags(["--max-model-lem", "512"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == "vllm: error: unrecognized arguments: --max-model-lem 512"


def test_nothing_is_added_with_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu.machine_flags([]) == []
