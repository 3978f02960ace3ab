"""One pass over a request's headers reads what a scan per header name would have read."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.asgi.headers import RequestHeaders

#: Names the proxy reads or replaces, in the cases a client may send them, and others.
_NAMES = [b"x-request-id", b"X-Request-Id", b"x-tenant", b"X-TENANT", b"traceparent", b"Traceparent",
          b"content-length", b"Content-Length", b"accept-encoding", b"authorization", b"Authorization",
          b"user-agent", b"x-stainless-os"]
_LOWER = sorted({name.lower() for name in _NAMES})

headers = st.lists(st.tuples(st.sampled_from(_NAMES), st.binary(max_size=6)), max_size=14)
names = st.frozensets(st.sampled_from(_LOWER))


@given(headers, names, names)
def test_each_noted_header_has_every_value_in_order_and_the_rest_is_forwarded_as_sent(
    sent: list[tuple[bytes, bytes]], noted: frozenset[bytes], dropped: frozenset[bytes]
) -> None:
    noted |= dropped
    read = RequestHeaders(sent, noted, dropped)
    for name in noted:
        expected = [value for sent_name, value in sent if sent_name.lower() == name]
        assert list(read.values(name)) == expected
        assert read.only(name) == (expected[0] if len(expected) == 1 else None)
    assert read.forwarded == [(name, value) for name, value in sent if name.lower() not in dropped]


def test_a_header_nobody_noted_cannot_read_as_absent() -> None:
    read = RequestHeaders([(b"X-Tenant", b"globex")], frozenset([b"traceparent"]))
    with pytest.raises(KeyError):
        read.only(b"x-tenant")
