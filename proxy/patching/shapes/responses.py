"""The OpenAI Responses API (``/v1/responses``): where its usage lives.

``usage.input_tokens`` is the whole prompt; ``usage.input_tokens_details.cached_tokens``
its cache reads, and vLLM's ``input_tokens_details.cache_write_tokens`` the prompt tokens
written to the prefix cache (written here whenever the engine's count is known).

- JSON: the response object's ``usage``;
- SSE: the terminal events ``response.completed``, ``response.incomplete`` and
  ``response.failed`` carry the response object, whose ``usage`` covers the whole
  request; earlier events carry ``"usage": null``.

A ``background`` request returns before the engine runs, outside the HTTP request that
meters it, so it is refused while billing is on (:meth:`ResponsesShape.refusal`). The flag
is read as vLLM reads it (pydantic's lax ``bool``: ``1``, ``"true"``, ``"on"`` ...).
"""

from __future__ import annotations

from typing import Any

from proxy.patching import json_exact
from proxy.patching.request_body import optional_bool
from proxy.patching.shapes.base import Figures, Reported, Shape
from proxy.patching.usage import count

TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


class ResponsesShape(Shape):
    name = "responses"
    whole_response_events = True  # the terminal events hold the response object
    event_holders = dict.fromkeys(TERMINAL, "response")
    body_kind = {"object": "response"}

    def refusal(self, payload: dict[str, Any]) -> str | None:
        try:
            background = optional_bool(payload.get("background"))
        except ValueError:  # vLLM answers 400 itself, and runs nothing
            return None
        if background:
            return "background responses are not metered on this server; send the request without background"
        return None

    def locate(self, payload: dict[str, Any]) -> tuple[dict[str, Any] | None, bool]:
        kind = payload.get("type")
        if kind in TERMINAL:
            response = payload.get("response")
            return (response if isinstance(response, dict) else None), True
        if payload.get("object") == "response":
            return payload, True
        return None, False

    def read(self, usage: dict[str, Any]) -> Reported:
        details = usage.get("input_tokens_details")
        if not isinstance(details, dict):
            details = {}
        return Reported(
            count(usage.get("input_tokens")),
            count(details.get("cached_tokens")),
            count(details.get("cache_write_tokens")),
        )

    def write(self, usage: dict[str, Any], figures: Figures) -> None:
        if figures.reads is None:
            return
        details = usage.get("input_tokens_details")
        if not isinstance(details, dict):
            details = usage["input_tokens_details"] = {}
        details["cached_tokens"] = figures.reads
        if figures.writes is not None:
            details["cache_write_tokens"] = figures.writes


def created_model(body: bytes) -> str | None:
    """The response's own ``model`` in a Responses stream's ``response.created`` event, when the
    event's data line is whole in ``body``; never a key of the client's ``metadata``."""
    for line in body.split(b"\n"):
        if line.startswith(b"data:") and b"response.created" in line:
            try:
                payload, _ = json_exact.loads(line[5:])
            except ValueError:
                return None
            response = payload.get("response") if isinstance(payload, dict) else None
            model = response.get("model") if isinstance(response, dict) else None
            return model[:256] if isinstance(model, str) and model else None
    return None


SHAPE = ResponsesShape()
