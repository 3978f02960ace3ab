"""A stop during vLLM's engine-core launch, against a launch that swallows a
``KeyboardInterrupt`` as vLLM 0.32's ``zmq_socket_ctx`` does (the real engine:
tests/real_vllm/test_vllm_start_stop.py)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import pytest

from engine_adapter.vllm.engine_start import _stoppable


def test_a_second_stop_while_the_launch_unwinds_neither_cuts_its_cleanup_nor_escapes() -> None:
    """An operator who presses Ctrl-C twice: the second comes while the launch cleans up."""
    cleaned: list[str] = []

    @contextlib.contextmanager
    def launch() -> Iterator[None]:
        try:
            yield
        except KeyboardInterrupt:  # zmq_socket_ctx's catch
            pass
        finally:
            os.kill(os.getpid(), signal.SIGINT)  # the second stop
            os.kill(os.getpid(), signal.SIGTERM)
            cleaned.append("socket closed")

    before = {stop: signal.getsignal(stop) for stop in (signal.SIGTERM, signal.SIGINT)}
    with pytest.raises(KeyboardInterrupt, match="SIGTERM during the engine core's start"), _stoppable(launch)():
        os.kill(os.getpid(), signal.SIGTERM)
        pytest.fail("the stop did not end the launch")
    assert cleaned == ["socket closed"]
    assert {stop: signal.getsignal(stop) for stop in before} == before  # vLLM's and asyncio's, back
