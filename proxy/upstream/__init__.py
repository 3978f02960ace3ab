"""Upstream mode: cachetally as a drop-in proxy in front of a running OpenAI-compatible server.

One entry point, :class:`proxy.upstream.engine.UpstreamEngine`. Inside, one module per concern:

- ``engine.py``: the ``Engine``: parses the upstream URL once, owns the shared client;
- ``forward.py``: one request forwarded and its response relayed, disconnects included;
- ``hop_headers.py``: which headers pass each way;
- ``client.py``: the seam between ``Forward`` and the pool, and the failures it reports;
- ``pool.py``: the HTTP/1.1 keep-alive pool, its limit and its fair wait queue;
- ``connection.py``: one connection, with h11's two explicit states (request, response);
- ``response.py``: one exchange's response as the forwarder reads it, and its read timeout;
- ``roles.py``: what the pool, a connection and a response need of each other;
- ``resend.py``: when a request may be sent a second time;
- ``wire.py``: every byte written upstream, validated.

The package imports nothing itself, so :mod:`proxy.server.settings` can check an upstream URL
with :class:`~proxy.upstream.client.Origin` while ``engine.py`` reads the settings.
"""
