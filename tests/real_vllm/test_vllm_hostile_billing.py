"""Hostile clients against billing, through real HTTP, inside `vllm serve --middleware`.

On the shared `cachetally serve` (tests/conftest.py: vLLM's own server with the middleware,
two API server processes, usage records in a session directory, OTLP spans to a loopback
collector from an environment whose sampler is ``always_off``, tenant header ``x-tenant``
naming ``acme`` and ``globex``). The clients are the official ``openai`` client and raw
httpx; each test asserts what billing sees: the usage records, the OTLP spans, the
counters and the report.

- a caller's unsampled ``traceparent`` (flags ``00``) still gets its span exported, as a
  child of the caller's span, carrying the record's ``record_id`` and tokens;
- the tenant header names only the configured tenants: any other value, a value sent
  twice or a long one is ``other``;
- one ``X-Request-Id`` reused in sequence and concurrently, across both API server
  processes, leaves one record per request, each with its own ``record_id``, and the
  report counts each once;
- ``stream: "true"`` / ``1`` / ``"on"`` and ``include_usage: 1`` are read as vLLM reads
  them: the client gets what vLLM sends for ``true``, the record says stream and carries
  the engine's tokens; a body with ``NaN``, an integer past 64 bits and a lone surrogate
  (which Python's ``json`` reads, as vLLM does, and orjson does not) is served and billed;
- made-up and 1 MiB model names are refused by vLLM (404) and mint no label, and their
  records and spans stay small; a Responses stream cut after ``response.created``, which
  echoes the request's ``metadata``, takes no model name from it.

Keys are not configured on this server (a tenant header beside a key is refused at
startup); the key rule inside vLLM is held by tests/accounting/test_tenants.py and the upstream
tests of tests/accounting/test_hostile_billing.py, which run the same middleware code.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.accounting.records.report import read
from tests.clients import fresh_prompt
from tests.conftest import VLLM_TENANT_HEADER, VLLM_TENANTS
from tests.otlp_receiver import Receiver, ReceivedSpan
from tests.servers import Pace, metric_value
from tests.real_vllm.test_vllm_records import records_for

pytestmark = [pytest.mark.vllm, pytest.mark.loopback]


@pytest.fixture
def client(vllm_server: str, vllm_pace: Pace) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{vllm_server}/v1", api_key="unused", max_retries=0,
                       timeout=vllm_pace.timeout(4)) as c:
        yield c


@pytest.fixture
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def labels(base_url: str, label: str) -> set[str]:
    """Every value of ``label`` on cachetally's series in ``/metrics`` (both processes summed)."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return {
        s.labels[label]
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("cachetally_") and label in s.labels
    }


