"""Every route of every supported vLLM (0.32, 0.33), and what cachetally does with it.

- ``patched``: metered (one usage record, the tenant's counters) and its usage made exact
  in JSON and SSE by the route's shape (:mod:`proxy.patching.shapes`);
- ``refused``: runs the engine but is not metered. While billing is on (tenants or usage
  records configured) such a request is answered with a 403 error and counted in
  ``cachetally_refused_unmetered_total``, so no key can use the engine unmetered;
- ``none``: does not run the engine (health, models, tokenizer, render, admin, ...).

No route of these versions is "metered only": each metered route is also patched.
``tests/patching/test_routes.py`` builds the installed vLLM's app and walks ``app.routes``, and
reads the 0.33.0 wheel's route decorators, and fails on any path this table does not
classify, so a new vLLM cannot add a generating route unnoticed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

Kind = Literal["patched", "refused", "none"]

#: Patched routes and the name a usage record, a metric label and an OTLP span carry.
PATCHED: Mapping[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/invocations": "invocations",  # SageMaker: a chat or completions body and answer
}

#: Routes that run the engine and are not metered: refused while billing is on.
REFUSED: frozenset[str] = frozenset({
    "/v1/chat/completions/batch",
    "/inference/v1/generate",  # tokens in, tokens out: no usage object to count from
    "/generative_scoring",
    "/v1/systemone",
    "/v1/decisions",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/realtime",  # a WebSocket
    "/cohere/v2/chat",
    "/classify",
    "/pooling",
    "/rerank",
    "/score",
    "/v1/embeddings",
    "/v1/rerank",
    "/v1/score",
    "/v2/embed",
    "/v2/rerank",
})

#: Routes that do not run the engine.
NOT_GENERATING: frozenset[str] = frozenset({
    # FastAPI's own pages
    "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc",
    # health, load, models, metrics
    "/health", "/ping", "/ready", "/readyz", "/load", "/version", "/metrics", "/v1/models",
    "/kv_event_sources", "/server_info",
    # tokenizer and prompt rendering: no engine step
    "/tokenize", "/detokenize", "/tokenizer_info", "/v1/messages/count_tokens",
    "/v1/chat/completions/render", "/v1/completions/render", "/v1/messages/render",
    "/v1/responses/render", "/cohere/v2/chat/render",
    "/v1/chat/completions/derender", "/v1/completions/derender",
    # stored responses: read or cancel what a metered request produced
    "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel",
    # administration: aborts, cache resets, sleep, profiling, weights, LoRA, scaling
    "/abort_requests", "/inference/v1/abort_requests", "/pause", "/resume", "/is_paused",
    "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache", "/collective_rpc",
    "/sleep", "/wake_up", "/is_sleeping", "/release_kv_cache_memory",
    "/start_profile", "/stop_profile",
    "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine", "/start_weight_update",
    "/start_draft_weight_update", "/update_weights", "/finish_weight_update",
    "/update_weight_version", "/weight_info", "/weight_checker", "/get_world_size",
    "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
    "/scale_elastic_ep", "/is_scaling_elastic_ep",
    "/fault_tolerance/apply", "/fault_tolerance/status",
    # cachetally's own
    "/stats",
})


def kind(path: str) -> Kind | None:
    """The table's word on a route path (a template, as in ``app.routes``); ``None``: unknown."""
    if path in PATCHED:
        return "patched"
    if path in REFUSED:
        return "refused"
    if path in NOT_GENERATING:
        return "none"
    return None
