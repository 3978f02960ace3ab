"""Usage records: one per metered HTTP request, written to JSONL files and/or OTLP spans.

``record`` defines the record (``record_id`` its id, ``notes`` what the responder notes for
it as the response passes); ``queue`` the bounded hand-off from the event loop to a
sink's thread; ``jsonl`` and ``otlp`` the sinks (``otlp_session``: what the OTLP exporter
does not pass on, and its deadline); ``recorder`` builds them from settings;
``report`` reads the JSONL files back and totals them, with ``prices`` for cost, and
``report_cli`` is ``cachetally report``.
"""
