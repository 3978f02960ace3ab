"""The tails of a path that an engine behind an unknown root path would route it as."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.asgi.paths import tails


@given(st.text(alphabet="/av1x", max_size=40), st.integers(min_value=0, max_value=45))
def test_tails_are_every_suffix_after_a_leading_segment_up_to_the_length(path: str, longest: int) -> None:
    """Against the plain definition: every suffix that starts with ``/`` after the first
    character and is at most ``longest`` long, from the longest to the shortest."""
    expected = [path[i:] for i in range(1, len(path)) if path[i] == "/" and len(path) - i <= longest]
    assert list(tails(path, longest)) == expected


def test_a_path_under_a_root_path_yields_the_route() -> None:
    assert "/v1/chat/completions" in tails("/api/v1/chat/completions", len("/v1/chat/completions"))
    assert list(tails("/v1/models", 100)) == ["/models"]
