"""`cachetally bench cache` against `cachetally serve --engine sim` on loopback.

Tiny counts, and no timing assertions: the sim has no prefill cost, so its TTFT says
nothing about the cache. What is asserted is what the bench reports about the cache.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.bench.cache import api_base, matplotlib_missing
from proxy.server.cli import main
from tests.servers import running_server

pytestmark = pytest.mark.loopback

BLOCK = 16  # the sim's default block size


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with running_server(["-m", "proxy.server.cli", "serve", "--engine", "sim", "--log-level", "warning"]) as (url, _):
        yield url


def bench(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["bench", "cache", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_reports_cold_warm_and_prefix(base_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = bench(capsys, "--url", base_url, "--prompt-tokens", "64", "--repeats", "2", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["model"] == "sim-model"  # the first id from /v1/models
    assert (report["prompt_tokens_target"], report["repeats"]) == (64, 2)
    requests = report["requests"]
    assert [r["kind"] for r in requests] == ["cold", "warm", "warm", "prefix", "prefix"]
    for r in requests:
        assert set(r) == {"kind", "prompt_tokens", "cached_tokens", "cached_fraction", "ttft_ms"}
        assert r["prompt_tokens"] > 64 and r["ttft_ms"] > 0
        assert r["cached_fraction"] == round(r["cached_tokens"] / r["prompt_tokens"], 4)
    cold, warm, prefix = requests[0], requests[1:3], requests[3:]
    assert cold["cached_tokens"] == 0
    for r in warm:
        assert r["prompt_tokens"] == cold["prompt_tokens"]
        assert r["cached_tokens"] == (r["prompt_tokens"] - 1) // BLOCK * BLOCK > 0
    for r in prefix:  # only the shared first half hits
        assert 0 < r["cached_tokens"] < warm[0]["cached_tokens"]

    summary = report["summary"]
    prompt = sum(r["prompt_tokens"] for r in requests)
    cached = sum(r["cached_tokens"] for r in requests)
    assert (summary["requests"], summary["total_prompt_tokens"], summary["total_cached_tokens"]) == (
        5,
        prompt,
        cached,
    )
    assert summary["token_hit_rate"] == round(cached / prompt, 4) > 0
    for key in ("ttft_cold_ms", "ttft_warm_ms", "ttft_prefix_ms", "ttft_warm_over_cold", "ttft_prefix_over_cold"):
        assert summary[key] > 0


def test_table_has_a_row_per_request_and_the_summary(
    base_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = bench(capsys, "--url", f"{base_url}/v1", "--model", "sim-model", "--prompt-tokens", "40",
                         "--repeats", "1")
    assert code == 0
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("kind"))
    assert lines[header].split() == ["kind", "prompt_tokens", "cached_tokens", "cached", "%", "TTFT", "ms"]
    rows = [line.split() for line in lines[header + 1 : header + 4]]
    assert [row[0] for row in rows] == ["cold", "warm", "prefix"]
    assert rows[0][2] == "0" and int(rows[1][2]) > 0
    assert any(line.startswith("token hit rate: ") for line in lines)
    assert any("warm/cold: " in line for line in lines)


def test_plot(base_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "ttft.png"
    code, _, err = bench(capsys, "--url", base_url, "--prompt-tokens", "32", "--repeats", "1", "--plot", str(png))
    if matplotlib_missing():
        assert code == 2
        assert "pip install matplotlib" in err
        assert not png.exists()
    else:
        assert code == 0
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("name", "says", "code"),
    [
        ("ttft.txt", "ttft.txt' does not end in .png, .svg, .pdf", 2),  # before any request
        ("no-such-dir/ttft.png", "cannot write the plot", 2),  # after the figures, which are printed
    ],
)
def test_a_plot_that_cannot_be_drawn_is_one_line_not_a_traceback(
    base_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, says: str, code: int
) -> None:
    if matplotlib_missing():
        pytest.skip("matplotlib is not installed")
    argv = ["--url", base_url, "--prompt-tokens", "32", "--repeats", "1", "--plot", str(tmp_path / name)]
    try:
        got, _, err = bench(capsys, *argv)
    except SystemExit as exit_info:  # argparse's refusal
        got, err = exit_info.code, capsys.readouterr().err
    assert got == code
    assert says in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("url", ["localhost:8000", "127.0.0.1:8000", "ftp://127.0.0.1", "http://"])
def test_a_url_without_its_scheme_is_refused_in_words_not_as_a_connection_error(
    capsys: pytest.CaptureFixture[str], url: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "cache", "--url", url])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --url: {url!r} is not an http:// or https:// URL" in err and "Connection error" not in err


def test_unreachable_server_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = bench(capsys, "--url", "http://127.0.0.1:9", "--repeats", "1")
    assert code == 1
    assert err.startswith("cachetally bench cache: http://127.0.0.1:9: ")


def test_api_base() -> None:
    assert api_base("http://h:1") == api_base("http://h:1/") == api_base("http://h:1/v1/") == "http://h:1/v1"
