"""The rounds every ``cachetally bench`` comparison runs (A R B A R B ...), and their statistics.

A figure is the median of the per-round medians; a ratio or difference against the direct
side is taken within a round, then its median (:mod:`proxy.bench.proxy`'s docstring).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

Figures = dict[str, Any]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def median(values: list[float]) -> float:
    return statistics.median(values)


def alternate(
    rounds: int,
    measure: Callable[[str], dict[str, float]],
    tick: Callable[[], None],
    sides: tuple[str, ...] = ("direct", "relay", "proxied"),
) -> dict[str, list[dict[str, float]]]:
    out: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for _ in range(rounds):
        for side in sides:  # A R B A R B ...
            out[side].append(measure(side))
        tick()
    return out


def summarize(
    sides: dict[str, list[dict[str, float]]], keys: list[str], a: str = "direct", b: str = "proxied"
) -> Figures:
    """Medians per side (named ``a`` and ``b``), and per round the difference (``added_``)
    and ratio (b/a), medians too; the same for the relay (``relay_``, ``relay_added_``,
    ``relay_ratio_``) when it ran."""
    out: Figures = {}
    for key in keys:
        xs = [r[key] for r in sides["direct"]]
        for prefix, side in (("", "proxied"), ("relay_", "relay")):
            if side not in sides:
                continue
            ys = [r[key] for r in sides[side]]
            out[f"{prefix or b + '_'}{key}"] = median(ys)
            out[f"{prefix}added_{key}"] = median([y - x for x, y in zip(xs, ys, strict=True)])
            # None when no round has a base to divide by: a CPU time read in 10 ms ticks can be
            # 0 for a short side (--quick), which must not end the whole run.
            ratios = [y / x for x, y in zip(xs, ys, strict=True) if x]
            out[f"{prefix}ratio_{key}"] = median(ratios) if ratios else None
        out[f"{a}_{key}"] = median(xs)
    return out
