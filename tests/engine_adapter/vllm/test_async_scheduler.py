"""The prefill tap (engine_adapter/vllm/prefill.py) under vLLM's ``AsyncScheduler``, which a CUDA
GPU runs by default and a CPU never does: the same request schedules through vLLM's real
``Scheduler`` and ``AsyncScheduler``, their outputs through a real ``OutputProcessor`` with
the tap installed (``scheduler_drive.py``, in a child process; no engine starts).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[3]
SCENARIOS = ["cold-then-repeat", "repeat-while-first-in-flight", "n2-and-shared-prefix-same-step",
             "abort-mid-chunked-prefill", "preemption", "preemption-n3", "preempted-with-prefill-output-in-flight"]
SCHEDULERS = ["Scheduler", "AsyncScheduler"]


@pytest.fixture(scope="module")
def driven() -> dict:
    out = subprocess.run([sys.executable, "-m", "tests.engine_adapter.vllm.scheduler_drive"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(results) == sorted(SCENARIOS)
    return results


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_each_prefilled_request_is_billed_once_with_the_schedulers_own_cached_count(
        driven: dict, scenario: str, scheduler: str) -> None:
    run = driven[scenario][scheduler]
    # A request is billed its first copy's count (its first child with n > 1), once; one cut
    # before its prefill ended has no figures (the tap's prompt-only announcement bills it).
    expected = {name: [counted[0]] for name, counted in run["counted"].items()
                if name != "cut"}
    billed = {name: [figures[0] for figures in published] for name, published in run["published"].items()}
    assert billed == expected
    assert all(local == cached and external == 0 for published in run["published"].values()
               for cached, local, external, _, _ in published)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_the_preemption_schedules_preempt(driven: dict, scheduler: str) -> None:
    """Else those schedules would hold nothing about preemption (a vLLM that sizes blocks
    otherwise): the requests the schedules squeeze out are preempted under either scheduler."""
    preempted = {scenario: {name for name, count in driven[scenario][scheduler]["preemptions"].items() if count}
                 for scenario in SCENARIOS if "preempt" in scenario}
    assert preempted == {"preemption": {"p2", "p3"}, "preemption-n3": {"m"},
                         "preempted-with-prefill-output-in-flight": {"b"}}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_reads_and_prompts_billed_are_the_same_under_both_schedulers(driven: dict, scenario: str) -> None:
    sync, pipelined = (driven[scenario][scheduler]["published"] for scheduler in SCHEDULERS)
    reads = {name: [(cached, prompt) for cached, _, _, _, prompt in published] for name, published in sync.items()}
    assert {name: [(cached, prompt) for cached, _, _, _, prompt in published]
            for name, published in pipelined.items()} == reads


@pytest.mark.parametrize("scenario", [
    *SCENARIOS[:-1],
    # vLLM 0.32/0.33 compute the writes when the prefill's output is handed back
    # (PrefillStats.finalize from KVCacheManager.estimate_cached_tokens). Under async scheduling
    # a request preempted in the schedule after its prefill has had its blocks freed by then,
    # so vLLM reports 0 written where the same schedule reports 32 under the Scheduler, in its
    # own usage too; cachetally bills vLLM's figure. Strict: this says when vLLM fixes it.
    pytest.param(SCENARIOS[-1], marks=pytest.mark.xfail(strict=True, reason="vLLM: writes of a request "
                                                         "preempted with its prefill output in flight")),
])
def test_writes_billed_are_the_same_under_both_schedulers(driven: dict, scenario: str) -> None:
    sync, pipelined = (driven[scenario][scheduler]["published"] for scheduler in SCHEDULERS)
    assert {name: [figures[3] for figures in published] for name, published in pipelined.items()} == \
        {name: [figures[3] for figures in published] for name, published in sync.items()}
