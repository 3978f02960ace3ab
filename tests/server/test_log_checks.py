"""The traceback check the vLLM server fixtures end with (tests/servers.py): it excuses
vLLM's known shutdown race and nothing else. The lines are from a CI run's log."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.servers import assert_no_traceback_in_vllm_log, tracebacks_in_vllm_log

_A, _B = "(ApiServer_0 pid=11534)", "(ApiServer_1 pid=11535)"
_RACE = [
    "ERROR 11-23 16:37:19 [async_llm.py:906] AsyncLLM output_handler failed.",
    "ERROR 11-23 16:37:19 [async_llm.py:906] Traceback (most recent call last):",
    'ERROR 11-23 16:37:19 [async_llm.py:906]   File "vllm/v1/engine/async_llm.py", line 849, in output_handler',
    "ERROR 11-23 16:37:19 [async_llm.py:906]     outputs = await engine_core.get_output_async()",
    "ERROR 11-23 16:37:19 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
]
_CLIENT_DOWN = "INFO 11-23 16:37:19 [core_client.py:769] [shutdown] MPClient: start timeout=default"
#: A fleet replica's log in a later CI run: the race logged while the client was still cleaning up.
_CLEANING_UP = [
    "INFO 11-29 02:25:22 [core_client.py:769] [shutdown] MPClient: start timeout=default",
    "INFO 11-29 02:25:22 [core_client.py:771] [shutdown] MPClient: stopping engine manager",
    "INFO 11-29 02:25:22 [core_client.py:774] [shutdown] MPClient: engine manager stopped",
    "INFO 11-29 02:25:22 [core_client.py:775] [shutdown] MPClient: cleaning up background resources",
    *_RACE,
    "INFO 11-29 02:25:22 [core_client.py:777] [shutdown] MPClient: complete",
]


def log(*lines: str) -> str:
    return "\n".join(lines) + "\n"


def test_the_output_handler_race_once_the_client_began_to_shut_down_is_excused() -> None:
    text = log(f"{_A} {_CLIENT_DOWN}", f"{_B} {_CLIENT_DOWN}", *(f"{_A} {x}" for x in _RACE),
               *(f"{_B} {x}" for x in _RACE))
    assert tracebacks_in_vllm_log(text) == []


def test_the_race_while_the_client_is_still_cleaning_up_is_excused() -> None:
    assert tracebacks_in_vllm_log(log(*(f"{_A} {x}" for x in _CLEANING_UP))) == []


def test_the_same_lines_before_that_process_shut_down_are_not() -> None:
    text = log(f"{_B} {_CLIENT_DOWN}", *(f"{_A} {x}" for x in _RACE))
    assert tracebacks_in_vllm_log(text) == [f"{_A} {_RACE[1]}"]


def test_any_other_traceback_is_reported() -> None:
    other = [line.replace("EngineDeadError", "ValueError") for line in _RACE]
    text = log(f"{_A} {_CLIENT_DOWN}", *(f"{_A} {x}" for x in other),
               "Traceback (most recent call last):", '  File "proxy/patching/responder.py", line 1', "KeyError: 'x'")
    assert tracebacks_in_vllm_log(text) == [f"{_A} {other[1]}", "Traceback (most recent call last):"]


def test_a_failed_check_shows_the_block_it_found(tmp_path: Path) -> None:
    """CI's output is all there is to read once the test's folder is gone: the failure carries
    the traceback's lines, not only the log's path."""
    log_file = tmp_path / "prefill.log"
    log_file.write_text(log(*(f"{_A} {x}" for x in _RACE)))
    with pytest.raises(AssertionError) as failed:
        assert_no_traceback_in_vllm_log(log_file)
    assert "EngineDeadError" in str(failed.value) and "output_handler failed" in str(failed.value)
    log_file.write_text(log(f"{_A} {_CLIENT_DOWN}", *(f"{_A} {x}" for x in _RACE)))
    assert_no_traceback_in_vllm_log(log_file)