def spans_where(receiver: Receiver, key: Callable[[ReceivedSpan], Any], wanted: set[Any],
                timeout_s: float = 30.0) -> dict[Any, list[ReceivedSpan]]:
    """The spans whose ``key`` is in ``wanted``, by key, waiting for the exporters' batches."""
    deadline = time.monotonic() + timeout_s
    while True:
        found: dict[Any, list[ReceivedSpan]] = {}
        for span in receiver.snapshot():
            if (k := key(span)) in wanted:
                found.setdefault(k, []).append(span)
        if set(found) == wanted or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def records_of(usage: Path, request_id: str, count: int, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The records of ``request_id``, waiting until there are ``count`` (or the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = records_for(usage, {request_id}, timeout_s=0).get(request_id, [])
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def process_of(record: dict[str, Any]) -> str:
    """The API server process that answered: the key's last component, ``p<pid>``."""
    return record["request_id"].rsplit(".", 1)[-1]


def only_record(usage: Path, request_id: str) -> dict[str, Any]:
    found = records_for(usage, {request_id}).get(request_id, [])
    assert len(found) == 1, found
    return found[0]


# -- item 1: sampling never drops a billing span ---------------------------------------------------


def test_an_unsampled_traceparent_still_exports_its_span(
    client: openai.OpenAI, model: str, vllm_usage_dir: Path, vllm_otlp: Receiver
) -> None:
    asked: dict[str, tuple[str, str, Any]] = {}  # request id -> (trace id, caller's span id, usage)
    for stream in (False, True):
        trace, parent, rid = secrets.token_hex(16), secrets.token_hex(8), uuid.uuid4().hex
        headers = {"traceparent": f"00-{trace}-{parent}-00", "x-request-id": rid}
        common: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": f"{rid} hello"}],
                                  "max_tokens": 4, "temperature": 0, "extra_headers": headers}
        if stream:
            chunks = list(client.chat.completions.create(**common, stream=True, stream_options={"include_usage": True}))
            usage = chunks[-1].usage
        else:
            usage = client.chat.completions.create(**common).usage
        asked[rid] = (trace, parent, usage)

    spans = spans_where(vllm_otlp, lambda span: span.trace_id, {trace for trace, _, _ in asked.values()})
    assert {rid: len(spans.get(trace, [])) for rid, (trace, _, _) in asked.items()} == dict.fromkeys(asked, 1)
    for rid, (trace, parent, usage) in asked.items():
        (span,) = spans[trace]
        assert span.parent_span_id == parent  # a child of the caller's span
        attributes = span.attributes
        assert attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
        assert attributes["gen_ai.usage.cache_read.input_tokens"] == usage.prompt_tokens_details.cached_tokens
        assert attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
        assert attributes["cachetally.tenant"] == "default"
        record = only_record(vllm_usage_dir, rid)  # the span and the record are the same request's
        assert record["traceparent"] == f"00-{trace}-{parent}-00"
        assert attributes["cachetally.record_id"] == record["record_id"]


# -- item 2: the trusted header names only the configured tenants ---------------------------------


def test_the_tenant_header_names_only_the_configured_tenants(
    vllm_server: str, model: str, vllm_usage_dir: Path
) -> None:
    header = VLLM_TENANT_HEADER
    sent: dict[str, list[tuple[str, str]]] = {
        "globex": [(header, "globex")],
        "acme, any bearer": [(header, "acme"), ("authorization", "Bearer sk-globex-guess")],
        "initech": [(header, "initech")],
        "twice": [(header, "acme"), (header, "globex")],
        "long": [(header, "globex" + "x" * 4000)],
        "case": [(header, "GLOBEX")],
        "none": [],
    }
    expected = {"globex": "globex", "acme, any bearer": "acme", "initech": "other", "twice": "other",
                "long": "other", "case": "other", "none": "default"}
    ids = {name: uuid.uuid4().hex for name in sent}
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    with httpx.Client(base_url=vllm_server, timeout=60) as http:
        for name, headers in sent.items():
            answer = http.post("/v1/completions", json=body, headers=[*headers, ("x-request-id", ids[name])])
            assert answer.status_code == 200, (name, answer.text)
    with openai.OpenAI(base_url=f"{vllm_server}/v1", api_key="unused", max_retries=0,
                       default_headers={header: "acme"}) as client:
        ids["openai"] = rid = uuid.uuid4().hex
        client.completions.create(model=model, prompt="hi", max_tokens=2, extra_headers={"x-request-id": rid})
    expected["openai"] = "acme"

    found = records_for(vllm_usage_dir, set(ids.values()))
    assert {name: [r["tenant"] for r in found.get(rid, [])] for name, rid in ids.items()} == {
        name: [tenant] for name, tenant in expected.items()}
    assert labels(vllm_server, "tenant") <= {"default", "other", *VLLM_TENANTS}


# -- item 3: a reused X-Request-Id collapses nothing ----------------------------------------------


def test_a_reused_request_id_keeps_every_record_apart_across_api_servers(
    vllm_server: str, model: str, vllm_usage_dir: Path, tmp_path: Path
) -> None:
    reused = f"reused-{uuid.uuid4().hex}"
    body = {"model": model, "prompt": "hi", "max_tokens": 2}

    def post(_: int) -> int:
        with httpx.Client(base_url=vllm_server, timeout=120) as http:  # a connection of its own
            return http.post("/v1/completions", json=body, headers={"x-request-id": reused}).status_code

    statuses = [post(i) for i in range(5)]  # in sequence
    with ThreadPoolExecutor(8) as pool:
        for _ in range(10):  # concurrently, until both API server processes have answered
            statuses += pool.map(post, range(8))
            found = records_of(vllm_usage_dir, reused, len(statuses))
            if len({process_of(r) for r in found}) == 2:
                break
    assert statuses == [200] * len(statuses)

    records = records_of(vllm_usage_dir, reused, len(statuses))
    assert len(records) == len(statuses)
    assert len({r["record_id"] for r in records}) == len(records)
    assert all(uuid.UUID(r["record_id"]).version == 7 for r in records)
    assert {r["request_id"].split(".")[0] for r in records} == {reused}  # the client's id, kept
    assert len({process_of(r) for r in records}) == 2  # both API server processes answered

    mine = tmp_path / "mine.jsonl"  # this test's records, as a billing job would gather them
    mine.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    report = read([mine, mine])  # gathered twice: each record still once
    assert (report.total().requests, report.duplicates) == (len(records), len(records))
    assert report.total().prompt_tokens == sum(r["prompt_tokens"] for r in records)


# -- item 4: lax stream booleans, read as vLLM reads them ------------------------------------------

LAX = {
    'stream "true"': ({"stream": "true"}, False),
    "stream 1": ({"stream": 1}, False),
    'stream "on"': ({"stream": "on"}, False),
    "include_usage 1": ({"stream": True, "stream_options": {"include_usage": 1}}, True),
    'both lax': ({"stream": "true", "stream_options": {"include_usage": "on"}}, True),
}


def sse(http: httpx.Client, body: dict[str, Any], request_id: str) -> list[dict[str, Any]]:
    """The stream's chunks, as sent; asserts it was a complete SSE stream."""
    with http.stream("POST", "/v1/chat/completions", json=body, headers={"x-request-id": request_id}) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        data = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [orjson.loads(d) for d in data[:-1]]


def shape(chunks: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What a client reads from each chunk: the deltas, finish reasons and usage."""
    return [(tuple((c["index"], c["delta"].get("content"), c["finish_reason"]) for c in chunk["choices"]),
             chunk.get("usage")) for chunk in chunks]


@pytest.mark.parametrize("lax", LAX)
def test_lax_stream_booleans_stream_as_vllm_reads_them(
    vllm_server: str, model: str, vllm_usage_dir: Path, vllm_pace: Pace, lax: str
) -> None:
    fields, usage_asked = LAX[lax]
    common = {"model": model, "messages": [{"role": "user", "content": fresh_prompt()}],
              "max_tokens": 6, "temperature": 0}
    strict = {"stream": True, **({"stream_options": {"include_usage": True}} if usage_asked else {})}
    ids = {name: uuid.uuid4().hex for name in ("cold", "lax", "strict")}
    with httpx.Client(base_url=vllm_server, timeout=vllm_pace.timeout(2)) as http:
        sse(http, {**common, **strict}, ids["cold"])  # warms the prefix cache: both below hit it alike
        got = sse(http, {**common, **fields}, ids["lax"])
        want = sse(http, {**common, **strict}, ids["strict"])

    assert shape(got) == shape(want)  # usage chunk included: same prompt, cached and completion tokens
    assert (got[-1].get("usage") is not None) == usage_asked
    found = records_for(vllm_usage_dir, {ids["lax"], ids["strict"]})
    (record,), (reference,) = found[ids["lax"]], found[ids["strict"]]
    billed = ("stream", "outcome", "prompt_tokens", "cached_tokens", "completion_tokens", "completion_source")
    assert {k: record[k] for k in billed} == {k: reference[k] for k in billed}
    assert (record["stream"], record["outcome"]) == (True, "completed")
    assert record["cached_tokens"] > 0 and record["prompt_tokens"] > record["cached_tokens"]
    if usage_asked:
        usage = got[-1]["usage"]
        assert (record["prompt_tokens"], record["cached_tokens"]) == (
            usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"])


def test_a_body_only_the_standard_librarys_json_reads_is_served_and_billed(
    vllm_server: str, model: str, vllm_usage_dir: Path, vllm_pace: Pace
) -> None:
    """vLLM reads a body with Python's ``json`` (Starlette's ``Request.json()``), which takes
    ``NaN``, integers past 64 bits and a lone surrogate (a JavaScript client's cut emoji);
    orjson takes none of them. With the details flag the body is also rewritten."""
    rid = uuid.uuid4().hex
    body = (b'{"model": ' + orjson.dumps(model) + b', "messages": [{"role": "user", "content": '
            + orjson.dumps(fresh_prompt()) + b'}], "max_tokens": 2, "return_cached_tokens_details": true, '
            b'"x-nan": NaN, "x-wide": 123456789012345678901234567890, "x-cut-emoji": "\\ud83d"}')
    with httpx.Client(base_url=vllm_server, timeout=vllm_pace.timeout(2)) as http:
        answer = http.post("/v1/chat/completions", content=body,
                           headers={"content-type": "application/json", "x-request-id": rid})
    assert answer.status_code == 200, answer.text
    usage, details = answer.json()["usage"], answer.json()["cached_tokens_details"]
    record = only_record(vllm_usage_dir, rid)
    assert (record["prompt_tokens"], record["cached_tokens"], record["completion_tokens"]) == (
        usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"])
    assert details["source"] == "engine" and record["outcome"] == "completed"


def test_a_beam_search_is_billed_the_prompt_its_response_reports(
    vllm_server: str, model: str, vllm_usage_dir: Path, vllm_pace: Pace
) -> None:
    """vLLM's beam search runs the engine once per beam per step, each on the prompt and the
    tokens so far; the record bills the prompt once, as the response's usage says."""
    rid = uuid.uuid4().hex
    body = {"model": model, "messages": [{"role": "user", "content": fresh_prompt(40)}], "max_tokens": 2,
            "n": 2, "use_beam_search": True, "temperature": 0}  # steps: the prompt, then two beams
    with httpx.Client(base_url=vllm_server, timeout=vllm_pace.timeout(4)) as http:
        answer = http.post("/v1/chat/completions", json=body, headers={"x-request-id": rid})
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    record = only_record(vllm_usage_dir, rid)
    assert (record["prompt_tokens"], record["cached_tokens"]) == (
        usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"])


def test_a_beam_search_over_several_prompts_is_refused_not_billed_one(
    vllm_server: str, model: str, vllm_pace: Pace
) -> None:
    """vLLM runs one beam search per prompt of a completions list, their steps interleaved: no
    engine event says which step is a client's prompt, so billing refuses it (one prompt is
    served and billed as above)."""
    name = "cachetally_refused_unmetered_total"
    before = metric_value(httpx.get(f"{vllm_server}/metrics", timeout=30).text, name, route="/v1/completions")
    body = {"model": model, "prompt": [fresh_prompt(10), fresh_prompt(30)], "max_tokens": 2, "n": 2,
            "use_beam_search": True}
    with httpx.Client(base_url=vllm_server, timeout=vllm_pace.timeout(4)) as http:
        refused = http.post("/v1/completions", json=body)
        served = http.post("/v1/completions", json={**body, "prompt": body["prompt"][:1]})
    assert refused.status_code == 400 and "not metered" in refused.json()["error"]["message"]
    assert served.status_code == 200, served.text
    after = metric_value(httpx.get(f"{vllm_server}/metrics", timeout=30).text, name, route="/v1/completions")
    assert after - before == 1


def test_a_client_cannot_group_its_streamed_tokens_to_be_billed_fewer(
    vllm_server: str, model: str, vllm_usage_dir: Path, vllm_pace: Pace
) -> None:
    """vLLM's per-request ``stream_interval`` puts that many tokens in one chunk, and a stream
    without a usage chunk is billed by its token events. The record equals what vLLM
    generated (its own ``vllm:generation_tokens_total``)."""
    rid = uuid.uuid4().hex
    body = {"model": model, "messages": [{"role": "user", "content": fresh_prompt(20)}], "max_tokens": 24,
            "ignore_eos": True, "stream": True, "stream_interval": 50}
    name = "vllm:generation_tokens_total"
    with httpx.Client(base_url=vllm_server, timeout=vllm_pace.timeout(2)) as http:
        before = metric_value(http.get("/metrics").text, name)
        with http.stream("POST", "/v1/chat/completions", json=body, headers={"x-request-id": rid}) as answer:
            events = [line for line in answer.iter_lines() if line.startswith("data: {")]
        generated = metric_value(http.get("/metrics").text, name) - before
    assert answer.status_code == 200 and generated == 24
    record = only_record(vllm_usage_dir, rid)
    assert (record["completion_tokens"], record["completion_source"]) == (24, "engine")
    assert len(events) == 1 + 24  # the role event, then one per token


def test_a_streamed_beam_search_is_billed_the_tokens_of_every_beam(
    vllm_server: str, model: str, vllm_usage_dir: Path, vllm_pace: Pace
) -> None:
    """vLLM streams a beam search's answer after the search, each beam's whole text in one
    event: billed by its token events, a stream without a usage chunk paid one token a beam.
    Nor is the search's work the answer: two beams of 16 tokens take 31 one-token engine
    steps. The record equals what vLLM itself reports for the same request asked with its
    usage chunk, and the client, who asked for none, gets none."""
    body = {"model": model, "messages": [{"role": "user", "content": fresh_prompt(20)}], "max_tokens": 16,
            "ignore_eos": True, "use_beam_search": True, "n": 2, "stream": True}
    rids = [uuid.uuid4().hex, uuid.uuid4().hex]
    payloads = []
    with httpx.Client(base_url=vllm_server, timeout=vllm_pace.timeout(8)) as http:
        for rid, extra in zip(rids, ({}, {"stream_options": {"include_usage": True}}), strict=True):
            with http.stream("POST", "/v1/chat/completions", json={**body, **extra},
                             headers={"x-request-id": rid}) as answer:
                assert answer.status_code == 200
                payloads.append([orjson.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: {")])
    unasked, asked = payloads
    assert [p for p in unasked if p.get("usage")] == []  # the client asked for no usage chunk
    [usage] = [p["usage"] for p in asked if p.get("usage")]
    assert usage["completion_tokens"] == 2 * 16
    for rid in rids:
        record = only_record(vllm_usage_dir, rid)
        assert (record["completion_tokens"], record["completion_source"]) == (usage["completion_tokens"], "usage")


def test_a_client_cannot_claim_its_own_cache_reads_in_kv_transfer_params(
    vllm_server: str, model: str, vllm_usage_dir: Path, vllm_pace: Pace
) -> None:
    """vLLM reads ``kv_transfer_params.remote_prefill_cached_tokens`` from any body, with or
    without a KV connector; this server runs no P/D legs, so the bill is what the scheduler
    found: 0 for a fresh prompt, whatever the claim (and a claim past the prompt fails nothing)."""
    ids = {claim: uuid.uuid4().hex for claim in (100, 10_000_000)}
    answers = {}
    with httpx.Client(base_url=vllm_server, timeout=vllm_pace.timeout(2)) as http:
        for claim, rid in ids.items():
            body = {"model": model, "messages": [{"role": "user", "content": fresh_prompt()}], "max_tokens": 2,
                    "kv_transfer_params": {"do_remote_prefill": True, "remote_prefill_cached_tokens": claim}}
            answers[claim] = http.post("/v1/chat/completions", json=body, headers={"x-request-id": rid})
    for claim, rid in ids.items():
        assert answers[claim].status_code == 200, answers[claim].text
        record = only_record(vllm_usage_dir, rid)
        usage = answers[claim].json()["usage"]
        assert record["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert record["prompt_tokens"] == usage["prompt_tokens"]


def test_two_responses_sharing_a_body_request_id_are_each_billed_their_own_prompt(
    vllm_server: str, model: str, vllm_usage_dir: Path, vllm_pace: Pace
) -> None:
    """vLLM names a Responses request's engine request after the body's ``request_id``; two
    at once with the same one, a warm long prompt and a cold short one, keep their own figures."""
    warm, cold = fresh_prompt(200), fresh_prompt(40)
    shared = f"resp_{uuid.uuid4().hex}"
    ids = {"warm": uuid.uuid4().hex, "cold": uuid.uuid4().hex}
    with httpx.Client(base_url=vllm_server, timeout=vllm_pace.timeout(4)) as http:
        assert http.post("/v1/responses", json={"model": model, "input": warm, "max_output_tokens": 1}).status_code == 200

        def ask(name: str) -> httpx.Response:
            body = {"model": model, "input": warm if name == "warm" else cold, "max_output_tokens": 4,
                    "request_id": shared}
            return http.post("/v1/responses", json=body, headers={"x-request-id": ids[name]})

        with ThreadPoolExecutor(2) as pool:
            answers = dict(zip(ids, pool.map(ask, ids), strict=True))
    for name, rid in ids.items():
        assert answers[name].status_code == 200, answers[name].text
        usage = answers[name].json()["usage"]
        record = only_record(vllm_usage_dir, rid)
        assert (record["prompt_tokens"], record["cached_tokens"]) == (
            usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]), name
    assert only_record(vllm_usage_dir, ids["warm"])["cached_tokens"] > 0


# -- item 6: made-up model names mint nothing, huge ones stay small -------------------------------


def test_made_up_model_names_are_refused_and_mint_nothing(
    client: openai.OpenAI, vllm_server: str, model: str, vllm_usage_dir: Path, vllm_otlp: Receiver
) -> None:
    made_up = [f"mint-{uuid.uuid4().hex}" for _ in range(10)]
    ids = {name: uuid.uuid4().hex for name in made_up}
    for name in made_up:
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           extra_headers={"x-request-id": ids[name]})
    huge = "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(1 << 20))
    ids["huge"] = uuid.uuid4().hex
    answer = httpx.post(f"{vllm_server}/v1/completions", json={"model": huge, "prompt": "hi", "max_tokens": 2},
                        headers={"x-request-id": ids["huge"]}, timeout=120)
    assert answer.status_code == 404

    found = records_for(vllm_usage_dir, set(ids.values()))
    records = [r for rid in ids.values() for r in found.get(rid, [])]
    assert len(records) == len(ids)
    assert {(r["status"], r["outcome"]) for r in records} == {(404, "error")}
    assert {r["model"] for r in records}.isdisjoint([*made_up, huge])
    assert max(len(r["request_model"]) for r in records) == 256
    assert max(len(orjson.dumps(r)) for r in records) < 4096
    sent = {*made_up, huge[:256], huge}
    assert labels(vllm_server, "model").isdisjoint(sent)
    assert labels(vllm_server, "model") <= {model, "other", "unknown"}

    spans = spans_where(vllm_otlp, lambda span: span.attributes["cachetally.record_id"],
                        {r["record_id"] for r in records})
    assert sorted(len(v) for v in spans.values()) == [1] * len(records)
    (huge_span,) = spans[only_record(vllm_usage_dir, ids["huge"])["record_id"]]
    assert len(huge_span.attributes["gen_ai.request.model"]) == 256


def test_a_responses_stream_cut_early_cannot_name_its_model_in_metadata(
    vllm_server: str, model: str, vllm_usage_dir: Path, vllm_pace: Pace
) -> None:
    """vLLM's ``response.created`` echoes the request's ``metadata`` before the response's
    ``model``; a client that hangs up after that event leaves a record and labels with the
    served model's name, never its metadata's."""
    names = {f"mint-{uuid.uuid4().hex}": uuid.uuid4().hex for _ in range(2)}
    with httpx.Client(base_url=vllm_server, timeout=vllm_pace.timeout(4)) as http:
        for name, rid in names.items():
            body = {"model": model, "input": fresh_prompt(), "stream": True, "max_output_tokens": 200,
                    "metadata": {"model": name}}
            with http.stream("POST", "/v1/responses", json=body, headers={"x-request-id": rid}) as answer:
                assert answer.status_code == 200
                lines = answer.iter_lines()
                while not next(lines).startswith("data:"):  # response.created: then hang up
                    pass
    found = records_for(vllm_usage_dir, set(names.values()))
    records = [r for rid in names.values() for r in found.get(rid, [])]
    assert len(records) == len(names)
    assert {r["model"] for r in records} == {model}  # response.created's own model
    assert labels(vllm_server, "model").isdisjoint(names)


def test_a_key_in_the_query_string_never_reaches_vllms_access_log(
    vllm_server: str, model: str, vllm_server_log: Path, vllm_pace: Pace
) -> None:
    """Clients put keys in query strings; vLLM's uvicorn logs every request line at info."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with httpx.Client(base_url=vllm_server, timeout=vllm_pace.timeout()) as http:
        assert http.post("/v1/chat/completions?api_key=SECRET-IN-QUERY", json=body).status_code == 200
    deadline = time.monotonic() + 10
    while '"POST /v1/chat/completions?*** HTTP/1.1" 200' not in (text := vllm_server_log.read_text(errors="replace")):
        assert time.monotonic() < deadline, "no access line for the request"
        time.sleep(0.1)
    assert "SECRET-IN-QUERY" not in text
