"""A block-hash prefix cache with vLLM's counting rules, for the simulated engine.

Token ids are split into blocks of ``block_size``. Each full block is identified by a hash
that chains its parent's hash, so a block only matches when the whole prefix before it
matches too. Partial trailing blocks are never cached.

Counting follows vLLM v1 (``KVCacheManager.get_computed_blocks``): at least one prompt
token must be recomputed to produce logits, so hits are searched over the first
``len(tokens) - 1`` tokens only, and at most ``((n - 1) // block_size) * block_size``
tokens can hit.

Capacity is counted in blocks, with LRU eviction. Like vLLM, which frees a request's
blocks tail first, a prompt's blocks are touched last block first, so under pressure a
prompt's tail is evicted before its prefix.

Hashes use Python's ``hash`` of ``(parent_hash, block_tokens)``: deterministic within a
process (ints and tuples of ints are not salted), which is all a simulation needs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

_ROOT_HASH = 0


class PrefixCache:
    """Block-hash prefix cache with an LRU capacity in blocks."""

    def __init__(self, block_size: int = 16, capacity_blocks: int = 4096) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        # Block hash -> None; order is recency, least recently used first.
        self._blocks: OrderedDict[int, None] = OrderedDict()

    @property
    def num_cached_blocks(self) -> int:
        return len(self._blocks)

    def block_hashes(self, token_ids: Sequence[int], num_tokens: int | None = None) -> list[int]:
        """Chained hashes of the full blocks in the first ``num_tokens`` tokens."""
        n = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
        bs = self.block_size
        hashes: list[int] = []
        parent = _ROOT_HASH
        for start in range(0, n - n % bs, bs):
            parent = hash((parent, tuple(token_ids[start : start + bs])))
            hashes.append(parent)
        return hashes

    def lookup(self, token_ids: Sequence[int]) -> int:
        """Number of leading prompt tokens served from the cache (does not touch the LRU)."""
        cached_blocks = 0
        for block_hash in self.block_hashes(token_ids, len(token_ids) - 1):
            if block_hash not in self._blocks:
                break
            cached_blocks += 1
        return cached_blocks * self.block_size

    def insert(self, token_ids: Sequence[int]) -> int:
        """Cache every full block of the prompt; return the tokens newly cached.

        Blocks already present are touched. Eviction runs after the whole prompt is in,
        so a prompt longer than the capacity keeps its leading blocks.
        """
        new_blocks = 0
        for block_hash in reversed(self.block_hashes(token_ids)):
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
            else:
                self._blocks[block_hash] = None
                new_blocks += 1
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
        return new_blocks * self.block_size

    def clear(self) -> None:
        """Drop every cached block (vLLM's ``reset_prefix_cache``); counters are kept."""
        self._blocks.clear()
