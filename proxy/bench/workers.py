"""``python -m proxy.bench.workers``: requests/s of ``serve --workers 1`` against ``--workers 2``.

One sim on 127.0.0.1 and two cachetally proxies in front of it (upstream mode), one with one
worker and one with two, all running at once; the load generator
(:mod:`proxy.bench.loadgen`) alternates rounds between them (A B B A ...) at c=64,
non-streaming chat and streamed chat. Nothing is pinned: a second worker is only worth
measuring on cores it can use. Each figure is the median over rounds; the ratio (2 / 1) is
taken within a round, then its median. The proxy's CPU per request is summed over its
process tree (uvicorn's supervisor and workers). Every server is started here and stopped
when done.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from proxy.bench.processes import LoadGen, Placement, Servers, cpu_s, wait_healthy
from proxy.bench.proxy import chat_body
from proxy.bench.rounds import percentile

SIDES = ("1", "2")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its children (uvicorn's workers), from /proc."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        children = []
    return sum(cpu_s(p) or 0.0 for p in (pid, *children))


def compare(rounds: int, per_conn: int) -> dict[str, Any]:
    placement = Placement()
    placement.proxy = placement.rest = None  # unpinned (module docstring)
    with Servers(placement) as servers:
        sim = servers.start(["-m", "engine_adapter.sim"], None)
        wait_healthy(f"http://127.0.0.1:{sim[0]}", sim[1])
        upstream = f"http://127.0.0.1:{sim[0]}"
        proxies = {
            n: servers.start(["-m", "proxy.server.cli", "serve", "--upstream", upstream, "--workers", n], None)
            for n in SIDES
        }
        for port, proc in proxies.values():
            wait_healthy(f"http://127.0.0.1:{port}", proc)
        gen = LoadGen(servers)
        chat = "/v1/chat/completions"
        loads = {"c64": (chat_body(8, stream=False), per_conn), "c64_sse": (chat_body(8, stream=True), max(1, per_conn // 2))}
        for port, _ in proxies.values():  # warm-up: connections, the pool, the heap
            gen.run(port, chat, loads["c64"][0], 64, 3)
        results: dict[str, dict[str, list[dict[str, float]]]] = {k: {s: [] for s in SIDES} for k in loads}
        for round_ in range(rounds):
            for load, (body, n) in loads.items():
                for side in SIDES if round_ % 2 == 0 else SIDES[::-1]:
                    port, proc = proxies[side]
                    cpu0 = tree_cpu_s(proc.pid)
                    gen.send({"op": "run", "port": port, "path": chat, "body": body, "conns": 64, "per_conn": n})
                    r = gen.answer()
                    done = len(r["latency_ms"])
                    results[load][side].append({
                        "rps": done / r["wall_s"], "cpu_us_per_req": (tree_cpu_s(proc.pid) - cpu0) / done * 1e6,
                        "p50_ms": percentile(r["latency_ms"], 0.5),
                        "p99_ms": percentile(r["latency_ms"], 0.99), "errors": r["errors"],
                    })
    out: dict[str, Any] = {"rounds": rounds}
    for load, sides in results.items():
        figures: dict[str, float] = {}
        for side in SIDES:
            for key in ("rps", "cpu_us_per_req", "p50_ms", "p99_ms"):
                figures[f"workers{side}_{key}"] = round(statistics.median(r[key] for r in sides[side]), 2)
            figures[f"workers{side}_errors"] = sum(r["errors"] for r in sides[side])
        figures["rps_ratio"] = round(statistics.median(
            two["rps"] / one["rps"] for one, two in zip(sides["1"], sides["2"], strict=True)), 3)
        out[load] = figures
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m proxy.bench.workers", description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--rounds", type=int, default=9, help="rounds per side (default: 9)")
    p.add_argument("--per-conn", type=int, default=40, help="requests per connection at c=64 (default: 40)")
    args = p.parse_args(argv)
    print(json.dumps(compare(args.rounds, args.per_conn), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
