"""Request options combined, through real HTTP: what the client sees, what is recorded and
what is counted agree, and the client gets the shape it asked for.

``cachetally serve --engine sim`` (embedded) and ``cachetally serve --upstream`` in front of
the sim reporting its figures (upstream, where cachetally asks for the usage chunk the
client did not: the ghost chunk), both billing with a trusted tenant header. Hypothesis
draws chat or completions; ``stream`` as JSON or lax spellings; ``stream_options`` absent,
``{}`` or any mix of ``include_usage`` and ``continuous_usage_stats``; ``n``; a completions
prompt as a string, strings or token-id lists; ``echo``, ``logprobs``, ``max_tokens``,
``return_cached_tokens_details``, the tenant; and whether the prompt is warm. The bytes are
read here (not by cachetally's parser) against a model of the sim's output and of its
prefix cache: usage exactly where asked, every ``cached_tokens`` the engine's figure for
its prompt (upstream, the continuous chunks before the final one say 0, the ``missing``
policy: an upstream reports its reads in its final chunk only; and a request of several
prompts has unknown reads, 0 to the client: vLLM reports one prompt's), the rest of the stream as
the sim writes it, one record and the counters carrying the client's figures (the
engine's, where the client asked for none)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_adapter.sim.tokenizer import render_chat, tokenize
from tests.real_vllm.test_vllm_records import records_for
from tests.servers import metric_value, running_server

pytestmark = pytest.mark.loopback

MODEL = "sim-model"
BLOCK = 16  # the sim's block size
TENANTS = ("acme", "globex")
BILLING = ["--log-level", "warning", "--usage-flush-interval", "0.05",
           "--tenant-header", "x-tenant", "--tenants", ",".join(TENANTS)]


class CacheModel:
    """A model of the sim's prefix cache, counted as vLLM counts it: whole blocks, never the
    prompt's last token. ``schedule`` returns a prompt's reads, then caches it."""

    def __init__(self) -> None:
        self.blocks: set[tuple[int, ...]] = set()

    def schedule(self, ids: list[int]) -> int:
        cached = 0
        while cached + BLOCK <= len(ids) - 1 and tuple(ids[: cached + BLOCK]) in self.blocks:
            cached += BLOCK
        self.blocks.update(tuple(ids[:end]) for end in range(BLOCK, len(ids) + 1, BLOCK))
        return cached


class Server:
    """One server under test, with the model of its engine's cache."""

    def __init__(self, url: str, usage_dir: Path) -> None:
        self.url, self.usage_dir = url, usage_dir
        self.cache = CacheModel()
        self.texts: list[str] = []  # prompts sent before: a warm one is one of these

    def __repr__(self) -> str:
        return f"Server({self.url})"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    embedded_dir, upstream_dir = tmp_path_factory.mktemp("embedded"), tmp_path_factory.mktemp("upstream")
    serve = ["-m", "proxy.server.cli", "serve", *BILLING]
    sim = ["-m", "engine_adapter.sim", "--log-level", "warning", "--report-cached-tokens"]
    with running_server([*serve, "--engine", "sim", "--usage-dir", str(embedded_dir)]) as (embedded, _), \
            running_server(sim) as (engine, _), \
            running_server([*serve, "--upstream", engine, "--usage-dir", str(upstream_dir)]) as (front, _):
        yield {"embedded": Server(embedded, embedded_dir), "upstream": Server(front, upstream_dir)}


STREAM_TRUE: list[Any] = [True, "true", 1, "on"]
STREAM_FALSE: list[Any] = [False, "false", 0, None]
#: A ``stream_options`` flag: absent, null, or a value vLLM's pydantic reads as a bool.
FLAG = st.sampled_from(["absent", None, True, False, "true", 1, "false", 0])


def _true(value: Any) -> bool:
    return value in (True, "true") or (type(value) is int and value == 1)


