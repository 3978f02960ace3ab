"""The top-level ``usage`` of a JSON body too large to hold, read as it passes, against the
standard library's parse of the whole body."""

from __future__ import annotations

import json
import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.patching.passing_usage import MAX_USAGE_BYTES, PassingUsage

#: Strings full of what could pass for structure: quotes, backslashes, brackets, "usage".
_TEXT = st.lists(st.sampled_from(['a', '"', '\\', 'usage', '"usage"', '"usage":', '{', '}', '[', ']', ':', ',', ' ',
                                  'é', '\n']), max_size=6).map("".join)
_VALUE = st.recursive(
    st.one_of(st.integers(-5, 10**6), st.none(), st.booleans(), _TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(_TEXT, st.just("usage")), inner, max_size=4)),
    max_leaves=20,
)
_USAGE = st.dictionaries(st.sampled_from(["prompt_tokens", "completion_tokens", "usage"]), st.integers(0, 10**9),
                         max_size=3)


def _fed(body: bytes, cuts: list[int]) -> PassingUsage:
    scanner, done = PassingUsage(), 0
    for cut in [*cuts, len(body)]:
        scanner.feed(body[done:cut], last=cut == len(body))
        done = cut
    return scanner


@settings(max_examples=500)
@given(st.dictionaries(_TEXT.filter(lambda key: key != "usage"), _VALUE, max_size=5), st.none() | _USAGE,
       st.integers(0, 6), st.randoms(), st.booleans(), st.booleans())
def test_the_top_level_usage_is_read_wherever_the_body_is_cut(
        members: dict[str, Any], usage: dict[str, int] | None, at: int, rnd: random.Random, ascii_only: bool,
        spaced: bool) -> None:
    """Nested ``"usage"`` keys (a client's echoed objects), the letters inside strings and
    escaped quotes are never taken for it; a key, its colon and its value cut anywhere are."""
    items = list(members.items())
    if usage is not None:
        items.insert(min(at, len(items)), ("usage", usage))
    body = json.dumps(dict(items), ensure_ascii=ascii_only, separators=(", ", ": ") if spaced else (",", ":")).encode()
    cuts = sorted(rnd.sample(range(1, len(body)), min(len(body) - 1, rnd.randint(0, 8))))
    assert _fed(body, cuts).usage == json.loads(body).get("usage") == usage


def test_a_usage_value_past_its_bound_is_not_read_and_what_follows_a_value_costs_nothing() -> None:
    body = json.dumps({"usage": {"prompt_tokens": 1, "pad": "x" * MAX_USAGE_BYTES}}).encode()
    for cuts in ([], list(range(1000, len(body), 1000))):
        assert _fed(body, cuts).usage is None
    body = json.dumps({"usage": {"prompt_tokens": 1}, "prompt_logprobs": ["x" * 100] * 10_000}).encode()
    assert _fed(body, [len(body) // 2]).usage == {"prompt_tokens": 1}
