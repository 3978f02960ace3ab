"""``cachetally report`` as a billing team runs it: the files of several replicas, copies
gathered twice, torn last lines, hand-edited figures and prices with decimals. Each bill
is checked against a plain sum over the lines, computed here, not by the report's code."""

from __future__ import annotations

import json
import os
import random
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.accounting.records.prices import PriceList
from proxy.server.cli import main

MAX_COUNT = (1 << 63) - 1  # the largest figure a record holds (an OTLP int64)

PRICES = """
[default]
input = 0.3
cached_input = 0.03
output = 1.1
cache_write_input = 0.375

[models."m-b"]
input = 0.1
cached_input = 0.01
output = 0.7
"""


def record(i: int, tenant: str, model: str, rng: random.Random) -> dict:
    prompt = rng.randrange(1, 5000)
    cached = rng.randrange(0, prompt + 1)
    return {"v": 2, "record_id": f"0190a000-0000-7000-8000-{i:012x}", "tenant": tenant, "model": model,
            "prompt_tokens": prompt, "cached_tokens": cached, "cache_creation_tokens": rng.randrange(0, prompt - cached + 1),
            "completion_tokens": rng.randrange(0, 900), "outcome": "completed", "start_time": "2026-11-02T10:00:00Z"}


def by_hand(lines: list[bytes], prices: dict[str, dict[str, Decimal]]) -> dict[tuple[str, str], Decimal]:
    """The bill per tenant x model: each record_id once, torn lines left out, per-million prices."""
    seen, bill = set(), {}
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r["record_id"] in seen:
            continue
        seen.add(r["record_id"])
        p = prices.get(r["model"], prices["default"])
        fresh = r["prompt_tokens"] - r["cached_tokens"] - r["cache_creation_tokens"]
        cost = (fresh * p["input"] + r["cache_creation_tokens"] * p["cache_write_input"]
                + r["cached_tokens"] * p["cached_input"] + r["completion_tokens"] * p["output"]) / 1_000_000
        key = (r["tenant"], r["model"])
        bill[key] = bill.get(key, Decimal(0)) + cost
    return bill


