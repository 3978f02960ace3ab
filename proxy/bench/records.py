"""What usage records and tenant resolution cost a request, in process.

``python -m proxy.bench.records``: ``CachetallyApp`` with the sim engine, called as an
ASGI app with the request in memory (as :mod:`proxy.bench.inprocess`), once without
accounting and once with JSONL records in a temporary directory (flushed every 0.1 s,
so the writer's work falls inside the rounds it belongs to) and a tenant header,
in alternating rounds. Prints the median CPU µs per request of each (process CPU time,
the JSONL writer thread's included; wall time on a shared machine swings by 2x between
rounds) and their ratio, for a JSON chat request and a 16-token stream with usage.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from typing import Any

import orjson

import proxy.bench.inprocess as inprocess
from proxy.server.app import CachetallyApp
from proxy.server.settings import Settings

_MESSAGES = [{"role": "user", "content": "How many of these prompt tokens were cached?"}]
BODIES = {
    "json": {"model": "sim-model", "max_tokens": 8, "messages": _MESSAGES},
    "sse": {"model": "sim-model", "max_tokens": 16, "messages": _MESSAGES, "stream": True,
            "stream_options": {"include_usage": True}},
}


async def _cpu_us(app: Any, requests: int) -> float:
    assert await inprocess._call(app) == 200
    start = time.process_time()
    for _ in range(requests):
        await inprocess._call(app)
    return (time.process_time() - start) / requests * 1e6


async def compare(body: dict[str, Any], requests: int = 3000, rounds: int = 9) -> dict[str, float]:
    raw = orjson.dumps(body)
    inprocess._BODY = raw
    inprocess._SCOPE["headers"] = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                                   (b"content-length", b"%d" % len(raw)), (b"x-tenant", b"a")]
    with tempfile.TemporaryDirectory() as usage:
        plain = CachetallyApp(Settings(engine="sim").validate())
        recorded = CachetallyApp(
            Settings(
                engine="sim", usage_dir=usage, tenant_header="x-tenant", tenants=["a", "b"],
                usage_flush_interval_s=0.1,  # flushes land inside the rounds they belong to
            ).validate()
        )
        without, with_records = [], []
        async with plain.running(), recorded.running():
            for _ in range(rounds):
                without.append(await _cpu_us(plain, requests))
                with_records.append(await _cpu_us(recorded, requests))
    ratios = [a / b for a, b in zip(without, with_records, strict=True)]
    return {
        "without_cpu_us": round(statistics.median(without), 1),
        "with_records_cpu_us": round(statistics.median(with_records), 1),
        "ratio_median_of_rounds": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
    }


async def _main(requests: int, rounds: int) -> None:
    for name, body in BODIES.items():
        print(orjson.dumps({"request": name, **(await compare(body, requests, rounds))}).decode())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m proxy.bench.records",
        description="CPU per request of the sim engine's app with JSONL records and a tenant header, "
        "against without, in alternating rounds, in process; one JSON line per request kind.")
    parser.add_argument("--requests", type=int, default=3000, help="requests per round (default: 3000)")
    parser.add_argument("--rounds", type=int, default=9, help="rounds of each (default: 9)")
    args = parser.parse_args()
    try:
        from uvloop import run
    except ImportError:
        run = asyncio.run
    run(_main(args.requests, args.rounds))
