"""`/metrics`, `/stats`, the debug stats line and `return_cached_tokens_details`, on loopback.

`cachetally serve --engine sim --log-level debug` gets a known sequence of requests:
chat and completions, JSON and SSE, cold and warm, a stream without `include_usage`, an
`n=2` chat, a two-prompt completions request, and two 400s. Afterwards every counter and
histogram on `/metrics` equals the sum of what the responses reported, `/stats` says the
same, the log has one stats line per counted request, and no prompt text reached the log.
"""

from __future__ import annotations

import re
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from tests.clients import ask, expected_stats, scrape
from tests.servers import metric_value, running_server

pytestmark = pytest.mark.loopback

MODEL = "sim-model"
MARKER = f"zqxmarker{uuid.uuid4().hex}"  # in every prompt; must never reach the log
BLOCK = 16  # the sim's default block size


def prompt(words: int = 120) -> str:
    """A prompt new to the cache (its first word is unique), carrying the marker."""
    return " ".join([uuid.uuid4().hex, MARKER, *(f"w{i}" for i in range(words))])


@dataclass(frozen=True, slots=True)
class Seen:
    """One counted request: the figures its response reported (or the engine's, if none)."""

    route: str
    stream: bool
    prompt_tokens: int
    cached_tokens: int

    @property
    def cache(self) -> str:
        return "hit" if self.cached_tokens > 0 else "miss"


def call(client: openai.OpenAI, route: str, stream: bool, text: str | list[str], **kw: Any) -> Any:
    return ask(client, route, stream, text, model=MODEL, **kw)


def record(seen: list[Seen], route: str, stream: bool, usage: Any) -> Seen:
    item = Seen(route, stream, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens)
    seen.append(item)
    return item


@dataclass(slots=True)
class Sequence:
    seen: list[Seen]
    metrics: str
    stats: dict[str, Any]
    log: str