@st.composite
def requests(draw: st.DrawFn) -> dict[str, Any]:
    route = draw(st.sampled_from(["chat", "completions"]))
    streamed = draw(st.booleans())
    stream = draw(st.sampled_from(STREAM_TRUE if streamed else STREAM_FALSE))
    options: Any = "absent"
    # vLLM refuses options that are truthy as JSON beside a stream that is not ("false" is).
    if (streamed or stream == "false") and draw(st.booleans()):
        options = {}
        for name in ("include_usage", "continuous_usage_stats"):
            if (value := draw(FLAG)) != "absent":
                options[name] = value
    elif draw(st.booleans()):
        options = draw(st.sampled_from([{}, None]))
    form = draw(st.sampled_from(["string", "strings", "token_ids"])) if route == "completions" else "messages"
    return {
        "route": route, "stream": stream, "streamed": streamed, "options": options, "form": form,
        "prompts": 1 if form in ("string", "messages") else draw(st.integers(1, 3)),
        "repeat": draw(st.booleans()),  # a list of prompts repeats its first (a hit within the request)
        "warm": draw(st.booleans()),
        "n": draw(st.integers(1, 3)),
        "max_tokens": draw(st.integers(1, 3)),
        "echo": draw(st.sampled_from([None, True, False])) if route == "completions" else None,
        "logprobs": draw(st.booleans()),
        "details": draw(st.booleans()),
        "tenant": draw(st.sampled_from([None, "acme", "globex", "initech"])),
        "mode": draw(st.sampled_from(["embedded", "upstream"])),
        "sdk": draw(st.booleans()),  # the openai client where its API can say it
    }


def _texts(server: Server, req: dict[str, Any]) -> list[str]:
    first = server.texts[-1] if req["warm"] and server.texts else " ".join(
        [uuid.uuid4().hex, *(f"w{i}" for i in range(40))])
    texts = [first]
    for _ in range(req["prompts"] - 1):
        texts.append(first if req["repeat"] else " ".join([uuid.uuid4().hex, *(f"v{i}" for i in range(25))]))
    server.texts.append(first)
    return texts


def _body(req: dict[str, Any], texts: list[str]) -> tuple[dict[str, Any], list[list[int]]]:
    body: dict[str, Any] = {"model": MODEL, "n": req["n"], "max_tokens": req["max_tokens"]}
    if req["route"] == "chat":
        messages = [{"role": "user", "content": texts[0]}]
        body["messages"], ids = messages, [tokenize(render_chat(messages))]
        if req["logprobs"]:
            body["logprobs"] = True
    else:
        ids = [tokenize(text) for text in texts]
        if req["form"] == "string":
            body["prompt"] = texts[0]
        elif req["form"] == "strings":
            body["prompt"] = texts
        else:
            body["prompt"] = ids
        if req["logprobs"]:
            body["logprobs"] = 1
        if req["echo"] is not None:
            body["echo"] = req["echo"]
    if req["stream"] is not None:
        body["stream"] = req["stream"]
    if req["options"] != "absent":
        body["stream_options"] = req["options"]
    if req["details"]:
        body["return_cached_tokens_details"] = True
    return body, ids


def _send(server: Server, req: dict[str, Any], body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
    path = "/v1/chat/completions" if req["route"] == "chat" else "/v1/completions"
    # The SDK sends ``stream`` as a JSON bool and ``stream_options`` as an object, or neither.
    sayable = type(body.get("stream", False)) is bool and isinstance(body.get("stream_options", {}), dict)
    if req["sdk"] and sayable:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30) as client:
            create = (client.chat.completions if req["route"] == "chat" else client.completions).with_raw_response.create
            known = {"model", "n", "max_tokens", "stream", "stream_options", "messages", "prompt", "logprobs", "echo"}
            kwargs = {k: v for k, v in body.items() if k in known}
            extra = {k: v for k, v in body.items() if k not in known}
            raw = create(**kwargs, extra_body=extra or None, extra_headers=headers).http_response
            raw.read()  # a stream's whole body, before the client closes
            return raw
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=30)


