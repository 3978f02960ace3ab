"""Cumulative prefix-cache figures for operators: one debug line per request, and ``/stats``.

``/stats`` is derived from the collected ``cachetally_requests_total``,
``cachetally_prompt_tokens_total`` and ``cachetally_cached_tokens_total{tier="all"}``
families (:func:`collected_stats`), so it agrees with ``/metrics`` whichever process
answers. The debug line is per process, kept in :class:`CacheStats` so the hot path never
reads the multiprocess files; when several processes share the instance it names its pid.

No prompt text, token ids or request bodies ever reach this module: only counts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

logger = logging.getLogger("cachetally.stats")


@dataclass(slots=True)
class CacheStats:
    #: Requests by what the engine said: at least one cached token, 0, or no figure.
    total_requests: int = 0
    hit_requests: int = 0
    miss_requests: int = 0
    unknown_requests: int = 0
    #: Set when several processes serve the instance: the debug line then ends in ``pid=``.
    pid: int | None = None
    #: Prompt and cached tokens of the hits and misses (the token hit rate's terms).
    total_prompt_tokens: int = 0
    total_cached_tokens: int = 0

    def add(self, prompt_tokens: int | None, cached_tokens: int | None) -> None:
        self.total_requests += 1
        if cached_tokens is None or prompt_tokens is None:
            self.unknown_requests += 1
        else:
            if cached_tokens > 0:
                self.hit_requests += 1
            else:
                self.miss_requests += 1
            self.total_prompt_tokens += prompt_tokens
            self.total_cached_tokens += cached_tokens
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("prefix cache stats: %s", self.line())

    @property
    def hit_rate(self) -> float:
        known = self.hit_requests + self.miss_requests
        return self.hit_requests / known if known else 0.0

    @property
    def token_hit_rate(self) -> float:
        total = self.total_prompt_tokens
        return self.total_cached_tokens / total if total else 0.0

    def line(self) -> str:
        return (
            f"total_requests={self.total_requests} hit_requests={self.hit_requests} "
            f"miss_requests={self.miss_requests} hit_rate={self.hit_rate:.4f} "
            f"total_prompt_tokens={self.total_prompt_tokens} "
            f"total_cached_tokens={self.total_cached_tokens} "
            f"token_hit_rate={self.token_hit_rate:.4f}"
        ) + ("" if self.pid is None else f" pid={self.pid}")

    def as_dict(self) -> dict[str, int | float]:
        return {
            "total_requests": self.total_requests,
            "hit_requests": self.hit_requests,
            "miss_requests": self.miss_requests,
            "unknown_requests": self.unknown_requests,
            "hit_rate": round(self.hit_rate, 4),
            "total_prompt_tokens": self.total_prompt_tokens,
            "total_cached_tokens": self.total_cached_tokens,
            "token_hit_rate": round(self.token_hit_rate, 4),
        }


_OUTCOMES = {"hit": "hit_requests", "miss": "miss_requests", "unknown": "unknown_requests"}


def collected_stats(registry: CollectorRegistry) -> CacheStats:
    """The figures of every ``cachetally_*`` request counter ``registry`` collects."""
    stats = CacheStats()
    for family in registry.collect():
        for sample in family.samples:
            name, value = sample.name, round(sample.value)
            if name == "cachetally_requests_total":
                stats.total_requests += value
                outcome = _OUTCOMES[sample.labels["cache"]]
                setattr(stats, outcome, getattr(stats, outcome) + value)
            elif name == "cachetally_prompt_tokens_total":
                stats.total_prompt_tokens += value
            elif name == "cachetally_cached_tokens_total" and sample.labels.get("tier") == "all":
                stats.total_cached_tokens += value
    return stats
