"""`cachetally bench proxy --quick --json`: every figure is there and sane. No timing thresholds.

The harness starts its own servers (sim, proxies, embedded) and load generator on
127.0.0.1 and must stop them all, which the last test checks.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from proxy.bench import report
from proxy.bench.micro import micro
from proxy.cli import main

pytestmark = pytest.mark.loopback


@pytest.fixture(scope="module")
def figures() -> dict[str, Any]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["bench", "proxy", "--quick", "--json"])
    assert code == 0
    return json.loads(out.getvalue())


def positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.mark.parametrize("section", ["latency_c1", "latency_c64", "ttft_paced"])
def test_latency_figures(figures: dict[str, Any], section: str) -> None:
    s = figures[section]
    for side in ("direct", "proxied"):
        assert positive(s[f"{side}_p50_ms"])
        assert s[f"{side}_p99_ms"] >= s[f"{side}_p50_ms"]
    for key in ("added_p50_ms", "added_p99_ms", "ratio_p50_ms", "ratio_p99_ms"):
        assert math.isfinite(s[key])


@pytest.mark.parametrize("section", ["sse_1", "sse_100"])
def test_streaming_figures(figures: dict[str, Any], section: str) -> None:
    s = figures[section]
    assert positive(s["direct_events_per_s"]) and positive(s["proxied_events_per_s"])
    assert positive(s["ratio_events_per_s"])


def test_throughput_and_loadgen_check(figures: dict[str, Any]) -> None:
    t = figures["throughput"]
    for key in ("direct_rps", "proxied_rps", "proxy_cpu_us_per_req", "rps_per_proxy_core", "loadgen_headroom"):
        assert positive(t[key]), key
    assert isinstance(t["loadgen_ok"], bool)


def test_memory_per_stream(figures: dict[str, Any]) -> None:
    m = figures["memory"]
    assert m["streams"] == figures["counts"]["held_streams"]
    assert positive(m["rss_before_kib"]) and positive(m["rss_held_kib"]) and positive(m["rss_after_kib"])
    assert math.isfinite(m["kib_per_stream"])


def test_embedded_figures(figures: dict[str, Any]) -> None:
    e = figures["embedded"]
    for key in ("without_rps", "with_rps", "ratio_rps", "without_cpu_us_per_req", "with_cpu_us_per_req"):
        assert positive(e[key]), key


def test_micro_figures(figures: dict[str, Any]) -> None:
    assert set(figures["micro"]) == {"passthrough_event_us", "passthrough_split_event_us", "usage_event_us"}
    assert all(positive(v) for v in figures["micro"].values())


def test_every_target_is_checked(figures: dict[str, Any]) -> None:
    assert [t["target"] for t in figures["targets"]] == [t[0] for t in report.TARGETS]
    assert all(isinstance(t["holds"], bool) and t["value"] is not None for t in figures["targets"])


def test_table_renders_every_target(figures: dict[str, Any]) -> None:
    text = report.table(figures)
    for label, *_ in report.TARGETS:
        assert label in text
    assert "load generator headroom" in text


def test_micro_patches_the_usage_event() -> None:
    assert set(micro(10)) == {"passthrough_event_us", "passthrough_split_event_us", "usage_event_us"}


def test_no_server_left_behind(figures: dict[str, Any]) -> None:
    import os

    children = [p for p in os.listdir("/proc") if p.isdigit()] if os.path.isdir("/proc") else []
    ours = []
    for pid in children:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    ours.append(pid)
        except OSError:
            continue
    assert ours == []
