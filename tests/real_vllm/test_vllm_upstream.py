"""Upstream mode against a real engine: cachetally in front of vLLM's own OpenAI server.

vLLM (CPU build, default model) runs as a separate process, once with
``--enable-prompt-tokens-details`` and once without; cachetally runs as
``cachetally serve --upstream`` in front of it. Every comparison sends the same request
directly to vLLM and through the proxy, and compares what the client gets.

The two vLLM servers run one after the other, never at once: ``stack`` is a module-scoped
fixture parametrized indirectly, so pytest groups the tests by flag state and stops the
first server before it starts the second (~40 s each with ``--enforce-eager``). Each is
stopped in ``finally`` (SIGTERM, wait, SIGKILL) together with its engine-core and worker
processes.

The warm value is deterministic: vLLM caches whole blocks and always recomputes the last
prompt token, so a repeated prompt reports ``((prompt_tokens - 1) // block) * block``, with
the block size the engine reports on its ``/metrics``.

Its chat template is the model's with the request's tools and the messages' tool calls
rendered first (:data:`TOOLS_FIRST`): SmolLM2's own renders neither, and their tokens are
part of the prompt a client is billed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import psutil
import pytest

from engine_adapter.vllm.cpu import machine_flags
from engine_adapter.vllm.model_store import DEFAULT_MODEL_NAME, ensure_default_model
from tests.clients import engine_block_size, fresh_prompt, warm_hit
from tests.real_vllm import test_vllm_apis as apis
from tests.real_vllm.test_vllm_records import records_for
from tests.servers import ENGINE_KV_FLAGS, ROOT, Pace, free_port, measure_pace, metric_value, running_server, stop

pytestmark = [pytest.mark.vllm, pytest.mark.loopback]

START_TIMEOUT_S = 600.0  # ~40 s alone; slower when other suites share the two cores
ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}

ON = pytest.mark.parametrize("stack", ["details-on"], indirect=True)
OFF = pytest.mark.parametrize("stack", ["details-off"], indirect=True)


# -- fixtures: vLLM as a subprocess, cachetally in front of it ----------------------------


def _family(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.NoSuchProcess):
        return psutil.Process(pid).children(recursive=True)
    return []


#: Put before the model's chat template: the tools as JSON in a system turn of their own, and
#: each assistant message's reasoning and tool calls (name and arguments) in one each, as
#: templates that take tools and reasoning write them (SmolLM2's ignores them). Field by field, as tool-use templates write a call (Llama 3.x,
#: Qwen2.5): vLLM's Responses route hands a template a call's function as ``name`` then
#: ``arguments``, its ``/tokenize`` the other way round (docs/ACCOUNTING.md).
TOOLS_FIRST = ("{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
               "{% for m in messages %}{% if m.reasoning %}<|im_start|>system\nThought: {{ m.reasoning }}"
               "<|im_end|>\n{% endif %}{% for c in m.tool_calls or [] %}<|im_start|>system\nCall: "
               '{"name": {{ c.function.name | tojson }}, "arguments": {{ c.function.arguments | tojson }}}'
               "<|im_end|>\n{% endfor %}{% endfor %}")


@contextlib.contextmanager
def vllm_server(details: bool, log_path: Path) -> Iterator[str]:
    """vLLM's OpenAI server on 127.0.0.1 until healthy; always stopped with its children."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    model = ensure_default_model(progress=False)
    template = log_path.with_name("chat_template.jinja")
    template.write_text(TOOLS_FIRST + (model / "chat_template.jinja").read_text())
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--chat-template", str(template),
        "--served-model-name", DEFAULT_MODEL_NAME,
        "--enable-prefix-caching", *ENGINE_KV_FLAGS,
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    args += machine_flags(ENGINE_KV_FLAGS)  # the embedded engine's CPU defaults (eager, float32 without bf16)
    if details:
        args.append("--enable-prompt-tokens-details")
    # Children are collected while the server runs: once the parent is gone, orphans can
    # no longer be found through it.
    children: dict[int, psutil.Process] = {}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, cwd=ROOT, env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                children |= {child.pid: child for child in _family(proc.pid)}
                if proc.poll() is not None:
                    raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{_tail(log_path)}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vLLM not healthy after {START_TIMEOUT_S} s:\n{_tail(log_path)}")
                time.sleep(0.5)
            children |= {child.pid: child for child in _family(proc.pid)}
            assert any("EngineCore" in _name(c) for c in children.values()), "no engine-core process"
            yield url
        finally:
            children |= {child.pid: child for child in _family(proc.pid)}
            stop(proc, timeout_s=60)
            _, alive = psutil.wait_procs(list(children.values()), timeout=30)
            for child in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            _, still = psutil.wait_procs(alive, timeout=10)
            assert not still, f"vLLM processes left behind: {still}"


