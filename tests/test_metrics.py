"""The per-request series expose exactly what prometheus_client's own types would."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from proxy.ledger import UsageLedger
from proxy.metrics import _RATIO_BUCKETS, _TOKEN_BUCKETS, Metrics, RequestRecord


def samples(text: bytes, prefix: str) -> dict[str, float]:
    """``name{labels} value`` lines of one family, labels sorted, ``_created`` left out."""
    out = {}
    for line in text.decode().splitlines():
        if line.startswith(prefix) and "_created" not in line:
            name, _, value = line.rpartition(" ")
            if "{" in name:
                base, labels = name[:-1].split("{", 1)
                name = base + "{" + ",".join(sorted(labels.split(","))) + "}"
            out[name] = float(value)
    return out


records = st.builds(
    RequestRecord,
    model=st.sampled_from(["m1", "m2"]),
    route=st.sampled_from(["chat", "completions"]),
    stream=st.booleans(),
    prompt_tokens=st.one_of(st.none(), st.integers(0, 200_000)),
    cached_tokens=st.one_of(st.none(), st.integers(0, 200_000)),
    source=st.sampled_from([None, "engine", "upstream"]),
    local_cached_tokens=st.one_of(st.none(), st.integers(0, 10_000)),
    external_cached_tokens=st.one_of(st.none(), st.integers(0, 10_000)),
    mismatches=st.integers(0, 2),
    tenant=st.sampled_from(["default", "other", "team-a"]),
    completion_tokens=st.integers(0, 5_000),
)


@given(st.lists(records, max_size=30))
def test_series_match_prometheus_client_counters_and_histograms(recs: list[RequestRecord]) -> None:
    metrics = Metrics(UsageLedger())
    reference = CollectorRegistry()
    requests = Counter(
        "cachetally_requests", "", ["model", "route", "stream", "cache", "tenant"], registry=reference
    )
    prompt = Counter("cachetally_prompt_tokens", "", ["model", "tenant"], registry=reference)
    cached = Counter("cachetally_cached_tokens", "", ["model", "source", "tier", "tenant"], registry=reference)
    completion = Counter("cachetally_completion_tokens", "", ["model", "tenant"], registry=reference)
    per_request = Histogram("cachetally_request_cached_tokens", "", ["model"], buckets=_TOKEN_BUCKETS,
                            registry=reference)
    ratio = Histogram("cachetally_request_cache_hit_ratio", "", ["model"], buckets=_RATIO_BUCKETS,
                      registry=reference)
    for rec in recs:
        metrics.record(rec)
        requests.labels(rec.model, rec.route, str(rec.stream).lower(), rec.cache, rec.tenant).inc()
        if rec.completion_tokens:
            completion.labels(rec.model, rec.tenant).inc(rec.completion_tokens)
        if rec.cache == "unknown":
            continue
        assert rec.prompt_tokens is not None and rec.cached_tokens is not None
        source = rec.source or "upstream"
        prompt.labels(rec.model, rec.tenant).inc(rec.prompt_tokens)
        cached.labels(rec.model, source, "all", rec.tenant).inc(rec.cached_tokens)
        for tier, value in (("local", rec.local_cached_tokens), ("external", rec.external_cached_tokens)):
            if value is not None:
                cached.labels(rec.model, source, tier, rec.tenant).inc(value)
        per_request.labels(rec.model).observe(rec.cached_tokens)
        if rec.prompt_tokens:
            ratio.labels(rec.model).observe(rec.cached_tokens / rec.prompt_tokens)
    ours, theirs = metrics.exposition(), generate_latest(reference)
    for family in ("cachetally_requests", "cachetally_prompt_tokens", "cachetally_cached_tokens_total",
                   "cachetally_completion_tokens",
                   "cachetally_request_cached_tokens", "cachetally_request_cache_hit_ratio"):
        assert samples(ours, family) == samples(theirs, family), family
    mismatch = samples(ours, "cachetally_cached_tokens_mismatch")
    assert mismatch == {"cachetally_cached_tokens_mismatch_total": sum(r.mismatches for r in recs)}
