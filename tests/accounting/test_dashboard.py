"""`config/grafana/cachetally.json` parses, and every query names metrics a live server exports.

The metric names come from a real `cachetally serve --engine sim` `/metrics`, not from a
list in this test: renaming a metric without updating the dashboard fails here.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.servers import ROOT, running_server

DASHBOARD = ROOT / "config" / "grafana" / "cachetally.json"

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w$.])([a-zA-Z_:][\w:]*)\b(?!\s*\()")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "group_left", "group_right", "inf", "nan"}
_LABEL_VALUES = re.compile(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,")


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


def expressions(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(dashboard["panels"]) for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects (functions, labels and ranges removed)."""
    bare = _RANGE.sub(" ", _MATCHERS.sub(" ", _STRING.sub(" ", expr)))
    bare = _GROUPING.sub(" ", bare)
    return {name for name in _IDENT.findall(bare) if name.lower() not in _KEYWORDS}


def test_metric_names_reads_promql() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le) (rate(a_bucket{model=~"$m", x="y{z}"}[$__rate_interval])))'
        " / on (model) group_left sum(b_total offset 5m) > bool 0"
    )
    assert metric_names(expr) == {"a_bucket", "b_total"}


def test_dashboard_parses_and_has_the_issue_panels() -> None:
    dashboard = load()
    assert dashboard["uid"] and dashboard["title"]
    exprs = expressions(dashboard)
    assert exprs and all(e.strip() for e in exprs)
    ids = [p["id"] for p in panels(dashboard["panels"])]
    assert len(ids) == len(set(ids))
    titles = " | ".join(p["title"].lower() for p in panels(dashboard["panels"]))
    for wanted in ("token hit rate", "by tier", "hit ratio", "open ledger slots", "anomalies"):
        assert wanted in titles
    heatmaps = [p for p in panels(dashboard["panels"]) if p["type"] == "heatmap"]
    assert heatmaps and all(t.get("format") == "heatmap" for p in heatmaps for t in p["targets"])


_SELECTOR = re.compile(r"(cachetally_\w+)(\{[^}]*\})?")


def test_every_query_follows_the_instance_variable_and_a_row_splits_by_instance() -> None:
    """A fleet (replicas behind a router) is one dashboard: Prometheus labels each scraped
    server ``instance``; every series follows the ``$instance`` picker, and one row shows
    each server on its own."""
    dashboard = load()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert _LABEL_VALUES.search(variables["instance"]["definition"])
    assert variables["instance"]["definition"].rstrip(") ").endswith("instance")
    for expr in expressions(dashboard):
        for name, matchers in _SELECTOR.findall(expr):
            assert 'instance=~"$instance"' in (matchers or ""), (name, expr)
    by_instance = [p for p in panels(dashboard["panels"]) if any(
        re.search(r"\bby \((?:[^)]*, *)?instance\b", t["expr"]) for t in p.get("targets", []))]
    titles = " | ".join(p["title"].lower() for p in by_instance)
    for wanted in ("token hit rate", "cached tokens/s", "requests/s"):
        assert wanted in titles, titles


@pytest.fixture(scope="module")
def live_names() -> set[str]:
    """Every series name a live sim server exports, with each family's suffixed forms."""
    args = ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--log-level", "warning"]
    with running_server(args) as (url, _):
        text = uuid.uuid4().hex + " a b c" * 20
        for _ in range(2):  # labelled children only appear once something was counted
            response = httpx.post(f"{url}/v1/completions", json={"prompt": text, "max_tokens": 1})
            assert response.status_code == 200
        exposition = httpx.get(f"{url}/metrics").text
    names: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            names.add(name)
            if kind == "counter":
                names.add(name if name.endswith("_total") else f"{name}_total")
            elif kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


@pytest.mark.loopback
def test_every_query_names_only_live_metrics(live_names: set[str]) -> None:
    dashboard = load()
    used: set[str] = set()
    for expr in expressions(dashboard):
        names = metric_names(expr)
        assert names, expr
        assert names <= live_names, (expr, names - live_names)
        used |= names
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = _LABEL_VALUES.search(variable["definition"])
            assert match and match.group(1) in live_names, variable["definition"]
    # A dashboard over all of cachetally's metrics: every family is on it.
    families = {n for n in live_names if n.startswith("cachetally_") and not n.endswith("_created")}
    bases = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in used}
    assert {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in families} <= bases