def _events(raw: bytes) -> list[Any]:
    """Each SSE event's data, read here: ``[DONE]`` as a string."""
    assert raw.endswith(b"\n\n"), raw[-200:]
    out: list[Any] = []
    for event in raw.split(b"\n\n")[:-1]:
        assert event.startswith(b"data: ") and b"\n" not in event, event
        data = event[len(b"data: "):]
        out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def _usage(prompt: int, completion: int, cached: int) -> tuple[int, int, int, int]:
    return prompt, prompt + completion, completion, cached


def _seen(usage: dict[str, Any]) -> tuple[int, int, int, int]:
    details = usage.get("prompt_tokens_details")
    assert isinstance(details, dict) and type(details.get("cached_tokens")) is int, usage
    return usage["prompt_tokens"], usage["total_tokens"], usage["completion_tokens"], details["cached_tokens"]


def _expected_stream(req: dict[str, Any], ids: list[list[int]], cached: list[int], usage_asked: bool,
                     continuous: bool) -> list[tuple[list[dict[str, Any]], tuple[int, int, int, int] | None]]:
    """(choices, usage) of each event the sim writes, ``[DONE]`` aside."""
    n, steps, chat = req["n"], req["max_tokens"], req["route"] == "chat"
    out: list[tuple[list[dict[str, Any]], tuple[int, int, int, int] | None]] = []
    if chat:
        for i in range(n):
            choice = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}
            out.append(([choice], _usage(len(ids[0]), 0, cached[0]) if continuous else None))
    for k in range(steps):
        last = k == steps - 1
        for p in range(len(ids)):
            for i in range(n):
                choice: dict[str, Any] = {"index": p * n + i}
                choice |= {"delta": {"content": f" tok{k}"}} if chat else {"text": f" tok{k}"}
                choice |= {"logprobs": None, "finish_reason": "length" if last else None}
                if last or not chat:
                    choice["stop_reason"] = None
                out.append(([choice], _usage(len(ids[p]), k + 1, cached[p]) if continuous else None))
    if usage_asked:
        out.append(([], _usage(sum(map(len, ids)), len(ids) * n * steps, sum(cached))))
    return out


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(req=requests())
def test_what_the_client_sees_is_what_is_recorded_and_counted(servers: dict[str, Server], req: dict[str, Any]) -> None:
    server = servers[req["mode"]]
    body, ids = _body(req, _texts(server, req))
    rid = uuid.uuid4().hex
    headers = {"x-request-id": rid} | ({"x-tenant": req["tenant"]} if req["tenant"] else {})
    tenant = req["tenant"] if req["tenant"] in TENANTS else ("other" if req["tenant"] else "default")
    before = httpx.get(f"{server.url}/metrics").text
    answer = _send(server, req, body, headers)
    cached = [server.cache.schedule(prompt) for prompt in ids]
    assert answer.status_code == 200, answer.text
    options = req["options"] if isinstance(req["options"], dict) else {}
    usage_asked = req["streamed"] and _true(options.get("include_usage"))
    continuous = usage_asked and _true(options.get("continuous_usage_stats"))
    choices = len(ids) * req["n"]
    engine = _usage(sum(map(len, ids)), choices * req["max_tokens"], sum(cached))
    unknown = req["mode"] == "upstream" and len(ids) > 1  # docs/ACCOUNTING.md: one prompt's reads
    seen = (*engine[:3], 0) if unknown else engine
    if not req["streamed"]:
        assert answer.headers["content-type"].startswith("application/json")
        payload = json.loads(answer.content)
        text = "".join(f" tok{k}" for k in range(req["max_tokens"]))
        said = {"message": {"role": "assistant", "content": text, "refusal": None}} if req["route"] == "chat" \
            else {"text": text}
        assert payload["choices"] == [{"index": i, **said, "logprobs": None, "finish_reason": "length",
                                       "stop_reason": None} for i in range(choices)]
        assert ("cached_tokens_details" in payload) == req["details"]
        final = payload["usage"]
        assert _seen(final) == seen
    else:
        assert answer.headers["content-type"].startswith("text/event-stream")
        events = _events(answer.content)
        assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
        # An upstream reports its reads in its final usage chunk only: the continuous ones
        # before it follow the missing policy, 0 (tests/upstream/test_upstream.py).
        per_chunk = cached if req["mode"] == "embedded" else [0] * len(ids)
        expected = _expected_stream(req, ids, per_chunk, usage_asked, continuous)
        if usage_asked:
            expected[-1] = (expected[-1][0], seen)
        got = events[:-1]
        assert [event["choices"] for event in got] == [c for c, _ in expected]
        for event, (_, usage) in zip(got, expected, strict=True):
            assert event["object"] == ("chat.completion.chunk" if req["route"] == "chat" else "text_completion")
            assert event["id"] == got[0]["id"] and event["model"] == MODEL
            if usage is None:
                assert "usage" not in event and "cached_tokens_details" not in event, event
            else:
                assert _seen(event["usage"]) == usage, (event, usage)
            assert ("cached_tokens_details" in event) == (req["details"] and event["choices"] == []), event
        final = got[-1]["usage"] if usage_asked else None
    if final is not None and req["details"]:
        holder = payload if not req["streamed"] else got[-1]
        details = holder["cached_tokens_details"]
        embedded = req["mode"] == "embedded"
        assert details["source"] == ("engine" if embedded else "unknown" if unknown else "upstream"), details
        assert details["local"] == (sum(cached) if embedded else None)
    [record] = records_for(server.usage_dir, {rid})[rid]
    figures = (record["prompt_tokens"], record["cached_tokens"], record["completion_tokens"])
    assert figures == (engine[0], None if unknown else engine[3], engine[2]), (record, engine)
    if final is not None:
        said = None if unknown else final["prompt_tokens_details"]["cached_tokens"]
        assert figures == (final["prompt_tokens"], said, final["completion_tokens"])
    assert (record["tenant"], record["stream"], record["outcome"], record["status"]) == (
        tenant, req["streamed"], "completed", 200), record
    after = httpx.get(f"{server.url}/metrics").text

    def moved(name: str, **labels: str) -> float:
        return metric_value(after, name, tenant=tenant, **labels) - metric_value(before, name, tenant=tenant, **labels)

    route = "chat" if req["route"] == "chat" else "completions"
    assert moved("cachetally_requests_total", route=route, stream=str(req["streamed"]).lower()) == 1
    assert moved("cachetally_requests_total") == 1
    assert moved("cachetally_prompt_tokens_total") == (0 if unknown else engine[0])  # unknown: not counted
    assert moved("cachetally_cached_tokens_total", tier="all") == (0 if unknown else engine[3])
    assert moved("cachetally_completion_tokens_total") == engine[2]


