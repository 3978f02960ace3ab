"""Read, check and (rarely) rewrite the JSON body of a request to a metered route.

The middleware needs a few request options (``stream``, ``stream_options``, ``model``,
``return_cached_tokens_details``) and answers malformed or oversized bodies itself, so
every mode (embedded, upstream, sim) gives the same clear error.

The options the engine acts on are read as the engine reads them: vLLM's request models
are pydantic models in lax mode, so ``"stream": "true"``, ``1`` or ``"on"`` is a stream
there and must be one here (:func:`lax_bool`, held against pydantic's own parsing in
tests/patching/test_request_body.py). A body whose options pydantic would reject is answered 400
by the engine, so it is no stream here and its stream options are not rewritten. A body over the limit
is refused from its ``Content-Length`` before any of it is read, or as soon as the bytes
read pass the limit (with ``pd_legs``, after it is read to its end and not kept, for its leg:
:mod:`proxy.patching.oversized_leg`).

The body itself is read as the engine's server reads it too. vLLM's routes take it from
Starlette's ``Request.json()``, the standard library's ``json.loads``, which also takes what
orjson refuses: ``NaN`` and ``Infinity``, numbers beyond a double, lone surrogate escapes
(a JavaScript client's cut emoji), UTF-16 and UTF-32. orjson reads the common body fast and
the standard library the rest, so no body the engine would serve is refused here. Where
the body is rewritten, it is encoded back by the parser that read it exactly
(:func:`editable`): orjson reads an integer beyond 64 bits as a float, which it would then
write as one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.types import Message, Receive

from proxy.patching.body_budget import BodyBudgetFull, Hold
from proxy.patching.json_exact import dumps, may_hold_wide_ints, standard_dumps, standard_loads

DETAILS_FLAG = "return_cached_tokens_details"


class BodyTooLarge(Exception):
    """``head``: the chunks read before the limit was passed; ``more``: the rest is unread."""

    def __init__(self, head: list[bytes] | None = None, more: bool = True) -> None:
        super().__init__()
        self.head, self.more = head or [], more


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


async def read_body(receive: Receive, declared_lengths: Iterable[bytes], limit: int, hold: Hold) -> bytes:
    """The whole body, taken into ``hold`` as it arrives; ``BodyTooLarge`` before reading any
    of it when a ``Content-Length`` (``declared_lengths``: every value the client sent) says
    it would be, and ``BodyBudgetFull`` when it says, or the bytes read say, that it does not
    fit in what the process may still hold (:mod:`proxy.patching.body_budget`)."""
    for value in declared_lengths:
        if value.isdigit():
            if (declared := int(value)) > limit:
                raise BodyTooLarge
            if not hold.fits(declared):
                raise BodyBudgetFull
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        chunks.append(chunk)
        if size > limit:
            raise BodyTooLarge(chunks, message.get("more_body", False))
        hold.take(len(chunk))
        if not message.get("more_body", False):
            return b"".join(chunks)


@dataclass(slots=True)
class RequestOptions:
    model: str | None
    stream: bool
    include_usage: bool
    want_details: bool
    #: orjson read the body (else the standard library did: :func:`editable`).
    orjson_read: bool = True
    #: vLLM's ``use_beam_search``: the engine runs one request per beam per step.
    beam_search: bool = False
    #: One choice streams (``n`` 1, one prompt): the usage on any of its chunks covers the
    #: whole request so far, not one choice of several. Read for streams only (True otherwise).
    one_choice: bool = True
    #: One engine request (not a completions batch of prompts): an upstream's own cache
    #: figures can be the request's (:class:`~proxy.patching.usage.UsagePatch`).
    one_prompt: bool = True


_TRUE = frozenset(("1", "on", "t", "true", "y", "yes"))
_FALSE = frozenset(("0", "off", "f", "false", "n", "no"))


def lax_bool(value: object) -> bool:
    """A JSON value read as pydantic's lax ``bool`` reads it; ``ValueError`` where it refuses.

    ``true``/``false``; the numbers 0 and 1; and, in any case, the strings 0/1, f/t,
    false/true, n/y, no/yes, off/on. Nothing else (no blanks around them, no ``null``).
    """
    if value is True or value is False:
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return value == 1
    if isinstance(value, str) and value.isascii():
        lower = value.lower()
        if lower in _TRUE:
            return True
        if lower in _FALSE:
            return False
    raise ValueError("not a boolean")


def optional_bool(value: object) -> bool:
    """An ``Optional[bool]`` field: ``null`` (or absent) reads as false."""
    return False if value is None else lax_bool(value)


def stream_options_of(payload: dict[str, Any]) -> tuple[bool, bool]:
    """``(stream, include_usage)`` as vLLM reads them; ``ValueError`` for a body it answers 400
    (a field it cannot parse, ``continuous_usage_stats`` too, or options without a stream).

    vLLM checks the raw body before parsing it: options that are truthy as JSON with a
    ``stream`` that is not are refused, whatever the strings say.
    """
    stream = optional_bool(payload.get("stream"))
    options = payload.get("stream_options")
    if options and not payload.get("stream"):
        raise ValueError("stream options without stream")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise ValueError("stream_options is not an object")
    optional_bool(options.get("continuous_usage_stats"))  # read only to refuse what vLLM refuses
    return stream, optional_bool(options.get("include_usage"))


def parse_request(body: bytes, stream_options: bool = True) -> tuple[dict[str, Any], RequestOptions]:
    """Raises ``ValueError`` with a client-facing message for a body that is no JSON object.
    ``stream_options``: the route's model reads that field (chat, completions); vLLM's
    Responses and Messages models have none, and read ``stream`` alone."""
    payload, orjson_read = _json_object(body)
    try:
        if stream_options:
            stream, include_usage = stream_options_of(payload)
        else:
            stream, include_usage = optional_bool(payload.get("stream")), False
    except ValueError:
        stream = include_usage = False
    model = payload.get("model")
    one_prompt = _one_prompt(payload)
    return payload, RequestOptions(
        model=model if isinstance(model, str) else None,
        stream=stream,
        include_usage=include_usage,
        want_details=payload.get(DETAILS_FLAG) is True,
        orjson_read=orjson_read,
        beam_search=_beam_search(payload),
        one_choice=not stream or (one_prompt and _one_n(payload)),  # read for a stream's chunks alone
        one_prompt=one_prompt,
    )


def _one_n(payload: dict[str, Any]) -> bool:
    """One choice a prompt: ``n`` absent, null or 1 (``true`` too is 1 to pydantic, but not
    surely: taken for several)."""
    n = payload.get("n")
    return n is None or (n == 1 and n is not True)


def _one_prompt(payload: dict[str, Any]) -> bool:
    """The body is one engine request. vLLM's completions run each of ``prompt_embeds`` (one,
    or a list) as a prompt of its own, then ``prompt``'s."""
    prompt, embeds = payload.get("prompt"), payload.get("prompt_embeds")
    if embeds is None:
        return prompt is None or not several_prompts(prompt)
    return prompt is None and (not isinstance(embeds, list) or len(embeds) == 1)


