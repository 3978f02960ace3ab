"""A framework's 404 or 405 on a metered route, held to be rewritten as the route's error
JSON (:func:`proxy.asgi.error_guard.send_rewritten`), bounded as a held JSON body is.

The rewrite reads the body for two things only: an error JSON, passed on as it came, and a
framework's ``{"detail": str}`` (FastAPI's ``{"detail": "Not Found"}``: a few bytes). Held
without a bound, an inner app's 404 of many megabytes was held whole, beside the process's
response budget, before the client had a byte, and an upstream's that never ends for as long
as it came. Each part held while more is awaited now counts against ``max_response_bytes``
and the budget (:mod:`proxy.patching.response_budget`). At the first that does not fit, the
rewrite is given up: the parts held are let go, the client gets the route's error JSON at
once, the status's phrase its message and the start's other headers kept (``Allow``), and
the rest of the body is dropped as it comes (an upstream's connection is let go then: the
client's answer is whole). The last part is not held waiting: the body is whole, and
rewritten from as ever.
"""

from __future__ import annotations

from proxy.patching.context import PatchConfig
from proxy.patching.response_budget import ResponseHold

#: What a given-up rewrite is made from: no body, so its message is the status's phrase.
GIVEN_UP = b""


def rewritten_from(whole: bytes | None, parts: list[bytes], hold: ResponseHold, config: PatchConfig) -> bytes | None:
    """What a held 404 or 405 is rewritten from once its latest part (``parts[-1]``) came:
    ``whole``, its body once the last part came; :data:`GIVEN_UP` where that part takes it
    past ``max_response_bytes`` or what the process may still hold (the parts held are let
    go); ``None`` while it is held."""
    if whole is not None:
        return whole
    if hold.keeps(len(parts[-1]), config.max_response_bytes) is None:
        return None
    parts.clear()
    hold.release()
    return GIVEN_UP
