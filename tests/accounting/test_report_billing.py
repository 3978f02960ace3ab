"""``cachetally report`` as a billing team runs it: the files of several replicas, copies
gathered twice, torn last lines, hand-edited figures and prices with decimals. Each bill
is checked against a plain sum over the lines, computed here, not by the report's code."""

from __future__ import annotations

import json
import os
from decimal import Decimal
from pathlib import Path

import orjson
import pytest

from proxy.server.cli import main


def test_a_figure_past_what_a_record_holds_is_not_counted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A hand-edited or corrupt 2**64 - 1 is an integer to JSON readers, but no record holds
    it: it billed 18 quintillion prompt tokens, 9.2 trillion at 0.5 per million."""
    good = {"record_id": "good", "tenant": "acme", "model": "m", "prompt_tokens": 1000, "completion_tokens": 0}
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


def test_a_file_that_cannot_be_read_is_an_error_in_words(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A listed file unreadable when read (here a directory named like one; also a file
    the writer's 0640 keeps from the billing user, or one removed meanwhile) ended in a
    traceback; it must say which and exit 2, never print a bill without it."""
    (tmp_path / "usage").mkdir()
    (tmp_path / "usage" / "a.jsonl").write_bytes(b'{"tenant": "acme", "model": "m", "prompt_tokens": 5}\n')
    (tmp_path / "usage" / "b.jsonl").mkdir()
    assert main(["report", str(tmp_path / "usage"), "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"cannot read {tmp_path / 'usage' / 'b.jsonl'}: Is a directory" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_an_unreadable_directory_is_an_error_not_an_empty_bill(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """glob reads a directory it may not list as an empty one: a zero bill, exit 0."""
    (tmp_path / "usage").mkdir()
    (tmp_path / "usage" / "a.jsonl").write_bytes(b'{"tenant": "acme", "model": "m", "prompt_tokens": 5}\n')
    (tmp_path / "usage").chmod(0o300)
    try:
        assert main(["report", str(tmp_path / "usage"), "--json"]) == 2
    finally:
        (tmp_path / "usage").chmod(0o700)
    assert "Permission denied" in capsys.readouterr().err