def _beam_search(payload: dict[str, Any]) -> bool:
    """``use_beam_search`` as vLLM's chat and completions models read it (a value it refuses
    is a 400 there, and no search)."""
    try:
        return optional_bool(payload.get("use_beam_search"))
    except ValueError:
        return False


def several_prompts(prompt: object) -> bool:
    """Whether vLLM reads a completions ``prompt`` as more than one: a list of two or more
    strings or token-id lists. A list of token ids is one prompt, and its model reads
    ``1.0`` and ``true`` there as ids too; a mixed list it refuses."""
    return isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list))


def _json_object(body: bytes) -> tuple[dict[str, Any], bool]:
    """The body as a JSON object, and whether orjson read it (module docstring)."""
    try:
        payload, orjson_read = orjson.loads(body), True
    except orjson.JSONDecodeError as exc:
        try:
            payload, orjson_read = standard_loads(body), False
        except (ValueError, RecursionError):  # RecursionError: nested deeper than it recurses
            raise ValueError(f"Request body is not valid JSON: {exc.msg}") from None
    if isinstance(payload, dict):
        return payload, orjson_read
    raise ValueError("Request body must be a JSON object")


def editable(
    payload: dict[str, Any], body: bytes, options: RequestOptions
) -> tuple[dict[str, Any], Callable[[dict[str, Any]], bytes]]:
    """``body`` as a payload to edit, and how to encode it after the edits so that the engine
    reads back exactly the client's body with those edits: ``payload`` and orjson where
    orjson read the body exactly; else the standard library's own read and its encoder."""
    if not options.orjson_read:
        return payload, standard_dumps
    if not may_hold_wide_ints(body):
        return payload, dumps
    return standard_loads(body), standard_dumps  # orjson read it: 1,024 levels at most


def replay(body: bytes, receive: Receive, handed: Callable[[], None]) -> Receive:
    """A ``receive`` that yields ``body`` once, then defers to the real one (disconnects).
    ``handed`` is called when the body is, and the body is no longer held here: the inner
    app holds its own."""
    held: bytes | None = body

    async def wrapped() -> Message:
        nonlocal held
        if held is not None:
            message = {"type": "http.request", "body": held, "more_body": False}
            held = None
            handed()
            return message
        return await receive()

    return wrapped
