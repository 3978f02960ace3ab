"""The simulated engine's prefix cache counts like vLLM: full blocks, chained, n-1 rule, LRU."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine_adapter.sim.prefix_cache import PrefixCache


def test_cold_cache_hits_nothing() -> None:
    cache = PrefixCache(block_size=4)
    assert cache.lookup([]) == 0
    assert cache.lookup([1]) == 0
    assert cache.lookup(list(range(100))) == 0
    assert cache.num_cached_blocks == 0


def test_insert_caches_full_blocks_only_and_reports_new_tokens() -> None:
    cache = PrefixCache(block_size=4)
    assert cache.insert(list(range(10))) == 8
    assert cache.num_cached_blocks == 2
    assert cache.insert(list(range(10))) == 0
    assert cache.insert(list(range(13))) == 4
    assert cache.num_cached_blocks == 3


def test_last_token_is_never_a_hit() -> None:
    cache = PrefixCache(block_size=4)
    cache.insert(list(range(8)))
    # An 8-token prompt may hit at most ((8 - 1) // 4) * 4 = 4 tokens.
    assert cache.lookup(list(range(8))) == 4
    assert cache.lookup(list(range(9))) == 8
    assert cache.lookup(list(range(100))) == 8


def test_block_hashes_chain_the_prefix() -> None:
    cache = PrefixCache(block_size=4)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8])
    # Same second block after a different first block: no hit.
    assert cache.lookup([9, 9, 9, 9, 5, 6, 7, 8, 0]) == 0
    # Diverging inside the second block: only the first block hits.
    assert cache.lookup([1, 2, 3, 4, 5, 6, 0, 8, 0]) == 4


def test_lru_evicts_least_recently_inserted_prompt() -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=4)
    a, b, c = [1] * 8, [2] * 8, [3] * 8
    cache.insert(a)
    cache.insert(b)
    cache.insert(a)  # touch a: b is now least recently used
    cache.insert(c)
    assert cache.num_cached_blocks == 4
    assert cache.lookup(a + [0]) == 8
    assert cache.lookup(b + [0]) == 0
    assert cache.lookup(c + [0]) == 8


def test_prompt_longer_than_capacity_keeps_its_prefix() -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=3)
    prompt = list(range(16))
    assert cache.insert(prompt) == 16
    assert cache.num_cached_blocks == 3
    assert cache.lookup(prompt + [99]) == 12


def test_zero_capacity_caches_nothing() -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=0)
    cache.insert(list(range(16)))
    assert cache.num_cached_blocks == 0
    assert cache.lookup(list(range(17))) == 0


def test_clear_drops_blocks() -> None:
    cache = PrefixCache(block_size=4)
    cache.insert(list(range(8)))
    cache.clear()
    assert cache.num_cached_blocks == 0
    assert cache.lookup(list(range(9))) == 0


@given(
    tokens=st.lists(st.integers(0, 3), max_size=80),
    other=st.lists(st.integers(0, 3), max_size=80),
    block_size=st.integers(1, 8),
)
def test_hits_are_the_shared_full_blocks(
    tokens: list[int], other: list[int], block_size: int
) -> None:
    cache = PrefixCache(block_size=block_size, capacity_blocks=1000)
    cache.insert(other)
    shared = 0
    while shared < min(len(tokens), len(other)) and tokens[shared] == other[shared]:
        shared += 1
    limit = min(shared, len(other), max(len(tokens) - 1, 0))
    assert cache.lookup(tokens) == (limit // block_size) * block_size
    cache.insert(tokens)
    assert cache.lookup(tokens) == (max(len(tokens) - 1, 0) // block_size) * block_size
