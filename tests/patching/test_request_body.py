"""Request options are read as the engine reads them: pydantic's lax mode is the oracle.

vLLM's request models (``chat_completion/protocol.py``, ``completion/protocol.py``,
``generate/base/protocol.py``: ``stream: bool | None = False``, ``stream_options:
StreamOptions | None``, ``include_usage`` and ``continuous_usage_stats`` as ``bool | None``,
and a raw "options need a stream" check before parsing) are mirrored below as pydantic
models; :mod:`proxy.patching.request_body` and the sim's parser are held against them over arbitrary
JSON values, and the request body reader against the installed vLLM's own models too (marked
``vllm``: it imports vLLM), so a vLLM that reads them otherwise is caught. Then, through real
HTTP in upstream mode, a client sending ``"stream": "true"`` gets exactly the stream it asked
for and its usage record carries the upstream's figures.

The body itself is read as vLLM's parser (Python's ``json``) reads it: the oracle is
``json.loads`` of what the engine is handed, against the client's body with only the
middleware's edits.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import warnings
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, model_validator

from engine_adapter.sim.protocol import RequestError
from engine_adapter.sim.protocol import lax_bool as sim_lax_bool
from proxy.patching.context import PatchConfig
from proxy.patching.request_body import (DETAILS_FLAG, lax_bool, optional_bool, parse_request,
    several_prompts, stream_options_of)
from proxy.server.app import CachetallyApp
from proxy.server.settings import Settings
from tests.patching.test_middleware import Client, Harness, chat_completion, json_response
from tests.servers import running_server, serving_in_thread
from tests.upstream.test_upstream import events, fresh_prompt

_PYDANTIC_BOOL = TypeAdapter(bool | None)

_WORDS = ["1", "0", "on", "off", "t", "f", "true", "false", "y", "n", "yes", "no", "True ", " 1", "2", "", "K", "ſ"]


def _cased(word: str) -> st.SearchStrategy[str]:
    return st.lists(st.booleans(), min_size=len(word), max_size=len(word)).map(
        lambda upper: "".join(c.upper() if u else c for c, u in zip(word, upper, strict=True))
    )


_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=3),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),  # what orjson writes and reads (the body)
    st.floats(allow_nan=False),
    st.sampled_from([0.0, -0.0, 1.0, 1.0000001, 0.5]),
    st.sampled_from(_WORDS).flatmap(_cased),
    st.text(max_size=6),
)
JSON = st.recursive(
    _SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")
    stream: bool | None = False
    stream_options: _StreamOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def validate_stream_options(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return data


def _vllm_reads(payload: dict[str, Any]) -> tuple[bool, bool] | None:
    """(stream, include_usage) as vLLM's ``should_include_usage`` sees them; None: a 400."""
    try:
        request = _Request.model_validate(payload)
    except ValidationError:
        return None
    options = request.stream_options
    return bool(request.stream), bool(options.include_usage) if options else False


@given(JSON)
def test_a_flag_is_read_as_pydantic_reads_a_bool(value: Any) -> None:
    try:
        expected: bool | None = bool(_PYDANTIC_BOOL.validate_python(value))
    except ValidationError:
        expected = None
    try:
        ours: bool | None = optional_bool(value)
    except ValueError:
        ours = None
    try:
        sim: bool | None = sim_lax_bool(value, "stream")
    except RequestError:
        sim = None
    assert ours == expected and sim == expected
    if value is not None and expected is not None:
        assert lax_bool(value) == expected


_BODIES = st.fixed_dictionaries(
    {},
    optional={
        "stream": JSON,
        "stream_options": JSON | st.fixed_dictionaries({}, optional={"include_usage": JSON, "continuous_usage_stats": JSON}),
    },
)


@given(_BODIES)
@example({"stream": True, "stream_options": {"continuous_usage_stats": "maybe"}})  # read only to be refused
def test_stream_options_are_read_as_vllm_reads_them(payload: dict[str, Any]) -> None:
    expected = _vllm_reads(payload)
    try:
        ours: tuple[bool, bool] | None = stream_options_of(payload)
    except ValueError:
        ours = None
    assert ours == expected
    _, options = parse_request(orjson.dumps(payload))
    # A body the engine refuses is never billed as a stream, nor asked for its usage.
    assert (options.stream, options.include_usage) == (expected or (False, False))



@functools.cache
def _installed_vllm() -> tuple[dict[str, tuple[dict[str, Any], Any]], Any, tuple[type[Exception], ...]]:
    """Each patched route's body (what it needs besides the options) and the installed vLLM's
    own request model for it; how its serving layer reads ``stream_options``; and what its
    models raise for a body it answers 400."""
    with warnings.catch_warnings():  # torch, imported by vLLM, deprecates its own torch.jit
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
        from vllm.entrypoints.serve.utils.api_utils import should_include_usage
        from vllm.exceptions import VLLMClientError

    return {
        "chat": ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, ChatCompletionRequest),
        "completions": ({"model": "m", "prompt": "hi"}, CompletionRequest),
        "responses": ({"model": "m", "input": "hi"}, ResponsesRequest),
        "messages": ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
                     AnthropicMessagesRequest),
    }, should_include_usage, (ValidationError, VLLMClientError)


