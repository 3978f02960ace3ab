"""What the responder notes about one request for its usage record, at no parsing cost.

- whether the client disconnected: a ``receive`` that returned ``http.disconnect`` before
  the response was complete (every mode's inner app listens for it);
- when the first response body bytes went out (``ttft_s``) and the response id;
- a stream's token events: ``data: {`` line starts, counted with ``bytes.count`` (a JSON
  string cannot hold a raw line break, so generated text never matches) in what the SSE
  patcher passes on, which is whole events however the engine's bytes were cut, less
  the chat role events and the usage-only event the client gets. They give
  ``completion_tokens`` when a stream is cut before its usage chunk
  (:mod:`proxy.accounting.records.record`). The Messages and Responses streams frame their tokens
  with other events, so there only their token events count, by ``event:`` line:
  ``content_block_delta`` and ``response.*delta``. The ``openai`` SDK reads a Responses
  event by its data's ``type`` alone, and some servers (LiteLLM) send no ``event:`` lines:
  in such events a data line that starts with a ``response.*delta`` type is the token event;
- an error event in a stream (``data: {"error"...}``, as vLLM and cachetally's upstream
  relay end a stream that failed; ``event: error`` in the named streams, and
  ``event: response.failed``, the Responses API's end of a failed response, or a data line
  that starts with either type, where the events are not named): not a token,
  and the request's outcome is ``error`` however the stream then ends;
- the completion tokens and id of a usage object that covers the whole request (a JSON
  body, or a stream's usage-only chunk), which the responder parses anyway;
- a JSON body too large to hold (``max_response_bytes``), passed on unread, or whose usage
  holds no count of its completion tokens (a peer's ``-1`` or ``2**64``): they are not known
  here (``completion_source: "unknown"``), and never taken for 0.
"""

from __future__ import annotations

import re
import time
from typing import Any

from proxy.accounting.records.record import count

_ID_FIELD = re.compile(rb'"id"\s*:\s*"([^"\\]{1,256})"')
#: Enough bytes to hold the start of an ``"id"`` field cut at a message boundary.
_ID_FIELD_MAX = 512
_FIRST_EVENT = (b"data: {", b"data:{")
_ERROR_EVENTS = (b'data: {"error"', b'data:{"error"')
#: In the named streams: an error event, named (``response.failed`` too) or not (vLLM's and
#: an upstream relay's ``data: {"error"...}``, which the openai SDK raises on there too).
_NAMED_STREAM_ERROR = re.compile(
    rb'event: ?(?:error|response\.failed)[\r\n]|data: ?\{(?:"error"|"type": ?"(?:error|response\.failed)")')
_LINE_ENDS = (b"\n", b"\r")
#: A chat stream's opening event, one per choice: a role and no content (vLLM's ``""``,
#: llama.cpp's ``null``), in either order. Ollama names the role beside every token: no match.
#: A JSON string holds no raw ``"``, so generated text never matches.
_ROLE_EVENT = re.compile(
    rb'"role":\s*"[^"]*",\s*"content":\s*(?:""|null)\s*[,}]|"content":\s*(?:""|null),\s*"role":\s*"[^"]*"\s*[,}]')
#: The end of a chat or completions stream, at a line start: a JSON string holds no raw line
#: end, so generated text never matches.
_DONE = re.compile(rb"[\r\n]data: ?\[DONE\][\r\n]")
#: Token events of the streams whose events are named (``event:`` lines), by route.
_TOKEN_EVENTS = {
    "messages": re.compile(rb"event: ?content_block_delta[\r\n]"),
    "responses": re.compile(rb"event: ?response\.[\w.]*delta[\r\n]"),
}
#: The events hold an ``event:`` line (a named stream), else the token events are read from
#: the data's leading ``type``: only the Responses API's client reads events without a name.
_EVENT_FIELD = re.compile(rb"(?:^|[\r\n])event:")
_UNNAMED_TOKEN_EVENTS = {"responses": re.compile(rb'data: ?\{"type": ?"response\.[\w.]*delta"')}


