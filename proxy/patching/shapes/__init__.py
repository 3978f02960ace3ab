"""Where each API keeps its usage, in a JSON body and in its stream: one module per API.

- ``chat``, ``completions`` and ``invocations`` (SageMaker, a chat or completions body):
  the OpenAI shape, ``usage.prompt_tokens_details.cached_tokens``, patched by
  :class:`proxy.patching.usage.UsagePatch` in every JSON body and usage chunk;
- ``responses``: :mod:`proxy.patching.shapes.responses`;
- ``messages``: :mod:`proxy.patching.shapes.messages`.

The responder (:mod:`proxy.patching.responder`) asks :func:`shape_for` once per request and hands
each parsed JSON body or SSE event payload to that shape; ``None`` means the OpenAI shape.
"""

from __future__ import annotations

from proxy.patching.shapes import messages, responses
from proxy.patching.shapes.base import Shape

_SHAPES: dict[str, Shape] = {"responses": responses.SHAPE, "messages": messages.SHAPE}


def shape_for(route: str) -> Shape | None:
    return _SHAPES.get(route)


__all__ = ["Shape", "shape_for"]
