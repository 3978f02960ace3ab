"""The source checker (tests/vllm_sources.py) on small fake vLLM trees: it finds what is there
and reports what is not, from a directory and from a wheel alike, so the 0.33 wheel test
(tests/engine_adapter/vllm/test_vllm_wheel_033.py) can fail."""

from __future__ import annotations

import textwrap
import zipfile
from pathlib import Path

import pytest

from engine_adapter.vllm.compat import TOUCH_POINTS
from tests.vllm_sources import Sources, locate

STARTUP_033 = "vllm/entrypoints/common/startup.py"
STARTUP_032 = "vllm/entrypoints/serve/utils/api_utils.py"


def tree(tmp_path: Path, files: dict[str, str], as_wheel: bool) -> Sources:
    if as_wheel:
        tmp_path.mkdir(parents=True, exist_ok=True)
        wheel = tmp_path / "vllm-0.0.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            for path, text in files.items():
                zf.writestr(path, textwrap.dedent(text))
        return Sources(wheel)
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(textwrap.dedent(text))
    return Sources(tmp_path)


@pytest.fixture(params=[False, True], ids=["directory", "wheel"])
def as_wheel(request: pytest.FixtureRequest) -> bool:
    return request.param


def test_the_first_candidate_wins_and_the_second_is_a_fallback(tmp_path: Path, as_wheel: bool) -> None:
    both = tree(tmp_path / "both", {STARTUP_033: "def cli_env_setup(): pass\n",
                                    STARTUP_032: "def cli_env_setup(): pass\n"}, as_wheel)
    old = tree(tmp_path / "old", {STARTUP_032: "def cli_env_setup(): pass\n"}, as_wheel)
    point = TOUCH_POINTS["cli_env_setup"]
    assert locate(both, point) == ("vllm.entrypoints.common.startup", "")
    assert locate(old, point) == ("vllm.entrypoints.serve.utils.api_utils", "")


def test_absent_names_are_reported_per_candidate(tmp_path: Path, as_wheel: bool) -> None:
    sources = tree(tmp_path, {STARTUP_032: "cli_env_setup_v2 = None\n"}, as_wheel)
    assert locate(sources, TOUCH_POINTS["cli_env_setup"]) == (None, (
        "vllm.entrypoints.common.startup: no such file; "
        "vllm.entrypoints.serve.utils.api_utils: cli_env_setup not defined"))


def test_method_parameters(tmp_path: Path, as_wheel: bool) -> None:
    sources = tree(tmp_path, {"vllm/v1/engine/output_processor.py": """
        class OutputProcessor:
            def _update_stats_from_output(self, req_state, output, ts, stats):
                pass
    """}, as_wheel)
    _, why = locate(sources, TOUCH_POINTS["OutputProcessor._update_stats_from_output"])
    assert why.endswith("takes ['req_state', 'output', 'ts', 'stats'], "
                        "not ['req_state', 'engine_core_output']")


def test_fields_from_class_body_and_init(tmp_path: Path, as_wheel: bool) -> None:
    sources = tree(tmp_path, {
        "vllm/v1/engine/__init__.py": """
            if True:
                class EngineCoreOutput(Struct):
                    request_id: str
                    prefill_stats: "PrefillStats | None" = None
        """,
        "vllm/v1/engine/output_processor.py": """
            class RequestState:
                def __init__(self, parent_req):
                    self.is_prefilling = True
                    self.parent_req = parent_req
                    other.request_id = 1
                    self.prompt_len = 0
                    self.remote_prefill_cached_tokens = None
        """}, as_wheel)
    assert locate(sources, TOUCH_POINTS["EngineCoreOutput"]) == ("vllm.v1.engine", "")
    _, why = locate(sources, TOUCH_POINTS["RequestState"])
    assert why.endswith("no field request_id")  # set on another object: not a field


def test_stores_loads_and_constants(tmp_path: Path, as_wheel: bool) -> None:
    sources = tree(tmp_path, {
        "vllm/entrypoints/launchers/api_server/app_state.py": """
            async def init_app_state(engine_client, state, args, supported_tasks=None):
                state.client = engine_client
        """,
        "vllm/entrypoints/cli/serve.py": """
            class ServeSubcommand(CLISubcommand):
                name = "serve"
        """}, as_wheel)
    _, why = locate(sources, TOUCH_POINTS["init_app_state"])
    assert why.endswith("does not set state.engine_client")
    assert locate(sources, TOUCH_POINTS["ServeSubcommand.name"])[1] == ""
