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
from proxy.server.cli import main

pytestmark = pytest.mark.loopback


def _children() -> set[str]:
    """The pids of this process's children (servers other tests' fixtures hold included)."""
    import os

    ours = set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    ours.add(pid)
        except OSError:
            continue
    return ours


@pytest.fixture(scope="module")
def children_before_bench() -> set[str]:
    return _children()


@pytest.fixture(scope="module")
def figures(children_before_bench: set[str]) -> dict[str, Any]:
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
    for side in ("direct", "relay", "proxied"):
        assert positive(s[f"{side}_p50_ms"])
        assert s[f"{side}_p99_ms"] >= s[f"{side}_p50_ms"]
    for key in ("added_p50_ms", "added_p99_ms", "ratio_p50_ms", "ratio_p99_ms"):
        assert math.isfinite(s[key]) and math.isfinite(s[f"relay_{key}"])


@pytest.mark.parametrize("section", ["sse_1", "sse_100"])
def test_streaming_figures(figures: dict[str, Any], section: str) -> None:
    s = figures[section]
    for key in ("direct_events_per_s", "relay_events_per_s", "proxied_events_per_s"):
        assert positive(s[key]), key
    assert positive(s["ratio_events_per_s"]) and positive(s["relay_ratio_events_per_s"])


def test_throughput_and_loadgen_check(figures: dict[str, Any]) -> None:
    t = figures["throughput"]
    for key in ("direct_rps", "proxied_rps", "proxy_cpu_us_per_req", "rps_per_proxy_core", "loadgen_headroom",
                "relay_rps"):
        assert positive(t[key]), key
    # The relay may use less than one clock tick of CPU in a quick run: then there is no figure.
    assert t["relay_rps_per_proxy_core"] is None or positive(t["relay_rps_per_proxy_core"])
    assert isinstance(t["loadgen_ok"], bool) and 0 <= t["proxy_busy"] <= 1.5


def test_memory_per_stream(figures: dict[str, Any]) -> None:
    m = figures["memory"]
    assert m["streams"] == figures["counts"]["held_streams"]
    assert positive(m["rss_before_kib"]) and positive(m["rss_held_kib"]) and positive(m["rss_after_kib"])
    assert math.isfinite(m["kib_per_stream"])


def test_embedded_figures(figures: dict[str, Any]) -> None:
    e = figures["embedded"]
    for key in ("without_rps", "with_rps", "ratio_rps", "without_cpu_us_per_req", "with_cpu_us_per_req"):
        assert positive(e[key]), key


def test_embedded_floor_figures(figures: dict[str, Any]) -> None:
    fl = figures["embedded_floor"]
    for key in ("sim_us", "passthrough_us", "cachetally_us", "least_work_us"):
        assert positive(fl[key]), key
    assert fl["ratio_passthrough"] == fl["sim_us"] / fl["passthrough_us"]
    assert fl["ratio_cachetally"] == fl["sim_us"] / fl["cachetally_us"]


def test_micro_figures(figures: dict[str, Any]) -> None:
    assert set(figures["micro"]) == {"passthrough_event_us", "passthrough_split_event_us", "usage_event_us"}
    assert all(positive(v) for v in figures["micro"].values())


def test_every_target_is_checked(figures: dict[str, Any]) -> None:
    assert [t["target"] for t in figures["targets"]] == [t[0] for t in report.TARGETS]
    assert all(isinstance(t["holds"], bool) and t["value"] is not None for t in figures["targets"])
    floors = {t["target"]: t["floor"] for t in figures["targets"]}
    assert floors["SSE events/s proxied/direct, 1 stream"] == figures["sse_1"]["relay_ratio_events_per_s"]
    assert floors["embedded with/without middleware req/s"] is None  # no relay in process


def test_table_renders_every_target(figures: dict[str, Any]) -> None:
    text = report.table(figures)
    for label, *_ in report.TARGETS:
        assert label in text
    assert "load generator headroom" in text and "embedded floor" in text


def test_micro_patches_the_usage_event() -> None:
    assert set(micro(10)) == {"passthrough_event_us", "passthrough_split_event_us", "usage_event_us"}


FLIP = bytes(255 - b for b in range(256))


@pytest.mark.asyncio
async def test_the_relay_copies_bytes_both_ways_and_closes_with_its_peer() -> None:
    import asyncio
    import contextlib

    from proxy.bench.relay import serve
    from tests.servers import free_port

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data.translate(FLIP))
        writer.close()
        await writer.wait_closed()
        closed.set()

    closed = asyncio.Event()
    upstream = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = free_port()
    relay = asyncio.create_task(serve("127.0.0.1", upstream.sockets[0].getsockname()[1], port))
    try:
        for _ in range(50):  # the relay is listening once a connect succeeds
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                break
            except OSError:
                await asyncio.sleep(0.02)
        payload = bytes(range(256)) * 4096  # 1 MiB: more than one socket buffer
        writer.write(payload)
        got = await asyncio.wait_for(reader.readexactly(len(payload)), 10)
        assert got == payload.translate(FLIP)  # every byte went there and came back, in order
        writer.close()
        await asyncio.wait_for(closed.wait(), 5)  # the client's close reached the upstream
        assert await asyncio.wait_for(reader.read(), 5) == b""
        await writer.wait_closed()
    finally:
        relay.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await relay
        upstream.close()
        await upstream.wait_closed()


def test_baseline_runs_two_checkouts_side_by_side_and_counts_failures(capsys: pytest.CaptureFixture[str]) -> None:
    """``--baseline`` with this checkout as its own baseline: both sides measured, none failed."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    assert main(["bench", "proxy", "--quick", "--json", "--baseline", str(root)]) == 0
    ab = json.loads(capsys.readouterr().out)
    for load in ("c64", "c64_sse", "c1"):
        for side in ("baseline", "this"):
            f = {key: ab[load][f"{side}_{key}"] for key in ("rps", "p50_ms", "p99_ms", "errors")}
            assert positive(f["rps"]) and positive(f["p50_ms"]) and f["p99_ms"] >= f["p50_ms"], (load, side, f)
            assert f["errors"] == 0, (load, side)
        assert positive(ab[load]["ratio_rps"])
    assert main(["bench", "proxy", "--quick", "--baseline", str(root / "docs")]) == 1  # not a checkout
    assert "not a checkout of cachetally" in capsys.readouterr().err


def test_no_server_left_behind(figures: dict[str, Any], children_before_bench: set[str]) -> None:
    """Every server the bench started is gone once it returns (another module's may be alive)."""
    assert _children() - children_before_bench == set()



def test_a_side_whose_cpu_read_0_in_every_round_has_no_ratio_and_ends_no_run() -> None:
    """CPU time is read in 10 ms ticks: a short side (``--quick``) can read 0 in every round.
    Its ratio is unknown, and the run goes on (it ended in StatisticsError, all figures lost)."""
    from proxy.bench.rounds import summarize

    sides = {"direct": [{"cpu_us_per_req": 0.0}] * 2, "proxied": [{"cpu_us_per_req": 78.0}, {"cpu_us_per_req": 0.0}]}
    s = summarize(sides, ["cpu_us_per_req"], a="without", b="with")
    assert (s["without_cpu_us_per_req"], s["with_cpu_us_per_req"], s["ratio_cpu_us_per_req"]) == (0.0, 39.0, None)
