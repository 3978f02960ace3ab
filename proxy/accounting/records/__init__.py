"""Usage records: one per metered HTTP request, written to JSONL files and/or OTLP spans.

``record`` defines the record; ``queue`` the bounded hand-off from the event loop to a
sink's thread; ``jsonl`` and ``otlp`` the sinks (``otlp_session``: what the OTLP exporter
does not pass on, and its deadline); ``recorder`` builds them from settings;
``report`` (``cachetally report``) reads the JSONL files back.
"""
