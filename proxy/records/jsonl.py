"""JSONL sink: one usage record per line, in append-only files rotated by size.

Files are ``usage-<UTC start>-<pid>-<n>.jsonl`` in the usage directory: one writer per
process (``--workers N`` run N), each file created exclusively and only appended to. A file
is closed and the next one started before a write would take it past the size limit (a
single batch larger than the limit gets a file of its own).

Each batch is written with ``os.write`` (no user-space buffer that could write it again
later) and ``fsync``'d. A failed write (disk full, directory gone) is cut back to the last
whole line with ``ftruncate`` and the batch is offered again next interval, so a record is
written once or not at all. When the cut itself fails the file is abandoned and the next
batch starts a new one; ``cachetally report`` skips, and counts, a torn last line.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from proxy.records.queue import RetryLater
from proxy.records.record import UsageRecord, dumps


class JsonlSink:
    name = "jsonl"
    failure = "write_failed"

    def __init__(self, directory: Path, max_file_bytes: int = 64 << 20) -> None:
        self.directory = directory
        self._max = max_file_bytes
        self._fd: int | None = None
        self._size = 0
        self._files = 0
        self.paths: list[Path] = []

    def write(self, batch: list[UsageRecord]) -> int:
        data = b"".join([dumps(record) for record in batch])
        try:
            if self._fd is None or (self._size and self._size + len(data) > self._max):
                self._next_file()
            assert self._fd is not None
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            os.fsync(self._fd)
        except OSError as exc:
            self._cut_back()
            raise RetryLater(f"{self.directory}: {exc.strerror or exc}") from None
        self._size += len(data)
        return 0

    def _next_file(self) -> None:
        self._close_file()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._files += 1
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        path = self.directory / f"usage-{stamp}-{os.getpid()}-{self._files:04d}.jsonl"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
        self._fd = os.open(path, flags, 0o640)
        self._size = 0
        self.paths.append(path)

    def _cut_back(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, self._size)
        except OSError:
            self._close_file()

    def _close_file(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.fsync(fd)
            except OSError:
                pass
            os.close(fd)

    def close(self) -> None:
        self._close_file()
