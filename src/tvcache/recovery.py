"""What reopening a durable cache found in its directory, and what it did about it.

A damaged journal line held an acknowledged record. Losing it costs reuse when the record was a call, a snapshot,
a test result or a cleared mark: the cache re-executes what it no longer knows, and every call recorded below a
lost call goes with it (a node without its parent is a state nobody can reach). Losing a *non-determinism mark*
costs exactness instead: the tool would be served from cache again. So a damaged line that may be a mark is read
for the tool it names (unverified) and that tool is marked again, tool-wide, together with any known tool whose
name is one byte away from it (the damage may be in the name). A damaged line of any other kind not known to be
safe to lose — a removal of nodes (``rm``), a kind this version does not know, an illegible line — that names no
legible tool makes the cache refuse to open (``JournalError``), saying which line to look at: the cache cannot
know what it would serve wrongly.

Leftovers of killed processes are removed: snapshot files the cache named itself under ``snapshots/`` that no
record mentions (a kill between writing a snapshot and journaling it), and — in ``tvcache.journal`` — an
interrupted compaction's ``journal.compact``. Snapshots whose storage is gone (``tvcache.store.durable``) are
dropped, their files under ``snapshots/`` removed, and counted in ``JournalRecovery.dropped``.

A checkpoint (``tvcache.store.checkpoint``) stands in for the journal lines it covers, and what replay would have
noted of those lines (``LoadNotes``) is kept in it. One that cannot be used — damaged, of another format, or not
describing the journal's bytes any more — is removed and the journal replayed alone, exactly as without it; the
warning says so (``JournalRecovery.checkpoint``).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import JournalError
from .journal import DamagedLine, JournalScan, decode, salvage

__all__ = ["DamagedRecord", "JournalRecovery", "LostCalls"]

# Record kinds whose loss only costs reuse; any other kind (a mark, or one this version does not know) may carry
# non-determinism evidence, which must not be lost silently.
SAFE_TO_LOSE = frozenset({"n", "s", "x", "test", "det", "checked"})
_KINDS = {
    "n": "a call record",
    "s": "a snapshot record",
    "x": "a snapshot eviction record",
    "test": "a test result record",
    "nondet": "a non-determinism mark",
    "det": "a cleared non-determinism mark",
    "checked": "a passed first-hit check",
    "rm": "a removal of nodes",
}
# How the cache names snapshot files: snapshots/<20 hex of the task>/<node id>-<8 hex>[.suffix of the backend].
_TASK_DIR = re.compile(r"[0-9a-f]{20}")
_SNAPSHOT_ENTRY = re.compile(r"(\d+-[0-9a-f]{8})(?:\..+)?")
_SNAPSHOT_NAME = re.compile(r"\d+-[0-9a-f]{8}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DamagedRecord:
    """A journal line that failed its checksum, with what its unverified text shows (None: illegible)."""

    line: int
    offset: int
    size: int
    kind: str | None
    task_id: str | None
    node_id: int | None
    tool: str | None

    def describe(self) -> str:
        what = _KINDS.get(self.kind or "", "an illegible record" if self.kind is None else f"a {self.kind!r} record")
        details = [f"task {self.task_id!r}"] if self.task_id is not None else []
        if self.node_id is not None:
            details.append(f"node {self.node_id}")
        if self.tool is not None:
            details.append(f"tool {self.tool!r}")
        shown = f" ({', '.join(details)}, unverified)" if details else ""
        return f"line {self.line} at byte {self.offset}: {what}{shown}"


@dataclass(frozen=True, kw_only=True, slots=True)
class LostCalls:
    """Acknowledged calls that no longer load because the node they were recorded below is missing."""

    task_id: str
    below: int
    nodes: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class JournalRecovery:
    """What opening a durable cache found and did. ``damaged``: lines that fail their checksum (kept in the
    journal until a compaction copies them aside). ``lost``: calls that depended on missing nodes. ``skipped``:
    other records that do not apply (snapshots and tests of lost nodes, invalid records; ``first_error`` shows
    one). ``torn_tail``: bytes of a write a crash left unfinished, truncated. ``recovered_marks``: tools marked
    non-deterministic again because a damaged line may have marked them. ``torn_copy``: where the torn tail was
    copied. ``set_aside``: copies of what compactions removed (damaged lines and the records that depended on
    them). ``removed``: leftovers of killed processes (orphan snapshot files, an interrupted compaction).
    ``dropped``: the paths of snapshots dropped because their storage is gone (the layers of a shell snapshot die
    with the process that made them unless it was published); what they left under ``snapshots/`` was removed.
    Dropping one costs only reuse, so it is not a lost record. ``from_checkpoint``: how many journal lines a
    checkpoint stood in for (0: the journal was replayed whole). ``checkpoint``: why a checkpoint found here was
    not used (then it was removed, and the journal replayed whole); costs only time."""

    journal: str
    damaged: tuple[DamagedRecord, ...] = ()
    lost: tuple[LostCalls, ...] = ()
    skipped: int = 0
    first_error: str | None = None
    torn_tail: int = 0
    torn_copy: str | None = None
    recovered_marks: tuple[str, ...] = ()
    set_aside: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    from_checkpoint: int = 0
    checkpoint: str | None = None

    @property
    def lost_records(self) -> bool:
        """Acknowledged records could not be loaded (a torn tail was never acknowledged, so it does not count)."""
        return bool(self.damaged or self.lost or self.skipped)

    @property
    def lost_calls(self) -> int:
        return sum(len(group.nodes) for group in self.lost)

    def describe(self) -> str:
        """One paragraph: what was lost, what was done, where the copies are. Empty when nothing happened."""
        parts: list[str] = []
        if self.damaged:
            listed = "; ".join(record.describe() for record in self.damaged[:5])
            more = f"; and {len(self.damaged) - 5} more" if len(self.damaged) > 5 else ""
            parts.append(f"{len(self.damaged)} damaged record(s) were skipped ({listed}{more})")
        if self.lost:
            groups = "; ".join(
                f"{len(group.nodes)} in task {group.task_id!r} below missing node {group.below} "
                f"(nodes {_ranges(group.nodes)})"
                for group in self.lost[:5]
            )
            more = f"; and {len(self.lost) - 5} more groups" if len(self.lost) > 5 else ""
            parts.append(
                f"{self.lost_calls} acknowledged call(s) recorded below missing nodes are lost with them: "
                f"{groups}{more}"
            )
        if self.skipped:
            parts.append(
                f"{self.skipped} other record(s) do not apply (snapshots, tests or removals of lost nodes, or "
                f"invalid records; first: {self.first_error})"
            )
        if self.recovered_marks:
            parts.append(
                "a damaged record may have marked a tool non-deterministic, so these are marked again, in every "
                f"task: {', '.join(map(repr, self.recovered_marks))} (clear_nondeterministic() lifts a mark)"
            )
        if self.torn_tail:
            copy = f"a copy is in {self.torn_copy}" if self.torn_copy else "no copy could be written"
            parts.append(f"a torn last write ({self.torn_tail} bytes a crash cut short) was truncated; {copy}")
        if self.set_aside:
            parts.append(
                "a compaction removed the damaged lines and the records that depended on them from the journal; "
                f"copies are in {', '.join(self.set_aside)}"
            )
        elif self.lost_records:
            parts.append("the damaged lines stay in the journal until a compaction copies them aside")
        if self.checkpoint:
            parts.append(
                f"its checkpoint was not used ({self.checkpoint}), so the whole journal was replayed (nothing is "
                "lost: the journal holds every record); a compaction writes a new one"
            )
        if self.dropped:
            parts.append(
                f"{len(self.dropped)} snapshot(s) whose storage is gone were dropped (a shell snapshot's layers end "
                "with the process that made them unless it was published; their states are replayed when needed)"
            )
        if not parts:
            return ""
        return f"{self.journal}: " + "; ".join(parts) + "."


def _ranges(ids: Iterable[int]) -> str:
    ordered = sorted(ids)
    spans: list[str] = []
    start = previous = ordered[0]
    for value in [*ordered[1:], None]:
        if value is not None and value == previous + 1:
            previous = value
            continue
        spans.append(str(start) if start == previous else f"{start}-{previous}")
        if value is not None:
            start = previous = value
    return ", ".join(spans[:8]) + (", ..." if len(spans) > 8 else "")


class LoadNotes:
    """What replay needs to know about the intact records besides applying them: the tools the journal names,
    the last line that speaks of each tool tool-wide, and the snapshot file names any record mentions. A
    checkpoint keeps the notes of the lines it covers (``to_json``, ``from_json``)."""

    def __init__(self) -> None:
        self.tools: set[str] = set()
        self.tool_wide: dict[str, int] = {}
        self.snapshot_names: set[str] = set()

    def to_json(self) -> dict[str, Any]:
        return {
            "tools": sorted(self.tools),
            "tool_wide": sorted(self.tool_wide.items()),
            "snapshot_names": sorted(self.snapshot_names),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LoadNotes:
        """ValueError (or TypeError) unless ``data`` has the shape ``to_json`` gives."""
        notes = cls()
        notes.tools = {str(tool) for tool in data["tools"]}
        notes.tool_wide = {str(tool): int(line) for tool, line in data["tool_wide"]}
        notes.snapshot_names = {str(name) for name in data["snapshot_names"]}
        return notes

    def note(self, line: int, record: dict[str, Any]) -> None:
        kind = record.get("t")
        if kind == "n":  # a call's output is the user's text: it never names a snapshot of ours
            if isinstance(record.get("name"), str):
                self.tools.add(record["name"])
            return
        tool = record.get("tool")
        if isinstance(tool, str):
            self.tools.add(tool)
            if record.get("task") is None:
                self.tool_wide[tool] = line
        for text in _strings(record):
            self.snapshot_names.update(_SNAPSHOT_NAME.findall(text))


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def read_damage(line: DamagedLine) -> DamagedRecord:
    fields = salvage(line.data)
    kind = fields.get("t") if isinstance(fields.get("t"), str) else None
    if kind not in _KINDS and "p" in fields and "name" in fields:
        kind = "n"  # the kind is what was damaged, but only call records have a parent and a tool name
    task, node, tool = fields.get("task"), fields.get("id"), fields.get("tool")
    return DamagedRecord(
        line=line.line,
        offset=line.offset,
        size=len(line.data),
        kind=kind,
        task_id=task if isinstance(task, str) else None,
        node_id=node if isinstance(node, int) and not isinstance(node, bool) else None,
        tool=tool if isinstance(tool, str) else None,
    )


def marks_to_recover(journal: Path, damaged: Iterable[DamagedRecord], notes: LoadNotes) -> list[str]:
    """The tools to mark non-deterministic again because a damaged line may have marked them. Raises
    JournalError for a line whose kind is not safe to lose and that names no legible tool (a removal, an illegible
    line): the cache cannot know what it would serve wrongly."""
    tools: list[str] = []
    for record in damaged:
        if record.kind in SAFE_TO_LOSE:
            continue
        if record.tool is None:
            raise JournalError(
                f"{journal}: {record.describe()} may have said that some results must not be served from cache (a "
                "non-determinism mark, a removal), and what it covers cannot be read, so the cache will not open. "
                f"Restore the line from a backup if you have one; otherwise keep a copy of line {record.line} and "
                "delete it (that accepts the risk), then open the cache again"
            )
        if notes.tool_wide.get(record.tool, 0) > record.line:
            continue  # a later intact record marked or cleared the tool everywhere: this one is superseded
        near = [known for known in sorted(notes.tools) if _one_byte_apart(known, record.tool)]
        for tool in [record.tool, *near]:
            if tool not in tools:
                tools.append(tool)
    return tools


def _one_byte_apart(a: str, b: str) -> bool:
    left, right = a.encode(), b.encode()
    return len(left) == len(right) and sum(x != y for x, y in zip(left, right, strict=True)) == 1


def lost_calls(unapplied: Iterable[dict[str, Any]], exists: Callable[[str, int], bool]) -> list[LostCalls]:
    """Group the call records that did not apply by the missing node they descend from (records whose parent
    exists failed for another reason and are left out)."""
    parents: dict[tuple[str, int], int] = {}
    for record in unapplied:
        task, node, parent = record.get("task"), record.get("id"), record.get("p")
        if record.get("t") == "n" and isinstance(task, str) and isinstance(node, int) and isinstance(parent, int):
            parents[(task, node)] = parent
    groups: dict[tuple[str, int], list[int]] = {}
    for (task, node), parent in parents.items():
        top = parent
        seen = {node}
        while (task, top) in parents and top not in seen:
            seen.add(top)
            top = parents[(task, top)]
        if not exists(task, top):
            groups.setdefault((task, top), []).append(node)
    lost = [LostCalls(task_id=task, below=below, nodes=tuple(sorted(nodes))) for (task, below), nodes in groups.items()]
    return sorted(lost, key=lambda group: (group.task_id, group.below))


def _may_name_snapshots(line: DamagedLine) -> bool:
    """Whether a damaged line may be a record naming snapshot files (whose names cannot be trusted)."""
    return read_damage(line).kind not in SAFE_TO_LOSE - {"s"}


def remove_orphan_snapshots(
    snapshot_root: Path, referenced: set[str], scan: JournalScan, directory: Path
) -> list[Path]:
    """Remove what the cache wrote under ``snapshot_root`` that no record mentions, by the cache's own naming
    only (``<20 hex>/<node id>-<8 hex>[.suffix]``). Records copied aside by a compaction (``journal.damaged-*``
    in the journal's ``directory``) still count, so a record someone may restore keeps its data; and nothing is
    removed while a damaged line, in the journal or in such a copy, may be a snapshot record: any file may be the
    one it names."""
    if not snapshot_root.is_dir() or any(_may_name_snapshots(line) for line in scan.damaged):
        return []
    kept = set(referenced)
    for copy in sorted(directory.glob("journal.damaged-*")):
        try:
            lines = copy.read_bytes().splitlines(keepends=True)
        except OSError:
            return []  # a copy we cannot read may name anything
        for number, data in enumerate(lines, 1):
            record = decode(data)
            if record is None and _may_name_snapshots(DamagedLine(line=number, offset=0, data=data)):
                return []
            kept.update(_SNAPSHOT_NAME.findall(data.decode(errors="replace")))
    removed: list[Path] = []
    for task_dir in snapshot_root.iterdir():
        if not _TASK_DIR.fullmatch(task_dir.name) or task_dir.is_symlink() or not task_dir.is_dir():
            continue
        for entry in task_dir.iterdir():
            match = _SNAPSHOT_ENTRY.fullmatch(entry.name)
            if match is None or match.group(1) in kept:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
        try:
            task_dir.rmdir()  # only succeeds when empty
        except OSError:
            pass
    return removed
