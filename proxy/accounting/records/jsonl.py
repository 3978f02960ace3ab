"""JSONL sink: one usage record per line, in append-only files rotated by size.

Files are ``usage-<UTC start>-<pid>-<n>.jsonl`` in the usage directory: one writer per
process (``--workers N`` run N), each file created exclusively and only appended to. A file
is closed and the next one started before a write would take it past the size limit (a
single batch larger than the limit gets a file of its own).

Each batch is written with ``os.write`` (no user-space buffer that could write it again
later) and ``fsync``'d; its records count as written only then. The rule that keeps a
record in a file once or in ``cachetally_usage_records_dropped_total``, never both and
never neither (docs/RELIABILITY.md, "Usage sinks under faults"):

- a record that orjson cannot serialize (a value no record should hold) is dropped alone,
  counted; the rest of its batch is written;
- ``open`` fails: nothing was written; the batch is offered again next interval;
- ``write`` or ``fsync`` fails: the file is cut back (``ftruncate``) to its last
  confirmed byte, so nothing of the batch is in it, and the batch is offered again;
- the cut fails too: the file is abandoned (never appended to again; the next batch
  starts a new one) and the batch is settled by what the file holds, which ``os.write``'s
  return values say exactly. A record whose line (its JSON object, newline aside) went in
  whole is counted written if an ``fsync`` of it then succeeds, else ``unconfirmed``
  (dropped, never written again: after a failed ``fsync`` the bytes are readable but
  may not be on disk, and no later call can tell). A record of which at most a torn
  prefix went in is not a record to any reader (``cachetally report`` skips and counts
  a torn line) and is offered again, into the next file.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from proxy.accounting.records.queue import Delivery
from proxy.accounting.records.record import UsageRecord, dumps


def _lines(batch: list[UsageRecord]) -> tuple[list[UsageRecord], list[bytes], int]:
    """The records that serialize, their lines, and how many did not: a value orjson cannot
    write loses its own record (counted), never the fair ones flushed with it."""
    kept: list[UsageRecord] = []
    lines: list[bytes] = []
    for record in batch:
        try:
            lines.append(dumps(record))
        except TypeError:  # orjson.JSONEncodeError is one
            continue
        kept.append(record)
    return kept, lines, len(batch) - len(kept)


class JsonlSink:
    name = "jsonl"
    failure = "write_failed"

    def __init__(self, directory: Path, max_file_bytes: int = 64 << 20) -> None:
        self.directory = directory
        self._max = max_file_bytes
        self._fd: int | None = None
        self._size = 0  # bytes of the open file that are fsync'd records
        self._files = 0
        self.paths: list[Path] = []

    def write(self, batch: list[UsageRecord]) -> Delivery:
        batch, lines, unwritable = _lines(batch)
        done = self._write(batch, lines) if batch else Delivery()
        if unwritable:
            done.lost += unwritable
            done.detail = done.detail or "a record JSON cannot hold"
        return done

    def _write(self, batch: list[UsageRecord], lines: list[bytes]) -> Delivery:
        data = b"".join(lines)
        try:
            if self._fd is None or (self._size and self._size + len(data) > self._max):
                self._next_file()
        except OSError as exc:
            return Delivery(retry=batch, detail=self._detail(exc))
        fd = self._fd
        assert fd is not None
        done = 0
        try:
            view = memoryview(data)
            while done < len(data):
                done += os.write(fd, view[done:])
            os.fsync(fd)
        except OSError as exc:
            return self._settle(batch, lines, done, synced=done == len(data), exc=exc)
        self._size += len(data)
        return Delivery(written=len(batch))

    def _settle(self, batch: list[UsageRecord], lines: list[bytes], done: int, *, synced: bool,
                exc: OSError) -> Delivery:
        """After a failed ``write`` (``synced`` false) or ``fsync``: the module docstring's rule."""
        fd, detail = self._fd, self._detail(exc)
        assert fd is not None
        try:
            os.ftruncate(fd, self._size)
        except OSError:
            pass
        else:
            return Delivery(retry=batch, detail=detail)
        whole, end = 0, 0
        for line in lines:
            end += len(line)
            if done < end - 1:  # the object's closing brace did not go in
                break
            whole += 1
        if not synced and whole:
            try:
                os.fsync(fd)
            except OSError:
                pass  # unconfirmed, as after a failed fsync of the whole write
            else:
                self._abandon()
                return Delivery(written=whole, retry=batch[whole:], detail=detail)
        self._abandon()
        return Delivery(unconfirmed=whole, retry=batch[whole:], detail=detail)

    def _detail(self, exc: OSError) -> str:
        return f"{self.directory}: {exc.strerror or exc}"

    def _next_file(self) -> None:
        self._abandon()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._files += 1
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        path = self.directory / f"usage-{stamp}-{os.getpid()}-{self._files:04d}.jsonl"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
        # The directory first, to fsync the new name through (or a power loss could take a
        # file of fsync'd records): opened after the file, a failure there (EMFILE, with one
        # descriptor free: the old file's) left the file behind empty, one more every retry.
        directory = os.open(self.directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            fd = os.open(path, flags, 0o640)
            try:
                os.fsync(directory)
            except OSError:
                with contextlib.suppress(OSError):
                    os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(path)  # nothing is in it
                raise
        finally:
            with contextlib.suppress(OSError):
                os.close(directory)
        self._fd, self._size = fd, 0
        self.paths.append(path)

    def _abandon(self) -> None:
        """Close the file for good: every byte of it that counts was ``fsync``'d already."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        self._abandon()
