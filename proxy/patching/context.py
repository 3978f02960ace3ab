"""What every patched request shares: the middleware's configuration and the objects a
request reports to (the ledger, the metrics, the recorder), handed to each
:class:`~proxy.patching.responder.Responder` so that it depends on these and not on the
middleware that builds it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Scope

from proxy.accounting.metrics import Metrics
from proxy.accounting.records.recorder import Recorder
from proxy.accounting.tenants import Tenancy
from proxy.asgi.error_guard import ErrorGuard
from proxy.patching.body_budget import BodyBudget
from proxy.patching.ledger import UsageLedger
from proxy.patching.response_budget import ResponseBudget
from proxy.patching.routes import PATCHED, REFUSED
from proxy.patching.served_models import ServedModels
from proxy.patching.usage import Missing

DEFAULT_ROUTES: Mapping[str, str] = PATCHED
CountPrompt = Callable[[str, bytes, Scope], Awaitable["int | None"]]


@dataclass(frozen=True, slots=True)
class PatchConfig:
    routes: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_ROUTES))
    missing: Missing = "zero"
    max_request_bytes: int = 32 << 20
    max_response_bytes: int = 64 << 20
    max_event_bytes: int = 1 << 20
    #: Bytes of request bodies still arriving that one process may hold (proxy.patching.body_budget).
    max_request_bytes_held: int = 1 << 30
    #: Bytes of responses held to be patched that one process may hold (proxy.patching.response_budget).
    max_response_bytes_held: int = 1 << 30
    #: Ask the inner app for a usage chunk the client did not request, and drop it
    #: before the client sees it, so every streamed request is counted (upstream mode).
    ghost_usage: bool = False
    #: Strip ``return_cached_tokens_details`` (our opt-in) before the inner app sees it.
    #: Off in upstream mode: the field is SGLang's own, and SGLang answers it itself.
    strip_details_flag: bool = True
    default_model: str = "unknown"
    tenancy: Tenancy = field(default_factory=Tenancy)
    #: Recognize disaggregated prefill/decode legs by their ``kv_transfer_params``: the
    #: prefill leg is counted as a leg only, the decode leg bills (:mod:`proxy.patching.pd_leg`).
    pd_legs: bool = False
    #: Remove a client's ``kv_transfer_params`` before the inner app sees them (upstream mode
    #: without ``pd_legs``): vLLM reports ``remote_prefill_cached_tokens`` as cache reads.
    drop_kv_transfer_params: bool = False
    #: Which response model names are labels (others are ``other``).
    models: ServedModels = field(default_factory=ServedModels)
    #: Billing is on (tenants or usage records): refuse what would run the engine unmetered,
    #: the ``refused`` routes (:mod:`proxy.patching.routes`) and bodies a shape cannot meter.
    refuse_unmetered: bool = False
    refused: frozenset[str] = REFUSED
    #: With ``refuse_unmetered``, also refuse a path that is a metered or refused route under
    #: a prefix (upstream mode): an upstream behind its own root path (vLLM's ``--root-path``)
    #: routes ``P/v1/chat/completions`` as ``/v1/chat/completions``, and ``P`` is not known here;
    #: and a path that is no route of the table, which another engine's server may run
    #: (:func:`proxy.patching.routes.runs_no_engine`).
    refuse_prefixed: bool = False
    #: With ``refuse_prefixed``, the upstream's own paths the operator vouches run no engine
    #: (``forward_routes``, each checked by :func:`proxy.patching.routes.check_forwarded_route`):
    #: forwarded by every method, where every form of the request's path is one of these or
    #: a route that runs no engine.
    forwarded: frozenset[str] = frozenset()
    #: Answer a metered route's other methods and trailing slash as vLLM's router does
    #: (upstream mode: :mod:`proxy.patching.route_methods`), where the inner app's router may
    #: run them unmetered. Inside vLLM its own router answers them.
    answer_as_vllms_router: bool = False


@dataclass(frozen=True, slots=True)
class PatchContext:
    """The inner app a request is replayed to, the configuration, and where it is counted."""

    app: ASGIApp
    #: ``app`` when it is the error guard: then the responder rewrites framework 404s and
    #: 405s itself, and the guard only answers exceptions (:meth:`ErrorGuard.serve`).
    guard: ErrorGuard | None
    config: PatchConfig
    ledger: UsageLedger
    metrics: Metrics
    recorder: Recorder | None
    #: The request-id header echoed in every response, lower-case.
    echo_header: bytes
    #: This process's request bodies being received, bounded.
    bodies: BodyBudget
    #: This process's responses held to be patched, bounded.
    responses: ResponseBudget
    #: Upstream mode: a cut stream's prompt tokens as the upstream counts them, from the route,
    #: the body it was sent and its forwarded scope (:meth:`proxy.upstream.engine.UpstreamEngine.count_prompt`).
    count_prompt: CountPrompt | None = None
