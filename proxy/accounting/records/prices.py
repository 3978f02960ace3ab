"""Prices per million tokens (``cachetally report --prices FILE``, TOML), and exact money.

A ``[default]`` table and optional per-model tables that override it, each with ``input``,
``cached_input``, ``output`` and optionally ``cache_write_input`` (else cache writes are
priced as ``input``). Prices are read as :class:`~decimal.Decimal` (``0.1`` stays 0.1), and
every cost is computed in :data:`EXACT`, so no sum or product is ever rounded; a price
below 1e100 with at most 100 decimals (:data:`PRICE_DIGITS`) keeps every cost a few hundred digits. The fields,
with an example: ``config/prices.example.toml``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import MAX_EMAX, MAX_PREC, MIN_EMIN, Context, Decimal, Inexact, InvalidOperation, Overflow, localcontext
from pathlib import Path
from typing import Any

from proxy.server.config_file import read_toml

PRICE_KEYS = ("input", "cached_input", "output")
OPTIONAL_PRICE_KEYS = ("cache_write_input",)
#: A price has at most this many digits either side of the point: 1e999999999999999999
#: overflowed the first product (a traceback, no bill) and 1e-999999999999999999 asked the
#: first sum for 10**18 digits (MemoryError). No tariff is near either bound.
PRICE_DIGITS = 100
#: Money arithmetic: wide enough that no product or sum is ever rounded (one would raise).
EXACT = Context(prec=MAX_PREC, Emax=MAX_EMAX, Emin=MIN_EMIN, traps=[Inexact, InvalidOperation, Overflow])


@dataclass(frozen=True, slots=True)
class Prices:
    """Per million tokens: uncached input, cached input, output; cache writes (``None``: as input)."""

    input: Decimal
    cached_input: Decimal
    output: Decimal
    cache_write_input: Decimal | None = None

    def cost(self, uncached: int, cache_writes: int, cached: int, completion: int) -> Decimal:
        """Of ``uncached`` input tokens, ``cache_writes`` were written to the cache."""
        write = self.input if self.cache_write_input is None else self.cache_write_input
        with localcontext(EXACT):
            return ((uncached - cache_writes) * self.input + cache_writes * write + cached * self.cached_input
                    + completion * self.output).scaleb(-6)


_TABLE_LIKE = re.compile(r"[a-z_]{1,24}")


@dataclass(slots=True)
class PriceList:
    default: Prices | None
    models: dict[str, Prices] = field(default_factory=dict)

    def for_model(self, model: str) -> Prices | None:
        return self.models.get(model, self.default)

    @classmethod
    def load(cls, path: Path) -> PriceList:
        data = read_toml(path, "prices", parse_float=Decimal)  # 0.1 stays 0.1, not 0.1000000000000000055
        if unknown := set(data) - {"default", "models"}:
            # Named when it reads as a misspelt table ([defaults]); the API keys file given here
            # by mistake must not have its keys printed.
            named = sorted(name for name in unknown if _TABLE_LIKE.fullmatch(name))
            raise ValueError(f"{path}: {len(unknown)} unknown table(s) or key(s){f', such as {named[0]}' if named else ''}; "
                             "expected only [default] and [models.NAME]")
        if not isinstance(data.get("models", {}), dict):  # models = 3 raised AttributeError, a traceback
            raise ValueError(f"{path}: models holds tables [models.NAME], not a value")
        default = _prices(data["default"], f"{path} [default]", None) if "default" in data else None
        models = {
            name: _prices(table, f"{path} [models.{name}]", default)
            for name, table in data.get("models", {}).items()
        }
        if default is None and not models:
            raise ValueError(f"{path}: no prices ([default] or [models.NAME])")
        return cls(default, models)


def _prices(table: Any, where: str, base: Prices | None) -> Prices:
    if not isinstance(table, dict) or set(table) - set(PRICE_KEYS) - set(OPTIONAL_PRICE_KEYS):
        raise ValueError(f"{where}: only {', '.join(PRICE_KEYS + OPTIONAL_PRICE_KEYS)} (per million tokens)")
    values: dict[str, Decimal] = {}
    for key in PRICE_KEYS + OPTIONAL_PRICE_KEYS:
        value = table.get(key, getattr(base, key) if base else None)
        if value is None and key in OPTIONAL_PRICE_KEYS:
            continue  # Prices' default: None, priced as input
        price = None if isinstance(value, bool) or not isinstance(value, int | Decimal) else Decimal(value)
        # inf and nan made every cost null; a price past PRICE_DIGITS made no bill at all
        if price is None or not price.is_finite() or price < 0 or not _within_digits(price):
            raise ValueError(f"{where}: {key} must be a number >= 0, below 1e{PRICE_DIGITS}, "
                             f"with at most {PRICE_DIGITS} decimals")
        values[key] = price.copy_abs()  # -0.0 is 0: no cost printed "-0"
    return Prices(**values)  # type: ignore[arg-type]


def _within_digits(price: Decimal) -> bool:
    """Whether ``price`` (finite) has at most :data:`PRICE_DIGITS` digits either side of the point."""
    return not price or (price.adjusted() < PRICE_DIGITS
                         and price.normalize(EXACT).as_tuple().exponent >= -PRICE_DIGITS)  # 0.50 has 2 decimals
