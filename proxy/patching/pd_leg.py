"""Disaggregated prefill/decode: which leg of a client request an HTTP request is, and
the rule that counts and bills each client request once across the fleet.

A P/D router (``vllm-router --vllm-pd-disaggregation``, llm-d, Dynamo, vLLM's own proxy
examples) sends each client request twice, under one request id: a **prefill leg** to a
prefill instance, whose body carries ``kv_transfer_params.do_remote_decode`` (the
instance computes the prompt's KV and holds it for a remote decode), then a **decode leg**
to a decode instance, whose body carries ``kv_transfer_params.do_remote_prefill`` (the
instance pulls that KV instead of computing it) and, since vLLM 0.31, the prefill's own
hits as ``remote_prefill_cached_tokens``. Those two markers are what vLLM's KV connector
acts on, so the leg is read from them, and from nothing else (never from ``max_tokens``).

The rule (docs/ACCOUNTING.md, "Disaggregated prefill and decode"):

- the **decode leg bills**: it is the response the client gets, its ``cached_tokens`` is
  the prefill's hits (vLLM applies ``remote_prefill_cached_tokens``), and it is counted in
  the tenant's totals and writes the usage record, whatever its outcome (a decode that
  fails after its prefill leaves one record, ``outcome`` error or disconnected);
- the **prefill leg** is counted only under ``cachetally_pd_legs_total{leg="prefill"}``
  and ``cachetally_pd_*_tokens_total{leg="prefill"}``: never in a tenant's totals, no
  usage record.

A decode leg refused or ended before its engine ran (a ``max_tokens`` past the context,
which vLLM refuses only once it has the tokens; a client gone between the legs) has no
figures of its own, yet its prefill was computed and cached: left at that, a client could
have prompts prefilled and cached for nothing. So the prefill instance **hands its figures
over**: it writes the prompt and cache reads its engine published (in upstream mode, its
upstream's believed usage) into the ``kv_transfer_params`` of its response (key
:data:`FIGURES`), which the router copies into the decode leg's body, and the decode leg
bills those when its own engine published none. They bill nothing more than the prefill
computed, and only a decode without figures of its own reads them.

Across the fleet, prefill legs minus decode legs is the number of client requests whose
decode leg never reached a decode instance (the router failed before sending it): the one
case with no record, since no instance served a response.

Recognition is off unless ``pd_legs`` is set (``CACHETALLY_PD_LEGS=true`` on every
instance of the P/D fleet): on any other server a client could mark its own request as a
prefill leg and go unbilled. In a P/D fleet the instances sit behind the router; clients
must not reach a prefill instance directly.
"""

from __future__ import annotations

from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter

from proxy.patching.ledger import EngineUsage
from proxy.patching.usage import ResponseUsage, count

Leg = Literal["prefill", "decode"]
PREFILL: Leg = "prefill"
DECODE: Leg = "decode"


#: Where a prefill leg's response hands its figures to the decode leg, in ``kv_transfer_params``.
FIGURES = "cachetally_prefill"


def hand_over(payload: dict[str, Any], engine: EngineUsage | None, reported: ResponseUsage) -> bool:
    """Write the prefill's figures (its engine's, else an upstream's believed usage) into its
    response's ``kv_transfer_params``, which the router copies into the decode leg's body;
    ``False`` where there is nothing to write."""
    params = payload.get("kv_transfer_params")
    if not isinstance(params, dict):
        return False
    if engine is not None and engine.events:
        prompt, cached, source = engine.prompt_tokens, engine.cached_tokens, "engine"
    elif reported.source == "upstream" and reported.prompt_tokens is not None and reported.cached_tokens is not None:
        prompt, cached, source = reported.prompt_tokens, reported.cached_tokens, "upstream"
    else:
        return False
    params[FIGURES] = {"prompt_tokens": prompt, "cached_tokens": cached, "source": source}
    return True


def handed(payload: dict[str, Any]) -> tuple[int, int, str] | None:
    """The prefill's (prompt, cached, source) a decode leg's body carries, if they are counts
    (cached within the prompt) from an engine or an upstream; ``None`` otherwise."""
    params = payload.get("kv_transfer_params")
    figures = params.get(FIGURES) if isinstance(params, dict) else None
    if not isinstance(figures, dict):
        return None
    prompt, cached = count(figures.get("prompt_tokens")), count(figures.get("cached_tokens"))
    source = figures.get("source")
    if prompt is None or cached is None or cached > prompt:  # a figure no record holds is none
        return None
    return (prompt, cached, source) if source in ("engine", "upstream") else None


def leg_of(payload: dict[str, Any]) -> Leg | None:
    """The leg a request body marks itself as, or ``None`` for an ordinary request."""
    params = payload.get("kv_transfer_params")
    if not isinstance(params, dict):
        return None
    # A leg is claimed with ``true`` only; the other marker is absent as vLLM reads it (its
    # scheduler and connectors test truthiness): ``{"do_remote_decode": true,
    # "do_remote_prefill": 1}`` is a decode to vLLM, so not a prefill leg here. Anything
    # else, a body claiming both included, is an ordinary request, billed as one.
    remote_decode, remote_prefill = params.get("do_remote_decode"), params.get("do_remote_prefill")
    if remote_decode is True and not remote_prefill:
        return PREFILL
    if remote_prefill is True and not remote_decode:
        return DECODE
    return None


class LegMetrics:
    """``cachetally_pd_*``: each leg under its own label, outside every tenant's totals."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._legs = Counter(
            "cachetally_pd_legs", "Disaggregated prefill/decode legs served here, by outcome",
            ["leg", "outcome"], registry=registry,
        )
        self._prompt = Counter(
            "cachetally_pd_prompt_tokens", "Prompt tokens of the prefill/decode legs served here",
            ["leg"], registry=registry,
        )
        self._cached = Counter(
            "cachetally_pd_cached_tokens",
            "Prompt tokens the legs served here found in this instance's caches, by tier",
            ["leg", "tier"], registry=registry,
        )
        self._transferred = Counter(
            "cachetally_pd_transferred_tokens",
            "Prompt tokens whose KV a decode leg pulled from its prefill instance (not cache hits)",
            registry=registry,
        ).inc

    def count(self, leg: Leg, outcome: str, engine: EngineUsage | None) -> None:
        self._legs.labels(leg, outcome).inc()
        if engine is None or not engine.events:
            return
        self._prompt.labels(leg).inc(engine.prompt_tokens)
        if leg == DECODE:  # its cached_tokens are the prefill's hits, counted on the prefill leg
            if engine.decode_local_tokens is not None:
                self._cached.labels(leg, "local").inc(engine.decode_local_tokens)
            if engine.transferred_tokens is not None:
                self._transferred(engine.transferred_tokens)
            return
        self._cached.labels(leg, "all").inc(engine.cached_tokens)
        for tier, value in (("local", engine.local_cached_tokens), ("external", engine.external_cached_tokens)):
            if value is not None:
                self._cached.labels(leg, tier).inc(value)
