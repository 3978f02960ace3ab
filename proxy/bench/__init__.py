"""``cachetally bench``, and the measurements run on their own (``python -m proxy.bench.NAME``).

``bench cache`` (:mod:`proxy.bench.cache`) shows what the prefix cache of a running
OpenAI-compatible server does for a client: cached tokens and time to first token, cold,
warm and prefix-sharing. ``bench proxy`` (:mod:`proxy.bench.proxy`) measures what the proxy
costs against a direct connection, on processes it starts itself. :mod:`proxy.bench.workers`,
:mod:`proxy.bench.metrics_cost`, :mod:`proxy.bench.records` and :mod:`proxy.bench.vllm_cpu`
run with ``python -m``.
"""
