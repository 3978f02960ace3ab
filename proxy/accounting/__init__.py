"""Who pays for what: tenants and their keys, request ids, usage records and their sinks,
the Prometheus metrics and ``/stats`` (docs/ACCOUNTING.md)."""
