"""What each request's first copy found in the cache, from vLLM's output processor.

vLLM's scheduler sends a ``PrefillStats`` (``vllm/v1/metrics/stats.py``) with each engine
request's first output: cached tokens, split into ``num_local_cached_tokens`` (this
engine's prefix cache) and ``num_external_cached_tokens`` (a KV connector: offload,
disk, another instance), and the tokens written to the cache. The output processor
(``vllm/v1/engine/output_processor.py``) copies only the totals into ``RequestOutput``.

With ``n > 1`` one ``generate()`` call fans out into child requests (``ParentRequest``),
and the ``RequestOutput`` that ``generate()`` yields carries the figures of whichever
child produced it: the first child when streaming, the last to finish otherwise. For a
cold prompt that is 0 streamed but the second copy's hit on the first copy's blocks
without streaming. The policy (README.md, "What it does") is one meaning for both: each
prompt counted once, with what its **first copy** found in the cache. So the figures come from here, not from
the output: :class:`PrefillTap` records the first prefill of each request (for ``n > 1``,
the first child the scheduler prefilled; it schedules children in order) under vLLM's
internal request id (the parent's for ``n > 1``), and hands it to the adapter at once, to
publish at the prefill rather than with the first output: a non-streaming request has no
output before it ends, and a client that leaves before then is still billed the prefill
vLLM ran. The internal id is the id passed to ``generate()`` plus 8 random characters
(``InputProcessor.assign_request_id``), so it is unique per ``generate()`` call where the
external id need not be: vLLM's Responses API names its engine requests after the body's
``request_id``, which two concurrent requests may share. The tap learns each call's internal
id from ``AsyncLLM.add_request`` (:mod:`engine_adapter.vllm.tap`) and registers the call
under it (:meth:`PrefillTap.expect`).

``remote_prefill_cached_tokens`` (the prefill instance's hits, which vLLM reads from the
request's ``kv_transfer_params``, so from the client's body on any server) is trusted only
where cachetally runs disaggregated prefill/decode (``pd_legs``, behind the router); anywhere
else the scheduler's own figures stand, whatever the body claims.

How that relates to vLLM's own counters: ``vllm:prompt_tokens_cached_total`` (and
``vllm:prompt_tokens_total``) count every child of an ``n > 1`` request. The sum of the
``cached_tokens`` cachetally reports therefore equals vLLM's counter delta minus the hits
of the second and later copies; with ``n = 1`` (prompt lists included) they are equal.

The hook wraps one bound method of the running engine's ``OutputProcessor`` instance,
``_update_stats_from_output(req_state, engine_core_output, ...)``, which runs for every
engine output before vLLM clears ``req_state.is_prefilling`` and before the output is
queued for ``generate()``. Its name, its leading parameters and the fields read here are
declared in :mod:`engine_adapter.vllm.compat` and checked against each supported vLLM's
sources. It is feature-detected: if the running engine's method is missing or takes other
parameters, ``installed`` is False, one warning says so
(:func:`~engine_adapter.vllm.compat.log_missing_once` where vLLM itself lacks it), and the
adapter publishes the output's totals (exact for ``n = 1``), at the first output.
Registrations are dropped at the prefill or when ``generate()`` ends, and capped in number
as a second line of defence (the oldest falls back to the first output), so nothing
outlives its request. The hook runs on the API server's event loop (vLLM's output handler
task), the loop the ledger lives on.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from engine_adapter.vllm import compat

logger = logging.getLogger("cachetally.engine.vllm")

_HOOK = compat.TOUCH_POINTS["OutputProcessor._update_stats_from_output"]
_HOOKED = _HOOK.attr
#: Registrations live while their request waits for its prefill: as many as the ledger's slots.
_MAX_ENTRIES = 100_000

Call = TypeVar("Call")


@dataclass(frozen=True, slots=True)
class Prefill:
    """One engine request's first prefill: cached tokens, their tiers, tokens written."""

    cached_tokens: int
    local_cached_tokens: int | None
    external_cached_tokens: int | None
    cache_creation_tokens: int | None
    transferred_tokens: int | None = None  # a disaggregated decode: KV pulled from the prefill
    decode_local_tokens: int | None = None  # a disaggregated decode: its own prefix-cache hits


def claims_remote_cache(params: Any) -> bool:
    """Whether vLLM reports a ``remote_prefill_cached_tokens`` in these sampling params as its
    request's cached tokens, as its ``RequestState.from_new_request`` reads them: from any
    body's ``kv_transfer_params``, with or without a KV connector."""
    extra = getattr(params, "extra_args", None)
    transfer = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    return (isinstance(transfer, dict) and bool(transfer.get("do_remote_prefill"))
            and isinstance(transfer.get("remote_prefill_cached_tokens"), int))