@pytest.mark.vllm
@settings(max_examples=400, deadline=None)
@given(route=st.sampled_from(["chat", "completions", "responses", "messages"]),
       options=_BODIES | st.fixed_dictionaries({}, optional={"use_beam_search": JSON}))
def test_the_installed_vllms_own_models_read_the_options_as_we_do(route: str, options: dict[str, Any]) -> None:
    """The mirror above, checked against the real thing: what the installed vLLM's route reads
    from the body (its pydantic model, then ``should_include_usage`` as its serving layer calls
    it) is what :func:`parse_request` reads, for every body vLLM serves."""
    models, should_include_usage, refusals = _installed_vllm()
    base, model = models[route]
    body = orjson.dumps({**base, **options})
    reads_options = route in ("chat", "completions")  # Responses and Messages have no stream_options
    try:
        request = model.model_validate(json.loads(body))
    except refusals:
        return  # a 400 from vLLM: nothing runs, nothing is billed
    _, ours = parse_request(body, stream_options=reads_options)
    assert ours.stream == bool(request.stream)
    if reads_options:
        assert ours.include_usage == should_include_usage(request.stream_options, False)[0]
        assert ours.beam_search == request.use_beam_search


_PROMPT_ITEMS = st.one_of(st.integers(0, 9), st.floats(0, 9), st.booleans(), st.text(max_size=2), st.none(),
                          st.lists(st.integers(0, 9) | st.floats(0, 9), min_size=1, max_size=2))


@pytest.mark.vllm
@settings(max_examples=300, deadline=None)
@given(prompt=st.text(max_size=2) | st.lists(_PROMPT_ITEMS, max_size=3))
def test_a_prompt_is_several_exactly_when_the_installed_vllm_reads_several(prompt: Any) -> None:
    """A beam search over several prompts is refused while billing (request_side): the count of
    prompts is read as the installed vLLM's completions model reads it, for every prompt it takes."""
    models, _, refusals = _installed_vllm()
    try:
        request = models["completions"][1].model_validate({"model": "m", "prompt": prompt})
    except refusals:
        return  # a 400 from vLLM: nothing runs
    read = request.prompt
    assert several_prompts(prompt) == (isinstance(read, list) and len(read) > 1 and not isinstance(read[0], int))

# -- the body, read and rewritten as the engine's parser reads it -----------------------------

#: What the standard library's ``json`` reads and writes, and orjson does not: integers of any
#: size (orjson reads those past 64 bits as floats), ``NaN`` and infinities, lone surrogates.
_LONE_SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff", "\ud83d"])
_ENGINE_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(),
    st.text(st.characters() | _LONE_SURROGATES, max_size=6),
)
_ENGINE_JSON = st.recursive(
    _ENGINE_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


def _as_engine_reads(body: bytes) -> str:
    """What vLLM's route reads from ``body`` (Starlette's ``Request.json()`` is ``json.loads``),
    written canonically, so that ``NaN`` compares equal to itself."""
    return json.dumps(json.loads(body), sort_keys=True)


@pytest.mark.parametrize("mode", ["embedded", "upstream"])
@settings(max_examples=150, deadline=None)
@given(extra=st.dictionaries(st.text(max_size=5).map("x-".__add__), _ENGINE_JSON, max_size=4),
       stream=st.booleans(), flag=st.booleans())
def test_the_engine_reads_the_clients_body_with_only_our_edits(
    mode: str, extra: dict[str, Any], stream: bool, flag: bool
) -> None:
    """A body the engine's parser reads is never refused, and what the engine reads is the
    client's body with only the edits this mode makes: the details flag stripped (embedded),
    the ghost usage asked for a stream without it (upstream)."""
    payload: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream,
                               **extra}
    if flag:
        payload[DETAILS_FLAG] = True
    body = json.dumps(payload).encode()  # as Python's json writes it: NaN, big integers, \ud83d
    upstream = mode == "upstream"
    h = Harness(PatchConfig(ghost_usage=upstream, strip_details_flag=not upstream))
    client = Client(body)
    asyncio.run(h.call(h.middleware(json_response(chat_completion()), (64, 48)), client))

    assert client.status == 200 and len(h.inner_bodies) == 1
    expected = dict(payload)
    if not upstream:
        expected.pop(DETAILS_FLAG, None)
    if upstream and stream:
        expected["stream_options"] = {"include_usage": True, "continuous_usage_stats": False}
    if expected == payload:  # nothing to edit: the client's bytes
        assert h.inner_bodies[0] == body
    assert _as_engine_reads(h.inner_bodies[0]) == json.dumps(expected, sort_keys=True)