@pytest.fixture(scope="module")
def sequence(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sequence]:
    log_path = tmp_path_factory.mktemp("observability") / "serve.log"
    args = ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--log-level", "debug"]
    with (
        running_server(args, log_path=log_path) as (url, _),
        openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        seen: list[Seen] = []
        for route in ("chat", "completions"):
            for stream in (False, True):
                text = prompt()
                cold = record(seen, route, stream, call(client, route, stream, text))
                warm = record(seen, route, stream, call(client, route, stream, text))
                assert (cold.cached_tokens, warm.prompt_tokens) == (0, cold.prompt_tokens)
                assert warm.cached_tokens == (warm.prompt_tokens - 1) // BLOCK * BLOCK

        # A stream whose client asked for no usage is still counted: the engine's figures.
        chat_text = prompt()
        record(seen, "chat", False, call(client, "chat", False, chat_text))
        text = scrape(url)
        before = (
            metric_value(text, "sim_prompt_tokens_total"),
            metric_value(text, "sim_prompt_tokens_cached_total"),
        )
        assert call(client, "chat", True, chat_text, include_usage=False) is None
        text = scrape(url)
        prompt_tokens = metric_value(text, "sim_prompt_tokens_total") - before[0]
        cached_tokens = metric_value(text, "sim_prompt_tokens_cached_total") - before[1]
        assert cached_tokens > 0
        seen.append(Seen("chat", True, int(prompt_tokens), int(cached_tokens)))

        # n=2: both choices share one prompt, counted once.
        n_text = prompt()
        cold = record(seen, "chat", False, call(client, "chat", False, n_text, n=2))
        warm = record(seen, "chat", True, call(client, "chat", True, n_text, n=2))
        assert (cold.cached_tokens, warm.prompt_tokens) == (0, cold.prompt_tokens)
        assert warm.cached_tokens > 0

        # Two prompts in one completions request: summed over both.
        pair = [prompt(40), prompt(50)]
        cold = record(seen, "completions", False, call(client, "completions", False, pair))
        warm = record(seen, "completions", True, call(client, "completions", True, pair))
        assert (cold.cached_tokens, warm.prompt_tokens) == (0, cold.prompt_tokens)
        assert warm.cached_tokens > 0

        # Rejected requests are not counted: one by the engine, one by the proxy.
        with pytest.raises(openai.BadRequestError):
            call(client, "chat", False, prompt(), n=0)
        bad = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "' + MARKER.encode())
        assert bad.status_code == 400

        # The last stats line is written as its response ends: wait for it, then read.
        deadline = time.monotonic() + 5
        while (stats := httpx.get(f"{url}/stats").json())["total_requests"] < len(seen):
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
        yield Sequence(seen, scrape(url), stats, log_path.read_text())


def test_counters_equal_what_the_responses_reported(sequence: Sequence) -> None:
    text, seen = sequence.metrics, sequence.seen
    prompt_total = sum(s.prompt_tokens for s in seen)
    cached_total = sum(s.cached_tokens for s in seen)
    assert metric_value(text, "cachetally_prompt_tokens_total") == prompt_total
    assert metric_value(text, "cachetally_prompt_tokens_total", model=MODEL) == prompt_total
    for tier in ("all", "local"):
        assert metric_value(text, "cachetally_cached_tokens_total", source="engine", tier=tier) == cached_total
    assert metric_value(text, "cachetally_cached_tokens_total", source="engine", tier="external") == 0
    assert metric_value(text, "cachetally_cached_tokens_total", source="upstream") == 0
    # ... and the engine's own counters agree.
    assert metric_value(text, "sim_prompt_tokens_total") == prompt_total
    assert metric_value(text, "sim_prompt_tokens_cached_total") == cached_total


def test_requests_are_counted_once_per_cache_outcome(sequence: Sequence) -> None:
    text = sequence.metrics
    expected = Counter((s.route, "true" if s.stream else "false", s.cache) for s in sequence.seen)
    assert {"hit", "miss"} == {cache for _, _, cache in expected}
    for route in ("chat", "completions"):
        for stream in ("true", "false"):
            for cache in ("hit", "miss", "unknown"):
                labels = {"route": route, "stream": stream, "cache": cache}
                got = metric_value(text, "cachetally_requests_total", model=MODEL, **labels)
                assert got == expected[(route, stream, cache)], labels
    assert metric_value(text, "cachetally_requests_total") == len(sequence.seen)


def test_histograms_count_every_request(sequence: Sequence) -> None:
    text, seen = sequence.metrics, sequence.seen
    cached = "cachetally_request_cached_tokens"
    ratio = "cachetally_request_cache_hit_ratio"
    assert metric_value(text, f"{cached}_count", model=MODEL) == len(seen)
    assert metric_value(text, f"{cached}_sum", model=MODEL) == sum(s.cached_tokens for s in seen)
    assert metric_value(text, f"{cached}_bucket", le="0.0") == sum(s.cache == "miss" for s in seen)
    assert metric_value(text, f"{ratio}_count", model=MODEL) == len(seen)
    ratios = [s.cached_tokens / s.prompt_tokens for s in seen]
    assert metric_value(text, f"{ratio}_sum", model=MODEL) == pytest.approx(sum(ratios))
    assert metric_value(text, f"{ratio}_bucket", le="0.0") == sum(s.cache == "miss" for s in seen)
    assert metric_value(text, f"{ratio}_bucket", le="+Inf") == len(seen)


def test_no_anomalies_and_no_open_slots(sequence: Sequence) -> None:
    text = sequence.metrics
    for name in (
        "cachetally_ledger_open_slots",
        "cachetally_ledger_evicted_total",
        "cachetally_events_unmatched_total",
        "cachetally_cached_tokens_mismatch_total",
        "cachetally_patch_skipped_total",
    ):
        assert metric_value(text, name) == 0, name


def seen_stats(seen: list[Seen]) -> dict[str, Any]:
    return expected_stats((s.prompt_tokens, s.cached_tokens) for s in seen)


def test_stats_agree_with_the_responses(sequence: Sequence) -> None:
    assert sequence.stats == seen_stats(sequence.seen)


_STATS_LINE = re.compile(r"prefix cache stats: (.*)$", re.MULTILINE)


def test_debug_log_has_one_stats_line_per_request_and_no_prompt_text(sequence: Sequence) -> None:
    lines = [dict(field.split("=") for field in m.group(1).split()) for m in _STATS_LINE.finditer(sequence.log)]
    assert len(lines) == len(sequence.seen)
    assert [int(line["total_requests"]) for line in lines] == list(range(1, len(lines) + 1))
    # Each line adds one request's figures (which one may race by a line; the multiset may not).
    added = Counter()
    previous = {"total_prompt_tokens": 0, "total_cached_tokens": 0}
    for line in lines:
        step = tuple(int(line[k]) - previous[k] for k in previous)
        added[step] += 1
        previous = {k: int(line[k]) for k in previous}
    assert added == Counter((s.prompt_tokens, s.cached_tokens) for s in sequence.seen)
    final = seen_stats(sequence.seen)
    assert lines[-1] == {
        k: f"{v:.4f}" if isinstance(v, float) else str(v) for k, v in final.items() if k != "unknown_requests"
    }
    assert MARKER not in sequence.log


# -- return_cached_tokens_details --------------------------------------------------------


def with_details(client: openai.OpenAI, route: str, stream: bool, text: str) -> tuple[Any, dict]:
    """(usage, cached_tokens_details) of one request that asks for the details."""
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 3,
        "extra_body": {"return_cached_tokens_details": True},
    }
    if stream:
        kwargs |= {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if route == "chat":
        result = client.chat.completions.create(messages=[{"role": "user", "content": text}], **kwargs)
    else:
        result = client.completions.create(prompt=text, **kwargs)
    if not stream:
        return result.usage, result.model_extra["cached_tokens_details"]
    chunks = list(result)
    # Only the final usage chunk carries the details, not the continuous usage ones.
    assert all("cached_tokens_details" not in c.model_extra for c in chunks if c.choices)
    final = [c for c in chunks if not c.choices]
    assert len(final) == 1
    return final[0].usage, final[0].model_extra["cached_tokens_details"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_cached_tokens_details_on_request(sim_client: openai.OpenAI, route: str, stream: bool) -> None:
    text = prompt()
    cold_usage, cold = with_details(sim_client, route, stream, text)
    warm_usage, warm = with_details(sim_client, route, stream, text)
    full_blocks = cold_usage.prompt_tokens // BLOCK * BLOCK
    assert cold == {"local": 0, "external": 0, "created": full_blocks, "source": "engine"}
    cached = warm_usage.prompt_tokens_details.cached_tokens
    assert cached == (warm_usage.prompt_tokens - 1) // BLOCK * BLOCK > 0
    assert warm == {"local": cached, "external": 0, "created": 0, "source": "engine"}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_no_extension_unless_asked(sim_server: str, route: str, stream: bool) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 3}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": prompt()}]
    else:
        body["prompt"] = prompt()
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    response = httpx.post(f"{sim_server}{path}", json=body)
    assert response.status_code == 200
    assert '"usage"' in response.text
    assert "cached_tokens_details" not in response.text


# -- the stats line in upstream mode ------------------------------------------------------


def test_upstream_mode_logs_one_stats_line_per_request_and_no_prompt_text(tmp_path) -> None:
    """In front of a server that reports cached tokens itself (the standalone sim, like
    vLLM with ``--enable-prompt-tokens-details``), each request adds its figures once."""
    log_path = tmp_path / "proxy.log"
    sim = ["-m", "engine_adapter.sim", "--report-cached-tokens", "--log-level", "warning"]
    with running_server(sim) as (upstream, _):
        serve = ["-m", "proxy.server.cli", "serve", "--upstream", upstream, "--log-level", "debug"]
        with (
            running_server(serve, log_path=log_path) as (url, _),
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
        ):
            text = prompt()
            seen = [call(client, route, stream, text) for route in ("chat", "completions") for stream in (False, True)]
            deadline = time.monotonic() + 5
            while httpx.get(f"{url}/stats").json()["total_requests"] < len(seen):
                assert time.monotonic() < deadline
                time.sleep(0.05)
    log = log_path.read_text()
    lines = [dict(field.split("=") for field in m.group(1).split()) for m in _STATS_LINE.finditer(log)]
    assert [int(line["total_requests"]) for line in lines] == [1, 2, 3, 4]
    assert int(lines[-1]["total_prompt_tokens"]) == sum(u.prompt_tokens for u in seen)
    assert int(lines[-1]["total_cached_tokens"]) == sum(u.prompt_tokens_details.cached_tokens for u in seen) > 0
    assert "cachetally ready on http://" in log
    assert MARKER not in log
