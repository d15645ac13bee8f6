"""An append-only, checksummed record log: how a durable cache survives ``kill -9`` and a full disk.

Each record is one line, ``<crc32 hex> <json>\\n``, written with a single ``write(2)`` to a file opened with
``O_APPEND`` before the operation it records is acknowledged. A killed process therefore loses nothing it
acknowledged (the page cache survives the process); ``fsync=True`` also survives a power cut, at a price per
record. An append that fails (a full disk: a short write, or no byte written) is cut back off the file, so the
journal is exactly as it was and the next record starts on a clean line; the failure is a ``JournalError``.

Loading tells two kinds of damage apart. A *torn tail* — bytes after the last newline — is a write that never
completed (so never acknowledged): it is copied aside and truncated so new records start on a clean line. A
*damaged line* — a complete line that fails its checksum — held a record that was acknowledged: it is skipped but
kept in place, and only a rewrite (compaction) removes it, after copying it aside. Copies go next to the
journal: ``journal.torn-<UTC time>`` for a torn tail, ``journal.damaged-<UTC time>`` for what a rewrite dropped.
What a damaged line held is the caller's to judge (``salvage`` reads what is still legible); ``Journal.scan`` says
what was found. A rewrite says which bytes it wrote (``Prefix``: size, lines, CRC-32), so that a checkpoint
(``tvcache.store.checkpoint``) can name the journal it describes; ``covers`` checks a prefix against the file,
and ``load(after=...)`` reads only what follows it. A lock file keeps a second process from writing the same
journal, and a ``journal.compact`` left by a process killed while compacting is removed on load.

The journal holds every call of every rollout and its output: its directory is 0700 and each file 0600, whatever
the umask (``tvcache.private_storage``), and a directory or journal an older version left readable is tightened
when it is opened.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import JournalError
from .private_storage import FILE_MODE, make_private, private_directory

__all__ = [
    "DamagedLine",
    "Journal",
    "JournalScan",
    "JournalWarning",
    "Prefix",
    "Rewrite",
    "decode",
    "fsync_directory",
    "salvage",
]


class JournalWarning(UserWarning):
    """Records were skipped while loading a journal (a torn tail after a crash, or corruption)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DamagedLine:
    """One line of a journal that does not pass its checksum. ``line`` counts from 1; ``data`` is the bytes
    exactly as found (with the newline, except for a torn tail)."""

    line: int
    offset: int
    data: bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class JournalScan:
    """What loading found besides intact records. ``damaged``: complete lines that fail their checksum, still in
    the file. ``torn_tail``: the unfinished last write, truncated away (a copy in ``set_aside`` when it could be
    written). ``removed``: files of an interrupted compaction that were removed."""

    damaged: tuple[DamagedLine, ...] = ()
    torn_tail: DamagedLine | None = None
    set_aside: Path | None = None
    removed: tuple[Path, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Prefix:
    """The first ``size`` bytes of a journal: ``lines`` whole lines whose bytes have the CRC-32 ``crc``."""

    size: int
    lines: int
    crc: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Rewrite:
    """A finished rewrite: how many records the journal now holds, and where what it dropped was copied.
    ``written`` names the bytes written (what a checkpoint of them covers); it describes the file, not the
    outcome, so it takes no part in comparisons."""

    records: int
    set_aside: Path | None
    written: Prefix = field(default=Prefix(size=0, lines=0, crc=0), compare=False)


def _encode(record: dict[str, Any]) -> bytes:
    body = json.dumps(record, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    return b"%08x " % zlib.crc32(body) + body + b"\n"


def decode(line: bytes) -> dict[str, Any] | None:
    """The record of one complete journal line, or None when it fails its checksum or is not a JSON object."""
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


# Where a record's line may begin inside a damaged line: its checksum, a space and a JSON object.
_RECORD_START = re.compile(rb"[0-9a-f]{8} \{")


def split_merged(line: bytes) -> tuple[list[dict[str, Any]], bytes | None]:
    """The records of a complete line that fails its checksum because a newline between records was damaged
    (one byte flipped merges two lines into one): each intact record in it, in order, and what is left damaged
    (None when every part came back). Without this a merged line would hide an intact record behind the damage
    of its neighbour's last byte — a non-determinism mark among them."""
    for start in reversed([match.start() for match in _RECORD_START.finditer(line, 10)]):
        tail = decode(line[start:])
        if tail is None:
            continue
        head = line[: start - 1] + b"\n"  # the byte before the tail stood where the newline was
        record = decode(head)
        if record is not None:
            return [record, tail], None
        records, left = split_merged(head)
        return [*records, tail], left
    return [], line


# A field, its separator (which may itself be the damaged byte) and its value.
_STRING_FIELD = re.compile(rb'"(t|task|tool|name)"[^"\\]("(?:[^"\\]|\\.)*")')
_INT_FIELD = re.compile(rb'"(id|p)"[^"\\](\d{1,18})[,}]')


def salvage(data: bytes) -> dict[str, Any]:
    """What can still be read of a damaged line, *unverified*: the whole object when its JSON still parses (the
    damage may be in the checksum, or anywhere in the values), else the fields ``t``, ``task``, ``tool``,
    ``name``, ``id`` and ``p`` found by pattern. Empty when nothing is legible. Any value may be the damaged one."""
    body = data[9:] if data[8:9] == b" " else data
    body = body.rstrip(b"\n")
    try:
        whole = json.loads(body)
    except ValueError:
        whole = None
    if isinstance(whole, dict):
        return whole
    found: dict[str, Any] = {}
    for match in _STRING_FIELD.finditer(body):
        with contextlib.suppress(ValueError):
            found.setdefault(match.group(1).decode(), json.loads(match.group(2)))
    for match in _INT_FIELD.finditer(body):
        found.setdefault(match.group(1).decode(), int(match.group(2)))
    return found


class Journal:
    """One journal file under ``directory``, exclusively held by this process while open."""

    FILE = "journal.log"
    COMPACT = "journal.compact"

    def __init__(self, directory: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.directory = Path(directory)
        self.path = self.directory / self.FILE
        self._fsync = fsync
        self._lock = threading.Lock()
        self.records_written = 0
        self.scan = JournalScan()
        try:
            private_directory(self.directory)
            self._lock_fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, FILE_MODE)
            make_private(self.directory / "lock")
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
        self._end = 0  # the journal's size: where the next record starts, and where a failed one is cut back to
        self._broken: str | None = None  # why appends are refused after a failed record could not be cut back

    def load(self, *, after: Prefix | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yield ``(line number, record)`` for every intact record; afterwards ``scan`` says what else was found.
        Truncates a torn tail (after copying it aside), keeps damaged lines. Call once, before the first append.
        ``after``: skip a prefix the caller holds otherwise (a checkpoint's; check it with ``covers`` first): only
        the lines after it are read, numbered on from it, and only damage there is found."""
        removed = self._remove_interrupted_compaction()
        if not self.path.exists():
            self.scan = JournalScan(removed=removed)
            self._open_for_append()
            return
        start = after.size if after is not None else 0
        try:
            with open(self.path, "rb") as handle:
                handle.seek(start)
                data = handle.read()
        except OSError as error:
            raise JournalError(f"cannot read the journal {self.path}: {error}") from error
        damaged: list[DamagedLine] = []
        offset = 0
        number = after.lines if after is not None else 0
        complete = data.rfind(b"\n") + 1  # everything after the last newline is a torn tail
        while offset < complete:
            end = data.index(b"\n", offset) + 1
            number += 1
            line = data[offset:end]
            record = decode(line)
            if record is not None:
                yield number, record
            else:
                records, left = split_merged(line)
                if left is not None:
                    damaged.append(DamagedLine(line=number, offset=start + offset, data=left))
                for part in records:
                    yield number, part
            offset = end
        torn = None
        set_aside = None
        if complete < len(data):
            torn = DamagedLine(line=number + 1, offset=start + complete, data=data[complete:])
            set_aside = self._set_aside_quietly([torn.data])
            try:
                with open(self.path, "r+b") as handle:
                    handle.truncate(start + complete)
            except OSError as error:
                raise JournalError(f"cannot truncate the torn tail of {self.path}: {error}") from error
        self.scan = JournalScan(damaged=tuple(damaged), torn_tail=torn, set_aside=set_aside, removed=removed)
        self._open_for_append()

    def covers(self, prefix: Prefix) -> bool:
        """Whether the journal begins with exactly the bytes ``prefix`` names (their CRC-32 is computed: any byte
        changed, cut or rewritten since shows). Reads at the speed of CRC-32, a few GB/s."""
        remaining = prefix.size
        crc = 0
        try:
            with open(self.path, "rb", buffering=0) as handle:
                chunk = bytearray(1 << 20)
                view = memoryview(chunk)
                while remaining > 0:
                    read = handle.readinto(view[: min(remaining, len(chunk))])
                    if not read:
                        return False  # the journal is shorter than the prefix
                    crc = zlib.crc32(view[:read], crc)
                    remaining -= read
        except FileNotFoundError:
            return False
        except OSError as error:
            raise JournalError(f"cannot read the journal {self.path}: {error}") from error
        return crc == prefix.crc

    def _remove_interrupted_compaction(self) -> tuple[Path, ...]:
        """A rewrite replaces the journal only once its copy is complete, so a copy still lying here was cut
        short by a kill: the journal beside it is whole, and the copy is garbage (we hold the lock: nobody is
        writing it)."""
        leftover = self.directory / self.COMPACT
        try:
            leftover.unlink()
        except FileNotFoundError:
            return ()
        except OSError as error:
            raise JournalError(f"cannot remove {leftover}, left by an interrupted compaction: {error}") from error
        return (leftover,)

    def _open_for_append(self) -> None:
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
            make_private(self.path)  # one an older version wrote 0644
            self._end = os.fstat(self._fd).st_size

    def append(self, record: dict[str, Any]) -> None:
        """Write one record; when this returns, the record survives the death of this process. When it raises
        ``JournalError``, the journal is as it was before the call."""
        line = _encode(record)
        with self._lock:
            if self._broken is not None:
                raise JournalError(self._broken)
            if self._fd < 0:
                raise JournalError(f"journal {self.path} is closed (or was never loaded)")
            try:
                written = os.write(self._fd, line)
                if written != len(line):  # a short write on a regular file: the disk is full
                    raise OSError(28, f"short write, {written} of {len(line)} bytes")
                if self._fsync:
                    os.fsync(self._fd)
            except OSError as error:
                self._cut_back()
                raise JournalError(
                    f"cannot write a record to the journal {self.path}: {error.strerror or error}; nothing was "
                    "recorded (free space on that filesystem, then retry)"
                ) from error
            self._end += written
            self.records_written += 1

    def _cut_back(self) -> None:
        """Remove whatever part of a failed record reached the file, so the next record starts on a clean line.
        Shrinking a file needs no free space; if even that fails, the journal refuses every later append rather
        than glue records onto a fragment."""
        try:
            os.ftruncate(self._fd, self._end)
        except OSError as error:
            self._broken = (
                f"the journal {self.path} holds part of a record that failed and could not be cut off ({error}); "
                "it takes no more records: close the cache and open it again (loading removes the fragment)"
            )

    def rewrite(self, records: Iterable[dict[str, Any]], *, lost: Iterable[tuple[int, dict[str, Any]]] = ()) -> Rewrite:
        """Atomically replace the journal with ``records`` (compaction). What the new journal drops as unusable —
        the old one's damaged lines, and the caller's ``lost`` ``(line number, record)`` records that no longer
        apply — is first copied aside, in journal order. If anything fails, the journal is left as it was."""
        tmp = self.directory / self.COMPACT
        count = 0
        size = 0
        crc = 0
        if self._lock_fd < 0:
            raise JournalError(f"journal {self.path} is closed; it cannot be rewritten")
        dropped = sorted(
            [(damage.line, damage.data) for damage in self.scan.damaged]
            + [(line, _encode(record)) for line, record in lost]
        )
        with self._lock:
            set_aside = self._set_aside([data for _, data in dropped]) if dropped else None
            try:
                with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE), "wb") as handle:
                    for record in records:
                        line = _encode(record)
                        handle.write(line)
                        crc = zlib.crc32(line, crc)
                        size += len(line)
                        count += 1
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(tmp, self.path)
            except BaseException as error:
                tmp.unlink(missing_ok=True)
                if isinstance(error, OSError):
                    raise JournalError(f"cannot compact the journal {self.path}: {error}; it is unchanged") from error
                raise
            fsync_directory(self.directory)
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            self._broken = None  # a fragment a failed append could not cut off went with the old file
            self._open_for_append()
            self.scan = JournalScan(removed=self.scan.removed)  # the damage is no longer in the journal
        return Rewrite(records=count, set_aside=set_aside, written=Prefix(size=size, lines=count, crc=crc))

    def _set_aside(self, lines: list[bytes], *, prefix: str = "journal.damaged-") -> Path:
        """Write ``lines`` to a new ``<prefix><UTC time>[-n]`` file, durably, and return its path."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        for attempt in range(1000):
            path = self.directory / (f"{prefix}{stamp}" + (f"-{attempt}" if attempt else ""))
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
            except FileExistsError:
                continue
            except OSError as error:
                raise JournalError(f"cannot keep a copy of damaged journal lines in {path}: {error}") from error
            try:
                with os.fdopen(fd, "wb") as handle:
                    for data in lines:
                        handle.write(data if data.endswith(b"\n") else data + b"\n")
                    handle.flush()
                    os.fsync(handle.fileno())
            except OSError as error:
                path.unlink(missing_ok=True)
                raise JournalError(f"cannot keep a copy of damaged journal lines in {path}: {error}") from error
            fsync_directory(self.directory)
            return path
        raise JournalError(f"cannot find a free name for a copy of damaged journal lines in {self.directory}")

    def _set_aside_quietly(self, lines: list[bytes]) -> Path | None:
        """A torn tail was never acknowledged: keep a copy when possible, and truncate it even when not (a full
        disk must not keep the cache from opening)."""
        try:
            return self._set_aside(lines, prefix="journal.torn-")
        except JournalError:
            return None

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1


def fsync_directory(directory: Path) -> None:
    """Make a directory's entries (a file created, renamed or removed in it) durable."""
    directory_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(directory_fd)
    finally:
        os.close(directory_fd)