@pytest.mark.parametrize("literal", [b"NaN", b"-Infinity", b"1e400", b'"\\ud83d"', b"18446744073709551616",
                                     b"-9223372036854775809", b"123456789012345678901234567890"])
def test_values_orjson_cannot_hold_reach_the_engine_as_the_client_wrote_them(literal: bytes) -> None:
    """orjson refuses the first four and reads the last three as floats; the engine reads all."""
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"user":' + literal + b"}"
    h = Harness(PatchConfig(ghost_usage=True, strip_details_flag=False))  # a rewrite: the ghost usage
    client = Client(body)
    asyncio.run(h.call(h.middleware(json_response(chat_completion()), (64, 48)), client))
    assert client.status == 200
    forwarded = json.loads(h.inner_bodies[0])
    assert json.dumps(forwarded["user"]) == json.dumps(json.loads(literal))
    assert forwarded["stream_options"]["include_usage"] is True


# -- through real HTTP in upstream mode ------------------------------------------------------

SIM = ["-m", "engine_adapter.sim", "--log-level", "warning", "--report-cached-tokens"]


@pytest.mark.loopback
@pytest.mark.parametrize("stream", [True, "true", 1, "on", "YES", 1.0])
def test_a_stream_flag_vllm_reads_as_true_is_billed_and_the_client_gets_what_it_asked(
    tmp_path: Path, stream: Any
) -> None:
    usage_dir = tmp_path / "usage"
    prompt = fresh_prompt()
    bodies = [
        {"model": "sim-model", "prompt": prompt, "max_tokens": 3, "stream": stream},
        {"model": "sim-model", "prompt": prompt, "max_tokens": 3, "stream": stream, "stream_options": {"include_usage": 1}},
        {"model": "sim-model", "prompt": prompt, "max_tokens": 3, "stream": stream, "stream_options": {"include_usage": "on"}},
    ]
    with contextlib.ExitStack() as stack:
        sim_url, _ = stack.enter_context(running_server(SIM, timeout_s=20))
        settings = Settings(engine="upstream", upstream=sim_url, usage_dir=str(usage_dir)).validate()
        with serving_in_thread(CachetallyApp(settings)) as url, httpx.Client(timeout=10) as client:
            seen = []
            for number, body in enumerate(bodies):
                with client.stream(
                    "POST", f"{url}/v1/completions", content=orjson.dumps(body), headers={"x-request-id": f"r{number}"}
                ) as resp:
                    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
                    seen.append(events(b"".join(resp.iter_raw())))
    plain, *asked = seen
    assert plain[-1] == "[DONE]" and all("usage" not in e or e["usage"] is None for e in plain[:-1])
    for stream_events in asked:
        [usage_chunk] = [e for e in stream_events[:-1] if e.get("usage")]
        assert usage_chunk["choices"] == [] and usage_chunk["usage"]["prompt_tokens"] == 600
        assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] == 592
    records = sorted(
        (orjson.loads(line) for path in usage_dir.glob("*.jsonl") for line in path.read_bytes().splitlines()),
        key=lambda r: r["request_id"],
    )
    assert [(r["request_id"], r["stream"], r["prompt_tokens"], r["cached_tokens"]) for r in records] == [
        ("r0", True, 600, 0),
        ("r1", True, 600, 592),
        ("r2", True, 600, 592),
    ]


#: Bodies vLLM answers 400. A stream whose options cachetally would rewrite (the ghost usage
#: sets include_usage and continuous_usage_stats) must stay refused: rewritten, the
#: upstream would serve a stream that vLLM refuses.
_REFUSED = [
    {"stream": "maybe"},
    {"stream": True, "stream_options": {"include_usage": "maybe"}},
    {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": "maybe"}},
    {"stream": True, "stream_options": {"continuous_usage_stats": "maybe"}},
    {"stream": True, "stream_options": "yes"},  # options that are no object
    {"stream": True, "stream_options": []},
]


@pytest.mark.loopback
def test_a_stream_flag_vllm_refuses_is_a_400_and_no_stream(tmp_path: Path) -> None:
    usage_dir = tmp_path / "usage"
    with contextlib.ExitStack() as stack:
        sim_url, _ = stack.enter_context(running_server(SIM, timeout_s=20))
        settings = Settings(engine="upstream", upstream=sim_url, usage_dir=str(usage_dir)).validate()
        with serving_in_thread(CachetallyApp(settings)) as url, httpx.Client(timeout=10) as client:
            statuses = [
                client.post(f"{url}/v1/completions", content=orjson.dumps(
                    {"model": "sim-model", "prompt": "hi", "max_tokens": 3, **options})).status_code
                for options in _REFUSED
            ]
    assert statuses == [400] * len(_REFUSED)
    records = [orjson.loads(line) for path in usage_dir.glob("*.jsonl") for line in path.read_bytes().splitlines()]
    assert [(r["status"], r["stream"], r["prompt_tokens"]) for r in records] == [(400, False, None)] * len(_REFUSED)
