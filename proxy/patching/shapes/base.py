"""What the Responses and Messages shapes share: one resolution of reads and writes.

The numbers follow :mod:`proxy.patching.usage`: an engine event wins (a different reported value
counts as a mismatch); else the response's own value (``source=upstream``); else the
``missing`` policy (``zero`` writes 0 reads, ``omit`` leaves the usage as it is). Cache
writes (prompt tokens the engine wrote to its prefix cache) come from the same event,
else from the response, else stay unwritten: they are never guessed.

A usage object that reports neither the prompt nor its cache reads, with no engine event
(Anthropic's final ``message_delta`` carries ``output_tokens`` only), has nothing to
resolve: it stays as the upstream wrote it, and the figures of an earlier usage object
(``message_start``) stand for the response.

A shape says where its usage object sits in a payload (:meth:`Shape.locate`) and how to
write the resolved :class:`Figures` into it (:meth:`Shape.write`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.patching import json_exact
from proxy.patching.ledger import EngineUsage
from proxy.patching.usage import Missing, ResponseUsage, believed


@dataclass(frozen=True, slots=True)
class Reported:
    """What one usage object says: the whole prompt, its cache reads and writes."""

    prompt: int | None
    reads: int | None
    writes: int | None


@dataclass(frozen=True, slots=True)
class Figures:
    prompt: int | None
    reads: int | None
    writes: int | None
    source: str | None


class Shape:
    """One API's usage layout. Subclasses define :meth:`locate`, :meth:`read`, :meth:`write`."""

    name = ""
    #: An event of this API can carry the whole response (and the request parts it echoes),
    #: so a partial event is held up to ``max_response_bytes``, as a JSON body is, rather than
    #: ``max_event_bytes``, to be patched; past it, its usage is read as it passes
    #: (:mod:`proxy.patching.passing_event`).
    whole_response_events = False
    #: For each type of stream event that carries a usage, the member of its data that holds
    #: that ``usage`` and the ``model`` (``""``: the data itself): read as such an event too
    #: large to hold passes (:mod:`proxy.patching.passing_event`).
    event_holders: dict[str, str] = {}
    #: The top-level fields that name a whole JSON body of this API (as :meth:`locate` reads
    #: them), beside its ``usage`` when only that was read (:mod:`proxy.patching.passing_usage`).
    body_kind: dict[str, str] = {}

    def refusal(self, payload: dict[str, Any]) -> str | None:
        """Why a request with this body cannot be metered (it is refused when billing is on)."""
        return None

    def locate(self, payload: dict[str, Any]) -> tuple[dict[str, Any] | None, bool]:
        """The object holding ``usage`` and ``id`` in a JSON body or SSE event payload, and
        whether that usage covers the whole request (a final figure)."""
        raise NotImplementedError

    def read(self, usage: dict[str, Any]) -> Reported:
        raise NotImplementedError

    def reported(self, payload: dict[str, Any], usage: dict[str, Any], in_response: ResponseUsage) -> Reported:
        """What ``usage`` says as the client reads it, after the response's earlier events."""
        return self.read(usage)

    def write(self, usage: dict[str, Any], figures: Figures) -> None:
        raise NotImplementedError

    def patch(
        self, payload: dict[str, Any], engine: EngineUsage | None, missing: Missing, in_response: ResponseUsage
    ) -> tuple[bool | None, dict[str, Any] | None]:
        """Patch ``payload`` in place: (``True`` if changed else ``None``, the final holder
        when this payload's usage covers the whole request)."""
        holder, final = self.locate(payload)
        if holder is None:
            return None, None
        model = holder.get("model")
        if isinstance(model, str):
            in_response.model = model
        usage = holder.get("usage")
        if not isinstance(usage, dict):
            return None, None
        reported = self.reported(payload, usage, in_response)
        if engine is None and reported.prompt is None and reported.reads is None:
            return None, (holder if final else None)
        figures = resolve(engine, missing, reported)
        if engine is not None and reported.reads is not None and reported.reads != figures.reads:
            in_response.mismatches += 1
        if figures.prompt is not None:
            in_response.prompt_tokens = figures.prompt
        in_response.cached_tokens, in_response.cache_creation_tokens = figures.reads, figures.writes
        in_response.source = figures.source
        before = json_exact.dumps(usage)  # orjson, unless the usage holds what it cannot write
        self.write(usage, figures)
        return (True if json_exact.dumps(usage) != before else None), (holder if final else None)


def resolve(engine: EngineUsage | None, missing: Missing, reported: Reported) -> Figures:
    if engine is not None:
        reads = engine.cached_for(reported.prompt)
        if reads is not None:
            whole = reported.prompt is None or reported.prompt == engine.prompt_tokens
            writes = engine.cache_creation_tokens if whole else None
            return Figures(
                engine.prompt_tokens if whole else reported.prompt,
                reads,
                reported.writes if writes is None else writes,
                "engine",
            )
    reads, writes = believed(reported.prompt, reported.reads, reported.writes)
    if reads is not None:
        return Figures(reported.prompt, reads, writes, "upstream")
    return Figures(reported.prompt, 0 if missing == "zero" else None, writes, None)
