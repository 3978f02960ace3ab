"""``cachetally bench``: measurements against a running OpenAI-compatible server.

``bench cache`` (:mod:`proxy.bench.cache`) shows what the prefix cache does for a client:
cached tokens and time to first token, cold, warm and prefix-sharing.
"""