def test_each_prompts_continuous_usage_carries_its_own_reads_where_two_prompts_share_a_length(
    servers: dict[str, Server],
) -> None:
    """A completions stream over one prompt twice: the engine finds the second in the cache
    the first wrote. Each per-prompt usage chunk reports its own prompt's reads (0, then the
    full blocks); matched by prompt length, both got 0, the one length being ambiguous."""
    server = servers["embedded"]
    text = " ".join([uuid.uuid4().hex, *(f"w{i}" for i in range(40))])
    ids = tokenize(text)
    reads = [server.cache.schedule(ids), server.cache.schedule(ids)]
    assert reads == [0, ((len(ids) - 1) // BLOCK) * BLOCK]
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30) as client:
        chunks = list(client.completions.create(
            model=MODEL, prompt=[text, text], n=2, max_tokens=2, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    per_prompt = [(chunk.choices[0].index // 2, chunk.usage) for chunk in chunks if chunk.choices]
    assert len(per_prompt) == 8
    for prompt, usage in per_prompt:
        assert usage is not None and usage.prompt_tokens_details is not None
        assert (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens) == (len(ids), reads[prompt])
    final = chunks[-1].usage
    assert final is not None and final.prompt_tokens_details is not None
    assert (final.prompt_tokens, final.prompt_tokens_details.cached_tokens) == (2 * len(ids), sum(reads))
