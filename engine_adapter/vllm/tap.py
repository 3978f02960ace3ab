"""The tap on one API server's vLLM engine client: ``generate()`` publishes ``Scheduled``.

vLLM's OpenAI server binds every serving object (chat, completions, responses, ...) to a
single engine client, ``app.state.engine_client`` (``init_app_state``). :class:`EngineTap`
replaces that instance's ``generate`` in place, so every caller reaches the tap whatever
object it holds: vLLM's own ``vllm serve`` with ``--middleware`` (each API server process
of ``--api-server-count N`` builds its own app and taps its own client), and
``cachetally serve``, which runs that same entry point.

Per engine request, one :class:`~engine_adapter.events.Scheduled` is published from the
first ``RequestOutput`` of ``generate()``, before the serving layer sees it, with the
figures of the request's first copy (:mod:`engine_adapter.vllm.prefill`; ``n > 1`` fans
out). The key is :data:`~engine_adapter.events.current_request_key`, which the HTTP
middleware set around the request, else vLLM's own request id. vLLM's
``--enable-prompt-tokens-details`` is left off: the numbers come from here.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import Any

from engine_adapter.events import EventSink, Scheduled, current_request_key
from engine_adapter.vllm import compat
from engine_adapter.vllm.prefill import Prefill, PrefillTap

logger = logging.getLogger("cachetally.engine.vllm")


class EngineTap:
    """Installed on an ``AsyncLLM`` instance until :meth:`uninstall`."""

    def __init__(self, client: Any, sink: EventSink) -> None:
        compat.check_version_once(logger)  # once per process: stock `vllm serve` never ran ours
        compat.log_missing_once(logger)
        self._client = client
        self._sink = sink
        self._generate = client.generate
        self._prefill = PrefillTap(client)
        client.generate = self.generate

    def uninstall(self) -> None:
        """Give the client its own ``generate`` and output processor back. Idempotent."""
        self._client.__dict__.pop("generate", None)
        self._prefill.uninstall()

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        # vLLM's signature: generate(prompt, sampling_params, request_id, *, ...)
        request_id = kwargs.get("request_id", args[2] if len(args) > 2 else None)
        outputs = self._generate(*args, **kwargs)
        published = False
        try:
            async for output in outputs:
                if not published:
                    published = True
                    self._publish(request_id, output)
                yield output
        finally:
            self._prefill.discard(request_id)
            await outputs.aclose()  # on disconnect: vLLM's generate() aborts the request

    def _publish(self, request_id: str | None, output: Any) -> None:
        prompt_ids = getattr(output, "prompt_token_ids", None)
        first = self._prefill.pop(request_id)
        if first is None:  # no hook: the output's totals (exact with n = 1)
            cached = getattr(output, "num_cached_tokens", None)
            creation = getattr(output, "num_cache_creation_tokens", None)
            first = Prefill(cached, None, None, creation) if isinstance(cached, int) else None
        if prompt_ids is None or first is None:
            return  # e.g. prompt embeddings: no exact count to publish
        self._sink.publish(Scheduled(
            request_id=current_request_key.get() or str(output.request_id),
            prompt_tokens=len(prompt_ids),
            cached_tokens=first.cached_tokens,
            local_cached_tokens=first.local_cached_tokens,
            external_cached_tokens=first.external_cached_tokens,
            cache_creation_tokens=first.cache_creation_tokens,
            source="engine",
            transferred_tokens=first.transferred_tokens,
            decode_local_tokens=first.decode_local_tokens,
        ))