def _name(process: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(process.cmdline()) or process.name()
    return ""


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Stack:
    details: bool
    vllm: str
    proxy: str  # cachetally serve --upstream, `missing` = zero (the default), with usage records
    omit: str  # the same with --missing omit
    legs: str  # the same as `proxy` with --pd-legs: a client's kv_transfer_params reach vLLM
    usage: Path  # where `proxy` and `legs` write their usage records
    pace: Pace  # one request on this vLLM, timed
    block: int  # this vLLM's prefix-cache block size, as it reports it

    def records(self, request_ids: set[str]) -> list[dict[str, Any]]:
        """The usage records ``proxy`` wrote for ``request_ids``, once there is one for each
        (or 30 s are up)."""
        return [record for found in records_for(self.usage, request_ids, timeout_s=30).values() for record in found]

    def send(self, base: str, route: str, payload: dict[str, Any]) -> bytes:
        """The raw response body (the SSE stream as it came, for a streaming request)."""
        with (
            httpx.Client(timeout=self.pace.timeout()) as client,
            client.stream("POST", base + ROUTES[route], json=payload) as resp,
        ):
            raw = b"".join(resp.iter_raw())
            assert resp.status_code == 200, raw
            kind = "text/event-stream" if payload.get("stream") else "application/json"
            assert resp.headers["content-type"].startswith(kind)
            return raw


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    details = {"details-on": True, "details-off": False}[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    usage = folder / "usage"
    with vllm_server(details, folder / "vllm.log") as upstream, contextlib.ExitStack() as proxies:
        # Entered after vLLM, so they stop before it.
        serve = ["-m", "proxy.server.cli", "serve", "--upstream", upstream, "--log-level", "warning"]
        recorded = [*serve, "--usage-dir", str(usage), "--usage-flush-interval", "0.05"]
        zero, _ = proxies.enter_context(running_server(recorded, timeout_s=120))
        omit, _ = proxies.enter_context(running_server([*serve, "--missing", "omit"], timeout_s=120))
        legs, _ = proxies.enter_context(running_server([*recorded, "--pd-legs"], timeout_s=120))
        yield Stack(details, upstream, zero, omit, legs, usage, measure_pace(upstream, DEFAULT_MODEL_NAME),
                    engine_block_size(upstream))


# -- helpers ---------------------------------------------------------------------------------


def body(route: str, prompt: str, stream: bool, stream_options: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"model": DEFAULT_MODEL_NAME, "max_tokens": 4, "temperature": 0}
    out |= {"messages": [{"role": "user", "content": prompt}]} if route == "chat" else {"prompt": prompt}
    if stream:
        out["stream"] = True
        if stream_options is not None:
            out["stream_options"] = stream_options
    return out


def normalized(raw: bytes) -> bytes:
    """Ids and timestamps aside (the proxy's X-Request-Id becomes vLLM's response id)."""
    raw = re.sub(rb'"id":"[^"]*"', b'"id":"X"', raw)
    return re.sub(rb'"created":\d+', b'"created":0', raw)


def sse_events(raw: bytes) -> list[bytes]:
    """Each event's bytes, normalized, in order; the stream must end with ``[DONE]``."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    return [normalized(event) for event in raw.split(b"\n\n")[:-1]]


OPENAI_WRITES = re.compile(rb',"cache_write_tokens":(\d+)')


def as_vllm_sent(raw: bytes) -> bytes:
    """The proxy's bytes less the one thing it adds to vLLM's own report: the cache writes vLLM
    names ``created_cache_tokens`` also under OpenAI's name, ``cache_write_tokens`` (what the
    ``openai`` SDK reads), the same figure."""
    for match in OPENAI_WRITES.finditer(raw):
        assert b'"created_cache_tokens":' + match[1] in raw, raw
    return OPENAI_WRITES.sub(b"", raw)


def data(event: bytes) -> Any:
    assert event.startswith(b"data: "), event
    payload = event[len(b"data: ") :]
    return "[DONE]" if payload == b"[DONE]" else orjson.loads(payload)


def usage_of(raw: bytes, stream: bool) -> dict[str, Any]:
    """The response's usage: the JSON body's, or the stream's final usage chunk's."""
    if not stream:
        return orjson.loads(raw)["usage"]
    chunks = [data(e) for e in sse_events(raw)]
    final = [c for c in chunks if isinstance(c, dict) and c.get("usage") and c["choices"] == []]
    assert len(final) == 1, chunks
    return final[0]["usage"]


class Counts:
    """Deltas of the proxy's own counters around a block of requests (the proxy is shared)."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.before = self._text()

    def _text(self) -> str:
        return httpx.get(f"{self.base}/metrics", timeout=10).text

    def delta(self, name: str, **labels: str) -> float:
        after = self._text()
        return metric_value(after, name, **labels) - metric_value(self.before, name, **labels)

    def requests(self, route: str, stream: bool) -> dict[str, float]:
        after = self._text()
        return {
            cache: metric_value(after, "cachetally_requests_total", route=route, stream=str(stream).lower(), cache=cache)
            - metric_value(
                self.before, "cachetally_requests_total", route=route, stream=str(stream).lower(), cache=cache
            )
            for cache in ("hit", "miss", "unknown")
        }


# -- flag on: the proxy passes vLLM's own report through, byte for byte ----------------------


@ON
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_cached_tokens_and_bytes_equal_vllms_own(stack: Stack, route: str, stream: bool) -> None:
    prompt = fresh_prompt()
    options = {"include_usage": True}
    counts = Counts(stack.proxy)
    cold = usage_of(stack.send(stack.proxy, route, body(route, prompt, stream, options)), stream)
    direct = stack.send(stack.vllm, route, body(route, prompt, stream, options))
    proxied = stack.send(stack.proxy, route, body(route, prompt, stream, options))

    assert cold["prompt_tokens"] > 3 * stack.block
    assert cold["prompt_tokens_details"]["cached_tokens"] == 0  # 0 is written as 0
    expected = warm_hit(cold["prompt_tokens"], stack.block)
    assert usage_of(direct, stream)["prompt_tokens_details"]["cached_tokens"] == expected
    assert usage_of(proxied, stream)["prompt_tokens_details"]["cached_tokens"] == expected
    # vLLM already wrote the exact value, so the proxy patched nothing but vLLM's cache writes,
    # also under OpenAI's name (chat; vLLM's completions report none): the whole response (the
    # usage chunk included) is what vLLM sent, ids and timestamps aside.
    writes = usage_of(direct, stream)["prompt_tokens_details"].get("created_cache_tokens")
    assert (route == "chat") == (writes is not None)
    assert usage_of(proxied, stream)["prompt_tokens_details"].get("cache_write_tokens") == writes
    if stream:
        assert sse_events(as_vllm_sent(proxied)) == sse_events(direct)
    else:
        assert normalized(as_vllm_sent(proxied)) == normalized(direct)
    assert counts.requests(route, stream) == {"hit": 1, "miss": 1, "unknown": 0}
    assert counts.delta("cachetally_cached_tokens_total", source="upstream", tier="all") == expected


@ON
@pytest.mark.parametrize("claim", [60, 10_000_000])
def test_a_clients_claim_of_cache_reads_never_reaches_the_upstream(stack: Stack, claim: int) -> None:
    """vLLM reports ``kv_transfer_params.remote_prefill_cached_tokens`` from any body as the
    request's cache reads (asked directly, it says so). Through the proxy, which serves no P/D
    legs, a fresh prompt reads 0, as billed."""
    payload = body("chat", fresh_prompt(), False)
    payload["kv_transfer_params"] = {"do_remote_prefill": True, "remote_prefill_cached_tokens": claim}
    direct = usage_of(stack.send(stack.vllm, "chat", payload), False)
    assert direct["prompt_tokens_details"]["cached_tokens"] == claim  # the attack, on vLLM itself
    payload["messages"][0]["content"] = fresh_prompt()
    counts = Counts(stack.proxy)
    proxied = usage_of(stack.send(stack.proxy, "chat", payload), False)
    assert proxied["prompt_tokens_details"]["cached_tokens"] == 0
    assert counts.delta("cachetally_cached_tokens_total", tier="all") == 0


@ON
@pytest.mark.parametrize("path", list(apis.PATHS))
def test_messages_and_responses_cold_zero_warm_full_blocks_and_counted(stack: Stack, path: str) -> None:
    """The Messages and Responses APIs in front of vLLM, with the official SDKs: the
    proxy normalizes what vLLM reports (Anthropic's ``input_tokens`` excludes reads and
    writes) and counts each request under its route."""
    route, ask = apis.PATHS[path]
    prompt = fresh_prompt()
    size = apis.prompt_size(stack.vllm, DEFAULT_MODEL_NAME, prompt)
    counts = Counts(stack.proxy)
    timeout = stack.pace.timeout(2)
    if route == "messages":
        client: Any = anthropic.Anthropic(base_url=stack.proxy, api_key="unused", max_retries=0, timeout=timeout)
        if path == "messages-sse":
            ask = functools.partial(apis.messages_sse, start_known=False)
    else:
        client = openai.OpenAI(base_url=f"{stack.proxy}/v1", api_key="unused", max_retries=0, timeout=timeout)
    with client:
        cold = ask(client, DEFAULT_MODEL_NAME, prompt, uuid.uuid4().hex)
        warm = ask(client, DEFAULT_MODEL_NAME, prompt, uuid.uuid4().hex)
    assert (cold[0], cold[1]) == (size, 0)
    assert (warm[0], warm[1]) == (size, warm_hit(size, stack.block))
    assert counts.requests(route, path.endswith("sse")) == {"hit": 1, "miss": 1, "unknown": 0}


@ON
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_ghost_usage_leaves_the_stream_byte_identical_and_counts_it(stack: Stack, route: str) -> None:
    prompt = fresh_prompt()
    stack.send(stack.vllm, route, body(route, prompt, stream=False))  # warm
    counts = Counts(stack.proxy)
    direct = sse_events(stack.send(stack.vllm, route, body(route, prompt, stream=True)))
    proxied = sse_events(stack.send(stack.proxy, route, body(route, prompt, stream=True)))

    # The proxy asked vLLM for include_usage and dropped the usage chunk: the client gets
    # exactly the events a direct request gives (ids and timestamps aside), including the
    # system_fingerprint that vLLM 0.32 moves to the usage chunk when include_usage is on ...
    assert not any(b'"usage"' in event for event in direct + proxied)
    assert any(b'"system_fingerprint"' in event for event in direct)
    assert proxied == direct
    # ... and the request is counted with the value from the dropped chunk.
    assert counts.requests(route, True) == {"hit": 1, "miss": 0, "unknown": 0}
    assert counts.delta("cachetally_cached_tokens_total", source="upstream", tier="all") > 0


@ON
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_chunks_gain_cached_tokens(stack: Stack, route: str) -> None:
    prompt = fresh_prompt()
    options = {"include_usage": True, "continuous_usage_stats": True}
    stack.send(stack.vllm, route, body(route, prompt, stream=False))  # warm
    direct = sse_events(stack.send(stack.vllm, route, body(route, prompt, True, options)))
    counts = Counts(stack.proxy)
    proxied = sse_events(stack.send(stack.proxy, route, body(route, prompt, True, options)))
    # Counted once, with the final chunk's value (the last usage object seen wins).
    assert counts.requests(route, True) == {"hit": 1, "miss": 0, "unknown": 0}

    assert len(proxied) == len(direct) >= 5  # 4 tokens (+ the role chunk for chat), usage, [DONE]
    # vLLM's final usage chunk carries the value; the proxy leaves it byte for byte, but for
    # vLLM's cache writes, also under OpenAI's name.
    assert as_vllm_sent(proxied[-2]) == direct[-2] and proxied[-1] == direct[-1] == b"data: [DONE]"
    final = data(direct[-2])["usage"]
    expected = warm_hit(final["prompt_tokens"], stack.block)
    assert final["prompt_tokens_details"]["cached_tokens"] == expected
    # The continuous chunks before it: vLLM omits prompt_tokens_details there even with the
    # flag on. Upstream mode has no engine event, so the proxy knows the value only once the
    # final chunk arrives, after these went out; until then no source knows it and the
    # `missing` policy applies (zero by default). So each gains the field, written as 0,
    # and is otherwise the chunk vLLM sent.
    continuous = list(zip(direct[:-2], proxied[:-2], strict=True))
    for direct_event, proxied_event in continuous:
        sent, got = data(direct_event), data(proxied_event)
        assert "prompt_tokens_details" not in sent["usage"]
        assert got["usage"].pop("prompt_tokens_details") == {"cached_tokens": 0}
        assert got == sent


@ON
def test_continuous_usage_chunks_with_missing_omit_stay_as_vllm_sent_them(stack: Stack) -> None:
    prompt = fresh_prompt()
    options = {"include_usage": True, "continuous_usage_stats": True}
    stack.send(stack.vllm, "chat", body("chat", prompt, stream=False))  # warm
    direct = sse_events(stack.send(stack.vllm, "chat", body("chat", prompt, True, options)))
    proxied = sse_events(stack.send(stack.omit, "chat", body("chat", prompt, True, options)))
    assert [as_vllm_sent(event) for event in proxied] == direct  # the final one's writes under both names
    assert data(proxied[-2])["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


#: Bodies whose prompt vLLM's ``/tokenize`` is asked to count, each as the client sends it:
#: a system message, an assistant's message continued, template kwargs, a truncation that cuts
#: the prompt, two choices, a completions prompt with and without the special tokens, two prompts.
CUT_BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat-system": ("chat", {"messages": [{"role": "system", "content": "Answer in French."}, {"role": "user"}]}),
    "chat-continued": ("chat", {"messages": [{"role": "user"}, {"role": "assistant", "content": "Sure, the"}],
                                "add_generation_prompt": False, "continue_final_message": True}),
    "chat-template-kwargs": ("chat", {"messages": [{"role": "user"}], "chat_template_kwargs": {"enable_thinking": False}}),
    "chat-truncated": ("chat", {"messages": [{"role": "user"}], "truncate_prompt_tokens": 100}),
    # a tool the client never lets be called: rendered all the same (vLLM's default)
    "chat-tool-never-called": ("chat", {"messages": [{"role": "user"}], "tools": [
        {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        "tool_choice": "none"}),
    "chat-two-choices": ("chat", {"messages": [{"role": "user"}], "n": 2, "temperature": 1.0}),  # one prompt, reported once
    "completions": ("completions", {}),
    "completions-bare": ("completions", {"add_special_tokens": False}),
    "completions-two-prompts": ("completions", {"prompt": ["", ""]}),  # vLLM's usage sums them
}


def _cut_body(case: str) -> tuple[str, dict[str, Any]]:
    route, extra = CUT_BODIES[case]
    out = {"model": DEFAULT_MODEL_NAME, "max_tokens": 48, "temperature": 0, "ignore_eos": True, **extra}
    if route == "chat":
        out["messages"] = [{**m, "content": m.get("content", fresh_prompt())} for m in extra["messages"]]
    else:
        out["prompt"] = [fresh_prompt() for _ in extra["prompt"]] if "prompt" in extra else fresh_prompt()
    return route, out


@ON
def test_a_stream_cut_before_its_usage_chunk_is_billed_the_prompt_vllm_reports(stack: Stack) -> None:
    """A client that reads a few tokens and hangs up before the usage chunk is billed the
    prompt vLLM's ``/tokenize`` counts for the body, which is the ``prompt_tokens`` vLLM's usage
    reports for the same prompt read whole (asked with ``max_tokens`` 1: the prompt is rendered
    and counted before the tokens are); its cache unknown. The module's proxy, with usage records."""
    expected = {}
    with openai.OpenAI(base_url=f"{stack.proxy}/v1", api_key="unused", max_retries=0,
                       timeout=stack.pace.timeout(4)) as client:
        for case in CUT_BODIES:
            route, payload = _cut_body(case)
            whole = stack.send(stack.vllm, route, {**payload, "max_tokens": 1, "stream": True,
                                                   "stream_options": {"include_usage": True}})
            expected[case] = usage_of(whole, True)["prompt_tokens"]
            if "tools" in payload:  # the template renders them: they are billed
                bare = {k: v for k, v in payload.items() if k not in ("tools", "tool_choice")}
                assert expected[case] > usage_of(stack.send(stack.vllm, route, {**bare, "max_tokens": 1}), False)[
                    "prompt_tokens"]
            standard = {k: payload[k] for k in ("model", "max_tokens", "temperature", "messages", "prompt") if k in payload}
            extra = {k: v for k, v in payload.items() if k not in standard}
            create = client.chat.completions.create if route == "chat" else client.completions.create
            stream: Any = create(**standard, stream=True, extra_body=extra, extra_headers={"x-request-id": case})
            read = [chunk for chunk, _ in zip(stream, range(3))]
            stream.close()
            assert len(read) == 3
    found = stack.records(set(CUT_BODIES))
    assert expected["chat-truncated"] == 100
    got = {r["request_id"]: (r["outcome"], r["prompt_tokens"], r["cached_tokens"], r["source"]) for r in found}
    assert len(found) == len(CUT_BODIES)
    assert got == {case: ("disconnected", n, None, "tokenize") for case, n in expected.items()}


#: Responses and Messages bodies cut the same way, each as the client sends it (``input`` and
#: ``messages`` filled with a fresh prompt): a string input, instructions beside it, message
#: items of string and ``input_text`` content (a system, a developer and an assistant turn),
#: truncation ``auto``, other tools, a reasoning effort, a function tool beside an agent's
#: turn (reasoning, function calls, their outputs, an output item); a Messages body with a
#: system prompt.
API_CUT_BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "responses-string": ("responses", {}),
    "responses-instructions": ("responses", {"instructions": "Answer in French."}),
    "responses-items": ("responses", {"input": [
        {"role": "system", "content": "Be brief."},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "No lists."}]},
        {"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": [{"type": "input_text"}, {"type": "input_text", "text": "Thanks."}]}]}),
    "responses-truncation-auto": ("responses", {"truncation": "auto"}),
    # a custom tool (shown as a one-string function), a namespace's function, a built-in tool (not shown)
    "responses-other-tools": ("responses", {"tools": [
        {"type": "custom", "name": "run_sql", "description": "Runs a query."},
        {"type": "namespace", "name": "crm", "description": "The CRM.", "tools": [
            {"type": "function", "name": "find", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]},
        {"type": "web_search"}]}),
    "responses-reasoning": ("responses", {"reasoning": {"effort": "low"}}),
    # function, namespace and custom tools, and an agent's loop: its reasoning and three calls
    # (a function's, a namespace's, a custom tool's: merged into one assistant message), their
    # outputs (text, text parts), the assistant's answer as the response's output item, and
    # the next user turn
    "responses-tool-calls": ("responses", {"tools": [
        {"type": "function", "name": "get_weather", "description": "The weather in a city.", "strict": False,
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
        {"type": "namespace", "name": "clock", "description": "Time.", "tools": [{"type": "function", "name": "now"}]},
        {"type": "custom", "name": "run_python", "description": "Runs Python."}],
        "input": [
            {"role": "user", "content": "What is the weather in Paris and the time?"},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "I need the weather tool and the time."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "c2", "namespace": "clock", "name": "now", "arguments": "{}",
             "id": "fc_2", "status": "completed"},
            {"type": "custom_tool_call", "call_id": "c3", "name": "run_python", "input": 'print("21 °C")'},
            {"type": "function_call_output", "call_id": "c1", "output": [
                {"type": "input_text", "text": "Sunny,"}, {"type": "input_text", "text": "21 C."}]},
            {"type": "function_call_output", "call_id": "c2", "output": "Noon."},
            {"type": "custom_tool_call_output", "call_id": "c3", "output": "21 °C"},
            {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "Sunny and noon.", "annotations": []}]},
            {"role": "user", "content": [{"type": "input_text"}]}]}),
    "messages-system": ("messages", {"system": "Answer in French."}),
}


