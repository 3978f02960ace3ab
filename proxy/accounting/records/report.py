"""Totals of usage records per tenant x model, and what they cost (``cachetally report``).

Reads the JSONL files the recorder writes. A line that is not a record is skipped and
counted, never guessed at: one that is not a JSON object (a torn last line after a failed
write), or an object without what every record since schema 1 carries (an integer schema
version ``v``, a ``tenant`` and a ``model`` string), such as a line of another log given
by mistake, which would otherwise bill a request to ``default``. Copies are found
first: the first read of a ``record_id`` decides, whatever it holds, and a later one (the
same file given twice, copies gathered from several places) is a duplicate, never counted
or said again; one whose content differs (a file edited, two writers minting one id) is
also ``conflicting``, said on stderr, since which copy is right cannot be told here. The
client's ``request_id`` is never a key: clients reuse it. Records written before
``record_id`` existed (schema 1) have none and each counts. A record with no
``prompt_tokens`` (refused or abandoned before the engine saw it, or a stream cut before
its usage in upstream mode: counted in ``unknown_prompts`` when it generated tokens) adds a
request and its completion tokens only. One whose ``completion_source`` is ``unknown`` (a
response that went out unread, or whose usage held no count) adds 0 completion tokens for
what it delivered: counted in ``unknown_completions``, since a bill that said nothing of
it read as an answer that cost nothing. ``cached_tokens`` unknown counts as 0 cached: the whole prompt is
billed as uncached input; one past its prompt (written by an upstream before cachetally
stopped believing such figures) counts as the whole prompt cached, and is counted in
``clamped``. Cache writes (``cache_creation_tokens``: uncached prompt tokens the engine
wrote to its prefix cache) are part of the uncached input, priced at ``cache_write_input``
when a price table sets it, else at ``input``. Money is exact (prices and costs are
:class:`~decimal.Decimal`, never rounded): rows add up to their totals to the last digit.

A record whose token figure is neither null nor a count (a negative number, a float, a
string, a boolean, an integer past the int64 a record holds) is not added to any total: a
negative figure would lower the bill, a float or string would bill nothing for what it
names. It is counted in ``invalid_records`` and named on stderr. With ``--since`` or
``--until``, a record whose ``start_time`` is missing or unreadable cannot be placed in
the period: it is counted in ``undated`` and named on stderr, never added; one without a
UTC offset is read as UTC, as ``--since`` reads its own.

Prices (``--prices FILE``: :mod:`proxy.accounting.records.prices`) are per model. A total
over rows of which one has no price (a model with no table, and no ``[default]``) has no
cost: it would be a partial sum read as the whole bill. :meth:`Report.unpriced` names those
models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson

from proxy.accounting.records.prices import EXACT, PriceList
from proxy.accounting.records.record import count

#: A record's token figures: each null (unknown) or a :func:`~proxy.accounting.records.record.count`.
FIGURES = ("prompt_tokens", "cached_tokens", "cache_creation_tokens", "completion_tokens")


@dataclass(slots=True)
class Totals:
    #: Records read, and of them those whose client left before the response ended.
    requests: int = 0
    disconnected: int = 0
    #: With a price table for the model; ``None`` without one, or over rows one of which has none.
    cost: Decimal | None = None
    #: Rows merged in that have no price: the cost above would be partial, so it is ``None``.
    unpriced: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    #: Of the uncached tokens, those written to the cache (priced as cache writes).
    cache_write_tokens: int = 0
    completion_tokens: int = 0

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def add(self, record: dict[str, Any]) -> None:
        self.requests += 1
        self.disconnected += record.get("outcome") == "disconnected"
        if isinstance(prompt := record.get("prompt_tokens"), int):
            self.prompt_tokens += prompt
            cached = record.get("cached_tokens")
            cached = min(max(cached, 0), prompt) if isinstance(cached, int) else 0
            self.cached_tokens += cached
            writes = record.get("cache_creation_tokens")
            if isinstance(writes, int) and writes > 0:
                self.cache_write_tokens += min(writes, max(0, prompt - cached))
        self.completion_tokens += completion if isinstance(completion := record.get("completion_tokens"), int) else 0

    def merge(self, other: Totals) -> None:
        self.requests += other.requests
        self.disconnected += other.disconnected
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.cache_write_tokens += other.cache_write_tokens
        self.completion_tokens += other.completion_tokens
        self.unpriced += other.unpriced
        if other.cost is not None:
            self.cost = EXACT.add(self.cost or Decimal(0), other.cost)
        if self.unpriced:
            self.cost = None

    def as_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests, "disconnected": self.disconnected,
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "uncached_tokens": self.uncached_tokens, "cache_write_tokens": self.cache_write_tokens,
            "completion_tokens": self.completion_tokens, "hit_ratio": round(self.hit_ratio, 4),
            "cost": None if self.cost is None else self.cost.normalize(EXACT),
        }


@dataclass(slots=True)
class Report:
    rows: dict[tuple[str, str], Totals] = field(default_factory=dict)
    files: int = 0
    records: int = 0
    skipped_lines: int = 0
    #: Each record read, by ``record_id``: the hash of its content.
    _record_ids: dict[str, int] = field(default_factory=dict, repr=False)
    #: Records read again under a ``record_id``; of those, the ones whose content differs.
    duplicates: int = 0
    conflicting: int = 0
    #: Records with more cached tokens than their prompt, counted as the whole prompt cached.
    clamped: int = 0
    #: Records with a token figure that is neither null nor a count: added to no total.
    invalid_records: int = 0
    #: With a period (--since/--until): records with no readable start_time, added to no total.
    undated: int = 0
    #: Records that generated tokens but have no prompt_tokens: their prompts are in no total.
    unknown_prompts: int = 0
    #: Records whose completion tokens are not known (``completion_source: "unknown"``): billed 0 output.
    unknown_completions: int = 0
    #: Whether :meth:`price` ran: then a bill over no record costs 0, not "no price".
    priced: bool = False

    def add(self, record: dict[str, Any], period: tuple[datetime | None, datetime | None] | None = None) -> None:
        """Total ``record``, unless a copy, not valid, or outside ``period`` (since, until)."""
        record_id = record.get("record_id")
        if isinstance(record_id, str):
            content = hash(orjson.dumps(record, option=orjson.OPT_SORT_KEYS))
            first = self._record_ids.get(record_id)
            if first is not None:
                self.duplicates += 1
                self.conflicting += first != content
                return
            self._record_ids[record_id] = content
        if not _counts(record):
            self.invalid_records += 1
            return
        if period is not None:
            (since, until), started = period, _started(record)
            if started is None:
                self.undated += 1
                return
            if (since is not None and started < since) or (until is not None and started >= until):
                return
        key = (record["tenant"], record["model"])
        totals = self.rows.get(key)
        if totals is None:
            totals = self.rows[key] = Totals()
        totals.add(record)
        self.records += 1
        prompt, cached = record.get("prompt_tokens"), record.get("cached_tokens")
        completion = record.get("completion_tokens")
        self.clamped += isinstance(prompt, int) and isinstance(cached, int) and cached > prompt
        self.unknown_prompts += prompt is None and isinstance(completion, int) and completion > 0
        self.unknown_completions += record.get("completion_source") == "unknown"

    def price(self, prices: PriceList) -> None:
        self.priced = True
        for (_, model), totals in self.rows.items():
            model_prices = prices.for_model(model)
            totals.cost = (model_prices.cost(totals.uncached_tokens, totals.cache_write_tokens, totals.cached_tokens,
                                             totals.completion_tokens) if model_prices else None)
            totals.unpriced = int(model_prices is None)

    def unpriced(self) -> list[str]:
        """The models of rows that :meth:`price` found no price for."""
        return sorted({model for (_, model), totals in self.rows.items() if totals.unpriced})

    def by_tenant(self) -> dict[str, Totals]:
        out: dict[str, Totals] = {}
        for (tenant, _), totals in sorted(self.rows.items()):
            out.setdefault(tenant, Totals()).merge(totals)
        return out

    def total(self) -> Totals:
        out = Totals(cost=Decimal(0) if self.priced else None)
        for totals in self.rows.values():
            out.merge(totals)
        return out

    def as_json(self) -> dict[str, Any]:
        return {
            "rows": [{"tenant": t, "model": m, **v.as_json()} for (t, m), v in sorted(self.rows.items())],
            "tenants": {t: v.as_json() for t, v in self.by_tenant().items()},
            "total": self.total().as_json(),
            "files": self.files, "records": self.records, "skipped_lines": self.skipped_lines,
            "duplicates": self.duplicates, "conflicting_duplicates": self.conflicting,
            "clamped": self.clamped, "invalid_records": self.invalid_records,
            "undated": self.undated, "unknown_prompts": self.unknown_prompts,
            "unknown_completions": self.unknown_completions, "unpriced_models": self.unpriced(),
        }


def read(
    paths: Iterable[Path],
    progress: Callable[[int], None] = lambda n: None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> Report:
    """Total the records in ``paths`` that started in ``[since, until)`` (aware datetimes);
    ``progress`` is called with the bytes read."""
    report = Report()
    period = (since, until) if since is not None or until is not None else None
    for path in paths:
        report.files += 1
        with path.open("rb") as fh:
            for line in fh:
                progress(len(line))
                if not line.strip():
                    continue
                try:
                    record = orjson.loads(line)
                except orjson.JSONDecodeError:
                    record = None
                if not _is_record(record):
                    report.skipped_lines += 1
                else:
                    report.add(record, period)
    return report


def _is_record(line: Any) -> bool:
    """Whether a line's JSON is a usage record of some schema (module docstring)."""
    return (isinstance(line, dict) and type(line.get("v")) is int and line["v"] >= 1
            and isinstance(line.get("tenant"), str) and isinstance(line.get("model"), str))


def _counts(record: dict[str, Any]) -> bool:
    """Whether each token figure of ``record`` is null or a count, as the recorder writes
    (an int64: one line's 2**64 - 1 billed trillions)."""
    return all(record.get(name) is None or count(record.get(name)) is not None for name in FIGURES)


def _started(record: dict[str, Any]) -> datetime | None:
    """The record's ``start_time`` (UTC when it carries no offset), or ``None``."""
    try:
        started = datetime.fromisoformat(record["start_time"])
    except (KeyError, TypeError, ValueError):
        return None
    return started.replace(tzinfo=UTC) if started.tzinfo is None else started
