"""Run-time resolution of vLLM touch points (engine_adapter/vllm/compat.py), on fake vLLMs.

A fake vLLM is a package written to a temporary directory and put first on ``sys.path``:
real imports, real ``inspect`` and bytecode, no vLLM needed. Each test builds the layout of
one release and checks what ``resolve`` finds, where, and what is logged.
"""

from __future__ import annotations

import logging
import sys
import textwrap
from pathlib import Path

import pytest

from engine_adapter.vllm import compat
from tests.vllm_preloaded import Script

NEW_STARTUP = "vllm.entrypoints.common.startup"
OLD_STARTUP = "vllm.entrypoints.serve.utils.api_utils"
NEW_CLI_ARGS = "vllm.entrypoints.common.cli_args"
OLD_CLI_ARGS = "vllm.entrypoints.launchers.cli_args"


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write modules of a fake ``vllm`` package; forget them and every resolution after."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(module: str, source: str) -> None:
        parts = module.split(".")
        for depth in range(1, len(parts)):
            init = tmp_path.joinpath(*parts[:depth], "__init__.py")
            init.parent.mkdir(parents=True, exist_ok=True)
            init.touch()
        tmp_path.joinpath(*parts[:-1], parts[-1] + ".py").write_text(textwrap.dedent(source))

    def forget() -> None:
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]
        compat.clear_cache()

    saved = {n: m for n, m in sys.modules.items() if n == "vllm" or n.startswith("vllm.")}
    forget()
    write("vllm.__init__", '__version__ = "0.33.0"\n')
    yield write
    forget()
    sys.modules.update(saved)


def test_finds_the_033_location_first(fake_vllm) -> None:
    fake_vllm(NEW_STARTUP, "def cli_env_setup():\n    return 'new'\n")
    fake_vllm(OLD_STARTUP, "def cli_env_setup():\n    return 'old'\n")
    assert compat.resolve("cli_env_setup")() == "new"
    assert compat.lookup("cli_env_setup")[1] == NEW_STARTUP


def test_falls_back_to_the_032_location(fake_vllm) -> None:
    fake_vllm(OLD_STARTUP, "def cli_env_setup():\n    return 'old'\n")
    fake_vllm(OLD_CLI_ARGS, "class FrontendArgs:\n    middleware: list = []\n")
    assert compat.resolve("cli_env_setup")() == "old"
    assert compat.resolve("FrontendArgs").middleware == []
    assert compat.lookup("FrontendArgs")[1] == OLD_CLI_ARGS


def test_a_module_without_the_name_falls_through(fake_vllm) -> None:
    fake_vllm(NEW_CLI_ARGS, "def something_else():\n    pass\n")
    fake_vllm(OLD_CLI_ARGS, "class FrontendArgs:\n    middleware: list = []\n")
    assert compat.lookup("FrontendArgs")[1] == OLD_CLI_ARGS


def test_wrong_parameters_count_as_missing(fake_vllm) -> None:
    fake_vllm("vllm.v1.engine.output_processor", """
        class OutputProcessor:
            def _update_stats_from_output(self, state, output, timestamp, stats):
                pass
    """)
    assert compat.resolve("OutputProcessor._update_stats_from_output") is None
    why = compat.lookup("OutputProcessor._update_stats_from_output")[2]
    assert "takes (state, output, timestamp, stats), not (req_state, engine_core_output, ...)" in why


def test_fields_are_found_in_class_bodies_and_init(fake_vllm) -> None:
    fake_vllm("vllm.v1.metrics.stats", """
        from dataclasses import dataclass
        @dataclass
        class PrefillStats:
            num_prompt_tokens: int = 0
            num_cached_tokens: int = 0
            num_local_cached_tokens: int = 0
            num_external_cached_tokens: int = 0
            num_cache_creation_tokens: int = 0
    """)
    fake_vllm("vllm.v1.engine.output_processor", """
        class RequestState:
            def __init__(self, parent_req):
                self.is_prefilling = True
                self.parent_req = parent_req
                self.request_id = "x"
                self.prompt_len = 0
    """)
    assert compat.resolve("PrefillStats") is not None
    assert compat.resolve("RequestState") is None
    assert compat.lookup("RequestState")[2].endswith("no field remote_prefill_cached_tokens")


def test_what_a_function_sets_and_uses(fake_vllm) -> None:
    fake_vllm("vllm.entrypoints.launchers.api_server.app_state", """
        async def init_app_state(engine_client, state, args, supported_tasks=None):
            state.engine_client = engine_client
    """)
    fake_vllm("vllm.entrypoints.serve.middleware.register", """
        def init_entrypoints_middleware(args, app, supported_tasks):
            for path in args.middleware:
                app.middleware("http")(path)
    """)
    assert compat.resolve("init_app_state") is not None
    assert compat.resolve("init_entrypoints_middleware") is None
    assert "does not use app.add_middleware" in compat.lookup("init_entrypoints_middleware")[2]


