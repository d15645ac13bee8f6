"""``journal.checkpoint``: the graphs a compaction wrote, in a form a cache opens without replaying them.

Replaying the journal costs ~15-20 us a record (a JSON line decoded, the call's arguments canonicalised and
hashed, a node inserted), so a cache of a million recorded calls took ~20 s to open. A compaction therefore also
writes a checkpoint of the records it writes into the new journal: per task, one binary section holding the
nodes (id, parent, flags, seconds, the call's name, canonical arguments and digest, the output) and the test
results, and one JSON index of the sections (with each task's snapshot records), of the records that belong to
no graph (marks, passed checks), of what replay notes of the lines (``LoadNotes``), and of the journal prefix it
stands for (size, lines, CRC-32). Opening reads the index, checks the prefix (``Journal.covers``) and every
section's CRC, and replays only the journal's tail; a task's section becomes a graph the first time the task is
used (``tvcache.store.durable``).

The journal stays the record of truth. The checkpoint is derived from it and is used only while it describes
the journal's bytes exactly, so whatever the journal says about damage, it still says. A checkpoint that is
damaged, of another format version, or that no longer describes the journal (rewritten without it by a kill
between the two, changed, cut short) is not used: the cache replays the journal alone and says why.

File layout (integers little-endian)::

    header   8s magic, I format version, Q index offset, Q index length, I index CRC-32
    section  per task: I nodes, I names, I arguments, I outputs, I tests (the last four: lengths in bytes),
             then names (JSON list), nodes (``_NODE`` each), digests (16 bytes each), arguments, outputs
             (UTF-8), tests (JSON list of [node id, key, value])
    index    JSON, after the sections
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..calls import DIGEST_BYTES, ToolCall
from ..errors import InvalidToolCall, JournalError
from ..graph import ToolCallGraph
from ..journal import Prefix, fsync_directory
from ..private_storage import FILE_MODE
from ..protocol import Snapshot
from ..recovery import LoadNotes
from .records import CheckedRecord, ClearRecord, MarkRecord, NodeRecord, Record, SnapshotRecord, TestRecord, parse

__all__ = ["FILE", "FORMAT", "Checkpoint", "CheckpointUnusable", "CheckpointWriter", "TaskSection"]

FILE = "journal.checkpoint"
PARTIAL = "journal.checkpoint.partial"  # being written; left only by a killed process
FORMAT = 1
MAGIC = b"TVCKPT\r\n"  # the CR LF shows a copy through a text-mode tool
_HEADER = struct.Struct("<8sIQQI")
_SECTION = struct.Struct("<IIIII")
_NODE = struct.Struct("<qqdIIIB")  # id, parent id, seconds, name index, argument bytes, output characters, flags
_IS_ERROR = 1
_READ_ONLY = 2
_STORE_RECORDS = (MarkRecord, CheckedRecord, ClearRecord)
# A ToolCall is immutable (its __setattr__ refuses); reading a checkpoint sets its slots through their
# descriptors, the fastest way to build one from bytes that were a ToolCall's: a task's nodes are read in one go.
_new_call = object.__new__
_set_name = ToolCall.__dict__["name"].__set__
_set_canonical = ToolCall.__dict__["_canonical"].__set__
_set_digest = ToolCall.__dict__["digest"].__set__


class CheckpointUnusable(JournalError):
    """A checkpoint that must not be used; the message says why. Opening replays the journal instead; only a
    section changed on disk after the cache opened reaches a caller (reopen the cache)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskSection:
    """Where one task's nodes are in the checkpoint, how many, and the task's snapshot records (which opening
    checks without reading the nodes)."""

    task_id: str
    offset: int
    length: int
    crc: int
    nodes: int
    snapshots: tuple[SnapshotRecord, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Index:
    prefix: Prefix
    records: tuple[Record, ...]
    notes: LoadNotes
    sections: tuple[TaskSection, ...]


class Checkpoint:
    """An open, verified checkpoint: its index, and its file, from which ``read_graph`` reads one task."""

    def __init__(self, path: Path, fd: int, index: _Index) -> None:
        self.path = path
        self._fd = fd
        self.prefix = index.prefix
        self.records = index.records
        self.notes = index.notes
        self.sections = index.sections

    @classmethod
    def open(cls, directory: Path) -> Checkpoint | None:
        """The checkpoint in ``directory``, verified (its index and every section pass their CRC); None when
        there is none. CheckpointUnusable when there is one that must not be used."""
        path = directory / FILE
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as error:
            raise CheckpointUnusable(f"it cannot be read: {error}") from error
        try:
            return cls(path, fd, _read_index(fd))
        except BaseException:
            os.close(fd)
            raise

    def read_graph(self, section: TaskSection, *, clock: Callable[[], float]) -> ToolCallGraph:
        """The graph of one task: its nodes and test results (snapshots are the caller's to attach)."""
        if self._fd < 0:
            raise JournalError(f"{self.path} is closed")
        data = os.pread(self._fd, section.length, section.offset)
        if len(data) != section.length or zlib.crc32(data) != section.crc:
            raise CheckpointUnusable(
                f"{self.path}: the section of task {section.task_id!r} changed after the cache opened; close the "
                "cache, remove the checkpoint and open it again (the journal holds every record)"
            )
        try:
            return _graph(section, data, clock)
        except (KeyError, IndexError, ValueError, TypeError, struct.error, InvalidToolCall) as error:
            raise CheckpointUnusable(
                f"{self.path}: the section of task {section.task_id!r} is invalid: {error}"
            ) from error

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def remove(directory: Path) -> None:
    """Remove the checkpoint, if any (it no longer describes the journal)."""
    try:
        (directory / FILE).unlink(missing_ok=True)
    except OSError as error:
        raise JournalError(f"cannot remove the unusable checkpoint {directory / FILE}: {error}") from error


def remove_partial(directory: Path) -> None:
    """Remove a checkpoint a killed compaction left half written."""
    path = directory / PARTIAL
    try:
        path.unlink(missing_ok=True)
    except OSError as error:
        raise JournalError(f"cannot remove {path}, left by an interrupted compaction: {error}") from error


# ------------------------------------------------------------------------------------------------- reading


def _read_index(fd: int) -> _Index:
    header = os.pread(fd, _HEADER.size, 0)
    if len(header) < _HEADER.size:
        raise CheckpointUnusable("it is cut short")
    magic, version, offset, length, crc = _HEADER.unpack(header)
    if magic != MAGIC:
        raise CheckpointUnusable("it is not a checkpoint (wrong magic bytes)")
    if version != FORMAT:
        raise CheckpointUnusable(f"it has format {version}, and this version of tvcache reads format {FORMAT}")
    data = os.pread(fd, length, offset)
    if len(data) != length or zlib.crc32(data) != crc:
        raise CheckpointUnusable("it is damaged: its index fails its checksum")
    try:
        raw = json.loads(data)
        journal = raw["journal"]
        prefix = Prefix(size=int(journal["size"]), lines=int(journal["lines"]), crc=int(journal["crc"]))
        sections = tuple(_section(entry) for entry in raw["tasks"])
        index = _Index(
            prefix=prefix,
            records=tuple(parse(record) for record in raw["records"]),
            notes=LoadNotes.from_json(raw["notes"]),
            sections=sections,
        )
    except (KeyError, IndexError, ValueError, TypeError, AttributeError) as error:
        raise CheckpointUnusable(f"it is damaged: its index cannot be read ({error!r:.200})") from error
    for section in sections:
        body = os.pread(fd, section.length, section.offset)
        if len(body) != section.length or zlib.crc32(body) != section.crc:
            raise CheckpointUnusable(f"it is damaged: the section of task {section.task_id!r} fails its checksum")
    return index


def _section(entry: dict[str, Any]) -> TaskSection:
    task_id = entry["task"]
    if not isinstance(task_id, str):
        raise TypeError(f"task id {task_id!r:.80}")
    return TaskSection(
        task_id=task_id,
        offset=int(entry["offset"]),
        length=int(entry["length"]),
        crc=int(entry["crc"]),
        nodes=int(entry["nodes"]),
        snapshots=tuple(
            SnapshotRecord(task_id=task_id, node_id=int(node_id), snapshot=Snapshot.from_json(snapshot))
            for node_id, snapshot in entry["snapshots"]
        ),
    )


def _graph(section: TaskSection, data: bytes, clock: Callable[[], float]) -> ToolCallGraph:
    nodes, names_size, arguments_size, outputs_size, tests_size = _SECTION.unpack_from(data, 0)
    at = _SECTION.size
    names = json.loads(data[at : at + names_size])
    at += names_size
    table = memoryview(data)[at : at + nodes * _NODE.size]
    at += nodes * _NODE.size
    digests = data[at : at + nodes * DIGEST_BYTES]
    at += nodes * DIGEST_BYTES
    arguments = data[at : at + arguments_size]
    at += arguments_size
    outputs = data[at : at + outputs_size].decode()
    at += outputs_size
    tests = json.loads(data[at : at + tests_size])
    graph = ToolCallGraph(section.task_id, clock=clock)
    made = {0: graph.root}
    insert = graph.insert
    at_arguments = at_output = at_digest = 0
    # Tens of thousands of objects and no garbage among them: collections while building only cost time.
    collecting = gc.isenabled()
    gc.disable()
    try:
        for node_id, parent_id, seconds, name, argument_bytes, output_chars, flags in _NODE.iter_unpack(table):
            # The bytes were a ToolCall's canonical arguments and digest when written (and pass their CRC), so the
            # call is rebuilt as it was, without parsing and hashing them again.
            call = _new_call(ToolCall)
            _set_name(call, names[name])
            _set_canonical(call, arguments[at_arguments : at_arguments + argument_bytes])
            _set_digest(call, digests[at_digest : at_digest + DIGEST_BYTES])
            made[node_id] = insert(
                made[parent_id],
                call,
                output=outputs[at_output : at_output + output_chars],
                is_error=(flags & _IS_ERROR) != 0,
                seconds=seconds,
                read_only=(flags & _READ_ONLY) != 0,
                node_id=node_id,
            )
            at_arguments += argument_bytes
            at_output += output_chars
            at_digest += DIGEST_BYTES
    finally:
        if collecting:
            gc.enable()
    if len(graph) != nodes + 1:
        raise ValueError(f"{nodes} nodes written, {len(graph) - 1} distinct")
    for node_id, key, value in tests:
        graph.set_test(graph.node(node_id), key, value)
    return graph


# ------------------------------------------------------------------------------------------------- writing


@dataclass(eq=False)
class _Section:
    """One task's section while it is written."""

    task_id: str
    names: dict[str, int] = field(default_factory=dict)
    table: bytearray = field(default_factory=bytearray)
    digests: bytearray = field(default_factory=bytearray)
    arguments: bytearray = field(default_factory=bytearray)
    outputs: list[str] = field(default_factory=list)
    tests: list[list[Any]] = field(default_factory=list)
    snapshots: list[list[Any]] = field(default_factory=list)
    nodes: int = 0

    def add_node(self, record: NodeRecord, call: ToolCall | None) -> None:
        canonical = call.canonical_arguments if call is not None else b""
        if call is None or call.name != record.name or canonical != record.arguments.encode():
            raise ValueError(f"node {record.node_id} of task {record.task_id!r} is not the node its record names")
        flags = (_IS_ERROR if record.is_error else 0) | (_READ_ONLY if record.read_only else 0)
        name = self.names.setdefault(call.name, len(self.names))
        self.table += _NODE.pack(
            record.node_id, record.parent_id, record.seconds, name, len(canonical), len(record.output), flags
        )
        self.digests += call.digest
        self.arguments += canonical
        self.outputs.append(record.output)
        self.nodes += 1

    def encode(self) -> bytes:
        names = json.dumps(list(self.names), ensure_ascii=False).encode()
        outputs = "".join(self.outputs).encode()
        tests = json.dumps(self.tests, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
        head = _SECTION.pack(self.nodes, len(names), len(self.arguments), len(outputs), len(tests))
        return b"".join((head, names, self.table, self.digests, self.arguments, outputs, tests))


class CheckpointWriter:
    """Writes a checkpoint of the records a compaction streams into the new journal: ``add`` each one, in
    journal order, then ``commit`` once that journal is in place (``abandon`` if it is not). The checkpoint is
    optional: a failure to write it (a full disk) is kept in ``error`` and costs the next open time, never the
    compaction."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.error: str | None = None
        self._notes = LoadNotes()
        self._records: list[dict[str, Any]] = []
        self._entries: list[dict[str, Any]] = []
        self._written: set[str] = set()
        self._section: _Section | None = None
        self._offset = _HEADER.size
        self._fd = -1
        try:
            self._fd = os.open(directory / PARTIAL, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
            _write_all(self._fd, bytes(_HEADER.size))  # the header goes in last, once the index is written
        except OSError as error:
            self._fail(error)

    def add(self, line: int, record: Record, data: dict[str, Any], call: ToolCall | None) -> None:
        """Record ``record`` (``data``: its JSON, at ``line`` of the new journal); ``call``: a node record's call,
        whose canonical bytes and digest are kept as they are."""
        if self.error is not None:
            return
        try:
            self._notes.note(line, data)
            if isinstance(record, _STORE_RECORDS):
                self._records.append(data)
                return
            section = self._section_of(record.task_id)
            if isinstance(record, NodeRecord):
                section.add_node(record, call)
            elif isinstance(record, SnapshotRecord):
                section.snapshots.append([record.node_id, record.snapshot.to_json()])
            elif isinstance(record, TestRecord):
                section.tests.append([record.node_id, record.key, record.value])
            else:
                raise ValueError(f"a checkpoint holds no {type(record).__name__}")
        except (OSError, ValueError, TypeError, OverflowError, struct.error) as error:
            self._fail(error)

    def _section_of(self, task_id: str) -> _Section:
        if self._section is not None and self._section.task_id == task_id:
            return self._section
        self._flush()
        if task_id in self._written:
            raise ValueError(f"the records of task {task_id!r} are not contiguous")
        self._section = _Section(task_id)
        return self._section

    def _flush(self) -> None:
        section, self._section = self._section, None
        if section is None:
            return
        body = section.encode()
        _write_all(self._fd, body)
        self._entries.append(
            {
                "task": section.task_id,
                "offset": self._offset,
                "length": len(body),
                "crc": zlib.crc32(body),
                "nodes": section.nodes,
                "snapshots": section.snapshots,
            }
        )
        self._written.add(section.task_id)
        self._offset += len(body)

    def commit(self, written: Prefix) -> bool:
        """Finish the checkpoint of the journal prefix ``written`` (the compaction's) and put it in place of any
        older one. False (``error`` says why) when it could not be written: then no checkpoint is left, since an
        older one no longer describes the journal."""
        if self.error is None:
            try:
                self._flush()
                index = json.dumps(
                    {
                        "journal": {"size": written.size, "lines": written.lines, "crc": written.crc},
                        "records": self._records,
                        "notes": self._notes.to_json(),
                        "tasks": self._entries,
                    },
                    separators=(",", ":"),
                    ensure_ascii=False,
                    allow_nan=False,
                ).encode()
                _write_all(self._fd, index)
                os.pwrite(self._fd, _HEADER.pack(MAGIC, FORMAT, self._offset, len(index), zlib.crc32(index)), 0)
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = -1
                os.replace(self.directory / PARTIAL, self.directory / FILE)
                fsync_directory(self.directory)
            except (OSError, ValueError, TypeError) as error:
                self._fail(error)
        if self.error is not None:
            remove(self.directory)
            return False
        return True

    def abandon(self) -> None:
        """The compaction failed: remove what was written (any older checkpoint still describes the journal)."""
        self._fail(None)

    def _fail(self, error: BaseException | None) -> None:
        if error is not None and self.error is None:
            self.error = f"{type(error).__name__}: {error}"
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(OSError):  # what stays is removed on the next open (``remove_partial``)
            (self.directory / PARTIAL).unlink(missing_ok=True)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written == 0:
            raise OSError(28, "no byte written")
        view = view[written:]