class PrefillTap(Generic[Call]):
    """Hands the first :class:`Prefill` of each registered internal request id, with its
    prompt's length, to ``prefilled(call, prefill, prompt_tokens)``, once.

    ``pd_legs``: this instance serves disaggregated prefill/decode legs from a router, so a
    decode's ``remote_prefill_cached_tokens`` is the prefill instance's word, not a client's.
    """

    def __init__(self, engine_client: Any, prefilled: Callable[[Call, Prefill, int], None], *,
                 pd_legs: bool = False) -> None:
        self._waiting: OrderedDict[str, Call] = OrderedDict()
        self._prefilled = prefilled
        self._failed_logged = self._evicted_logged = False
        self._pd_legs = pd_legs
        self._processor = getattr(engine_client, "output_processor", None)
        self._original = getattr(self._processor, _HOOKED, None)
        self.installed = self._original is not None and compat.params_match(_HOOK, self._original)
        if self.installed:
            setattr(self._processor, _HOOKED, self._hook)
        elif _HOOK.qualname not in compat.log_missing_once(logger):
            # vLLM has it, this engine client does not (a wrapper, a subclass): say so here.
            logger.warning("engine client %s has no %s(%s, ...): %s", type(engine_client).__name__,
                           _HOOKED, ", ".join(_HOOK.params), _HOOK.without)

    def expect(self, engine_id: str, call: Call) -> None:
        """Hand the first prefill of internal id ``engine_id`` to ``call`` (when installed)."""
        if not self.installed:
            return
        self._waiting[engine_id] = call
        if len(self._waiting) > _MAX_ENTRIES:  # a leak, not a queue: generate() forgets its own
            self._waiting.popitem(last=False)
            if not self._evicted_logged:
                self._evicted_logged = True
                logger.warning("more than %d requests wait for their prefill: the oldest is billed from "
                               "its first output instead (this is logged once)", _MAX_ENTRIES)

    def forget(self, engine_id: str | None) -> None:
        """``generate()`` for ``engine_id`` ended: nothing more to hand it."""
        if engine_id is not None:
            self._waiting.pop(engine_id, None)

    def _hook(self, req_state: Any, engine_core_output: Any, *args: Any, **kwargs: Any) -> Any:
        stats = getattr(engine_core_output, "prefill_stats", None)
        if stats is not None and getattr(req_state, "is_prefilling", False):
            try:
                self._record(req_state, stats)
            except Exception:  # vLLM's output handler serves every request: never break it
                if not self._failed_logged:
                    self._failed_logged = True
                    logger.exception("prefill figures not handed over (this is logged once; "
                                     "the request's first output publishes them)")
        return self._original(req_state, engine_core_output, *args, **kwargs)

    def _record(self, req_state: Any, stats: Any) -> None:
        parent = getattr(req_state, "parent_req", None)
        key = getattr(parent or req_state, "request_id", None)
        call = self._waiting.pop(key, None) if key is not None else None
        if call is None:
            return  # a later copy (the first one's figures stand), or a call not registered
        # vLLM's own count: the prompt's token ids, or its embeddings' rows (``prompt_embeds``,
        # whose token ids are None), the figure its counters and its usage add.
        prompt_tokens = getattr(req_state, "prompt_len", None)
        if not isinstance(prompt_tokens, int):
            return
        cached = getattr(stats, "num_cached_tokens", None)
        local = getattr(stats, "num_local_cached_tokens", None)
        external = getattr(stats, "num_external_cached_tokens", None)
        remote = getattr(req_state, "remote_prefill_cached_tokens", None) if self._pd_legs else None
        if isinstance(remote, int):
            # A disaggregated decode: the client is told what the prefill instance found
            # (vLLM's own override); the tokens the connector brought are a transfer.
            first = Prefill(
                remote, None, None, None,
                transferred_tokens=external if isinstance(external, int) else None,
                decode_local_tokens=local if isinstance(local, int) else None,
            )
        elif isinstance(cached, int):
            split = isinstance(local, int) and isinstance(external, int) and local + external == cached
            creation = getattr(stats, "num_cache_creation_tokens", None)
            first = Prefill(
                cached,
                local if split else None,
                external if split else None,
                creation if isinstance(creation, int) else None,
            )
        else:
            return
        self._prefilled(call, first, prompt_tokens)

    def uninstall(self) -> None:
        """Restore the output processor's own method. Idempotent."""
        if self.installed:
            self._processor.__dict__.pop(_HOOKED, None)
            self.installed = False
        self._waiting.clear()