def _api_cut_body(case: str) -> tuple[str, dict[str, Any]]:
    route, extra = API_CUT_BODIES[case]
    prompt = fresh_prompt()
    if route == "messages":
        return route, {"model": DEFAULT_MODEL_NAME, "max_tokens": 64, "temperature": 0,
                       "messages": [{"role": "user", "content": prompt}], **extra}
    given: Any = prompt
    if "input" in extra:  # the last item's first part is the fresh prompt
        given = [*extra["input"][:-1], {**extra["input"][-1], "content": [
            {"type": "input_text", "text": prompt}, *extra["input"][-1]["content"][1:]]}]
    return route, {"model": DEFAULT_MODEL_NAME, "max_output_tokens": 64, "temperature": 0, "ignore_eos": True,
                   **extra, "input": given}


def _read_deltas(stream: Any, wanted: int) -> int:
    """Read a Responses or Messages stream up to ``wanted`` text deltas, then close it: how
    many it read."""
    deltas = 0
    for event in stream:
        deltas += event.type in ("response.output_text.delta", "content_block_delta")
        if deltas == wanted:
            break
    stream.close()
    return deltas


def _whole_prompt(stack: Stack, route: str, payload: dict[str, Any]) -> int:
    """The prompt vLLM's usage reports for ``payload``'s prompt read whole, asked with one
    output token (Messages: all three parts)."""
    path = "/v1/responses" if route == "responses" else "/v1/messages"
    limit = "max_output_tokens" if route == "responses" else "max_tokens"
    answer = httpx.post(stack.vllm + path, json={**payload, limit: 1}, timeout=stack.pace.timeout(4))
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    if route == "responses":
        return usage["input_tokens"]
    return usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0) + (
        usage.get("cache_creation_input_tokens") or 0)


