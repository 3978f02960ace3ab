"""The usage record: what one HTTP request to a metered route consumed, and for whom.

Built by the responder in the middleware's ``finally`` from figures it already holds
(no parsing, no I/O), then handed to each sink's queue. Never holds prompt or completion
text, nor any header but the request id and a W3C ``traceparent``.

Identity: ``record_id`` is minted here, a UUIDv7 (:mod:`proxy.accounting.records.record_id`) unique
across processes, replicas and restarts: the key to deduplicate on. ``request_id`` is the
client's ``X-Request-Id``, which a client may reuse, kept as a field of its own.

Bounds: ``request_model`` is the client's string, ``response_id`` the engine's; a record
keeps at most :data:`MAX_TEXT_CHARS` characters of each, so no client (nor an upstream)
can make a record, or the OTLP batch that carries it, arbitrarily large, nor one that cannot
be written (:func:`peer_text`). The other
strings are bounded where they are made (request ids, ``traceparent``, tenant names). ``model`` is a label the responder has already bounded to
the models the engine serves (:mod:`proxy.patching.served_models`).

``outcome``:

- ``completed``: the whole response went out with a status below 400 (a chat or completions
  stream is whole at its ``[DONE]``, where the ``openai`` SDK hangs up);
- ``error``: the whole response went out with a status of 400 or more, or the server
  side failed or ended the response early while the client was still there, or its body
  was an error object (a 200 some servers answer a failure with);
- ``disconnected``: the client left before the response was complete, whatever the app
  sent after (vLLM answers a request whose client left with a 200 and ``null``).

``completion_tokens`` comes from the response's own usage object when one covering the
whole request was seen (``completion_source="usage"``). A stream without one counts the
tokens the tapped vLLM engine handed its serving layer (``"engine"``: an event may carry
many), else the token events produced up to the end (``"stream"``): one per choice per
engine step, which is one token in vLLM (stream interval 1, no speculative decoding) and
in the sim, and a lower bound when several tokens share an event. Otherwise 0
(``"none"``): a JSON response that was never produced delivered nothing; or 0 with
``"unknown"``: a JSON response too large to hold (``max_response_bytes``) went out unread,
or its usage held no count of them, so its tokens were not counted here.

Every token figure is a :func:`count`: a peer's figure that is not one is unknown here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson

from proxy.accounting.records.record_id import new_record_id

SCHEMA_VERSION = 2
#: The longest ``request_model`` or ``response_id`` a record keeps; longer ones are cut to this.
MAX_TEXT_CHARS = 256

#: The largest token figure a record holds: an OTLP span's integer attribute is an int64,
#: and one figure past it would fail the export of the whole batch, other records' too.
MAX_COUNT = (1 << 63) - 1


def count(value: Any) -> int | None:
    """A token count: a non-negative int a record can hold (a JSON ``true`` is not one: a
    parsed value's type is exactly ``int`` or ``bool``, one check of the type for both)."""
    if type(value) is int and 0 <= value <= MAX_COUNT:
        return value
    return None


def peer_text(value: str) -> str:
    """A client's or an upstream's string as a record holds it: at most :data:`MAX_TEXT_CHARS`
    characters, and UTF-8. A body read by Python's ``json`` (vLLM's, an upstream's) may hold
    a lone surrogate (``"\\ud800"``), which orjson cannot write: one such record failed its
    JSONL flush, and every other record of that flush with it (the OTLP span dropped the
    attribute). It is kept as its escape, ``\\ud800``, in both."""
    if len(value) > MAX_TEXT_CHARS:
        value = value[:MAX_TEXT_CHARS]
    if not utf8(value):
        value = value.encode("utf-8", "backslashreplace").decode()[:MAX_TEXT_CHARS]
    return value


def utf8(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8: Python's ``json`` reads a lone surrogate
    (``"\\ud800"``), which orjson cannot write and no Prometheus exposition can encode."""
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


@dataclass(slots=True)
class UsageRecord:
    request_id: str
    tenant: str
    route: str  # chat | completions | responses | messages | invocations (proxy.patching.routes)
    stream: bool
    start_unix: float
    end_unix: float = 0.0
    model: str = "unknown"  # the engine's own model name (the response's "model")
    request_model: str | None = None  # what the client asked for
    response_id: str | None = None  # the response's "id" (chatcmpl-...)
    status: int | None = None  # None: no response was started
    outcome: str = "error"
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    local_cached_tokens: int | None = None
    external_cached_tokens: int | None = None
    cache_creation_tokens: int | None = None
    source: str | None = None  # engine | upstream | None when unknown
    completion_tokens: int = 0
    completion_source: str = "none"  # usage | engine | stream | none | unknown
    ttft_s: float | None = None  # first response body bytes after the request started
    traceparent: str | None = None  # the client's W3C trace context, if it sent one
    record_id: str = field(default_factory=new_record_id)  # ours, unique: deduplicate on this

    def __post_init__(self) -> None:
        if self.request_model is not None:
            self.request_model = peer_text(self.request_model)
        if self.response_id is not None:
            self.response_id = peer_text(self.response_id)

    def as_json(self) -> dict[str, Any]:
        """The JSONL line's object, keys in a fixed order; times as datetimes (:func:`dumps`)."""
        return {
            "v": SCHEMA_VERSION,
            "record_id": self.record_id,
            "request_id": self.request_id,
            "tenant": self.tenant,
            "model": self.model,
            "request_model": self.request_model,
            "response_id": self.response_id,
            "route": self.route,
            "stream": self.stream,
            "status": self.status,
            "outcome": self.outcome,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "local_cached_tokens": self.local_cached_tokens,
            "external_cached_tokens": self.external_cached_tokens,
            "cache_creation_tokens": self.cache_creation_tokens,
            "source": self.source,
            "completion_tokens": self.completion_tokens,
            "completion_source": self.completion_source,
            "start_time": datetime.fromtimestamp(self.start_unix, UTC),
            "end_time": datetime.fromtimestamp(self.end_unix, UTC),
            "duration_s": round(self.end_unix - self.start_unix, 6),
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 6),
            "traceparent": self.traceparent,
        }


def dumps(record: UsageRecord) -> bytes:
    """One JSONL line (with its newline); times as RFC 3339 UTC with microseconds and ``Z``."""
    return orjson.dumps(record.as_json(), option=orjson.OPT_UTC_Z | orjson.OPT_APPEND_NEWLINE)
