"""vLLM's own ``vllm serve`` parser, and which settings a user's flags set as it reads them.

cachetally adds a few machine defaults (engine_adapter/vllm/cpu.py) only where the user set
nothing. vLLM's parser accepts one setting in many spellings: ``--dtype=half``, ``--dtype
half``, underscores (``--gpu_memory_utilization``), aliases (``--device-memory-utilization``),
unambiguous prefixes (``--dty``), and a YAML ``--config`` file whose values rank below every
flag, so below a default added on the command line. Matching flag names by hand missed all
but the first two; asking vLLM's parser misses none, and rejects a bad flag before the
default model is pulled.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from engine_adapter.vllm import compat

#: Stands for the model while only the flags are read: the parser takes any positional.
_ANY_MODEL = "model"


class _Unset:
    """A default no user value can equal: a setting that keeps it was not given."""


_UNSET = _Unset()


def serve_parser() -> tuple[Any, Any, Any]:
    """vLLM's top-level parser, its ``serve`` command and that command's parser, as ``vllm serve`` builds them."""
    # Importing vLLM's CLI warns of torch's own deprecations: noise for a user, and an error
    # where warnings are errors (the test suite reads flags in its own process).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        parser = compat.require("FlexibleArgumentParser")(prog="vllm")
        commands = compat.require("cmd_init")()
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    (serve,) = [cmd for cmd in commands if cmd.name == "serve"]
    subparser = serve.subparser_init(subparsers)
    subparser.set_defaults(dispatch_function=serve.cmd)
    return parser, serve, subparser


def settings_given(user_args: Sequence[str], settings: Iterable[str]) -> set[str]:
    """Which of ``settings`` (vLLM's argument names, e.g. ``"dtype"``) ``user_args`` set.

    A bad flag exits as ``vllm serve`` does on it: status 2 and argparse's message.
    """
    parser, _, subparser = serve_parser()
    settings = list(settings)
    subparser.set_defaults(**dict.fromkeys(settings, _UNSET))
    args = parser.parse_args(["serve", _ANY_MODEL, *user_args])
    return {name for name in settings if getattr(args, name, _UNSET) is not _UNSET}
