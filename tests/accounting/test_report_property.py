"""``cachetally report`` against a plain bill, over drawn fleets (Hypothesis).

Records are written by the real JSONL sink (:class:`JsonlSink`, one directory per replica,
small files so that it rotates), then laid out as a fleet leaves them: a torn last line
after a crash (of a record the sink then wrote again, or one the crash lost), lines or
whole files copied twice (a retried batch, copies gathered from several places), empty
files, a file named beside its directory, a directory named twice. The bill the report prints (``--json``) must be
what docs/ACCOUNTING.md says, worked out here from the drawn figures with
:class:`~decimal.Decimal`, not by the report's code: each record once, each tenant only
its own, to the last digit.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal, Inexact, localcontext
from functools import partial
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.accounting.records.jsonl import JsonlSink
from proxy.accounting.records.record import UsageRecord, dumps
from proxy.server.cli import main

MAX_COUNT = (1 << 63) - 1  # the largest figure a record holds (an OTLP int64)
BASE = 1_793_000_000  # 2026-10-27T09:33:20Z
SECONDS = 4  # records start in BASE + [0, SECONDS), periods end on whole seconds
#: The report's total when no record is in the period: nothing, and no cost (0 with prices).
EMPTY = {"requests": 0, "disconnected": 0, "prompt_tokens": 0, "cached_tokens": 0, "uncached_tokens": 0,
         "cache_write_tokens": 0, "completion_tokens": 0, "hit_ratio": 0.0, "cost": None}
KEYS = ("input", "cached_input", "output", "cache_write_input")

TENANTS = st.one_of(
    st.sampled_from(["default", "other", "TOTAL", "acme", "-", ".", "..", "_", "a" * 64, "A.b-c_9"]),
    st.from_regex(r"[A-Za-z0-9._-]{1,64}", fullmatch=True),
)
MODELS = st.sampled_from(["m", "other", "unknown", "org/Model-7B:q4", "modèle ünï", "模型", 'q"uote\\d', "a b"])
SMALL = st.integers(0, 5000)
FIGURE = st.one_of(SMALL, st.integers(0, MAX_COUNT), st.sampled_from([0, 1, MAX_COUNT]))


@dataclass(frozen=True)
class Drawn:
    tenant: str
    model: str
    outcome: str
    prompt: int | None
    cached: int | None
    writes: int | None
    completion: int
    start_us: int  # microseconds after BASE


@st.composite
def drawn_records(draw: st.DrawFn, tenants: list[str], models: list[str]) -> Drawn:
    prompt = draw(st.one_of(st.none(), FIGURE))
    cached = writes = None
    if prompt is not None:
        # Unknown (null), a count of the prompt, or past it (an upstream's figure written
        # before cachetally stopped believing those: billed as the whole prompt cached).
        past = st.integers(prompt + 1, MAX_COUNT) if prompt < MAX_COUNT else st.nothing()
        cached = draw(st.one_of(st.none(), st.integers(0, prompt), past))
        uncached = prompt - min(cached or 0, prompt)
        writes = draw(st.one_of(st.none(), st.integers(0, uncached)))
    start_us = draw(st.integers(0, SECONDS - 1)) * 10**6 + draw(st.sampled_from([0, 0, 1, 999_999]))
    outcome = draw(st.sampled_from(["completed", "error", "disconnected"]))
    return Drawn(draw(st.sampled_from(tenants)), draw(st.sampled_from(models)), outcome, prompt, cached, writes,
                 draw(FIGURE), start_us)


def usage_record(d: Drawn, i: int) -> UsageRecord:
    status = {"completed": 200, "error": 500, "disconnected": None}[d.outcome]
    start = BASE + d.start_us / 10**6
    return UsageRecord(request_id=f"req-{i % 3}", tenant=d.tenant, route="chat", stream=bool(i % 2),
                       start_unix=start, end_unix=start + 0.25, model=d.model, request_model=d.model,
                       status=status, outcome=d.outcome, prompt_tokens=d.prompt, cached_tokens=d.cached,
                       cache_creation_tokens=d.writes, source=None if d.cached is None else "engine",
                       completion_tokens=d.completion, completion_source="usage")


PRICE = st.one_of(
    st.decimals(min_value=0, max_value=1000, places=9),
    st.builds(lambda m, e: Decimal(m).scaleb(e), st.integers(0, 10**6), st.integers(-12, 2)),
    st.sampled_from([Decimal(0), Decimal("0.1"), Decimal("-0.0"), Decimal("1")]),
)


def toml_number(price: Decimal) -> str:
    """``price`` as TOML can write it: ``3``, ``0.125`` or ``125e-3`` (by its digits' parity)."""
    sign, digits, exponent = price.as_tuple()
    mantissa = ("-" if sign else "") + "".join(map(str, digits))
    if exponent == 0:
        return mantissa
    return f"{mantissa}e{exponent}" if len(digits) % 2 else format(price, "f")


@st.composite
def price_lists(draw: st.DrawFn, models: list[str]) -> dict[str, dict[str, Decimal]] | None:
    """``{"default": ..., model: ...}``, each key a table sets; ``None``: no --prices."""
    if draw(st.integers(0, 3)) == 0:
        return None
    tables: dict[str, dict[str, Decimal]] = {}
    if draw(st.booleans()):
        tables["default"] = {k: draw(PRICE) for k in KEYS if k != "cache_write_input" or draw(st.booleans())}
    for model in draw(st.lists(st.sampled_from(models), min_size=0 if tables else 1, unique=True)):
        required = set() if "default" in tables else set(KEYS[:3])
        tables[model] = {k: draw(PRICE) for k in KEYS if k in required or draw(st.booleans())}
    return tables


def prices_toml(tables: dict[str, dict[str, Decimal]]) -> str:
    out = []
    for name, table in tables.items():
        out.append("[default]" if name == "default" else f"[models.{json.dumps(name, ensure_ascii=False)}]")
        out += [f"{key} = {toml_number(value)}" for key, value in table.items()]
    return "\n".join(out) + "\n"


def expected_bill(records: list[Drawn], tables: dict[str, dict[str, Decimal]] | None,
                  period: tuple[int | None, int | None], key: Callable[[Drawn], object]) -> dict[object, dict]:
    """Per ``key`` (a tenant, a tenant x model, one bill), as docs/ACCOUNTING.md bills it:
    cached unknown is the whole prompt uncached; cached past the prompt is the whole prompt
    cached; writes are uncached input priced at ``cache_write_input``, else ``input``; no
    prompt: the request and its completion only; a model's table overrides [default] key by
    key; a total over a model with no price has no cost."""
    since, until = period
    bill: dict[object, Counter] = {}
    for d in records:
        if (since is not None and d.start_us < since) or (until is not None and d.start_us >= until):
            continue
        t = bill.setdefault(key(d), Counter(cost=Decimal(0), priced=True))
        t["requests"] += 1
        t["disconnected"] += d.outcome == "disconnected"
        t["completion_tokens"] += d.completion
        prompt = d.prompt or 0
        cached = min(d.cached or 0, prompt)
        writes = d.writes or 0
        t["prompt_tokens"] += prompt
        t["cached_tokens"] += cached
        t["cache_write_tokens"] += writes
        if tables is None or (d.model not in tables and "default" not in tables):
            t["priced"] = False
            continue
        price = {**tables.get("default", {}), **tables.get(d.model, {})}
        write_price = price.get("cache_write_input", price["input"])
        with localcontext() as ctx:
            ctx.prec, ctx.traps[Inexact] = 2000, True
            t["cost"] += ((prompt - cached - writes) * price["input"] + writes * write_price
                          + cached * price["cached_input"] + d.completion * price["output"]).scaleb(-6)
    out = {}
    for name, t in bill.items():
        uncached = t["prompt_tokens"] - t["cached_tokens"]
        ratio = round(t["cached_tokens"] / t["prompt_tokens"], 4) if t["prompt_tokens"] else 0.0
        out[name] = {
            "requests": t["requests"], "disconnected": t["disconnected"], "prompt_tokens": t["prompt_tokens"],
            "cached_tokens": t["cached_tokens"], "uncached_tokens": uncached,
            "cache_write_tokens": t["cache_write_tokens"], "completion_tokens": t["completion_tokens"],
            # Read back as the JSON's digits (the report is parsed with Decimal for its costs).
            "hit_ratio": Decimal(repr(ratio)),
            "cost": t["cost"] if t["priced"] else None,
        }
    return out


def run_report(args: list[str]) -> tuple[int, dict | None, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["report", *args, "--json"])
    return code, json.loads(out.getvalue(), parse_float=Decimal) if code == 0 else None, err.getvalue()


@st.composite
def fleets(draw: st.DrawFn) -> dict:
    # A few tenants and models each, so that a tenant's bill spans models, priced or not.
    tenants = draw(st.lists(TENANTS, min_size=1, max_size=4, unique=True))
    models = draw(st.lists(MODELS, min_size=1, max_size=3, unique=True))
    records = draw(st.lists(drawn_records(tenants, models), min_size=3, max_size=30))
    lost = draw(st.lists(drawn_records(tenants, models), max_size=2))  # crashed mid-write: only a torn prefix remains
    replicas = draw(st.integers(1, 3))
    return {
        "records": records, "lost": lost, "replicas": replicas,
        "replica_of": draw(st.lists(st.integers(0, replicas - 1), min_size=len(records), max_size=len(records))),
        "batch": draw(st.integers(1, 6)), "file_bytes": draw(st.integers(300, 4000)),
        "copies": draw(st.lists(st.integers(0, len(records) - 1), max_size=6)),
        "copied_files": draw(st.integers(0, 2)), "torn": draw(st.lists(st.tuples(st.integers(0, 10**6),
                                                                                  st.floats(0, 1)), max_size=3)),
        "empty_files": draw(st.integers(0, 2)), "order": draw(st.randoms(use_true_random=False)),
        "prices": draw(price_lists(models)),
        "period": draw(st.one_of(st.just((None, None)), st.tuples(  # since, until: µs after BASE
            st.one_of(st.none(), st.integers(0, SECONDS).map(lambda s: s * 10**6)),
            st.one_of(st.none(), st.integers(0, SECONDS).map(lambda s: s * 10**6))).filter(
                lambda p: None in p or p[0] != p[1]).map(  # swapped or equal bounds are refused (test_report.py)
                lambda p: p if None in p else tuple(sorted(p))))),
    }


def lay_out(root: Path, fleet: dict) -> tuple[list[str], int, int, int]:
    """The fleet's files under ``root``; the paths to give the report, and how many files,
    whole lines and torn lines they hold."""
    rng = fleet["order"]
    dirs = [root / f"replica-{n}" for n in range(fleet["replicas"])]
    made = [usage_record(d, i) for i, d in enumerate(fleet["records"])]
    per_replica: list[list[UsageRecord]] = [[] for _ in dirs]
    for record, n in zip(made, fleet["replica_of"], strict=True):
        per_replica[n].append(record)
    for directory, recs in zip(dirs, per_replica, strict=True):
        directory.mkdir()
        sink = JsonlSink(directory, max_file_bytes=fleet["file_bytes"])
        for start in range(0, len(recs), fleet["batch"]):
            batch = recs[start:start + fleet["batch"]]
            assert sink.write(batch).written == len(batch)
        sink.close()
    written = {json.loads(line)["record_id"]: line  # each record's line as the sink wrote it
               for path in root.glob("*/*.jsonl") for line in path.read_bytes().splitlines(keepends=True)}
    lines = [written[record.record_id] for record in made]
    gathered = root / "gathered"
    gathered.mkdir()
    whole = len(fleet["records"])
    if fleet["copies"]:  # a retried batch, copied into another file
        (gathered / "usage-retried.jsonl").write_bytes(b"".join(lines[i] for i in fleet["copies"]))
        whole += len(fleet["copies"])
    sink_files = sorted(root.glob("replica-*/*.jsonl"))
    for n in range(fleet["copied_files"]):  # a replica's file gathered twice
        source = rng.choice(sink_files)
        (gathered / f"copy-{n}-{source.name}").write_bytes(source.read_bytes())
        whole += source.read_bytes().count(b"\n")
    for n in range(fleet["empty_files"]):
        (rng.choice(dirs + [gathered]) / f"usage-empty-{n}.jsonl").write_bytes(b"")
    candidates = lines + [dumps(usage_record(d, 1000 + n)) for n, d in enumerate(fleet["lost"])]
    torn_files = sorted(root.glob("*/*.jsonl"))
    torn = 0
    for pick, fraction in fleet["torn"]:
        path = torn_files.pop(pick % len(torn_files)) if torn_files else None
        if path is None:
            break
        line = candidates[pick % len(candidates)]
        cut = int(fraction * (len(line) - 2))  # never the closing brace: a prefix of a record only
        with path.open("ab") as fh:
            fh.write(line[:max(cut, 1)])
        torn += 1
    files = sorted(root.glob("*/*.jsonl"))
    args = [str(p) for p in dirs + [gathered]]
    args += [str(p) for p in rng.sample(files, min(2, len(files)))]  # a file named beside its directory
    args.append(str(rng.choice(dirs)))  # and a directory named twice
    rng.shuffle(args)
    return args, len(files), whole, torn


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(fleet=fleets())
def test_the_report_bills_each_record_once_to_its_own_tenant_to_the_last_digit(fleet: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        args, files, whole, torn = lay_out(root, fleet)
        since, until = fleet["period"]
        if fleet["prices"] is not None:
            (root / "prices.toml").write_text(prices_toml(fleet["prices"]))
            args += ["--prices", str(root / "prices.toml")]
        for flag, bound in (("--since", since), ("--until", until)):
            if bound is not None:
                args += [flag, datetime.fromtimestamp(BASE + bound // 10**6, UTC).isoformat()]
        code, report, err = run_report(args)
    assert code == 0, err
    bill = partial(expected_bill, fleet["records"], fleet["prices"], fleet["period"])
    expected = bill(lambda d: d.tenant)
    assert report["tenants"] == expected
    assert {(r.pop("tenant"), r.pop("model")): r for r in report["rows"]} == bill(lambda d: (d.tenant, d.model))
    empty = EMPTY | {"cost": None if fleet["prices"] is None else 0}
    assert report["total"] == bill(lambda d: "total").get("total", empty)
    assert (report["files"], report["skipped_lines"], report["conflicting_duplicates"]) == (files, torn, 0)
    assert report["duplicates"] == whole - len(fleet["records"])
    assert report["records"] == sum(t["requests"] for t in expected.values())
