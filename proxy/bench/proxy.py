"""``cachetally bench proxy``: what the proxy costs, measured side by side with a direct connection.

Processes on 127.0.0.1, each started here and stopped in ``finally``:

- ``sim``: the simulated engine alone (no model cost), and ``proxy``: ``cachetally serve
  --upstream`` in front of it; a second such pair whose sim paces its tokens (TTFT,
  memory per open stream);
- ``relay`` in front of each sim (:mod:`proxy.bench.relay`): a bare TCP relay pinned
  like the proxy, the floor any extra hop costs on this machine;
- ``bare`` (the sim alone) and ``embedded`` (``cachetally serve --engine sim``: the same
  routes behind ``UsagePatchMiddleware`` in one process);
- the load generator (:mod:`proxy.bench.loadgen`).

With two or more cores the proxies and the embedded pair are pinned to one core and
everything else to the others, so "per proxy core" means one core. Every figure comes
from rounds that alternate direct, relay and proxied (A R B A R B ...): the figure is the
median of the per-round medians, and each ratio or difference (against direct) is taken
within a round, then its median. The micro figures time :class:`~proxy.patching.sse.SSEPatcher` in this process, and
the embedded floor (:mod:`proxy.bench.inprocess`) the sim's route called in process.

At c=64 the proxy must be the limit for its figures to measure it (``loadgen_ok``): either
the direct baseline reaches well above the proxied throughput, or the proxy's core was
busy (``proxy_busy``, CPU seconds per wall second of the proxied rounds). When neither
holds, the sim and the load generator, which share the other core, were the limit.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from proxy.bench import report
from proxy.bench.inprocess import embedded_floor
from proxy.bench.micro import micro
from proxy.bench.processes import (
    LoadGen,
    Placement,
    Servers,
    cpu_s,
    rss_kib,
    wait_healthy,
)
from proxy.bench.rounds import Figures, alternate, median, percentile, summarize


@dataclass(frozen=True, slots=True)
class Counts:
    rounds: int = 5
    c1_requests: int = 1000
    c64_per_conn: int = 40
    sse1_tokens: int = 4000
    sse1_streams: int = 2  # one after another
    sse100_tokens: int = 300
    ttft_conns: int = 8
    ttft_per_conn: int = 3
    paced_delay_s: float = 0.2
    held_streams: int = 500
    embedded_per_conn: int = 40
    inprocess_requests: int = 5000
    micro_events: int = 100_000


QUICK = Counts(
    rounds=2, c1_requests=10, c64_per_conn=2, sse1_tokens=40, sse1_streams=1, sse100_tokens=4,
    ttft_conns=2, ttft_per_conn=2, paced_delay_s=0.05, held_streams=20, embedded_per_conn=10,
    inprocess_requests=50, micro_events=2000,
)


def chat_body(max_tokens: int, stream: bool) -> str:
    body: dict[str, Any] = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "How many of these prompt tokens were cached?"}],
        "max_tokens": max_tokens,
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return json.dumps(body)


def _completion_stream(max_tokens: int) -> str:
    # Completions, not chat: its first event is the first token (chat sends a role chunk first).
    return json.dumps(
        {"model": "sim-model", "prompt": "time to first token", "max_tokens": max_tokens, "stream": True,
         "stream_options": {"include_usage": True}}
    )


# -- the run -----------------------------------------------------------------------------


def run(counts: Counts = Counts(), progress: Callable[[int], Any] | None = None) -> Figures:
    """Start everything, measure, stop everything; return the figures (see module docstring)."""
    steps = counts.rounds * 6 + 2
    bar = progress(steps) if progress else contextlib.nullcontext()
    with bar as tick_bar, Servers(Placement()) as servers:
        tick = (lambda: tick_bar.update()) if tick_bar is not None else (lambda: None)
        return _measure(counts, servers, tick)


def _measure(counts: Counts, servers: Servers, tick: Callable[[], None]) -> Figures:
    place = servers.placement
    sim = servers.start(["-m", "engine_adapter.sim"], place.rest)
    paced = servers.start(["-m", "engine_adapter.sim", "--token-delay-s", str(counts.paced_delay_s)], place.rest)
    bare = servers.start(["-m", "engine_adapter.sim"], place.proxy)
    started = [sim, paced, bare]
    for port, proc in started:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
    proxy = servers.start(["-m", "proxy.server.cli", "serve", "--upstream", f"http://127.0.0.1:{sim[0]}"], place.proxy)
    paced_proxy = servers.start(
        ["-m", "proxy.server.cli", "serve", "--upstream", f"http://127.0.0.1:{paced[0]}"], place.proxy
    )
    embedded = servers.start(["-m", "proxy.server.cli", "serve", "--engine", "sim"], place.proxy)
    relay = servers.start(["-m", "proxy.bench.relay", "--upstream", f"127.0.0.1:{sim[0]}"], place.proxy)
    paced_relay = servers.start(["-m", "proxy.bench.relay", "--upstream", f"127.0.0.1:{paced[0]}"], place.proxy)
    for port, proc in (proxy, paced_proxy, embedded, relay, paced_relay):
        wait_healthy(f"http://127.0.0.1:{port}", proc)
    gen = LoadGen(servers)
    port = {"direct": sim[0], "relay": relay[0], "proxied": proxy[0]}
    paced_port = {"direct": paced[0], "relay": paced_relay[0], "proxied": paced_proxy[0]}
    chat, completions = "/v1/chat/completions", "/v1/completions"
    plain = chat_body(8, stream=False)
    for warm in (sim, relay, proxy, bare, embedded):  # connections, pools, caches, lazy imports
        gen.run(warm[0], chat, plain, 64, 3)
        gen.run(warm[0], chat, chat_body(8, stream=True), 8, 2)
    for warm in (paced, paced_relay, paced_proxy):
        gen.run(warm[0], completions, _completion_stream(1), 8, 1)
    tick()

    middle = {"direct": proxy[1].pid, "relay": relay[1].pid, "proxied": proxy[1].pid}

    def latency(conns: int, per_conn: int) -> Callable[[str], dict[str, float]]:
        def measure(side: str) -> dict[str, float]:
            cpu0 = cpu_s(middle[side])
            r = gen.run(port[side], chat, plain, conns, per_conn)
            cpu = (cpu_s(middle[side]) or 0.0) - (cpu0 or 0.0)
            n = len(r["latency_ms"])
            return {"p50_ms": percentile(r["latency_ms"], 0.5), "p99_ms": percentile(r["latency_ms"], 0.99),
                    "rps": n / r["wall_s"], "proxy_cpu_s_per_req": cpu / n, "busy": cpu / r["wall_s"]}

        return measure

    def sse(conns: int, tokens: int, per_conn: int) -> Callable[[str], dict[str, float]]:
        body = chat_body(tokens, stream=True)

        def measure(side: str) -> dict[str, float]:
            r = gen.run(port[side], chat, body, conns, per_conn)
            return {"events_per_s": r["events"] / r["wall_s"]}

        return measure

    def ttft(side: str) -> dict[str, float]:
        r = gen.run(paced_port[side], completions, _completion_stream(1), counts.ttft_conns, counts.ttft_per_conn)
        return {"p50_ms": percentile(r["ttfb_ms"], 0.5), "p99_ms": percentile(r["ttfb_ms"], 0.99)}

    embedded_port = {"direct": bare[0], "proxied": embedded[0]}
    embedded_pid = {"direct": bare[1].pid, "proxied": embedded[1].pid}

    def embedded_round(side: str) -> dict[str, float]:
        cpu0 = cpu_s(embedded_pid[side])
        r = gen.run(embedded_port[side], chat, plain, 64, counts.embedded_per_conn)
        cpu = (cpu_s(embedded_pid[side]) or 0.0) - (cpu0 or 0.0)
        n = len(r["latency_ms"])
        return {"rps": n / r["wall_s"], "cpu_us_per_req": cpu / n * 1e6}

    c1 = alternate(counts.rounds, latency(1, counts.c1_requests), tick)
    c64 = alternate(counts.rounds, latency(64, counts.c64_per_conn), tick)
    s1 = alternate(counts.rounds, sse(1, counts.sse1_tokens, counts.sse1_streams), tick)
    s100 = alternate(counts.rounds, sse(100, counts.sse100_tokens, 1), tick)
    t = alternate(counts.rounds, ttft, tick)
    e = alternate(counts.rounds, embedded_round, tick, sides=("direct", "proxied"))
    memory = _held_streams(gen, paced_proxy, completions, counts)
    tick()

    throughput = c64["proxied"]
    cpu_per_req = median([r["proxy_cpu_s_per_req"] for r in throughput])
    figures: Figures = {
        "machine": _machine(place),
        "counts": asdict(counts),
        "latency_c1": summarize(c1, ["p50_ms", "p99_ms"]),
        "latency_c64": summarize(c64, ["p50_ms", "p99_ms"]),
        "throughput": {
            "direct_rps": median([r["rps"] for r in c64["direct"]]),
            "proxied_rps": median([r["rps"] for r in throughput]),
            "proxy_cpu_us_per_req": cpu_per_req * 1e6,
            "rps_per_proxy_core": 1 / cpu_per_req if cpu_per_req > 0 else None,
            "relay_rps": median([r["rps"] for r in c64["relay"]]),
            "relay_rps_per_proxy_core": 1 / relay_cpu if (relay_cpu := median(
                [r["proxy_cpu_s_per_req"] for r in c64["relay"]])) > 0 else None,
        },
        "sse_1": summarize(s1, ["events_per_s"]),
        "sse_100": summarize(s100, ["events_per_s"]),
        "ttft_paced": summarize(t, ["p50_ms", "p99_ms"]),
        "memory": memory,
        "embedded": summarize(e, ["rps", "cpu_us_per_req"], a="without", b="with"),
        "embedded_floor": embedded_floor(counts.inprocess_requests),
        "micro": micro(counts.micro_events),
    }
    tp = figures["throughput"]
    tp["loadgen_headroom"] = tp["direct_rps"] / tp["proxied_rps"]
    tp["proxy_busy"] = median([r["busy"] for r in throughput])
    # "Well above": a load generator that can't outrun the proxy by half again, with the
    # proxy's core not busy, measured itself (or the sim beside it).
    tp["loadgen_ok"] = tp["loadgen_headroom"] >= 1.5 or tp["proxy_busy"] >= 0.9
    figures["targets"] = report.check(figures)
    return figures


def _held_streams(gen: LoadGen, proxy: tuple[int, subprocess.Popen[bytes]], path: str, counts: Counts) -> Figures:
    """RSS of the proxy with ``held_streams`` streams open, minus before, per stream."""
    pid = proxy[1].pid
    before = rss_kib(pid)
    gen.send({"op": "hold", "port": proxy[0], "path": path, "body": _completion_stream(1_000_000),
              "conns": counts.held_streams, "timeout_s": 60 + counts.paced_delay_s * 2})
    ready = gen.answer()
    time.sleep(max(0.5, counts.paced_delay_s * 3))  # a few events through every stream
    held = rss_kib(pid)
    gen.send({"op": "release"})
    gen.answer()
    after = rss_kib(pid)
    per_stream = (held - before) / ready["ready"] if held is not None and before is not None else None
    return {"streams": ready["ready"], "rss_before_kib": before, "rss_held_kib": held,
            "rss_after_kib": after, "kib_per_stream": per_stream}


def _machine(place: Placement) -> Figures:
    import platform

    import httptools
    import uvicorn

    def installed(name: str) -> bool:
        with contextlib.suppress(ImportError):
            __import__(name)
            return True
        return False

    return {
        "cpus": os.cpu_count(),
        "pinned": place.pinned,
        "proxy_cores": sorted(place.proxy) if place.proxy else None,
        "python": platform.python_version(),
        "uvloop": installed("uvloop"),
        "httptools": httptools.__version__,
        "uvicorn": uvicorn.__version__,
    }


@contextlib.contextmanager
def tqdm_progress(total: int) -> Iterator[Any]:
    from tqdm import tqdm

    with tqdm(total=total, desc="bench proxy", unit="step", file=sys.stderr, leave=False) as bar:
        yield bar