def test_a_bill_over_replicas_is_exact_and_its_rows_add_up_to_its_totals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two replicas' directories, a file copied from one into the other, each with a torn
    last line: the costs must be the exact sums, and the rows must add up to each tenant's
    and to the total to the last digit (floats rounded each row to 6 places: two rows of
    0.0000005 showed 0 each and a total of 0.000001)."""
    rng = random.Random(7)
    tenants, models = ["acme", 'evil,"t"\n=cmd|x', "zeta"], ["m-a", "m-b"]
    records = [record(i, rng.choice(tenants), rng.choice(models), rng) for i in range(600)]
    records += [{**record(600 + i, "tiny", "m-a", rng), "prompt_tokens": 1, "cached_tokens": 0,
                 "cache_creation_tokens": 0, "completion_tokens": 0} for i in range(1000)]
    rng.shuffle(records)
    lines = [orjson.dumps(r) + b"\n" for r in records]
    for replica, part in (("replica-a", lines[:900]), ("replica-b", lines[900:])):
        (tmp_path / replica).mkdir()
        (tmp_path / replica / "usage-1.jsonl").write_bytes(b"".join(part) + part[0][:40])  # torn last line
    (tmp_path / "replica-b" / "copied-from-a.jsonl").write_bytes(b"".join(lines[:300]))
    (tmp_path / "prices.toml").write_text(PRICES)
    args = ["report", str(tmp_path / "replica-a"), str(tmp_path / "replica-b"), "--prices", str(tmp_path / "prices.toml")]

    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out, parse_float=Decimal)
    d = {k: Decimal(v) for k, v in (("input", "0.3"), ("cached_input", "0.03"), ("output", "1.1"))}
    expected = by_hand(b"".join(lines).splitlines(), {
        "default": {**d, "cache_write_input": Decimal("0.375")},
        "m-b": {"input": Decimal("0.1"), "cached_input": Decimal("0.01"), "output": Decimal("0.7"),
                "cache_write_input": Decimal("0.375")}})  # a key a model's table leaves out is [default]'s
    assert (report["records"], report["duplicates"], report["skipped_lines"]) == (1600, 300, 2)
    assert {(r["tenant"], r["model"]): r["cost"] for r in report["rows"]} == expected
    assert report["tenants"]["tiny"]["cost"] == Decimal("0.0003")  # 1,000 x 1 token x 0.3 per million
    for tenant, totals in report["tenants"].items():
        assert totals["cost"] == sum(r["cost"] for r in report["rows"] if r["tenant"] == tenant)
    assert report["total"]["cost"] == sum(expected.values()) == sum(r["cost"] for r in report["rows"])

    assert main(args) == 0  # the table says the same figures, digit for digit
    table = capsys.readouterr().out.splitlines()
    assert table[-2].split()[-1] == str(report["total"]["cost"])
    assert [line.split()[-1] for line in table if line.startswith("tiny")] == ["0.0003"]


def test_a_figure_past_what_a_record_holds_is_not_counted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A hand-edited or corrupt 2**64 - 1 is an integer to JSON readers, but no record holds
    it: it billed 18 quintillion prompt tokens, 9.2 trillion at 0.5 per million."""
    good = {"v": 2, "record_id": "good", "tenant": "acme", "model": "m", "prompt_tokens": 1000, "completion_tokens": 0}
    bad = {**good, "record_id": "bad", "prompt_tokens": (1 << 64) - 1}
    path = tmp_path / "a.jsonl"
    path.write_bytes(orjson.dumps(good) + b"\n" + orjson.dumps(bad) + b"\n")
    (tmp_path / "p.toml").write_text("[default]\ninput = 0.5\ncached_input = 0.05\noutput = 1.5\n")
    assert main(["report", str(path), "--prices", str(tmp_path / "p.toml"), "--json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out, parse_float=Decimal)
    assert (report["records"], report["invalid_records"]) == (1, 1)
    assert (report["total"]["prompt_tokens"], report["total"]["cost"]) == (1000, Decimal("0.0005"))
    assert "1 record(s) with a token figure that is not a count" in err


def test_totals_past_64_bits_are_written_digit_for_digit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Three records at the largest figure a record holds (an upstream may report it) sum
    past 64 bits: --json ended in a TypeError traceback, and the period had no bill at all."""
    path = tmp_path / "a.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"v": 2, "record_id": f"r{i}", "tenant": "acme", "model": "m",
                                            "prompt_tokens": MAX_COUNT, "completion_tokens": 1}) + b"\n"
                              for i in range(3)))
    assert main(["report", str(path), "--json"]) == 0
    total = json.loads(capsys.readouterr().out)["total"]
    assert (total["prompt_tokens"], total["uncached_tokens"], total["completion_tokens"]) == (3 * MAX_COUNT, 3 * MAX_COUNT, 3)


def test_a_file_that_cannot_be_read_is_an_error_in_words(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A listed file unreadable when read (here a directory named like one; also a file
    the writer's 0640 keeps from the billing user, or one removed meanwhile) ended in a
    traceback; it must say which and exit 2, never print a bill without it."""
    (tmp_path / "usage").mkdir()
    (tmp_path / "usage" / "a.jsonl").write_bytes(b'{"v": 2, "tenant": "acme", "model": "m", "prompt_tokens": 5}\n')
    (tmp_path / "usage" / "b.jsonl").mkdir()
    assert main(["report", str(tmp_path / "usage"), "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"cannot read {tmp_path / 'usage' / 'b.jsonl'}: Is a directory" in err


def test_an_unreadable_directory_is_an_error_not_an_empty_bill(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """glob reads a directory it may not list as an empty one: a zero bill, exit 0. The
    directory is made unlistable to the process at the system call (root lists any mode)."""
    usage = tmp_path / "usage"
    usage.mkdir()
    (usage / "a.jsonl").write_bytes(b'{"v": 2, "tenant": "acme", "model": "m", "prompt_tokens": 5}\n')
    for name in ("scandir", "listdir"):
        def refused(path: Any = ".", *, _real: Any = getattr(os, name)) -> Any:
            if os.fspath(path) == str(usage):
                raise PermissionError(13, "Permission denied", str(usage))
            return _real(path)
        monkeypatch.setattr(os, name, refused)
    assert main(["report", str(usage), "--json"]) == 2
    assert "Permission denied" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["inf", "nan", "-0.0"])
def test_a_price_that_is_not_a_finite_number_is_refused(tmp_path: Path, value: str) -> None:
    """TOML reads inf and nan: each made every cost null (no price said missing) or nan."""
    path = tmp_path / "p.toml"
    path.write_text(f"[default]\ninput = {value}\ncached_input = 0\noutput = 1\n")
    if value == "-0.0":  # zero, however written, is a price
        assert PriceList.load(path).for_model("m").input == 0
        return
    with pytest.raises(ValueError, match="input must be a number >= 0"):
        PriceList.load(path)


def _bill(tmp_path: Path, capsys: pytest.CaptureFixture[str], prices: str, records: list[dict]) -> str:
    (tmp_path / "usage.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    (tmp_path / "prices.toml").write_text(prices)
    assert main(["report", str(tmp_path / "usage.jsonl"), "--prices", str(tmp_path / "prices.toml"), "--json"]) == 0
    return capsys.readouterr().out


def test_a_cost_of_more_digits_than_a_float_holds_is_billed_to_the_last_digit_in_plain_digits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The largest figure a record holds at a price with nine decimals is a cost of 28
    significant digits: a float (17) or a fixed precision would round it, and a round cost is
    written 100, not 1E+2, to the billing team's tools."""
    prices = '[default]\ninput = 0.123456789\ncached_input = 0\noutput = 0\n[models."r"]\ninput = 2\ncached_input = 0\noutput = 0\n'
    out = _bill(tmp_path, capsys, prices, [
        {"v": 2, "record_id": "a", "tenant": "big", "model": "m", "prompt_tokens": MAX_COUNT, "completion_tokens": 0},
        {"v": 2, "record_id": "b", "tenant": "round", "model": "r", "prompt_tokens": 50_000_000, "completion_tokens": 0}])
    report = json.loads(out, parse_float=Decimal)
    exact = Decimal(MAX_COUNT) * Decimal("0.123456789") / 10**6
    assert report["tenants"]["big"]["cost"] == exact and len(exact.as_tuple().digits) == 28
    assert report["tenants"]["round"]["cost"] == 100
    assert report["total"]["cost"] == exact + 100
    assert all(re.fullmatch(r"\d+(\.\d+)?", cost) for cost in re.findall(r'"cost": ([^,\n]+)', out)), out


def test_a_price_of_minus_zero_bills_zero_not_minus_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _bill(tmp_path, capsys, "[default]\ninput = -0.0\ncached_input = -0.0\noutput = -0.0\n",
                [{"v": 2, "record_id": "a", "tenant": "t", "model": "m", "prompt_tokens": 5, "completion_tokens": 2}])
    assert set(re.findall(r'"cost": ([^,\n]+)', out)) == {"0"}, out


def test_a_priced_bill_over_no_record_costs_zero_not_no_price(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A period with no usage, priced: the bill is 0. A null cost means "a model without a
    price" (docs/ACCOUNTING.md); a billing script must not read an idle month as one."""
    (tmp_path / "usage.jsonl").write_bytes(orjson.dumps(
        {"v": 2, "record_id": "a", "tenant": "t", "model": "m", "prompt_tokens": 5, "completion_tokens": 2,
         "start_time": "2026-11-01T00:00:00+00:00"}) + b"\n")
    (tmp_path / "prices.toml").write_text("[default]\ninput = 1\ncached_input = 0\noutput = 1\n")
    assert main(["report", str(tmp_path / "usage.jsonl"), "--prices", str(tmp_path / "prices.toml"),
                 "--since", "2026-12-01T00:00:00+00:00", "--json"]) == 0
    report = json.loads(capsys.readouterr().out, parse_float=Decimal)
    assert (report["total"]["requests"], report["total"]["cost"], report["unpriced_models"]) == (0, 0, [])
