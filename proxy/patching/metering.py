"""The finish step of one patched request: count it once and hand its usage record over.

Runs synchronously in the middleware's ``finally``, after the ledger slot is closed, so
neither cancellation nor a failure of the inner app skips it: every request that opened a
slot is counted once (docs/ARCHITECTURE.md, "Invariants").
"""

from __future__ import annotations

import re

from proxy.accounting.metrics import MeteredRequest
from proxy.accounting.records.record import UsageRecord
from proxy.asgi.headers import RequestHeaders
from proxy.patching.ledger import EngineUsage
from proxy.patching.pd_leg import DECODE, PREFILL
from proxy.patching.responder import Responder

_TRACEPARENT = re.compile(rb"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


def meter(r: Responder, engine: EngineUsage | None) -> None:
    """Count this request once and submit its usage record. Synchronous: runs in the
    middleware's ``finally``. A prefill leg is counted as a leg only (:mod:`proxy.patching.pd_leg`)."""
    if r.leg == PREFILL:
        r.ctx.metrics.legs.count(PREFILL, r.notes.outcome(r.status), engine)
        return
    in_response = r.in_response
    # A model the engine serves, never a name a client made up: labels must stay bounded.
    model = r.ctx.config.models.label(in_response.model) if in_response.model else r.ctx.config.default_model
    completion, completion_source = r.notes.completion(r.stream)
    record = MeteredRequest(
        model=model,
        route=r.route,
        stream=r.stream,
        mismatches=in_response.mismatches,
        tenant=r.tenant,
        completion_tokens=completion,
    )
    if engine is not None:
        record.prompt_tokens, record.cached_tokens, record.source = (
            engine.prompt_tokens,
            engine.cached_tokens,
            "engine",
        )
        record.local_cached_tokens = engine.local_cached_tokens
        record.external_cached_tokens = engine.external_cached_tokens
        record.cache_write_tokens = engine.cache_creation_tokens
    elif in_response.source == "upstream":
        record.prompt_tokens, record.cached_tokens, record.source = (
            in_response.prompt_tokens,
            in_response.cached_tokens,
            "upstream",
        )
    else:
        record.prompt_tokens = in_response.prompt_tokens
    if engine is None and in_response.prompt_tokens is None and not r.completed:
        # Rejected (4xx), failed or abandoned before the engine saw it: not a counted
        # request, but the tokens it streamed still count, as its usage record does.
        r.ctx.metrics.count_completion(record)
    else:
        r.ctx.metrics.record(record)
    if r.leg == DECODE:
        r.ctx.metrics.legs.count(DECODE, r.notes.outcome(r.status), engine)
    recorder = r.ctx.recorder
    if recorder is not None:
        recorder.submit(_usage_record(r, record, engine, completion_source))


def _usage_record(r: Responder, rec: MeteredRequest, engine: EngineUsage | None, completion_source: str) -> UsageRecord:
    options = r.options
    return r.notes.record(
        request_id=r.key,
        tenant=r.tenant,
        route=r.route,
        stream=r.stream if options is None else options.stream,
        model=rec.model,
        request_model=options.model if options is not None else None,
        status=r.status,
        outcome=r.notes.outcome(r.status),
        prompt_tokens=rec.prompt_tokens,
        cached_tokens=rec.cached_tokens,
        local_cached_tokens=rec.local_cached_tokens,
        external_cached_tokens=rec.external_cached_tokens,
        cache_creation_tokens=engine.cache_creation_tokens if engine is not None else None,
        source=rec.source,
        completion_tokens=rec.completion_tokens,
        completion_source=completion_source,
        traceparent=_traceparent(r.request_headers),
    )


def _traceparent(headers: RequestHeaders) -> str | None:
    """The client's W3C ``traceparent``, when it sent exactly one that looks like one."""
    value = headers.only(b"traceparent")
    if value is None or not _TRACEPARENT.fullmatch(value):
        return None
    return value.decode("ascii")
