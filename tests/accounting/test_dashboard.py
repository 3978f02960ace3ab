"""`config/grafana/cachetally.json` parses, and every query names metrics a live server exports.

The metric names come from a real `cachetally serve --engine sim` `/metrics`, not from a
list in this test: renaming a metric without updating the dashboard fails here. Each
series is read as its TYPE there says, in the dashboard and in the PromQL the docs give:
counters through rate() or increase(), gauges not.
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
def exposition() -> str:
    """What a live sim server's ``/metrics`` says after two requests."""
    args = ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--log-level", "warning"]
    with running_server(args) as (url, _):
        text = uuid.uuid4().hex + " a b c" * 20
        for _ in range(2):  # labelled children only appear once something was counted
            response = httpx.post(f"{url}/v1/completions", json={"prompt": text, "max_tokens": 1})
            assert response.status_code == 200
        return httpx.get(f"{url}/metrics").text


def series_types(exposition: str) -> dict[str, str]:
    """Each series name a family exports (with its suffixed forms) -> the family's TYPE."""
    types: dict[str, str] = {}
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
            if kind == "counter":
                types[name if name.endswith("_total") else f"{name}_total"] = kind
            elif kind == "histogram":
                types |= {f"{name}_{suffix}": kind for suffix in ("bucket", "sum", "count")}
    return types


@pytest.fixture(scope="module")
def live_names(exposition: str) -> set[str]:
    """Every series name a live sim server exports, with each family's suffixed forms."""
    names = set(series_types(exposition))
    for line in exposition.splitlines():
        if line and not line.startswith("#"):
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


_CACHETALLY_SELECTOR = re.compile(r"\b(cachetally_\w+)\s*(?:\{[^}]*\})?\s*(\[[^\]]*\])?")
_OVER_A_RANGE = ("rate", "increase", "irate")
#: A PromQL expression the docs give an operator, in backticks (``label_values`` is Grafana's, not PromQL).
_DOC_PROMQL = re.compile(r"`((?!label_values)[a-z_]+\([^`]*cachetally_[^`]*)`")


def misread_series(expr: str, types: dict[str, str]) -> list[str]:
    """Each series ``expr`` reads against its type: one not exported, a counter or a
    histogram's series not through rate(), increase() or irate() over a range (a bare
    counter drops to 0 when its process restarts), a gauge through one of them, a
    histogram_quantile() not over buckets."""
    found = []
    for match in _CACHETALLY_SELECTOR.finditer(expr):
        name, window = match.groups()
        enclosing = re.search(r"(\w+)\s*\(\s*$", expr[: match.start()])
        over_a_range = window is not None and enclosing is not None and enclosing.group(1) in _OVER_A_RANGE
        if name not in types or over_a_range != (types[name] in ("counter", "histogram")):
            found.append(f"{name} ({types.get(name)})")
    for quantile in re.finditer(r"histogram_quantile\(", expr):
        if not re.match(r"[^,]*,\s*sum by \((?:[^)]*, *)?le\b[^)]*\) \(rate\(\w+_bucket\b", expr[quantile.end():]):
            found.append(f"histogram_quantile not over bucket rates by le: {expr[quantile.start():]}")
    return found


def test_misread_series_finds_a_counter_read_bare_a_gauge_rated_and_a_quantile_of_sums() -> None:
    types = {"cachetally_c_total": "counter", "cachetally_g": "gauge", "cachetally_h_bucket": "histogram",
             "cachetally_h_sum": "histogram"}
    assert misread_series('sum(cachetally_c_total{leg="prefill"}) - sum(cachetally_c_total)', types) == [
        "cachetally_c_total (counter)"] * 2
    assert misread_series("sum(rate(cachetally_g[5m]))", types) == ["cachetally_g (gauge)"]
    assert misread_series("sum(cachetally_renamed)", types) == ["cachetally_renamed (None)"]
    assert misread_series("histogram_quantile(0.9, sum by (le) (rate(cachetally_h_sum[5m])))", types)
    assert misread_series(
        "histogram_quantile(0.9, sum by (le) (rate(cachetally_h_bucket{x=\"y\"}[5m]))) + sum(cachetally_g)"
        " / sum(increase(cachetally_c_total[$__range]))", types) == []


@pytest.mark.loopback
def test_every_query_and_every_documented_expression_reads_each_series_as_its_type(exposition: str) -> None:
    """The dashboard's queries and the PromQL the docs give (an alert in docs/ACCOUNTING.md
    once subtracted two bare counters: wrong after any instance's restart)."""
    documented = [e for doc in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
                  for e in _DOC_PROMQL.findall(doc.read_text())]
    assert documented, "the docs give no PromQL any more: the pattern needs a look"
    types = series_types(exposition)
    misread = {expr: found for expr in expressions(load()) + documented if (found := misread_series(expr, types))}
    assert misread == {}


@pytest.mark.loopback
def test_the_instance_picker_lists_a_server_that_counted_no_request_of_its_own() -> None:
    """A P/D prefill instance counts its legs only, and a replica just started has counted
    nothing: the ``Instance`` variable's series must still have a sample there, or the
    picker cannot show that server (docs/DEPLOY.md: it "lists every scraped server")."""
    (variable,) = [v for v in load()["templating"]["list"] if v["name"] == "instance"]
    match = _LABEL_VALUES.search(variable["definition"])
    assert match
    args = ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--log-level", "warning", "--pd-legs"]
    with running_server(args) as (url, _):
        fresh = httpx.get(f"{url}/metrics").text
        leg = {"prompt": "a prefill leg", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        assert httpx.post(f"{url}/v1/completions", json=leg).status_code == 200
        prefill_only = httpx.get(f"{url}/metrics").text
    for exposition in (fresh, prefill_only):
        samples = [line for line in exposition.splitlines() if re.match(rf"{match.group(1)}[{{ ]", line)]
        assert samples, (match.group(1), exposition)
