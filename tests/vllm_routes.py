"""vLLM's routes, two ways, for ``tests/patching/test_routes.py``.

- ``python -m tests.vllm_routes [FAKE_PATH...]`` builds the installed vLLM's real FastAPI
  app with every task it knows (dev mode and fault tolerance on, so every optional router
  is mounted), adds each ``FAKE_PATH`` as a POST route, and prints the paths of
  ``app.routes`` as JSON. Run in a process of its own (:mod:`tests.vllm_preloaded`):
  importing vLLM is slow and warns, and the dev mode is set in the environment.
- :func:`declared_paths` reads the route paths a vLLM's sources declare
  (``@router.post("/...")``, ``add_api_route("/...", ...)``, ...) with ``ast``, from a
  directory or a wheel that cannot be installed here (0.33.0).
"""

from __future__ import annotations

import ast
import os
import sys
import typing
import zipfile
from collections.abc import Iterator
from pathlib import Path

import orjson

_DECORATORS = {"get", "post", "put", "delete", "patch", "api_route", "websocket",
               "add_api_route", "add_api_websocket_route", "add_websocket_route", "add_route"}


def _entrypoint_sources(root: Path) -> Iterator[tuple[str, str]]:
    if root.is_file():
        with zipfile.ZipFile(root) as wheel:
            for name in wheel.namelist():
                if name.startswith("vllm/entrypoints/") and name.endswith(".py"):
                    yield name, wheel.read(name).decode()
        return
    for path in sorted((root / "vllm" / "entrypoints").rglob("*.py")):
        yield str(path), path.read_text()


def declared_paths(root: Path) -> set[str]:
    paths: set[str] = set()
    for name, text in _entrypoint_sources(root):
        for node in ast.walk(ast.parse(text, name)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in _DECORATORS and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                    and node.args[0].value.startswith("/")):
                paths.add(node.args[0].value)
    return paths


def _all_tasks() -> tuple[str, ...]:
    from vllm.tasks import SupportedTask

    return tuple(task for alias in typing.get_args(SupportedTask) for task in (typing.get_args(alias) or (alias,)))


def main(fakes: list[str]) -> None:
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    from vllm.entrypoints.launchers.app import build_app  # 0.33: the same module

    try:
        from vllm.entrypoints.common.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "unused"])
    args.enable_fault_tolerance = True
    app = build_app(args, _all_tasks())

    async def fake() -> dict[str, str]:
        return {}

    for path in fakes:
        app.add_api_route(path, fake, methods=["POST"])
    sys.stdout.write(orjson.dumps(sorted({route.path for route in app.routes})).decode())


if __name__ == "__main__":
    main(sys.argv[1:])