@ON
def test_a_responses_or_messages_stream_cut_before_its_usage_is_billed_the_prompt_vllm_reports(stack: Stack) -> None:
    """The official ``openai`` (``responses.create(stream=True)``) and ``anthropic``
    (``messages.create(stream=True)``) clients read two text deltas and hang up before the
    final usage: the record bills the prompt vLLM's usage reports for the same prompt read whole."""
    timeout = stack.pace.timeout(4)
    expected = {}
    with openai.OpenAI(base_url=f"{stack.proxy}/v1", api_key="unused", max_retries=0, timeout=timeout) as oai, \
            anthropic.Anthropic(base_url=stack.proxy, api_key="unused", max_retries=0, timeout=timeout) as claude:
        for case in API_CUT_BODIES:
            route, payload = _api_cut_body(case)
            expected[case] = _whole_prompt(stack, route, payload)
            if "tools" in payload:  # the template renders them: they are billed
                assert expected[case] > _whole_prompt(stack, route, {k: v for k, v in payload.items() if k != "tools"})
            headers = {"x-request-id": case}
            extra = {k: payload[k] for k in ("ignore_eos", "temperature") if k in payload}  # past the SDKs' types
            standard = {k: v for k, v in payload.items() if k not in extra}
            create = oai.responses.create if route == "responses" else claude.messages.create
            stream: Any = create(**standard, stream=True, extra_body=extra, extra_headers=headers)
            assert _read_deltas(stream, 2) == 2
    found = stack.records(set(API_CUT_BODIES))
    got = {r["request_id"]: (r["route"], r["outcome"], r["prompt_tokens"], r["cached_tokens"], r["source"])
           for r in found}
    assert len(found) == len(API_CUT_BODIES)
    assert got == {case: (route, "disconnected", expected[case], None, "tokenize" if route == "responses" else None)
                   for case, (route, _) in API_CUT_BODIES.items()}