def test_a_constant_must_have_its_value(fake_vllm) -> None:
    fake_vllm("vllm.entrypoints.cli.serve", """
        class ServeSubcommand:
            name = "run"
            @staticmethod
            def cmd(args):
                pass
    """)
    assert compat.resolve("ServeSubcommand.name") is None
    assert compat.resolve("ServeSubcommand.cmd") is not None


def test_missing_is_logged_once_in_one_line(fake_vllm, caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test_vllm_compat")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        first = compat.log_missing_once(logger)
        again = compat.log_missing_once(logger)
    assert first == again == list(compat.TOUCH_POINTS)  # an empty fake vLLM lacks them all
    assert len(caplog.records) == 1
    line = caplog.records[0].getMessage()
    assert "\n" not in line
    assert line.startswith("vLLM 0.33.0: not found: FlexibleArgumentParser (")
    assert "OutputProcessor._update_stats_from_output (no prefill hook: totals from RequestOutput" in line
    assert f"cli_env_setup ({compat.TOUCH_POINTS['cli_env_setup'].without}; {NEW_STARTUP}: " in line


def test_require_names_what_it_tried(fake_vllm) -> None:
    with pytest.raises(ImportError, match=rf"vLLM 0.33.0: cli_env_setup not found \({NEW_STARTUP}: "
                                          rf"no such module; {OLD_STARTUP}: no such module\)"):
        compat.require("cli_env_setup")


def test_a_module_that_fails_to_import_says_why(fake_vllm) -> None:
    fake_vllm(NEW_STARTUP, "import no_such_dependency_here\n")
    fake_vllm(OLD_STARTUP, "def cli_env_setup():\n    pass\n")
    assert compat.lookup("cli_env_setup")[1] == OLD_STARTUP
    fake_vllm(OLD_STARTUP, "raise RuntimeError('no accelerator')\n")
    del sys.modules[OLD_STARTUP]
    compat.clear_cache()
    assert compat.lookup("cli_env_setup")[2] == (
        f"{NEW_STARTUP}: import failed (ModuleNotFoundError: No module named "
        f"'no_such_dependency_here'); {OLD_STARTUP}: import failed (RuntimeError: no accelerator)")


@pytest.mark.parametrize(("version", "ok"), [
    ("0.32.0", True), ("0.33.0", True), ("0.33.2rc1", True), ("0.32.0+cpu", True),
    ("0.31.9", False), ("0.34.0", False), ("0.34.0rc1", False), ("1.33.0", False), (None, False),
])
def test_supported_range(version: str | None, ok: bool) -> None:
    assert compat.supported(version) is ok


def test_an_unsupported_version_is_warned_once(fake_vllm, caplog: pytest.LogCaptureFixture) -> None:
    fake_vllm("vllm.__init__", '__version__ = "0.34.1"\n')
    logger = logging.getLogger("test_vllm_compat")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        assert compat.check_version_once(logger) is False
        assert compat.check_version_once(logger) is False
    assert [r.getMessage() for r in caplog.records] == [
        "vLLM 0.34.1 is outside the supported range >=0.32,<0.34; the adapter feature-detects "
        "what it uses"]


def test_importing_compat_does_not_import_vllm() -> None:
    import subprocess

    code = "import sys, engine_adapter.vllm.compat; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.stdout.strip() == "False"


@pytest.mark.vllm
def test_the_installed_vllm_has_every_touch_point(vllm_script: Script) -> None:
    """The real resolution, on the installed vLLM, in a child process (importing vLLM there
    keeps its import-time warnings and environment out of this one; no engine starts)."""
    import json
    import os

    code = ("import json, logging, sys; from engine_adapter.vllm import compat; "
            "ok = compat.check_version_once(logging.getLogger('t')); "
            "print(json.dumps([compat.version(), ok, compat.log_missing_once(logging.getLogger('t')), "
            "{n: compat.lookup(n)[1] for n in compat.TOUCH_POINTS}]))")
    out = vllm_script(code, env=dict(os.environ), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    version, ok, lacking, where = json.loads(out.stdout.strip().splitlines()[-1])
    assert (ok, lacking) == (True, []), f"vLLM {version}"
    minor = int(version.split(".")[1])
    assert where["cli_env_setup"] == {32: OLD_STARTUP, 33: NEW_STARTUP}[minor]
    assert where["FrontendArgs"] == {32: OLD_CLI_ARGS, 33: NEW_CLI_ARGS}[minor]
    assert "not found" not in out.stderr


class _Processor:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def _update_stats_from_output(self, req_state, engine_core_output, timestamp, iteration_stats):
        self.calls.append(req_state.request_id)


class _OldProcessor:
    def _update_stats_from_output(self, state, output):
        pass


class _Client:
    def __init__(self, processor: object) -> None:
        self.output_processor = processor


def test_prefill_tap_hooks_a_matching_method_and_records_the_first_prefill(fake_vllm) -> None:
    from types import SimpleNamespace as NS

    from engine_adapter.vllm.prefill import Prefill, PrefillTap

    processor, handed = _Processor(), []
    tap = PrefillTap(_Client(processor), lambda *figures: handed.append(figures))
    assert tap.installed
    tap.expect("r1-0a1b2c3d", "call")
    state = NS(is_prefilling=True, parent_req=None, request_id="r1-0a1b2c3d", prompt_len=500,
               remote_prefill_cached_tokens=None)
    stats = NS(num_cached_tokens=384, num_local_cached_tokens=256, num_external_cached_tokens=128,
               num_cache_creation_tokens=128)
    for _ in range(2):  # the second: vLLM's next output of the request (it still reads is_prefilling)
        processor._update_stats_from_output(state, NS(prefill_stats=stats), 0.0, None)
    assert processor.calls == ["r1-0a1b2c3d"] * 2  # vLLM's own method still runs
    assert handed == [("call", Prefill(384, 256, 128, 128), 500)]
    tap.uninstall()
    assert "_update_stats_from_output" not in vars(processor)


def test_prefill_tap_hands_an_n_copies_request_its_first_copys_prefill_once(fake_vllm) -> None:
    """``n > 1``: each child prefills and reports; the request is billed once, with what its
    first copy found (cold), not the later copies' hits on the first one's blocks."""
    from types import SimpleNamespace as NS

    from engine_adapter.vllm.prefill import Prefill, PrefillTap

    processor, handed = _Processor(), []
    tap = PrefillTap(_Client(processor), lambda *figures: handed.append(figures))
    parent = NS(request_id="p-0a1b2c3d")
    tap.expect("p-0a1b2c3d", "call")
    for index, cached in enumerate((0, 384, 384)):
        child = NS(is_prefilling=True, parent_req=parent, request_id=f"{index}_p-0a1b2c3d",
                   prompt_len=400, remote_prefill_cached_tokens=None)
        stats = NS(num_cached_tokens=cached, num_local_cached_tokens=cached, num_external_cached_tokens=0,
                   num_cache_creation_tokens=384 - cached)
        processor._update_stats_from_output(child, NS(prefill_stats=stats), 0.0, None)
    assert handed == [("call", Prefill(0, 0, 0, 384), 400)]


def test_prefill_tap_on_a_disaggregated_decode_reports_the_prefills_hits_and_the_transfer_apart(fake_vllm) -> None:
    """The decode's scheduler counts the KV it pulled as external hits; the client is told the
    prefill's (``remote_prefill_cached_tokens``), and the transfer is never a hit."""
    from types import SimpleNamespace as NS

    from engine_adapter.vllm.prefill import Prefill, PrefillTap

    processor, handed = _Processor(), []
    tap = PrefillTap(_Client(processor), lambda *figures: handed.append(figures), pd_legs=True)
    tap.expect("d1-0a1b2c3d", "call")
    state = NS(is_prefilling=True, parent_req=None, request_id="d1-0a1b2c3d", prompt_len=640,
               remote_prefill_cached_tokens=256)
    stats = NS(num_cached_tokens=639, num_local_cached_tokens=128, num_external_cached_tokens=511,
               num_cache_creation_tokens=1)
    processor._update_stats_from_output(state, NS(prefill_stats=stats), 0.0, None)
    assert handed == [("call", Prefill(256, None, None, None, transferred_tokens=511,
                                       decode_local_tokens=128), 640)]


def test_prefill_tap_without_the_method_logs_one_line(fake_vllm, caplog) -> None:
    from engine_adapter.vllm.prefill import PrefillTap

    with caplog.at_level(logging.WARNING, logger="cachetally.engine.vllm"):
        assert not PrefillTap(_Client(_OldProcessor()), print).installed
        assert not PrefillTap(_Client(None), print).installed
    # vLLM (here: an empty fake) lacks it too: the one compat line says it all.
    assert len(caplog.records) == 1
    assert "not found: " in caplog.records[0].getMessage()


def test_prefill_tap_on_a_client_unlike_vllms_says_so(fake_vllm, caplog) -> None:
    from engine_adapter.vllm.prefill import PrefillTap

    fake_vllm("vllm.v1.engine.output_processor", """
        class OutputProcessor:
            def _update_stats_from_output(self, req_state, engine_core_output, ts, stats):
                pass
    """)
    with caplog.at_level(logging.WARNING, logger="cachetally.engine.vllm"):
        assert not PrefillTap(_Client(_OldProcessor()), print).installed
    messages = [r.getMessage() for r in caplog.records]
    assert messages[-1] == ("engine client _Client has no _update_stats_from_output(req_state, "
                            "engine_core_output, ...): " + compat.TOUCH_POINTS[
                                "OutputProcessor._update_stats_from_output"].without)
