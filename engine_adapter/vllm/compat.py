"""Where each vLLM entry point lives, by version (0.32 and 0.33): looked up, not assumed.

(Provisional: the full table of touch points and the 0.33 wheel check land with issue 13 item 7.)
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

_WHERE: dict[str, tuple[tuple[str, str], ...]] = {
    "cli_env_setup": (
        ("vllm.entrypoints.common.startup", "cli_env_setup"),  # 0.33
        ("vllm.entrypoints.serve.utils.api_utils", "cli_env_setup"),  # 0.32
    ),
    "FlexibleArgumentParser": (("vllm.utils.argparse_utils", "FlexibleArgumentParser"),),
    "serve_cmd_init": (("vllm.entrypoints.cli.serve", "cmd_init"),),
    "configure_logging_from_args": (("vllm.logger", "configure_logging_from_args"),),
    "get_prometheus_registry": (("vllm.v1.metrics.prometheus", "get_prometheus_registry"),),
}


@cache
def resolve(name: str) -> Any | None:
    for module, attr in _WHERE[name]:
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            continue
    return None


def require(name: str) -> Any:
    found = resolve(name)
    if found is None:
        raise ImportError(f"vLLM provides no {name} (looked in {[m for m, _ in _WHERE[name]]})")
    return found
