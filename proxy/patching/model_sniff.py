"""The response's own ``"model"``, read from its first bytes where the response is not parsed
whole: a stream whose usage chunk never comes (the client did not ask for it), a JSON body
too large to hold. So the request is labelled like the rest.
"""

from __future__ import annotations

import re

#: Inside a JSON string a quote is escaped, so this only matches a real key.
_MODEL_FIELD = re.compile(rb'"model"\s*:\s*"([^"\\]{1,256})"')
#: A stream's first body messages read for it.
SNIFF_CHUNKS = 4
#: Routes whose first events carry the client's own objects before the model: a Responses
#: stream's ``response.created`` echoes the request's ``metadata`` (any keys, ``"model"``
#: too) ahead of the response's ``model``. There the event is parsed
#: (:func:`~proxy.patching.shapes.responses.created_model`).
NO_MODEL_SNIFF = frozenset(("responses",))


def sniffed_model(body: bytes) -> str | None:
    """The first ``"model"`` string field in ``body``, or ``None``."""
    match = _MODEL_FIELD.search(body)
    return match.group(1).decode("utf-8", "replace") if match else None
