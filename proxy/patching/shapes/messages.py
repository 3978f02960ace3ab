"""The Anthropic Messages API (``/v1/messages``): where its usage lives, and what it means.

Anthropic splits the prompt in three: ``input_tokens`` excludes both the cache reads
(``cache_read_input_tokens``) and the cache writes (``cache_creation_input_tokens``), so
``input_tokens + cache_read_input_tokens + cache_creation_input_tokens`` is the whole
prompt. Writes are the prompt tokens the engine wrote to its prefix cache.

- JSON: the message object's ``usage``;
- SSE: ``message_start`` carries ``message.usage`` (the prompt is known by then) and the
  final ``message_delta`` carries ``usage`` for the whole request.

``cache_read_input_tokens`` is written in both events and in JSON, 0 included (under the
``zero`` missing policy); vLLM writes it only with ``--enable-prompt-tokens-details``.
Upstream, a final ``message_delta`` with ``output_tokens`` only (Anthropic's own shape) is
left as it came: the figures are ``message_start``'s (:mod:`proxy.patching.shapes.base`).
A ``message_delta``'s figures are cumulative and each is optional: one it omits (or sends as
``null``) keeps ``message_start``'s value, as the ``anthropic`` SDK merges them, so a delta
with some of the three is read and written whole, the others taken from ``message_start``.
"""

from __future__ import annotations

from typing import Any

from proxy.patching.shapes.base import Figures, Reported, Shape
from proxy.patching.usage import ResponseUsage, count

#: The input figures of a usage object: together, the whole prompt.
_INPUT_FIGURES = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


class MessagesShape(Shape):
    name = "messages"
    body_kind = {"type": "message"}
    event_holders = {"message_start": "message", "message_delta": ""}

    def locate(self, payload: dict[str, Any]) -> tuple[dict[str, Any] | None, bool]:
        kind = payload.get("type")
        if kind == "message_start":
            message = payload.get("message")
            return (message if isinstance(message, dict) else None), False
        if kind in ("message_delta", "message"):
            return payload, True
        return None, False

    def read(self, usage: dict[str, Any]) -> Reported:
        fresh = count(usage.get("input_tokens"))
        reads = count(usage.get("cache_read_input_tokens"))
        writes = count(usage.get("cache_creation_input_tokens"))
        # Each part a record can hold, their sum perhaps not: then it is no count of the prompt.
        prompt = None if fresh is None else count(fresh + (reads or 0) + (writes or 0))
        return Reported(prompt, reads, writes)

    def reported(self, payload: dict[str, Any], usage: dict[str, Any], in_response: ResponseUsage) -> Reported:
        sent = {name: usage[name] for name in _INPUT_FIGURES if usage.get(name) is not None}
        kind = payload.get("type")
        if kind == "message_start":
            in_response.opening = sent
        elif kind == "message_delta" and sent and in_response.opening:
            return self.read(in_response.opening | sent)
        return self.read(usage)

    def write(self, usage: dict[str, Any], figures: Figures) -> None:
        reads, writes, prompt = figures.reads, figures.writes, figures.prompt
        if reads is None:
            return  # the ``omit`` policy and nothing known: the usage stays as it came
        if prompt is not None and reads + (writes or 0) <= prompt:
            usage["input_tokens"] = prompt - reads - (writes or 0)
        usage["cache_read_input_tokens"] = reads
        if writes is not None:
            usage["cache_creation_input_tokens"] = writes


SHAPE = MessagesShape()
