"""Every route of every supported vLLM (0.32, 0.33), and what cachetally does with it.

- ``patched``: metered (one usage record, the tenant's counters) and its usage made exact
  in JSON and SSE by the route's shape (:mod:`proxy.patching.shapes`);
- ``refused``: runs the engine but is not metered. While billing is on (tenants or usage
  records configured) such a request is answered with a 403 error and counted in
  ``cachetally_refused_unmetered_total``, so no key can use the engine unmetered;
- ``none``: does not run the engine (health, models, tokenizer, render, admin, ...).

In upstream mode the engine may be another server than vLLM, whose own routes run it
(llama.cpp's ``/chat/completions``, ``/completion`` and ``/infill``, SGLang's ``/generate``,
Ollama's ``/api/chat``, TGI's ``POST /``): while billing is on, only the routes of this table
are forwarded (:func:`runs_no_engine` says which of the others may be), and the paths an operator
lists as running none on that server (``forward_routes``: :func:`check_forwarded_route`).

No route of these versions is "metered only": each metered route is also patched.
``tests/patching/test_routes.py`` builds the installed vLLM's app and walks ``app.routes``, and
reads the 0.33.0 wheel's route decorators, and fails on any path this table does not
classify, so a new vLLM cannot add a generating route unnoticed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Literal

from proxy.asgi.paths import tails

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


#: The templated routes of :data:`NOT_GENERATING` and the methods vLLM serves them for: another
#: server may fill the parameter with a route of its own (OpenAI's ``POST /v1/responses/compact``
#: runs a model, as the gateways that serve it do).
_TEMPLATE_METHODS: Mapping[str, frozenset[str]] = {
    "/v1/responses/{response_id}": frozenset({"GET", "HEAD"}),
    "/v1/responses/{response_id}/cancel": frozenset({"POST"}),
}


def _after_leading_segments(routes: list[str]) -> re.Pattern[str]:
    """A path that is one of ``routes`` (templates: a ``{parameter}`` is one segment) after any
    leading segments (an upstream's root path, unknown here: ``/api/v1/models``), with or
    without a trailing slash (vLLM redirects it)."""
    patterns = (re.sub(r"\\\{[^/]*?\\\}", "[^/]+", re.escape(route)) for route in routes)
    return re.compile("(?:/.*)?(?:" + "|".join(patterns) + ")/?", re.DOTALL)


_FIXED_ROUTES = _after_leading_segments(sorted(NOT_GENERATING - _TEMPLATE_METHODS.keys(), key=len, reverse=True))
_TEMPLATES = [(_after_leading_segments([route]), methods) for route, methods in _TEMPLATE_METHODS.items()]


def runs_no_engine(path: str, method: str, preflight: bool = False) -> bool:
    """Whether ``method`` on ``path`` (a request's, not a template) is a route of
    :data:`NOT_GENERATING`, after any leading segments and with an optional trailing slash:
    what upstream mode forwards, besides the metered routes, while billing is on. A bodiless
    CORS preflight (``preflight``) runs no handler, so any method of a templated route's: the
    upstream's CORS middleware answers it, as for a browser's read of a stored response."""
    if _FIXED_ROUTES.fullmatch(path) is not None:
        return True
    return any((preflight or method in methods) and pattern.fullmatch(path) is not None
               for pattern, methods in _TEMPLATES)


#: A path an operator may vouch runs no engine on the upstream (``forward_routes``): from the
#: root, segments of lower-case letters, digits and ``-._~`` (RFC 3986's unreserved characters)
#: between single slashes, none a dot segment, no trailing slash. Each of its
#: :func:`~proxy.asgi.paths.forwarded_forms` is itself: no hop or lenient router reads it as
#: another path.
_PLAIN_PATH = re.compile(r"(?:/(?!\.\.?(?:/|$))[a-z0-9._~-]+)+")


def check_forwarded_route(path: str) -> None:
    """``ValueError`` unless ``path`` may be listed as a route of the upstream's that runs no
    engine: a plain path (:data:`_PLAIN_PATH`) that is no metered or refused route, nor one
    after leading segments (as an upstream behind a root path serves ``/api/v1/embeddings``)."""
    if _PLAIN_PATH.fullmatch(path) is None:
        raise ValueError(f"{path!r} is no plain path: list it from the root, in lower case, of letters, digits and "
                         "-._~ between single slashes, with no dot segment, trailing slash, query, fragment or "
                         "percent-escape (/props), so that no hop or router reads it as another path")
    route = next((tail for tail in (path, *tails(path, len(path))) if tail in PATCHED or tail in REFUSED), None)
    if route is None:
        return
    named = path if route == path else f"{path} ends with {route}, which"
    if route in PATCHED:
        raise ValueError(f"{named} is a metered route: it is metered already; list only routes that run no engine")
    raise ValueError(f"{named} runs the engine unmetered: it is refused while billing is on, never forwarded")
