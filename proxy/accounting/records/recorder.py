"""The recorder: every configured sink behind its own bounded queue and thread.

Built from settings by :func:`recorder_from_settings`; ``None`` when no sink is
configured, and then the responder builds no record at all. A sink that cannot even be
set up (the ``otlp`` extra missing, a usage directory that cannot take a file) fails startup
with a clear message; a sink that fails later only drops records (:mod:`proxy.accounting.records.queue`).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from proxy.accounting.records.queue import DropCounts, Sink, SinkWorker
from proxy.accounting.records.record import UsageRecord
from proxy.server.logs import redacted
from proxy.server.settings import Settings, SettingsError

logger = logging.getLogger("cachetally.records")


class Recorder:
    def __init__(self, sinks: list[Sink], *, max_queued: int = 10_000, interval_s: float = 1.0) -> None:
        self.drops = DropCounts()
        self.workers = [SinkWorker(s, self.drops, max_queued=max_queued, interval_s=interval_s) for s in sinks]

    def submit(self, record: UsageRecord) -> None:
        for worker in self.workers:
            worker.submit(record)

    def start(self) -> None:
        for worker in self.workers:
            worker.start()

    def stop(self, timeout_s: float) -> None:
        """Drain every sink (blocking; run it off the event loop)."""
        for worker in self.workers:
            if not worker.stop(timeout_s):
                logger.error("usage sink %s did not finish within %.0f s", worker.sink.name, timeout_s)
        self.drops.flush_log()


def recorder_from_settings(settings: Settings) -> Recorder | None:
    sinks: list[Sink] = []
    if settings.usage_dir:
        from proxy.accounting.records.jsonl import JsonlSink

        directory = Path(settings.usage_dir)
        try:  # a directory that cannot take a file fails the start, not every record after it
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=directory):
                pass
        except OSError as exc:
            raise SettingsError(f"usage_dir: cannot write in {directory} ({exc.strerror or exc})") from None
        logger.info("usage records: JSONL files in %s, flushed every %g s", directory,
                    settings.usage_flush_interval_s)
        sinks.append(JsonlSink(directory, settings.usage_max_file_bytes))
    if settings.otlp_endpoint:
        try:
            from proxy.accounting.records.otlp import OtlpSink

            sinks.append(OtlpSink(settings.otlp_endpoint, settings.otlp_timeout_s))
            logger.info("usage records: OTLP spans to %s", redacted(settings.otlp_endpoint))
        except ImportError:
            raise SettingsError(
                "otlp_endpoint needs the OpenTelemetry SDK: pip install 'cachetally[otlp]'"
            ) from None
    if not sinks:
        return None
    return Recorder(sinks, max_queued=settings.usage_queue_size, interval_s=settings.usage_flush_interval_s)
