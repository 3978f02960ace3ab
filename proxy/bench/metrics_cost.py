"""What counting one request costs: these metrics against another revision's, side by side.

``python -m proxy.bench.metrics_cost --baseline REV`` loads ``proxy/accounting/metrics.py`` as it was
at ``REV`` (``git show``) beside this checkout's, and times, for each, one request's
bookkeeping: open and close a ledger slot, then ``Metrics.record`` of a streamed hit with
one tier (the seven series updates). Rounds alternate between the two; each figure is the
median over rounds of the mean per request, with the garbage collector off while timing
(as ``timeit`` does). Once in one process, and once more in a child
process with ``PROMETHEUS_MULTIPROC_DIR`` set (prometheus_client picks its value class at
import, so the mode needs a process of its own).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _baseline_module(rev: str) -> types.ModuleType:
    source = subprocess.run(
        ["git", "show", f"{rev}:proxy/accounting/metrics.py"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    module = types.ModuleType(f"metrics_at_{rev}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:proxy/accounting/metrics.py", "exec"), module.__dict__)
    return module


def measure(rev: str, rounds: int, requests: int) -> dict[str, float]:
    """Microseconds per request, median over ``rounds``: {"baseline": ..., "this": ...}."""
    import proxy.accounting.metrics as this
    from proxy.accounting.records.record import UsageRecord
    from proxy.patching.ledger import UsageLedger

    designs = {"baseline": _baseline_module(rev), "this": this}
    timings: dict[str, list[float]] = {name: [] for name in designs}

    def one_round(module: types.ModuleType) -> float:
        ledger = UsageLedger()
        metrics = module.Metrics(ledger)
        figures = dict(model="m", route="chat", stream=True, prompt_tokens=1200, cached_tokens=960, source="engine",
                       local_cached_tokens=960, tenant="default", completion_tokens=16)
        if hasattr(module, "MeteredRequest"):  # revisions whose metrics counted a record of their own
            rec = module.MeteredRequest(**figures)
        else:
            rec = UsageRecord(request_id="r", start_unix=0.0, **figures)  # type: ignore[arg-type]
        record, open_, close = metrics.record, ledger.open, ledger.close
        keys = [f"k{i}" for i in range(requests)]
        gc.disable()  # as timeit does: the collector's pauses are the served process's own business
        try:
            start = time.perf_counter()
            for key in keys:
                open_(key)
                close(key)
                record(rec)
            return (time.perf_counter() - start) / requests * 1e6
        finally:
            gc.enable()

    for _ in range(rounds):
        for name, module in designs.items():
            timings[name].append(one_round(module))
    return {name: round(statistics.median(values), 2) for name, values in timings.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m proxy.bench.metrics_cost", description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--baseline", required=True, metavar="REV", help="git revision whose proxy/accounting/metrics.py to compare")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds per design (default: 7)")
    p.add_argument("--requests", type=int, default=20_000, help="requests counted per round (default: 20000)")
    p.add_argument("--one-mode", action="store_true", help=argparse.SUPPRESS)  # the child's flag
    args = p.parse_args(argv)
    if args.one_mode:
        print(json.dumps(measure(args.baseline, args.rounds, args.requests)))
        return 0
    results = {"single-process": measure(args.baseline, args.rounds, args.requests)}
    with tempfile.TemporaryDirectory(prefix="cachetally-bench-metrics-") as mp_dir:
        child = subprocess.run(
            [sys.executable, "-m", "proxy.bench.metrics_cost", "--baseline", args.baseline,
             "--rounds", str(args.rounds), "--requests", str(args.requests), "--one-mode"],
            cwd=ROOT, env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": mp_dir}, check=True, capture_output=True,
            text=True,
        )
    results["multiprocess"] = json.loads(child.stdout)
    print(f"us per request (median of {args.rounds} rounds of {args.requests}): baseline = {args.baseline}")
    for mode, figures in results.items():
        ratio = figures["this"] / figures["baseline"]
        print(f"  {mode:15} baseline {figures['baseline']:6.2f}   this {figures['this']:6.2f}   ratio {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
