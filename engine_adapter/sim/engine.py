"""A simulated OpenAI-compatible engine with a real prefix cache, for tests and benchmarks.

No model: prompts are tokenized deterministically (:mod:`engine_adapter.sim.tokenizer`), looked up in a
block-hash prefix cache with vLLM's counting rules (:mod:`engine_adapter.sim.prefix_cache`), and answered with
``max_tokens`` deterministic tokens (`` tok0 tok1 …``, ``finish_reason: length``).

Each engine request (each prompt of a request; ``n`` choices share one) is announced
(:meth:`~engine_adapter.events.EventSink.added`) when the request arrives and scheduled
after ``prefill_delay_s``, before the handler returns, so its
:class:`~engine_adapter.events.Scheduled` is published before the first byte of the
response exists. One whose client leaves during the prefill publishes nothing more, as
vLLM reports nothing for it, and is answered ``null``, as vLLM's ``with_cancellation``
answers it. It is keyed by the proxy's
:data:`~engine_adapter.events.current_request_key`, or by the response id when the sim
is served alone. Like engines that drop the number, responses carry no
``prompt_tokens_details`` unless ``report_cached_tokens`` is set (vLLM's
``--enable-prompt-tokens-details``). It also serves the Responses and Messages APIs
(:mod:`engine_adapter.sim.apis`), and vLLM's ``/tokenize`` (:mod:`engine_adapter.sim.tokenize_route`).

Standalone: ``python -m engine_adapter.sim --host 127.0.0.1 --port 8000`` (:mod:`engine_adapter.sim.__main__`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from engine_adapter.events import EventSink, Scheduled, current_request_key
from engine_adapter.sim import apis
from engine_adapter.sim.prefix_cache import PrefixCache
from engine_adapter.sim.tokenize_route import tokenize_route
from engine_adapter.sim.protocol import (
    SYSTEM_FINGERPRINT,
    Kind,
    Reported,
    RequestError,
    SimRequest,
    full_response,
    generated_token,
    parse_request,
    reported_figures,
    sse,
    stream_choice,
    usage,
)


@dataclass(frozen=True, slots=True)
class SimConfig:
    model: str = "sim-model"
    block_size: int = 16
    capacity_blocks: int = 4096
    #: Delay per generation step (all choices of a request decode together).
    token_delay_s: float = 0.0
    #: Delay between a request's arrival (its prompts announced) and its prefill's end (its
    #: ``Scheduled``): a client may hang up in between, as it may before vLLM's prefill ends.
    prefill_delay_s: float = 0.0
    default_max_tokens: int = 16
    #: Put ``usage.prompt_tokens_details.cached_tokens`` in responses, like vLLM with
    #: ``--enable-prompt-tokens-details`` (its figures: :func:`~engine_adapter.sim.protocol.reported_figures`).
    report_cached_tokens: bool = False


class SimEngine:
    """The simulated engine; implements :class:`~engine_adapter.engine.Engine`."""

    name = "sim"

    def __init__(self, sink: EventSink | None = None, config: SimConfig = SimConfig()) -> None:
        self.sink = sink
        self.config = config
        self.cache = PrefixCache(config.block_size, config.capacity_blocks)
        self.requests_total = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self._running = False
        self._app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/responses", self._responses, methods=["POST"]),
                Route("/v1/messages", self._messages, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/tokenize", tokenize_route(config.model), methods=["POST"]),
                Route("/health", self._health, methods=["GET"]),
            ]
        )

    async def start(self) -> Starlette:
        # starlette's StreamingResponse loads anyio's task groups and asyncio backend at the
        # first stream, and an import opens files: a server out of descriptors answered every
        # stream 500 until one got through. A task group loads them now.
        async with anyio.create_task_group():
            pass
        self._running = True
        return self._app

    async def stop(self) -> None:
        self._running = False

    def healthy(self) -> bool:
        return self._running

    def describe(self) -> str:
        return f"model {self.config.model}, simulated, block size {self.config.block_size}"

    def metrics_text(self) -> bytes:
        lines = []
        for name, kind, value, help_ in (
            ("sim_requests_total", "counter", self.requests_total, "Engine requests scheduled."),
            ("sim_prompt_tokens_total", "counter", self.prompt_tokens_total, "Prompt tokens."),
            ("sim_prompt_tokens_cached_total", "counter", self.cached_tokens_total,
             "Prompt tokens served from the prefix cache."),
            ("sim_prefix_cache_blocks", "gauge", self.cache.num_cached_blocks, "Cached blocks."),
        ):
            lines.append(f"# HELP {name} {help_}\n# TYPE {name} {kind}\n{name} {value}\n")
        return "".join(lines).encode()

    def announce(self, prompts: list[list[int]], key: str) -> None:
        """Tell the sink each engine request's prompt length before its prefill, as vLLM's tap does."""
        if self.sink is not None:
            for token_ids in prompts:
                self.sink.added(key, len(token_ids))

    def schedule(
        self, token_ids: list[int], key: str, first_choice: int | None = None, choices: int = 1
    ) -> tuple[int, int]:
        """Look the prompt up, cache it, publish its ``Scheduled``; return the cached tokens
        and the tokens written to the cache. ``first_choice``, ``choices``: the response's
        choices this prompt makes, as vLLM's tap says them, so a per-prompt usage chunk gets
        its own prompt's reads even where two prompts of one length differ in them."""
        cached = self.cache.lookup(token_ids)
        created = self.cache.insert(token_ids)
        self.requests_total += 1
        self.prompt_tokens_total += len(token_ids)
        self.cached_tokens_total += cached
        if self.sink is not None:
            self.sink.publish(
                Scheduled(
                    request_id=key,
                    prompt_tokens=len(token_ids),
                    cached_tokens=cached,
                    local_cached_tokens=cached,
                    external_cached_tokens=0,
                    cache_creation_tokens=created,
                    source="engine",
                    first_choice=first_choice,
                    choices=choices,
                )
            )
        return cached, created

    async def _chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def _responses(self, request: Request) -> Response:
        return await self._api(request, "responses")

    async def _messages(self, request: Request) -> Response:
        return await self._api(request, "messages")

    async def _api(self, request: Request, api: str) -> Response:
        """The Responses and Messages routes (:mod:`engine_adapter.sim.apis`)."""
        cfg = self.config
        try:
            if not self._running:
                raise RequestError("The engine is not running.", 503, "ServiceUnavailableError")
            req = apis.parse(await request.body(), api, cfg.model, cfg.default_max_tokens)
        except RequestError as exc:
            return Response(exc.body(messages=api == "messages"), exc.status, media_type="application/json")
        rid = apis.new_id()
        key = current_request_key.get() or rid
        self.announce([req.prompt], key)
        if not await _client_stays(request, cfg.prefill_delay_s):
            return _client_left()
        figures = self.schedule(req.prompt, key)
        reported = figures if cfg.report_cached_tokens or api == "responses" else None
        if req.stream:
            stream = apis.responses_stream if api == "responses" else apis.messages_stream
            return StreamingResponse(stream(req, rid, reported, self._step), media_type="text/event-stream")
        if not await _client_stays(request, cfg.token_delay_s * req.max_tokens):
            return _client_left()
        whole = apis.responses_json if api == "responses" else apis.messages_json
        return Response(orjson.dumps(whole(req, rid, reported)), media_type="application/json")

    async def _step(self) -> None:
        # Even at no delay, one turn of the loop per token, as an engine's stream gives: else a
        # stream runs to its end unbroken, the loop held, its client's departure unseen.
        await asyncio.sleep(self.config.token_delay_s)

    async def _generate(self, request: Request, kind: Kind) -> Response:
        cfg = self.config
        try:
            if not self._running:
                raise RequestError("The engine is not running.", 503, "ServiceUnavailableError")
            req = parse_request(await request.body(), kind, cfg.model, cfg.default_max_tokens)
        except RequestError as exc:
            return Response(exc.body(), exc.status, media_type="application/json")
        response_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        key = current_request_key.get() or response_id
        self.announce(req.prompts, key)
        if not await _client_stays(request, cfg.prefill_delay_s):  # the prompts prefill together
            return _client_left()
        # Prompt p makes choices p*n to p*n+n-1, as vLLM numbers them.
        figures = [self.schedule(ids, key, p * req.n, req.n) for p, ids in enumerate(req.prompts)]
        reported = reported_figures(req, figures) if cfg.report_cached_tokens else None
        created = int(time.time())
        if req.stream:
            return StreamingResponse(
                self._stream(req, response_id, created, reported), media_type="text/event-stream"
            )
        if not await _client_stays(request, cfg.token_delay_s * req.max_tokens):
            return _client_left()
        body = orjson.dumps(full_response(req, response_id, created, reported))
        return Response(body, media_type="application/json")

    async def _stream(
        self, req: SimRequest, response_id: str, created: int, cached: Reported
    ) -> AsyncIterator[bytes]:
        chat = req.kind == "chat"
        head = {
            "id": response_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": req.model,
        }
        prompt_lens = [len(p) for p in req.prompts]
        if chat:
            for i in range(req.n):
                delta = {"role": "assistant", "content": ""}
                chunk = {**head, "choices": [
                    {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
                ]}
                if req.continuous_usage:
                    chunk["usage"] = usage(prompt_lens[0], 0)
                yield sse(chunk)
        for k in range(req.max_tokens):
            await self._step()
            text, last = generated_token(k), k == req.max_tokens - 1
            for p, prompt_len in enumerate(prompt_lens):
                for i in range(req.n):
                    choice = stream_choice(req.kind, p * req.n + i, text, last)
                    chunk = {**head, "choices": [choice]}
                    if req.continuous_usage:
                        chunk["usage"] = usage(prompt_len, k + 1)
                    if last and not req.include_usage:  # else the usage chunk carries it
                        chunk["system_fingerprint"] = SYSTEM_FINGERPRINT
                    yield sse(chunk)
        if req.include_usage:
            completion = len(prompt_lens) * req.n * req.max_tokens
            yield sse({**head, "choices": [], "usage": usage(sum(prompt_lens), completion, cached),
                       "system_fingerprint": SYSTEM_FINGERPRINT})
        yield b"data: [DONE]\n\n"

    async def _models(self, request: Request) -> Response:
        model = self.config.model
        card = {"id": model, "object": "model", "created": int(time.time()),
                "owned_by": "vllm", "root": model, "parent": None}
        return Response(orjson.dumps({"object": "list", "data": [card]}),
                        media_type="application/json")

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200 if self._running else 503)


def _client_left() -> Response:
    """What vLLM's ``with_cancellation`` answers a request whose client left before its
    response began (a non-streaming one's decode, or any one's prefill)."""
    return Response(b"null", media_type="application/json")


async def _client_stays(request: Request, seconds: float) -> bool:
    """Wait ``seconds`` (a prefill, or a non-streaming request's decode), cut short when the
    client leaves, as vLLM's ``with_cancellation`` cuts it; whether the client stayed."""
    if seconds <= 0:
        return True

    async def left() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    listener = asyncio.ensure_future(left())
    try:
        done, _ = await asyncio.wait({listener}, timeout=seconds)
        return not done
    finally:
        listener.cancel()
