"""The tails of a path that an engine behind an unknown root path would route it as, and the
path a normalizing hop (Envoy's ``normalize_path``) hands it."""

from __future__ import annotations

import posixpath
from urllib.parse import urljoin, urlsplit

from hypothesis import given
from hypothesis import strategies as st

from proxy.asgi.paths import cleaned, forwarded_forms, leniently_routed, normalized, tails


@given(st.text(alphabet="/av1x", max_size=40), st.integers(min_value=0, max_value=45))
def test_tails_are_every_suffix_after_a_leading_segment_up_to_the_length(path: str, longest: int) -> None:
    """Against the plain definition: every suffix that starts with ``/`` after the first
    character and is at most ``longest`` long, from the longest to the shortest."""
    expected = [path[i:] for i in range(1, len(path)) if path[i] == "/" and len(path) - i <= longest]
    assert list(tails(path, longest)) == expected


def test_a_path_under_a_root_path_yields_the_route() -> None:
    assert "/v1/chat/completions" in tails("/api/v1/chat/completions", len("/v1/chat/completions"))
    assert list(tails("/v1/models", 100)) == ["/models"]


@given(st.lists(st.sampled_from(["a", "v1", ".", "..", ".a", "a."]), max_size=8))
def test_dot_segments_are_removed_as_the_standard_library_resolves_them(segments: list[str]) -> None:
    """Against ``urljoin``, which removes dot segments as RFC 3986 §5.2.4 says (but for empty
    segments, which it drops: none are drawn)."""
    path = "/" + "/".join(segments)
    assert normalized(path) == urlsplit(urljoin("http://h/", path)).path


def test_backslashes_are_slashes_to_a_normalizing_hop() -> None:
    assert normalized("/x\\..\\invocations") == "/invocations"
    assert normalized("/v1\\chat/completions") == "/v1/chat/completions"
    assert normalized("/v1/chat/completions") == "/v1/chat/completions"


def test_the_forms_a_normalizing_hop_forwards_are_the_path_then_istios_base_then_merged_slashes() -> None:
    assert forwarded_forms("/v1/chat/completions") == ("/v1/chat/completions",)
    assert forwarded_forms("/v1/.//chat/completions") == (
        "/v1/.//chat/completions", "/v1//chat/completions", "/v1/chat/completions")
    # dot segments first, as Envoy orders them; merged as they go, as Traefik and nginx do
    assert forwarded_forms("/a//../b") == ("/a//../b", "/a/b", "/b")
    assert forwarded_forms("/v1/chat/completions/.") == (
        "/v1/chat/completions/.", "/v1/chat/completions/", "/v1/chat/completions")


def test_a_lenient_router_ignores_trailing_slashes_and_letter_case() -> None:
    """Express's and Fiber's defaults; ASP.NET Core's case-insensitive comparison reads the
    dotless ı as I, the long ſ as S and the Kelvin sign as K."""
    assert leniently_routed("/V1/Chat/Completions//") == "/v1/chat/completions"
    assert leniently_routed("/v1/completıonſ") == "/v1/completions"
    assert leniently_routed("/\u212aey") == "/key"
    assert leniently_routed("/") == "/"
    assert forwarded_forms("/invocations/") == ("/invocations/", "/invocations")
    assert forwarded_forms("/x/../Invocations/") == (
        "/x/../Invocations/", "/Invocations/", "/x/../invocations", "/invocations")


@given(st.lists(st.sampled_from(["a", "v1", ".", "..", "", ".a", "a."]), max_size=8))
def test_a_cleaned_path_is_gos_path_clean_with_the_trailing_slash_kept(segments: list[str]) -> None:
    """Against ``posixpath.normpath`` (Go's ``path.Clean`` but for a leading ``//``, which it
    keeps), with ``url.JoinPath``'s trailing slash: what Traefik forwards."""
    path = "/" + "/".join(segments)
    expected = posixpath.normpath("/" + path.lstrip("/"))
    assert cleaned(path) == (expected + "/" if path.endswith("/") and expected != "/" else expected)