class RequestNotes:
    __slots__ = (
        "started", "t0", "ttft_s", "response_id", "disconnected", "response_done", "errored", "unread",
        "usage_completion", "ended", "_roles_pending", "_cr", "_line_start", "_events", "_role_events",
        "_usage_events", "_token_events", "_unnamed_token_events", "_plain", "_id_tail",
    )

    def __init__(self, route: str) -> None:
        self.started = time.time()
        #: ``time.monotonic()`` at ``started``: durations are measured on it.
        self.t0 = time.monotonic()
        self.ttft_s: float | None = None
        self.response_id: str | None = None
        self.disconnected = False
        self.response_done = False  # the last body message went out
        self.errored = False  # the stream carried an error event
        self.unread = False  # a JSON body's tokens are unknown: too large to read, or no count in its usage
        self.usage_completion: int | None = None
        #: ``[DONE]`` went out: the stream is whole for the client (the ``openai`` SDK hangs up
        #: there), whenever the HTTP body ends.
        self.ended = False
        self._roles_pending = route == "chat"
        self._cr: bool | None = None
        self._line_start = True  # the next byte of the stream starts a line
        self._events = self._role_events = self._usage_events = 0
        self._token_events = _TOKEN_EVENTS.get(route)
        self._unnamed_token_events = _UNNAMED_TOKEN_EVENTS.get(route)
        #: Past the chat role events, in an LF stream at a line start: what engines send.
        self._plain = False
        #: The end of the last body message sniffed for an id: an ``"id"`` cut between two.
        self._id_tail = b""

    def body(self, body: bytes, more: bool) -> None:
        if not more:
            self.response_done = True
        if self.ttft_s is None and body:
            self.ttft_s = time.monotonic() - self.t0

    def sse_events(self, events: bytes) -> None:
        """Count in whole events (the patcher's output); runs for every chunk of every
        stream, so a few ``bytes.count``, written out."""
        if self._plain and events.startswith(b"data: {") and events.find(b"\n") == len(events) - 2 \
                and events[-1] == 10:
            # one event, one line and its blank line, as engines frame each chunk
            if events.startswith(b'"error"', 7):
                self.errored = True
            else:
                self._events += 1
            return
        if self._token_events is not None:
            tokens = self._token_events
            if self._unnamed_token_events is not None and not _EVENT_FIELD.search(events):
                tokens = self._unnamed_token_events
            self._events += len(tokens.findall(events))
            if _NAMED_STREAM_ERROR.search(events):  # one scan of the events
                self.errored = True
            return
        count = events.count(b"\ndata: {") + events.count(b"\ndata:{")
        if events.startswith(_FIRST_EVENT) and self._line_start:
            count += 1
        # A JSON string cannot hold '"error"' unescaped: these are error events' first lines.
        if errors := events.count(_ERROR_EVENTS[0]) + events.count(_ERROR_EVENTS[1]):
            count -= errors
            self.errored = True
        if self._cr is None:
            self._cr = b"\r" in events  # a stream keeps the line ends it starts with
        if self._cr:
            count += events.count(b"\rdata: {") + events.count(b"\rdata:{")
        self._events += count
        if events.find(b"[DONE]") >= 0 and _DONE.search((b"\n" if self._line_start else b"") + events):
            self.ended = True
        self._line_start = events.endswith(_LINE_ENDS)
        if self._roles_pending:  # role events open a chat stream, one per choice, then stop
            roles = len(_ROLE_EVENT.findall(events))
            self._role_events += roles
            self._roles_pending = roles > 0
        self._plain = self._line_start and self._cr is False and not self._roles_pending

    def sniff_id(self, body: bytes) -> None:
        """The first ``"id"`` of the response's first body messages, however they were cut
        (the response's own precedes any of its parts', such as a tool call's)."""
        if self.response_id is not None:
            return
        head = self._id_tail + body
        if match := _ID_FIELD.search(head):
            self.response_id = match.group(1).decode("utf-8", "replace")
            self._id_tail = b""
        else:  # no whole field yet: keep what may be the start of one
            self._id_tail = head[-_ID_FIELD_MAX:]

    def client_left(self) -> None:
        if not (self.response_done or self.ended):
            self.disconnected = True

    def chunk_usage(self, payload: dict[str, Any], *, dropped: bool, one_choice: bool) -> None:
        """A stream chunk's usage, when it covers the whole request: a usage-only chunk (not
        among the counted events if ``dropped``, the ghost one the client never gets), or,
        when one choice streams, any chunk's (llama.cpp's finishing chunk, continuous usage),
        counted so far; with several, a choice's chunk counts that choice alone."""
        if not isinstance(payload.get("usage"), dict):
            return
        usage_only = payload.get("choices") == []
        if usage_only or one_choice:
            self.whole_usage(payload, event=usage_only and not dropped)

    def whole_usage(self, payload: dict[str, Any], *, event: bool = False) -> None:
        """``payload``'s usage covers the whole request (``event``: an SSE usage-only chunk
        the client gets, so counted among the stream's events). A whole body that is an error
        object (a 200 some servers and gateways answer a failure with) failed the request."""
        self._usage_events += event
        if isinstance(payload.get("error"), dict):  # Responses' own "error" is null unless it failed
            self.errored = True
        usage = payload.get("usage")
        completion = (  # OpenAI chat and completions, else Responses and Messages
            usage.get("completion_tokens", usage.get("output_tokens")) if isinstance(usage, dict) else None
        )
        if (tokens := count(completion)) is not None:  # a peer's -1, true or 2**64 is not a count
            self.usage_completion = tokens
        elif isinstance(usage, dict) or payload.get("choices"):  # delivered, with no count of it
            self.unread = True
        response_id = payload.get("id")
        if isinstance(response_id, str):
            self.response_id = response_id

    def completion(self, stream: bool) -> tuple[int, str]:
        if self.usage_completion is not None:
            return self.usage_completion, "usage"
        if stream:
            return max(0, self._events - self._role_events - self._usage_events), "stream"
        return 0, "unknown" if self.unread else "none"

    def outcome(self, status: int | None) -> str:
        if self.errored:
            return "error"
        if self.disconnected:  # whatever the app sent after (vLLM's handler: a null body)
            return "disconnected"
        if self.response_done or self.ended:
            return "completed" if status is not None and status < 400 else "error"
        return "error"
