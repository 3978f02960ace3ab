"""The tap on one API server's vLLM engine client: ``generate()`` publishes ``Scheduled``.

vLLM's OpenAI server binds every serving object (chat, completions, responses, ...) to a
single engine client, ``app.state.engine_client`` (``init_app_state``). :class:`EngineTap`
replaces that instance's ``generate`` in place, so every caller reaches the tap whatever
object it holds: vLLM's own ``vllm serve`` with ``--middleware`` (each API server process
of ``--api-server-count N`` builds its own app and taps its own client), and
``cachetally serve``, which runs that same entry point.

Per engine request, one :class:`~engine_adapter.events.Scheduled` is published at its
prefill, with the figures of the request's first copy (:mod:`engine_adapter.vllm.prefill`;
``n > 1`` fans out), before any output of it exists. A non-streaming request has no
output until it ends, so a client that leaves while it decodes is still billed the prompt
vLLM prefilled. Where the prefill hook is not installed, the figures come from the first
``RequestOutput`` of ``generate()`` instead, before the serving layer sees it (exact with
``n = 1``). The key is :data:`~engine_adapter.events.current_request_key`, which the HTTP
middleware set around the request, else vLLM's own request id (then from the output). vLLM's
``--enable-prompt-tokens-details`` is left off: the numbers come from here.

The prefill is matched to its ``generate()`` call by vLLM's internal request id, unique per
call, which vLLM mints inside ``generate()``'s first step (``AsyncLLM.add_request``, called
on the same instance): the tap wraps that method too, finds the call through a context
variable set around that step, and registers it with the prefill hook. A figure that
fails ``Scheduled``'s checks is logged (once) and not published: the request goes on.

A request cut before its prefill ends has neither prefill figures nor an output, but vLLM
holds its prompt from ``add_request`` on: the tap announces its length then
(:meth:`~engine_adapter.events.EventSink.added`, vLLM's ``prompt_len``, the figure its usage
reports), so the prompt is billed with its cache figures unknown where no ``Scheduled`` follows.

Each output ``generate()`` hands the serving layer is counted too, in tokens
(:meth:`~engine_adapter.events.EventSink.generated`): a stream without a usage chunk cannot be
billed by its events, which may each carry many tokens: vLLM merges a stream's outputs that
its serving layer has not taken yet (a client that reads slowly). A beam search's answer
passes through no ``generate()`` call (vLLM's serving layer builds it from its one-token
steps), so the ledger counts none for it and the middleware asks for its usage chunk.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from contextvars import ContextVar
from typing import Any

from engine_adapter.events import EventSink, Scheduled, current_request_key
from engine_adapter.vllm import compat
from engine_adapter.vllm.prefill import Prefill, PrefillTap, claims_remote_cache

logger = logging.getLogger("cachetally.engine.vllm")


class _Call:
    """One ``generate()`` call: the middleware's key, the internal id vLLM gave its request
    once added, whether its figures were published (or refused) at the prefill, and the
    ``output_kind`` of its outputs: ``DELTA`` (a stream's) carry only new tokens, the others
    every token of a choice so far."""

    __slots__ = ("key", "engine_id", "settled", "kind", "tokens", "first_choice", "choices", "claims_cache")

    def __init__(self, key: str | None, params: Any, request_id: object) -> None:
        self.key = key
        self.engine_id: str | None = None
        self.settled = False
        self.claims_cache = claims_remote_cache(params)
        self.kind: str | None = getattr(getattr(params, "output_kind", None), "name", None)
        self.tokens: dict[int, int] = {}  # choice index -> tokens handed so far (not DELTA)
        n = getattr(params, "n", 1)
        self.choices = n if type(n) is int and n > 0 else 1
        self.first_choice = _prompt_index(key, request_id)
        if self.first_choice is not None:
            self.first_choice *= self.choices


def _prompt_index(key: str | None, request_id: object) -> int | None:
    """Which prompt of its HTTP request this call runs: vLLM's completions run prompt ``i``
    as engine request ``cmpl-{X-Request-Id}-{i}``, and make its ``n`` choices
    ``i * n`` to ``i * n + n - 1`` of the response. ``None`` for any other id."""
    if key is None or type(request_id) is not str:
        return None
    prefix = f"cmpl-{key}-"
    if not request_id.startswith(prefix):
        return None
    index = request_id[len(prefix):]
    return int(index) if index.isascii() and index.isdigit() else None


def _prompt_len(processor: Any, engine_id: str) -> int | None:
    """The ``prompt_len`` of vLLM's request state for internal id ``engine_id`` (its token ids,
    or its embeddings' rows: the figure vLLM's usage reports); with ``n > 1``, of a child
    (each holds the same prompt). ``None`` where vLLM holds no such state."""
    states = getattr(processor, "request_states", None)
    if not isinstance(states, dict):
        return None
    state = states.get(engine_id)
    if state is None and (parent := getattr(processor, "parent_requests", {}).get(engine_id)) is not None:
        state = next((states[child] for child in parent.child_requests if child in states), None)
    prompt_len = getattr(state, "prompt_len", None)
    return prompt_len if isinstance(prompt_len, int) else None


#: Set around a call's first step, in which vLLM's ``generate()`` runs ``add_request()``.
_adding: ContextVar[_Call | None] = ContextVar("cachetally_adding", default=None)


class EngineTap:
    """Installed on an ``AsyncLLM`` instance until :meth:`uninstall`.

    ``pd_legs``: the instance serves a router's disaggregated prefill/decode legs
    (:class:`~engine_adapter.vllm.prefill.PrefillTap`).
    """

    def __init__(self, client: Any, sink: EventSink, *, pd_legs: bool = False) -> None:
        compat.check_version_once(logger)  # once per process: stock `vllm serve` never ran ours
        compat.log_missing_once(logger)
        self._client = client
        self._sink = sink
        self._refused_logged = False
        self._generate = client.generate
        self._add_request = getattr(client, "add_request", None)
        self._pd_legs = pd_legs
        self._prefill: PrefillTap[_Call] = PrefillTap(client, self._prefilled, pd_legs=pd_legs)
        client.generate = self.generate
        if self._add_request is not None:
            client.add_request = self.add_request
        self._shutdown = getattr(client, "shutdown", None)
        self._stopping = False
        if self._shutdown is not None:
            client.shutdown = self.shutdown

    def uninstall(self) -> None:
        """Give the client its own methods and output processor back. Idempotent."""
        for name in ("generate", "add_request", "shutdown"):
            self._client.__dict__.pop(name, None)
        self._prefill.uninstall()

    @property
    def stopping(self) -> bool:
        """Whether vLLM's stop has begun to close the client: a request can no longer run."""
        return self._stopping

    def shutdown(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's stop (from a worker thread): from now on, a request the client fails is the stop's."""
        self._stopping = True
        assert self._shutdown is not None
        return self._shutdown(*args, **kwargs)

    async def add_request(self, *args: Any, **kwargs: Any) -> Any:
        queue = await self._add_request(*args, **kwargs)
        call = _adding.get()
        if call is not None and call.engine_id is None:
            call.engine_id = getattr(queue, "request_id", None)  # vLLM's internal id
            if call.engine_id is not None:
                self._prefill.expect(call.engine_id, call)
                self._announce(call.key, call.engine_id)
        return queue

    def _announce(self, key: str | None, engine_id: str) -> None:
        """Tell the sink the prompt's length as vLLM counts it, now that vLLM holds the request:
        one cut before its prefill ends gets no output and no prefill figures, only this."""
        if key is None:
            return  # outside a metered request: no slot to bill it to
        prompt_tokens = _prompt_len(getattr(self._client, "output_processor", None), engine_id)
        if prompt_tokens is not None:
            self._sink.added(key, prompt_tokens)

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        outputs = self._generate(*args, **kwargs)
        call = _Call(current_request_key.get(), kwargs.get("sampling_params", args[1] if len(args) > 1 else None),
                     kwargs.get("request_id", args[2] if len(args) > 2 else None))
        try:
            token = _adding.set(call)
            try:  # reset in the same step: later steps may run in other tasks' contexts
                output = await self._next(outputs)
            finally:
                _adding.reset(token)
            if output is not None and not call.settled:  # the first, before the serving layer sees it
                self._publish_output(call, output)
            while output is not None:
                self._count(call, output)
                yield output
                output = await self._next(outputs)
        finally:
            self._prefill.forget(call.engine_id)  # one cut before its prefill: nothing to hand it
            await outputs.aclose()  # on disconnect: vLLM's generate() aborts the request

    async def _next(self, outputs: AsyncGenerator[Any, None]) -> Any:
        """The next output. While vLLM stops, it closes this client and then cancels the task
        that reads the engine's outputs: a request still running waits forever, until the
        server's stop cancels it and answers it (:mod:`proxy.patching.stopped`), unless that
        task read the closed socket first and failed every request with ``EngineDeadError``
        (vllm-project/vllm#48745), which the client would get as a 500 saying the engine
        failed. Such a failure waits for the same cancellation, so every request the stop
        left gets the same answer."""
        try:
            return await anext(outputs, None)
        except Exception:
            if not self._stopping:
                raise
        await asyncio.Event().wait()  # until cancelled

    def _count(self, call: _Call, output: Any) -> None:
        """The tokens ``output`` hands the serving layer, to the sink under the call's key."""
        if call.key is None or call.kind is None:  # compat: unknown, the stream's events bill it
            return
        added = 0
        for choice in getattr(output, "outputs", ()):
            tokens = len(getattr(choice, "token_ids", ()))
            if call.kind != "DELTA":  # cumulative, or the final output: every token of the choice so far
                tokens, call.tokens[choice.index] = tokens - call.tokens.get(choice.index, 0), tokens
            added += tokens
        if added:
            self._sink.generated(call.key, added)

    def _prefilled(self, call: _Call, first: Prefill, prompt_tokens: int) -> None:
        if call.key is not None:  # else outside a metered request: keyed by vLLM's id, from the output
            self._publish(call.key, first, prompt_tokens, call)
            call.settled = True

    def _publish_output(self, call: _Call, output: Any) -> None:
        """``output``'s totals (no prefill hook: exact with ``n = 1``). Off a P/D fleet, none for
        a body that claims a prefill instance's hits: vLLM reports that claim as the output's
        cached tokens, so the prompt announced at ``add_request`` bills with its cache unknown."""
        if call.claims_cache and not self._pd_legs:
            return
        prompt_ids = getattr(output, "prompt_token_ids", None)
        cached = getattr(output, "num_cached_tokens", None)
        if prompt_ids is None or not isinstance(cached, int):
            return  # no exact count to publish (vLLM gives prompt embeddings one placeholder id per row)
        creation = getattr(output, "num_cache_creation_tokens", None)
        self._publish(call.key or str(output.request_id), Prefill(cached, None, None, creation), len(prompt_ids), call)

    def _publish(self, key: str, first: Prefill, prompt_tokens: int, call: _Call) -> None:
        try:
            event = Scheduled(
                request_id=key,
                prompt_tokens=prompt_tokens,
                cached_tokens=first.cached_tokens,
                local_cached_tokens=first.local_cached_tokens,
                external_cached_tokens=first.external_cached_tokens,
                cache_creation_tokens=first.cache_creation_tokens,
                source="engine",
                transferred_tokens=first.transferred_tokens,
                decode_local_tokens=first.decode_local_tokens,
                first_choice=call.first_choice,
                choices=call.choices,
            )
        except ValueError as exc:  # never fail the request over its figures
            if not self._refused_logged:
                self._refused_logged = True
                logger.warning("engine figures not published (this is logged once): %s", exc)
            return
        self._sink.publish(event)
