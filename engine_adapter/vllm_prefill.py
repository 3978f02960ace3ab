"""Per-request cache tiers (local vs external) from vLLM's output processor.

vLLM's scheduler sends a ``PrefillStats`` (``vllm/v1/metrics/stats.py``) with each
request's first output: ``num_local_cached_tokens`` (this engine's prefix cache) and
``num_external_cached_tokens`` (a KV connector: offload, disk, another instance). The
output processor (``vllm/v1/engine/output_processor.py``) copies only the totals into
``RequestOutput``. To keep the split without patching vLLM's source, :class:`TierTap`
wraps one bound method of the running engine's ``OutputProcessor`` instance,
``_update_stats_from_output(req_state, engine_core_output, ...)``, which runs for every
engine output, before that output is queued for ``generate()``. It records the split by
the caller's request id (``req_state.external_req_id``, the id passed to ``generate()``).
With ``n > 1`` each child request has its own split; the tap asks for the one whose sum
matches the ``num_cached_tokens`` of the output it saw.

The hook is feature-detected: if vLLM renames that method or its fields, ``installed``
is False and the adapter publishes totals only. Entries are popped by the tap when it
publishes, discarded when ``generate()`` ends, and capped in number as a second line of
defence, so nothing outlives its request.
"""

from __future__ import annotations

import inspect
import logging
from collections import OrderedDict
from typing import Any

logger = logging.getLogger("cachetally.engine.vllm")

_HOOKED = "_update_stats_from_output"
_MAX_ENTRIES = 4096


class TierTap:
    """Captures ``(local, external)`` cached tokens per request id from an ``AsyncLLM``."""

    def __init__(self, engine_client: Any) -> None:
        self._tiers: OrderedDict[str, dict[int, tuple[int, int]]] = OrderedDict()
        self._processor = getattr(engine_client, "output_processor", None)
        self._original = getattr(self._processor, _HOOKED, None)
        self.installed = self._compatible(self._original)
        if self.installed:
            setattr(self._processor, _HOOKED, self._hook)
        else:
            logger.info("vLLM cache tiers unavailable: publishing cached_tokens totals only")

    @staticmethod
    def _compatible(method: Any) -> bool:
        if method is None:
            return False
        params = list(inspect.signature(method).parameters)
        return params[:2] == ["req_state", "engine_core_output"]

    def _hook(self, req_state: Any, engine_core_output: Any, *args: Any, **kwargs: Any) -> Any:
        stats = getattr(engine_core_output, "prefill_stats", None)
        if stats is not None and getattr(req_state, "is_prefilling", False):
            self._record(req_state, stats)
        return self._original(req_state, engine_core_output, *args, **kwargs)

    def _record(self, req_state: Any, stats: Any) -> None:
        parent = getattr(req_state, "parent_req", None)
        key = getattr(parent or req_state, "external_req_id", None)
        local = getattr(stats, "num_local_cached_tokens", None)
        external = getattr(stats, "num_external_cached_tokens", None)
        if key is None or not isinstance(local, int) or not isinstance(external, int):
            return
        self._tiers.setdefault(key, {}).setdefault(local + external, (local, external))
        while len(self._tiers) > _MAX_ENTRIES:
            self._tiers.popitem(last=False)

    def pop(self, request_id: str | None, cached_tokens: int) -> tuple[int, int] | None:
        """The ``(local, external)`` split of ``cached_tokens`` for ``request_id``.

        Everything recorded for the id is forgotten. ``None`` when no split adds up.
        """
        splits = self._tiers.pop(request_id, None) if request_id is not None else None
        return splits.get(cached_tokens) if splits else None

    def discard(self, request_id: str | None) -> None:
        """Forget ``request_id`` (its ``generate()`` ended before publishing)."""
        if request_id is not None:
            self._tiers.pop(request_id, None)

    def uninstall(self) -> None:
        """Restore the output processor's own method. Idempotent."""
        if self.installed:
            self._processor.__dict__.pop(_HOOKED, None)
            self.installed = False
        self._tiers.clear()
