"""An append-only, checksummed record log: how a durable cache survives ``kill -9``.

Each record is one line, ``<crc32 hex> <json>\\n``, written with a single ``write(2)`` to a file opened with
``O_APPEND`` before the operation it records is acknowledged. A killed process therefore loses nothing it
acknowledged (the page cache survives the process); ``fsync=True`` also survives a power cut, at a price per
record. On load a torn or corrupt tail is detected by its checksum, skipped with a warning and truncated away so
new records start on a clean line. A lock file keeps a second process from writing the same journal.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import warnings
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .errors import JournalError

__all__ = ["Journal", "JournalWarning"]


class JournalWarning(UserWarning):
    """Records were skipped while loading a journal (a torn tail after a crash, or corruption)."""


def _encode(record: dict[str, Any]) -> bytes:
    body = json.dumps(record, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    return b"%08x " % zlib.crc32(body) + body + b"\n"


def _decode(line: bytes) -> dict[str, Any] | None:
    if len(line) < 10 or line[8:9] != b" " or not line.endswith(b"\n"):
        return None
    body = line[9:-1]
    try:
        if int(line[:8], 16) != zlib.crc32(body):
            return None
        record = json.loads(body)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


class Journal:
    """One journal file under ``directory``, exclusively held by this process while open."""

    FILE = "journal.log"

    def __init__(self, directory: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.directory = Path(directory)
        self.path = self.directory / self.FILE
        self._fsync = fsync
        self._lock = threading.Lock()
        self.records_written = 0
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise JournalError(f"cannot open cache directory {self.directory}: {error}") from error
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as error:
            os.close(self._lock_fd)
            raise JournalError(
                f"cache directory {self.directory} is in use by another process; share one cache between "
                "processes through `tvcache serve`, or give each process its own directory"
            ) from error
        self._fd = -1

    def load(self) -> Iterator[dict[str, Any]]:
        """Yield every intact record; truncate a torn tail. Call once, before the first append."""
        if not self.path.exists():
            self._open_for_append()
            return
        data = self.path.read_bytes()
        good_end = 0
        offset = 0
        skipped = 0
        while offset < len(data):
            end = data.find(b"\n", offset)
            line = data[offset:] if end < 0 else data[offset : end + 1]
            offset = len(data) if end < 0 else end + 1
            record = _decode(line)
            if record is None:
                skipped += 1
                continue
            good_end = offset
            yield record
        if skipped:
            torn_tail = good_end < len(data)
            warnings.warn(
                f"{self.path}: skipped {skipped} damaged record(s)"
                + (" at the end (a write torn by a crash); truncating them" if torn_tail else ""),
                JournalWarning,
                stacklevel=2,
            )
            if torn_tail:
                with open(self.path, "r+b") as handle:
                    handle.truncate(good_end)
        self._open_for_append()

    def _open_for_append(self) -> None:
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, record: dict[str, Any]) -> None:
        """Write one record; when this returns, the record survives the death of this process."""
        line = _encode(record)
        with self._lock:
            if self._fd < 0:
                raise JournalError(f"journal {self.path} is closed (or was never loaded)")
            written = os.write(self._fd, line)
            if written != len(line):  # a short write on a regular file means the disk is full
                raise JournalError(f"short write to {self.path} ({written}/{len(line)} bytes); is the disk full?")
            if self._fsync:
                os.fsync(self._fd)
            self.records_written += 1

    def rewrite(self, records: Iterable[dict[str, Any]]) -> int:
        """Atomically replace the journal with ``records`` (compaction). Returns how many were written."""
        tmp = self.path.with_suffix(".compact")
        count = 0
        if self._lock_fd < 0:
            raise JournalError(f"journal {self.path} is closed; it cannot be rewritten")
        with self._lock, open(tmp, "wb") as handle:
            for record in records:
                handle.write(_encode(record))
                count += 1
            handle.flush()
            os.fsync(handle.fileno())
            os.replace(tmp, self.path)
            directory_fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(directory_fd)
            finally:
                os.close(directory_fd)
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            self._open_for_append()
        return count

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1
