"""``cachetally report``: totals per tenant x model, cost from per-million prices, JSON,
a torn last line skipped and counted, and a PNG plot."""

from __future__ import annotations

import io
import json
import re
import sys
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import orjson
import pytest

from proxy.accounting.records.prices import PriceList
from proxy.server.cli import main


def write(path: Path, records: list[dict], tail: bytes = b"") -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records) + tail)
    return path


def rec(tenant: str, model: str, prompt: int | None, cached: int | None, completion: int, outcome: str = "completed") -> dict:
    return {"v": 1, "tenant": tenant, "model": model, "prompt_tokens": prompt, "cached_tokens": cached,
            "completion_tokens": completion, "outcome": outcome}


RECORDS = [
    rec("acme", "m1", 1000, 600, 100),
    rec("acme", "m1", 500, 0, 50, "disconnected"),
    rec("acme", "m2", 2000, 2000, 10),
    rec("zeta", "m1", None, None, 7, "disconnected"),  # refused or abandoned before the engine
    rec("zeta", "m1", 300, None, 20),  # cache unknown: billed as uncached input
]

PRICES = """
[default]
input = 2.0
cached_input = 0.5
output = 10.0

[models.m2]
input = 1.0
"""


def test_totals_cost_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one = write(tmp_path / "a.jsonl", RECORDS[:3])
    (tmp_path / "dir").mkdir()
    write(tmp_path / "dir" / "b.jsonl", RECORDS[3:], tail=b'{"tenant": "acme", "mod')  # a torn last line
    prices = tmp_path / "prices.toml"
    prices.write_text(PRICES)
    assert main(["report", str(one), str(tmp_path / "dir"), "--prices", str(prices), "--json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert "skipped 1 line" in err
    assert (report["files"], report["records"], report["skipped_lines"]) == (2, 5, 1)
    # acme/m2 was wholly cached (an upstream may say so): not more than its prompt, not clamped.
    assert report["clamped"] == 0 and "more cached tokens" not in err
    rows = {(r["tenant"], r["model"]): r for r in report["rows"]}
    acme_m1 = rows["acme", "m1"]
    assert (acme_m1["requests"], acme_m1["disconnected"], acme_m1["prompt_tokens"], acme_m1["cached_tokens"],
            acme_m1["uncached_tokens"], acme_m1["completion_tokens"]) == (2, 1, 1500, 600, 900, 150)
    assert acme_m1["hit_ratio"] == 0.4
    # per million: 900 uncached x 2.0 + 600 cached x 0.5 + 150 output x 10.0
    assert acme_m1["cost"] == pytest.approx((900 * 2.0 + 600 * 0.5 + 150 * 10.0) / 1e6)
    # m2 overrides input only; cached_input and output come from [default]
    assert rows["acme", "m2"]["cost"] == pytest.approx((0 * 1.0 + 2000 * 0.5 + 10 * 10.0) / 1e6)
    zeta = rows["zeta", "m1"]
    assert (zeta["requests"], zeta["prompt_tokens"], zeta["cached_tokens"], zeta["completion_tokens"]) == (2, 300, 0, 27)
    assert report["tenants"]["acme"]["prompt_tokens"] == 3500
    assert report["total"]["completion_tokens"] == 187
    # The bill, by hand: acme m1 3,600 + acme m2 1,100 + zeta m1 (300 x 2.0 + 27 x 10.0) 870, per million.
    assert report["total"]["cost"] == pytest.approx(5570 / 1e6)
    assert report["tenants"]["zeta"]["cost"] == pytest.approx(870 / 1e6)
    # zeta's first streamed 7 tokens with no prompt count (a stream cut before its usage chunk
    # upstream): its prompt is in no total, and the operator is told how many such records.
    assert report["unknown_prompts"] == 1
    assert "1 record(s) generated tokens with no prompt_tokens" in err


@pytest.mark.parametrize("line", [
    b'{"x": 1}',  # any object
    b'{"level": "info", "tenant": "acme", "model": "m1", "msg": "served"}',  # another log's line
    b'{"v": true, "tenant": "acme", "model": "m1", "prompt_tokens": 5}',  # a boolean for the version
    b'{"v": 0, "tenant": "acme", "model": "m1", "prompt_tokens": 5}',  # schemas start at 1
    b'{"v": 2, "tenant": null, "model": "m1", "prompt_tokens": 5}',
    b'{"v": 2, "tenant": "acme", "prompt_tokens": 5}',
    b'[1, 2]',
])
def test_a_line_that_is_not_a_usage_record_bills_nothing_and_is_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: bytes
) -> None:
    """A file of another log given by mistake (or one line of it) bills no request to anyone."""
    path = write(tmp_path / "a.jsonl", RECORDS[:1], tail=line + b"\n")
    assert main(["report", str(path), "--json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert (report["records"], report["skipped_lines"], report["total"]["requests"]) == (1, 1, 1)
    assert [(r["tenant"], r["model"]) for r in report["rows"]] == [("acme", "m1")]
    assert "skipped 1 line(s) that are not records" in err


def test_a_record_that_generated_nothing_is_no_unknown_prompt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before the engine (no prompt count, 0 or null tokens generated) is not a prompt
    missing from the totals; one generated token with no prompt count is."""
    refused = [rec("acme", "m1", None, None, 0, "refused"), {**rec("acme", "m1", None, None, 0), "completion_tokens": None}]
    path = write(tmp_path / "a.jsonl", [*refused, rec("acme", "m1", None, None, 1, "disconnected")])
    assert main(["report", str(path), "--json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert (report["records"], report["unknown_prompts"]) == (3, 1)
    assert "1 record(s) generated tokens with no prompt_tokens" in err


def test_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "a.jsonl", RECORDS)
    png = tmp_path / "out.png"
    assert main(["report", str(path), "--plot", str(png)]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert err.splitlines()[-1] == f"cachetally report: plot written to {png}"
    assert lines[0].split() == ["tenant", "model", "requests", "disconnected", "prompt", "cached", "completion", "hit_ratio"]
    assert lines[1].split() == ["acme", "m1", "2", "1", "1500", "600", "150", "0.4000"]
    assert lines[-2].split()[:3] == ["TOTAL", "5", "2"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [("[default]\ninput = -1\ncached_input = 0\noutput = 0\n", "input must be a number"),
     ("[default]\ninput = 1\n", "cached_input must be"),
     ("[defaults]\ninput = 1\n", "1 unknown table.*, such as defaults;"),
     ("[default]\ninput = 1\ncached_input = 1\noutput = 1\nextra = 2\n", "only input"),
     ("[default]\ninput = true\ncached_input = 0\noutput = 0\n", "input must be a number"),  # not 1
     ("[models]\nm1 = 5\n", "only input"),  # a price where a model's table goes
     ("", "no prices"),
     ("[models]\n", "no prices")],
)
def test_bad_prices_are_refused(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        PriceList.load(path)


def test_the_api_keys_file_given_as_prices_is_refused_without_printing_a_key(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text('"sk-live-2f0c" = "acme"\n"sk-live-9ab1" = "globex"\n')
    with pytest.raises(ValueError, match="2 unknown table") as info:
        PriceList.load(path)
    assert "sk-live" not in str(info.value)


@pytest.mark.parametrize(("text", "says"), [
    ("[sk-live-2f0c]\n[sk-live-2f0c]\n", "not valid TOML at line 2: Cannot declare a name twice"),
    ('[default]\ninput = "sk-live-2f0c\n', "not valid TOML at line 2: "),
])
def test_a_prices_file_that_is_not_toml_is_refused_at_its_line_without_quoting_it(
    tmp_path: Path, text: str, says: str
) -> None:
    """tomllib's own message quoted the file ("Cannot declare ('sk-live-2f0c',) twice")."""
    path = tmp_path / "prices.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"cannot read prices {path}: {says}")) as info:
        PriceList.load(path)
    assert "sk-live" not in str(info.value)
    assert "column" not in str(info.value)  # the line said once, not the parser's "(at line 2, column 14)" again


def test_since_and_until_select_requests_by_start_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    times = ["2026-10-31T23:59:59.999999Z", "2026-11-01T00:00:00Z", "2026-11-15T12:00:00.5Z", "2026-12-01T00:00:00Z"]
    path = write(tmp_path / "a.jsonl", [{**rec("acme", "m", 10, 0, 1), "start_time": t} for t in times])
    assert main(["report", str(path), "--since", "2026-11-01", "--until", "2026-12-01T00:00:00+00:00", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["records"] == 2
    assert main(["report", str(path), "--since", "2026-11-01T01:00:00+01:00", "--json"]) == 0  # = 00:00 UTC
    assert json.loads(capsys.readouterr().out)["records"] == 3
    assert main(["report", str(path), "--until", "2026-11-15T12:00:00.5Z", "--json"]) == 0  # an end alone
    assert json.loads(capsys.readouterr().out)["records"] == 2


def test_cache_writes_have_their_own_price_and_default_to_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Anthropic prices cache writes above fresh input: 1000 prompt tokens, 200 read, 700
    written (the rest, 100, fresh); writes never exceed the uncached tokens."""
    records = [{**rec("acme", "m1", 1000, 200, 10), "cache_creation_tokens": 700},
               {**rec("acme", "m2", 100, 90, 0), "cache_creation_tokens": 50}]  # clamped to 10
    usage = write(tmp_path / "a.jsonl", records)
    prices = tmp_path / "prices.toml"
    prices.write_text(PRICES + "\n[models.m1]\ncache_write_input = 2.5\n")
    assert main(["report", str(usage), "--prices", str(prices), "--json"]) == 0
    rows = {r["model"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert (rows["m1"]["uncached_tokens"], rows["m1"]["cache_write_tokens"]) == (800, 700)
    assert rows["m1"]["cost"] == pytest.approx((100 * 2.0 + 700 * 2.5 + 200 * 0.5 + 10 * 10.0) / 1e6)
    assert rows["m2"]["cache_write_tokens"] == 10
    # no cache_write_input for m2: writes cost what fresh input costs
    assert rows["m2"]["cost"] == pytest.approx((10 * 1.0 + 90 * 0.5) / 1e6)


def test_a_total_over_a_model_with_no_price_has_no_cost_and_says_which(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A partial sum read as the whole bill undercharges: no [default], m2 has no table."""
    path = write(tmp_path / "a.jsonl", [rec("acme", "m1", 1000, 0, 0), rec("acme", "m2", 1000, 0, 0),
                                        rec("zeta", "m1", 1000, 0, 0)])
    prices = tmp_path / "prices.toml"
    prices.write_text('[models.m1]\ninput = 1.0\ncached_input = 0.1\noutput = 2.0\n')
    assert main(["report", str(path), "--prices", str(prices), "--json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    rows = {(r["tenant"], r["model"]): r["cost"] for r in report["rows"]}
    assert rows == {("acme", "m1"): pytest.approx(1000 / 1e6), ("acme", "m2"): None, ("zeta", "m1"): pytest.approx(1000 / 1e6)}
    assert (report["tenants"]["acme"]["cost"], report["total"]["cost"]) == (None, None)
    assert report["tenants"]["zeta"]["cost"] == pytest.approx(1000 / 1e6)
    assert report["unpriced_models"] == ["m2"] and "no price for model(s) m2" in err


def test_more_cached_tokens_than_the_prompt_never_bill_a_negative_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Records an upstream's claim wrote before cachetally stopped believing it."""
    path = write(tmp_path / "a.jsonl", [rec("acme", "m", 159, 10_000_000, 0), rec("acme", "m", 100, 50, 0)])
    prices = tmp_path / "prices.toml"
    prices.write_text("[default]\ninput = 10.0\ncached_input = 1.0\noutput = 2.0\n")
    assert main(["report", str(path), "--prices", str(prices), "--json"]) == 0
    out, err = capsys.readouterr()
    [row] = json.loads(out)["rows"]
    assert (row["prompt_tokens"], row["cached_tokens"], row["uncached_tokens"]) == (259, 209, 50)
    assert row["cost"] == pytest.approx((50 * 10.0 + 209 * 1.0) / 1e6)
    assert json.loads(out)["clamped"] == 1 and "1 record(s) report more cached tokens" in err


def test_a_file_named_twice_is_read_once_even_without_record_ids(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Schema-1 records have no record_id: only the file's identity tells a re-read apart."""
    (tmp_path / "usage").mkdir()
    path = write(tmp_path / "usage" / "old.jsonl", RECORDS)
    (tmp_path / "link.jsonl").symlink_to(path)
    assert main(["report", str(tmp_path / "usage"), str(path), str(tmp_path / "link.jsonl"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["files"], report["records"], report["total"]["prompt_tokens"]) == (1, 5, 3800)


def test_a_record_id_read_twice_with_different_figures_is_counted_once_and_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same record gathered twice is one request; the same id with other figures (a file
    edited, two writers minting one id) is too, but the bill must say it is not a plain copy."""
    first = {**rec("acme", "m", 10, 0, 1), "record_id": "r1"}
    other = {**first, "prompt_tokens": 50_000}
    write(tmp_path / "a.jsonl", [first, {**rec("acme", "m", 5, 0, 1), "record_id": "r2"}])
    write(tmp_path / "b.jsonl", [first, other])
    assert main(["report", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert (report["records"], report["total"]["prompt_tokens"]) == (2, 15)
    assert (report["duplicates"], report["conflicting_duplicates"]) == (2, 1)
    assert "1 of them differ from the first read of their record_id" in err


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prompt_tokens", -1000),  # would lower the bill, and show a negative cached total
        ("cached_tokens", -5),
        ("completion_tokens", -100),
        ("cache_creation_tokens", -1),
        ("prompt_tokens", 1000.0),  # would bill nothing for a prompt it names
        ("completion_tokens", "100"),
        ("prompt_tokens", True),  # would bill one token
        ("prompt_tokens", 10**30),  # past 64 bits: JSON readers (orjson) give a float
    ],
)
def test_a_record_whose_figure_is_not_a_count_is_added_to_no_total_and_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: object
) -> None:
    good = {**rec("acme", "m", 1000, 0, 100), "record_id": "good"}
    bad = {**rec("acme", "m", 1000, 0, 100), "record_id": "bad", field: value}
    path = tmp_path / "a.jsonl"
    path.write_bytes(orjson.dumps(good) + b"\n" + json.dumps(bad).encode() + b"\n")
    prices = tmp_path / "prices.toml"
    prices.write_text("[default]\ninput = 1.0\ncached_input = 0.1\noutput = 2.0\n")
    assert main(["report", str(path), "--prices", str(prices), "--json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    total = report["total"]
    assert (report["records"], report["invalid_records"]) == (1, 1)
    assert (total["prompt_tokens"], total["cached_tokens"], total["completion_tokens"]) == (1000, 0, 100)
    assert total["cost"] == pytest.approx((1000 * 1.0 + 100 * 2.0) / 1e6)
    assert "1 record(s) with a token figure that is not a count" in err


def test_with_a_period_a_record_without_a_readable_start_time_is_counted_as_undated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No offset reads as UTC (as --since does); none, or an unreadable one, is said, not
    silently left out (before: a traceback for the first, silence for the others)."""
    records = [{**rec("acme", "m", 10, 0, 1), "start_time": "2026-11-15T00:00:00"},
               rec("acme", "m", 20, 0, 1),
               {**rec("acme", "m", 40, 0, 1), "start_time": "yesterday"}]
    path = write(tmp_path / "a.jsonl", records)
    assert main(["report", str(path), "--since", "2026-11-01", "--json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert (report["records"], report["undated"], report["total"]["prompt_tokens"]) == (1, 2, 10)
    assert "2 record(s) with no readable start_time" in err
    assert main(["report", str(path), "--json"]) == 0  # without a period every record counts
    assert json.loads(capsys.readouterr().out)["records"] == 3


def test_a_plot_that_cannot_be_written_is_said_in_words(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a FileNotFoundError traceback from matplotlib, after the table."""
    path = write(tmp_path / "a.jsonl", [rec("acme", "m", 10, 0, 1)])
    assert main(["report", str(path), "--plot", str(tmp_path / "no-such-dir" / "u.png")]) == 2
    err = capsys.readouterr().err
    assert "cannot write the plot" in err and "No such file or directory" in err and "Traceback" not in err


def test_a_plot_in_a_format_matplotlib_cannot_write_is_refused_before_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a ValueError traceback from matplotlib ("Format 'txt' is not supported"), after the table."""
    path = write(tmp_path / "a.jsonl", [rec("acme", "m", 10, 0, 1)])
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(path), "--plot", str(tmp_path / "usage.txt")])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "does not end in .png, .svg, .pdf" in err and "Traceback" not in err
    assert not (tmp_path / "usage.txt").exists()


def test_a_directory_with_no_usage_file_is_said(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Files one folder down (one per host) were read as an empty bill, without a word."""
    (tmp_path / "host-a").mkdir()
    write(tmp_path / "host-a" / "usage.jsonl", [rec("acme", "m", 10, 0, 1)])
    assert main(["report", str(tmp_path), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["records"] == 0
    assert f"{tmp_path} holds no *.jsonl file" in err


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("threshold", "shown"), [(1, True), (1 << 30, False)])
def test_on_a_terminal_an_input_over_the_threshold_shows_a_progress_bar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threshold: int, shown: bool
) -> None:
    """Reading gigabytes of records says how far it got; a small input gets no bar (the
    threshold is made tiny here; it is 16 MiB)."""
    from proxy.accounting.records import report_cli

    monkeypatch.setattr(report_cli, "PROGRESS_BYTES", threshold)
    monkeypatch.setattr(sys, "stderr", terminal := Terminal())
    path = write(tmp_path / "a.jsonl", [rec("acme", "m", 10, 0, 1)])
    assert main(["report", str(path), "--json"]) == 0
    assert ("reading" in terminal.getvalue()) == shown


def test_an_unreadable_period_is_refused_in_words(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "a.jsonl", [rec("acme", "m", 10, 0, 1)])
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(path), "--since", "yesterday"])
    assert exit_info.value.code == 2
    assert "not an ISO 8601 time: 'yesterday'" in capsys.readouterr().err


@pytest.mark.parametrize("until", ["2026-10-31T23:59:59", "2026-10-01", "2026-11-01"])  # the last: empty
def test_a_period_that_ends_before_it_starts_is_refused_not_billed_as_zero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], until: str
) -> None:
    path = write(tmp_path / "a.jsonl", [{**rec("acme", "m", 10, 0, 1), "start_time": "2026-11-15T00:00:00Z"}])
    assert main(["report", str(path), "--since", "2026-11-01", "--until", until, "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    until_utc = until + ("" if "T" in until else "T00:00:00") + "+00:00"
    assert err == f"cachetally report: --since 2026-11-01T00:00:00+00:00 is not before --until {until_utc}\n"


def test_copies_of_an_invalid_or_undated_record_are_said_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Files gathered twice (the case ``record_id`` is for) must not double what the report
    says is wrong: one invalid and one undated record, each read from two copies of a file,
    are one of each, and their copies are duplicates."""
    records = [{**rec("acme", "m", 10, 0, 1), "record_id": "ok", "start_time": "2026-11-15T00:00:00Z"},
               {**rec("acme", "m", -10, 0, 1), "record_id": "bad", "start_time": "2026-11-15T00:00:00Z"},
               {**rec("acme", "m", 40, 0, 1), "record_id": "nodate"}]
    first, second = write(tmp_path / "a.jsonl", records), write(tmp_path / "b.jsonl", records)
    assert main(["report", str(first), str(second), "--since", "2026-11-01", "--json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert (report["records"], report["invalid_records"], report["undated"], report["duplicates"]) == (1, 1, 1, 3)
    assert "1 record(s) with a token figure that is not a count" in err
    assert "1 record(s) with no readable start_time" in err


@pytest.mark.parametrize(("price", "message"), [
    ("1e999999999999999999", "input must be a number >= 0, below 1e100"),  # overflowed: a traceback
    ("1e-999999999999999999", "with at most 100 decimals"),  # MemoryError
    ("1" * 101, "below 1e100"),
])
def test_a_price_too_wide_to_bill_is_refused_in_words_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], price: str, message: str
) -> None:
    usage = write(tmp_path / "a.jsonl", RECORDS)
    prices = tmp_path / "prices.toml"
    prices.write_text(f"[default]\ninput = {price}\ncached_input = 0.5\noutput = 10.0\n")
    assert main(["report", str(usage), "--prices", str(prices), "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err


def test_prices_with_many_decimals_bill_to_the_last_digit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """100 decimals, trailing zeros past them, and a price just below 1e100 are all billed exactly."""
    decimals = "0." + "0" * 99 + "1" + "000"
    usage = write(tmp_path / "a.jsonl", [rec("acme", "m1", 2**63 - 1, 0, 2**63 - 1)])
    prices = tmp_path / "prices.toml"
    prices.write_text(f"[default]\ninput = {decimals}\ncached_input = 0\noutput = {'9' * 100}\n")
    assert main(["report", str(usage), "--prices", str(prices), "--json"]) == 0
    cost = json.loads(capsys.readouterr()[0], parse_float=Decimal)["total"]["cost"]
    tokens = 2**63 - 1  # by hand, in fractions: tokens x 10**-100 + tokens x (10**100 - 1), per million
    assert Fraction(cost) == (Fraction(tokens, 10**100) + tokens * (10**100 - 1)) / 10**6


def test_a_models_key_that_is_not_a_table_is_refused_in_words(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text("models = 3\n[default]\ninput = 1\ncached_input = 0\noutput = 1\n")
    with pytest.raises(ValueError, match="models holds tables"):
        PriceList.load(path)


def test_a_folder_beside_the_usage_files_is_said_unless_it_is_named_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another host's records gathered into a folder beside this host's files were left out of
    the bill without a word."""
    write(tmp_path / "usage-a.jsonl", [rec("acme", "m1", 10, 0, 1)])
    (tmp_path / "host-b" / "2026-11").mkdir(parents=True)
    write(tmp_path / "host-b" / "2026-11" / "usage-b.jsonl", [rec("zeta", "m1", 20, 0, 2)])
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path), "--json"]) == 0
    out, err = capsys.readouterr()
    assert [row["tenant"] for row in json.loads(out)["rows"]] == ["acme"]
    assert err.splitlines() == [f"cachetally report: {tmp_path / 'host-b'} holds *.jsonl files that are not read "
                                "(name it to bill them)"]
    assert main(["report", str(tmp_path), str(tmp_path / "host-b" / "2026-11"), "--json"]) == 0
    out, err = capsys.readouterr()
    assert ([row["tenant"] for row in json.loads(out)["rows"]], err) == (["acme", "zeta"], "")
