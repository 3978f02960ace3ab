"""``cachetally bench proxy --baseline DIR``: this checkout's proxy against another's, side by side.

For a change to the proxy's hot path, the figure that matters is requests per proxy
core, and the machine is too noisy to compare two separate runs. So both proxies run
at once, in front of one sim: ``baseline`` from ``DIR`` (another checkout of
cachetally, e.g. ``git worktree add --detach /tmp/bench-main main``; its own code, run
with ``PYTHONPATH=DIR`` from ``DIR``) and ``this`` from this checkout, both pinned to
the proxy core. Rounds alternate (A B A B ...) at c=1 and c=64, non-streaming chat and
streamed chat; each figure is the median over rounds, each ratio (this / baseline) is
taken within a round, then its median.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from proxy.bench.processes import LoadGen, Placement, Servers, cpu_s, free_port, stop, wait_healthy

SIDES = ("baseline", "this")
#: Where a checkout keeps its command line, newest layout first: a baseline may predate
#: the package layout (docs/ARCHITECTURE.md).
_CLI_MODULES = ("proxy.server.cli", "proxy.cli")


def _cli_module(checkout: Path) -> str | None:
    for module in _CLI_MODULES:
        if (checkout / (module.replace(".", "/") + ".py")).is_file():
            return module
    return None


def _start_proxy(servers: Servers, checkout: Path, upstream: int) -> tuple[int, subprocess.Popen[bytes]]:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(checkout)}
    proc = subprocess.Popen(
        [sys.executable, "-m", _cli_module(checkout), "serve", "--upstream", f"http://127.0.0.1:{upstream}",
         "--port", str(port), "--log-level", "warning"],
        cwd=checkout, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
    )
    servers.callback(stop, proc)
    servers.placement.pin(proc.pid, servers.placement.proxy)
    return port, proc


def compare(baseline: Path, rounds: int, c64_per_conn: int = 40, c1_requests: int = 1000) -> dict[str, Any]:
    from proxy.bench.proxy import chat_body
    from proxy.bench.rounds import median, percentile

    this = Path(__file__).resolve().parent.parent.parent
    if _cli_module(baseline) is None:
        raise RuntimeError(f"{baseline} is not a checkout of cachetally (no proxy/server/cli.py)")
    with Servers(Placement()) as servers:
        sim = servers.start(["-m", "engine_adapter.sim"], servers.placement.rest)
        wait_healthy(f"http://127.0.0.1:{sim[0]}", sim[1])
        proxies = {"baseline": _start_proxy(servers, baseline, sim[0]), "this": _start_proxy(servers, this, sim[0])}
        for port, proc in proxies.values():
            wait_healthy(f"http://127.0.0.1:{port}", proc)
        gen = LoadGen(servers)
        chat, plain, streamed = "/v1/chat/completions", chat_body(8, stream=False), chat_body(8, stream=True)
        for port, _ in proxies.values():
            gen.run(port, chat, plain, 64, 3)
            gen.run(port, chat, streamed, 8, 2)
        loads = {
            "c64": (plain, 64, c64_per_conn),
            "c64_sse": (streamed, 64, max(1, c64_per_conn // 2)),
            "c1": (plain, 1, c1_requests),
        }
        results: dict[str, dict[str, list[dict[str, float]]]] = {k: {s: [] for s in SIDES} for k in loads}
        for round_ in range(rounds):
            for load, (body, conns, per_conn) in loads.items():
                order = SIDES if round_ % 2 == 0 else SIDES[::-1]
                for side in order:
                    port, proc = proxies[side]
                    cpu0 = cpu_s(proc.pid) or 0.0
                    gen.send({"op": "run", "port": port, "path": chat, "body": body, "conns": conns,
                              "per_conn": per_conn})
                    r = gen.answer()
                    cpu = (cpu_s(proc.pid) or 0.0) - cpu0
                    n = len(r["latency_ms"])
                    results[load][side].append({
                        "rps": n / r["wall_s"], "cpu_us_per_req": cpu / n * 1e6,
                        "p50_ms": percentile(r["latency_ms"], 0.5), "p99_ms": percentile(r["latency_ms"], 0.99),
                        "errors": r["errors"],
                    })
    out: dict[str, Any] = {"rounds": rounds, "baseline": str(baseline)}
    for load, sides in results.items():
        figures: dict[str, float | None] = {}
        for key in ("rps", "cpu_us_per_req", "p50_ms", "p99_ms"):
            for side in SIDES:
                figures[f"{side}_{key}"] = median([r[key] for r in sides[side]])
            ratios = [b[key] / a[key] for a, b in zip(sides["baseline"], sides["this"], strict=True) if a[key]]
            figures[f"ratio_{key}"] = median(ratios) if ratios else None
        # CPU is counted in clock ticks: a run too short to span one has no per-core figure.
        for side in SIDES:
            cpu = figures[f"{side}_cpu_us_per_req"]
            figures[f"{side}_rps_per_proxy_core"] = 1e6 / cpu if cpu else None
        ratio = figures["ratio_cpu_us_per_req"]
        figures["ratio_rps_per_proxy_core"] = 1 / ratio if ratio else None
        for side in SIDES:  # failed requests (not 200) are counted, not hidden
            figures[f"{side}_errors"] = sum(r["errors"] for r in sides[side])
        out[load] = figures
    return out


def table(figures: dict[str, Any]) -> str:
    lines = [f"this checkout vs baseline {figures['baseline']} ({figures['rounds']} alternating rounds, medians)",
             "| load | figure | baseline | this | this / baseline |", "| --- | --- | ---: | ---: | ---: |"]
    for load in ("c64", "c64_sse", "c1"):
        f = figures[load]
        for key, label in (("rps_per_proxy_core", "req/s per proxy core"), ("cpu_us_per_req", "proxy CPU µs/req"),
                           ("rps", "req/s"), ("p50_ms", "latency p50 (ms)"), ("p99_ms", "latency p99 (ms)")):
            ratio = f["ratio_rps_per_proxy_core"] if key == "rps_per_proxy_core" else f[f"ratio_{key}"]
            base, this = _fmt(f["baseline_" + key]), _fmt(f["this_" + key])
            lines.append(f"| {load} | {label} | {base} | {this} | {'n/a' if ratio is None else f'{ratio:.3f}'} |")
        lines.append(f"| {load} | failed requests | {f['baseline_errors']} | {f['this_errors']} | |")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"