#: A prefill stage's token ids, as disaggregated serving hands them to the decode stage.
REUSED_IDS = list(range(1000, 1300))
#: Bodies that carry them in ``kv_transfer_params``: vLLM runs them as the prompt, untruncated,
#: unless a chat asks to ``echo`` (then it renders the messages).
REUSED_BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "reused-chat": ("chat", {}),
    "reused-chat-truncated": ("chat", {"truncate_prompt_tokens": 20}),
    "reused-chat-echo": ("chat", {"echo": True}),
    "reused-responses": ("responses", {}),
}


@ON
def test_a_stream_cut_before_its_usage_is_billed_the_reused_ids_vllm_runs(stack: Stack) -> None:
    """With ``--pd-legs`` a client's ``kv_transfer_params`` reach vLLM; ``prompt_token_ids`` in
    them are the prompt it runs, not the messages. A client sends 300 of them beside a fresh
    message, reads a few chunks and hangs up: the record bills the prompt vLLM's usage reports
    for the same body read whole (on the code before, ``null``)."""
    expected = {}
    with openai.OpenAI(base_url=f"{stack.legs}/v1", api_key="unused", max_retries=0,
                       timeout=stack.pace.timeout(4)) as client:
        for case, (route, extra) in REUSED_BODIES.items():
            prompt = fresh_prompt()
            payload = {"model": DEFAULT_MODEL_NAME, "temperature": 0,
                       "kv_transfer_params": {"prompt_token_ids": REUSED_IDS}, **extra}
            headers, options = {"x-request-id": case}, {"ignore_eos": True, **extra}
            if route == "chat":
                messages = [{"role": "user", "content": prompt}]
                whole = stack.send(stack.vllm, route, {**payload, "messages": messages, "max_tokens": 1})
                expected[case] = usage_of(whole, False)["prompt_tokens"]
                stream: Any = client.chat.completions.create(
                    model=DEFAULT_MODEL_NAME, messages=messages, max_tokens=48, temperature=0, stream=True,
                    extra_body={"kv_transfer_params": {"prompt_token_ids": REUSED_IDS}, **options},
                    extra_headers=headers)
                read = len([chunk for chunk, _ in zip(stream, range(3))])
            else:
                expected[case] = _whole_prompt(stack, route, {**payload, "input": prompt})
                stream = client.responses.create(
                    model=DEFAULT_MODEL_NAME, input=prompt, max_output_tokens=48, temperature=0, stream=True,
                    extra_body={"kv_transfer_params": {"prompt_token_ids": REUSED_IDS}, **options},
                    extra_headers=headers)
                read = _read_deltas(stream, 3)
            stream.close()
            assert read == 3
    assert expected["reused-chat"] == expected["reused-chat-truncated"] == len(REUSED_IDS) != expected["reused-chat-echo"]
    found = stack.records(set(REUSED_BODIES))
    got = {r["request_id"]: (r["outcome"], r["prompt_tokens"], r["cached_tokens"], r["source"]) for r in found}
    assert len(found) == len(REUSED_BODIES)
    assert got == {case: ("disconnected", n, None, "tokenize") for case, n in expected.items()}


