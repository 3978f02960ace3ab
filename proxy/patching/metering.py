"""The finish step of one patched request: count it once and hand its usage record over.

Runs synchronously in the middleware's ``finally``, after the ledger slot is closed, so
neither cancellation nor a failure of the inner app skips it: every request that opened a
slot is counted once (docs/ARCHITECTURE.md, "Invariants").
"""

from __future__ import annotations

import re
import time

from proxy.accounting.records.record import UsageRecord
from proxy.asgi.headers import RequestHeaders
from proxy.patching.ledger import EngineUsage
from proxy.patching.pd_leg import DECODE, PREFILL
from proxy.patching.responder import Responder

# W3C Trace Context's shape, less what it says to ignore: version ff, an all-zero trace id or
# parent id. The OTLP span starts a trace of its own for those, so the record names none.
_TRACEPARENT = re.compile(rb"(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")


def meter(r: Responder, engine: EngineUsage | None) -> None:
    """Count this request once and submit its usage record. Synchronous: runs in the
    middleware's ``finally``. A prefill leg is counted as a leg only (:mod:`proxy.patching.pd_leg`)."""
    notes, metrics = r.notes, r.ctx.metrics
    outcome = notes.outcome(r.status)
    if r.leg == PREFILL:
        metrics.legs.count(PREFILL, outcome, engine)
        return
    in_response = r.in_response
    # A model the engine serves, never a name a client made up: labels must stay bounded.
    model = r.ctx.config.models.label(in_response.model) if in_response.model else r.ctx.config.default_model
    completion, completion_source = notes.completion(r.stream)
    if completion_source == "stream" and engine is not None and engine.generated_tokens is not None:
        # Tokens, not events: vLLM merges the outputs a slow reader has not taken into one event.
        completion, completion_source = engine.generated_tokens, "engine"
    local = external = writes = None
    if engine is not None and not engine.unscheduled:
        prompt, cached, source = engine.prompt_tokens, engine.cached_tokens, "engine"
        local, external = engine.local_cached_tokens, engine.external_cached_tokens
        writes = engine.cache_creation_tokens
    elif engine is not None and (engine.events or r.handed is None):
        # An engine request cut before its prefill ended: its prompt as the engine counted it,
        # the cache it found unknown (vLLM reports nothing for it), so never 0.
        prompt, cached, source = engine.prompt_tokens + engine.unscheduled_tokens, None, "engine"
    elif in_response.source == "upstream":
        prompt, cached, source = in_response.prompt_tokens, in_response.cached_tokens, "upstream"
        writes = in_response.cache_creation_tokens
    elif r.counted_prompt is not None:  # a stream cut before its usage chunk: the upstream's /tokenize
        prompt, cached, source = r.counted_prompt, None, "tokenize"
    elif r.handed is not None:  # a decode leg that never ran: its prefill's figures
        prompt, cached, source = r.handed
    else:
        prompt, cached, source = in_response.prompt_tokens, None, None
    options = r.options
    record = UsageRecord(
        request_id=r.key, tenant=r.tenant, route=r.route, stream=r.stream if options is None else options.stream,
        start_unix=notes.started, end_unix=notes.started + (time.monotonic() - notes.t0), model=model,
        request_model=None if options is None else options.model, response_id=notes.response_id,
        status=r.status, outcome=outcome, prompt_tokens=prompt, cached_tokens=cached,
        local_cached_tokens=local, external_cached_tokens=external, cache_creation_tokens=writes,
        source=source, completion_tokens=completion, completion_source=completion_source, ttft_s=notes.ttft_s,
        traceparent=_traceparent(r.request_headers),
    )
    if engine is None and prompt is None and outcome != "completed":
        # Rejected (4xx), failed or abandoned before the engine saw it: not a counted
        # request, but the tokens it streamed still count, as its usage record does. Read
        # from the record's outcome, so that the records tell which requests were counted: a
        # 200 whose body is an error object, or a stream that ended in an error event, went
        # out whole and was counted though its record said it failed.
        metrics.count_completion(record)
    else:
        metrics.record(record, in_response.mismatches)
    if r.leg == DECODE:
        metrics.legs.count(DECODE, outcome, engine)
    if r.ctx.recorder is not None:
        r.ctx.recorder.submit(record)


def _traceparent(headers: RequestHeaders) -> str | None:
    """The client's W3C ``traceparent``, when it sent exactly one valid one: the span's parent."""
    value = headers.only(b"traceparent")
    if value is None or not _TRACEPARENT.fullmatch(value):
        return None
    return value.decode("ascii")
