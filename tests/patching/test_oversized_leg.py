"""A body too large to hold yields the top-level ``kv_transfer_params`` the engine would read
(proxy.patching.oversized_leg), however it is cut into chunks: never a nested one, a key
spelt inside a string, or an earlier duplicate; ``json.loads`` is the reference."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.patching.oversized_leg import TopLevelMember

NAME = "kv_transfer_params"
# Keys and strings that look like the member, or like structure, to a careless scanner.
TEXT = st.sampled_from([NAME, "kv", f"{NAME} ", '"', "\\", "}{][,:", '"kv_transfer_params":', "é\n", ""])
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=12,
)


@st.composite
def bodies_and_cuts(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    members = draw(st.lists(st.tuples(TEXT, VALUES), max_size=5))
    parts = []
    for key, value in members:  # duplicates kept, as a client may send them; escapes or not
        ascii_only = draw(st.booleans())
        parts.append(json.dumps(key, ensure_ascii=ascii_only) + draw(st.sampled_from([":", " : "]))
                     + json.dumps(value, ensure_ascii=ascii_only))
    body = ("{" + ",".join(parts) + "}").encode()
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=12)))
    return body, cuts


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies_and_cuts())
def test_the_member_is_what_json_loads_reads_however_the_body_is_cut(case: tuple[bytes, list[int]]) -> None:
    body, cuts = case
    member = TopLevelMember(NAME, cap=len(body))
    for start, end in zip([0, *cuts], [*cuts, len(body)], strict=True):
        member.feed(body[start:end])
    expected: Any = json.loads(body).get(NAME, "absent")
    assert (json.loads(member.value) if member.value is not None else "absent") == expected


def test_a_member_longer_than_the_cap_is_not_kept_nor_an_earlier_one() -> None:
    member = TopLevelMember(NAME, cap=32)
    member.feed(b'{"kv_transfer_params": {"do_remote_prefill": true}, "kv_transfer_params": [' + b"1," * 40 + b"1]}")
    assert member.value is None


def test_a_member_after_values_nested_deeper_than_the_fast_path_is_found_at_every_cut() -> None:
    deep = {"k": [[[[[[[[[[[[{NAME: 1, "s": '"]}'}]]]]]]]]]]]]}
    body = json.dumps({"a": deep, NAME: {"do_remote_prefill": True, "t": "},"}, "z": deep}).encode()
    for cut in range(len(body) + 1):
        member = TopLevelMember(NAME, cap=len(body))
        member.feed(body[:cut])
        member.feed(body[cut:])
        assert member.value is not None and json.loads(member.value) == {"do_remote_prefill": True, "t": "},"}


def test_a_member_exactly_as_long_as_the_cap_is_kept_at_every_cut() -> None:
    """``cap`` is the most a member may hold: one of exactly that length is the leg's."""
    value = b'{"do_remote_prefill": true, "remote_block_ids": [1, 2, 3]}'
    body = b'{"model": "m", "kv_transfer_params":' + value + b', "max_tokens": 4}'
    for cut in range(len(body) + 1):
        member = TopLevelMember(NAME, cap=len(value))
        member.feed(body[:cut])
        member.feed(body[cut:])
        assert member.value == value


def test_a_key_spelt_with_an_escape_is_the_member_wherever_the_cut_falls_in_it() -> None:
    """The engine's json.loads reads ``"kv_transfer_param\\u0073"`` as the member's name; a cut
    right after its backslash leaves the escaped byte to the next chunk."""
    body = b'{"kv_transfer_param\\u0073":{"do_remote_prefill":true}}'
    assert json.loads(body) == {NAME: {"do_remote_prefill": True}}
    for cut in range(len(body) + 1):
        member = TopLevelMember(NAME, cap=len(body))
        member.feed(body[:cut])
        member.feed(body[cut:])
        assert member.value == b'{"do_remote_prefill":true}', cut