# -- flag off: the `missing` policy, counted as unknown ----------------------------------------


@OFF
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_without_the_flag_missing_policy_applies_and_cache_is_unknown(
    stack: Stack, route: str, stream: bool
) -> None:
    prompt = fresh_prompt()
    options = {"include_usage": True}
    stack.send(stack.vllm, route, body(route, prompt, stream=False))  # warm: vLLM does hit, silently
    zero_counts, omit_counts, engine_counts = Counts(stack.proxy), Counts(stack.omit), Counts(stack.vllm)
    direct = stack.send(stack.vllm, route, body(route, prompt, stream, options))
    zero = stack.send(stack.proxy, route, body(route, prompt, stream, options))
    omit = stack.send(stack.omit, route, body(route, prompt, stream, options))

    sent = usage_of(direct, stream)
    # vLLM did reuse its cache for all three; it just does not say so in the response.
    hits = engine_counts.delta("vllm:prompt_tokens_cached_total")
    assert hits == 3 * warm_hit(sent["prompt_tokens"], stack.block) > 0
    if stream:
        assert "prompt_tokens_details" not in sent
        events, zero_events = sse_events(direct), sse_events(zero)
        # Only the usage chunk changed: it gained {"cached_tokens": 0}.
        assert zero_events[:-2] == events[:-2] and zero_events[-1] == events[-1]
        patched, original = data(zero_events[-2]), data(events[-2])
        assert patched["usage"].pop("prompt_tokens_details") == {"cached_tokens": 0}
        assert patched == original
        assert sse_events(omit) == events
        assert "prompt_tokens_details" not in usage_of(omit, stream)
    else:
        assert sent["prompt_tokens_details"] is None
        patched, original = orjson.loads(normalized(zero)), orjson.loads(normalized(direct))
        assert patched["usage"].pop("prompt_tokens_details") == {"cached_tokens": 0}
        original["usage"].pop("prompt_tokens_details")
        assert patched == original
        assert normalized(omit) == normalized(direct)
        assert usage_of(omit, stream)["prompt_tokens_details"] is None
    for counts in (zero_counts, omit_counts):
        assert counts.requests(route, stream) == {"hit": 0, "miss": 0, "unknown": 1}
        # An unknown request stays out of the token counters altogether ("prompt tokens of
        # counted requests"), so their ratio is never diluted by requests without a report.
        assert counts.delta("cachetally_cached_tokens_total") == 0
        assert counts.delta("cachetally_prompt_tokens_total") == 0


@OFF
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_without_the_flag_ghost_usage_counts_unknown(stack: Stack, route: str) -> None:
    prompt = fresh_prompt()
    counts = Counts(stack.proxy)
    raw = stack.send(stack.proxy, route, body(route, prompt, stream=True))
    assert b'"usage"' not in raw
    assert counts.requests(route, True) == {"hit": 0, "miss": 0, "unknown": 1}
