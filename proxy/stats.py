"""Cumulative prefix-cache figures for operators: one debug line per request, and ``/stats``.

No prompt text, token ids or request bodies ever reach this module: only counts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger("cachetally.stats")


@dataclass(slots=True)
class CacheStats:
    total_requests: int = 0
    hit_requests: int = 0
    miss_requests: int = 0
    unknown_requests: int = 0
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
        )

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
