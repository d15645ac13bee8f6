"""A ``LocalStore``'s durability: replaying its journal on open, accounting for damage, compacting.

Every change is journaled as a typed record (``tvcache.store.records``) before it is applied; opening replays
them. What the journal held besides intact records that apply — damaged lines, records depending on lost ones,
a torn tail, snapshot files a killed process never journaled, snapshots whose storage is gone — is dealt with
by ``tvcache.recovery`` and reported in ``LocalStore.recovery``.

A snapshot record whose storage is gone (``Snapshot.exists`` fails: a shell snapshot's layers live in a store of
the process that made them, so after a restart they are gone unless the snapshot was published, and then
``publication_available`` keeps it) is dropped on open, and what it left in the cache's own ``snapshots/``
directory (its file, a CRIU image beside it) is removed with it: nothing will ever fork or evict it again.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from ..calls import ToolCall
from ..errors import InvalidToolCall, JournalError
from ..graph import ToolCallGraph
from ..journal import Journal, JournalWarning
from ..private_storage import make_private
from ..protocol import Snapshot
from ..recovery import (
    DamagedRecord,
    JournalRecovery,
    LoadNotes,
    lost_calls,
    marks_to_recover,
    read_damage,
    remove_orphan_snapshots,
)
from ..results import NondeterminismMark
from ..snapshots.publication import publication_available
from .records import (
    CheckedRecord,
    DetachRecord,
    MarkRecord,
    NodeRecord,
    Record,
    RemoveRecord,
    SnapshotRecord,
    TestRecord,
    parse,
)

__all__ = ["DurableState", "apply_to_graph", "compact", "load", "records"]


class DurableState(Protocol):
    """What replaying and compacting need of a store (``LocalStore`` has it all)."""

    journal: Journal | None
    recovery: JournalRecovery | None
    unapplied: list[tuple[int, dict[str, Any]]]
    dropped: list[SnapshotRecord]
    verify_snapshots: bool
    snapshot_root: Path

    @property
    def lock(self) -> threading.RLock: ...

    def graph(self, task_id: str) -> ToolCallGraph: ...

    def graphs(self) -> list[ToolCallGraph]: ...

    def has_task(self, task_id: object) -> bool: ...

    def apply(self, record: Record) -> None: ...

    def records(self) -> Iterator[Record]: ...

    def checked(self) -> list[tuple[str, str]]: ...

    def nondeterministic_marks(self, task_id: str | None = None) -> list[NondeterminismMark]: ...

    def mark_nondeterministic(self, tool: str, reason: str, *, task_id: str | None = None) -> bool: ...

    def release_dropped(self, snapshot: Snapshot) -> None: ...


def load(store: DurableState, *, compact_due: bool) -> None:
    """Replay the journal, then deal with what it held besides intact records (``_recover``). If the store
    cannot open, the journal is closed again before the error propagates."""
    journal = store.journal
    assert journal is not None
    make_private(store.snapshot_root)  # an older version's 0755 one
    notes = LoadNotes()
    count = 0
    errors: list[BaseException] = []
    try:
        for line, data in journal.load():
            count += 1
            notes.note(line, data)
            try:
                record = parse(data)
                store.apply(record)
                if isinstance(record, DetachRecord) and store.dropped:  # dropped on an earlier open already
                    store.dropped = [
                        old for old in store.dropped if (old.task_id, old.node_id) != (record.task_id, record.node_id)
                    ]
            except (KeyError, ValueError, TypeError, InvalidToolCall) as error:
                store.unapplied.append((line, data))
                errors.append(error)
        _recover(store, journal, notes, errors)
        _remove_leftovers(store, journal, notes)  # before a compaction moves damaged lines out of sight
        live = sum(len(g) for g in store.graphs()) + len(store.nondeterministic_marks())
        if compact_due and count > 2 * live + 1000:
            try:
                compact(store, warn=False)
            except JournalError as error:  # optional: the journal is whole as it is (a full disk, say)
                warnings.warn(f"{error}; opening without compacting", JournalWarning, stacklevel=4)
    except BaseException:
        journal.close()
        raise
    recovery = store.recovery
    assert recovery is not None
    if recovery.lost_records or recovery.torn_tail or recovery.recovered_marks:
        warnings.warn(recovery.describe(), JournalWarning, stacklevel=4)


def apply_to_graph(store: DurableState, graph: ToolCallGraph, record: Record) -> None:
    """Replay a record of one task's graph."""
    if isinstance(record, NodeRecord):
        parent = graph.node(record.parent_id)
        call = ToolCall.from_json(record.name, record.arguments)
        graph.insert(
            parent,
            call,
            output=record.output,
            is_error=record.is_error,
            seconds=record.seconds,
            read_only=record.read_only,
            node_id=record.node_id,
        )
    elif isinstance(record, SnapshotRecord):
        snapshot = record.snapshot
        node = graph.node(record.node_id)
        # Snapshots whose data is gone are dropped; a published one's data may live on in its store.
        usable = not store.verify_snapshots or snapshot.exists() or publication_available(snapshot)
        if not usable:
            store.release_dropped(snapshot)
            store.dropped.append(record)
        elif node.snapshot is None:
            graph.attach_snapshot(node, snapshot)
    elif isinstance(record, DetachRecord):
        node = graph.node(record.node_id)
        if node.snapshot is not None:
            graph.detach_snapshot(node)
    elif isinstance(record, TestRecord):
        graph.set_test(graph.node(record.node_id), record.key, record.value)
    elif isinstance(record, RemoveRecord):
        graph.remove(graph.node(record.node_id))
    else:
        raise ValueError(f"not a record of a graph: {record!r:.200}")


def _recover(store: DurableState, journal: Journal, notes: LoadNotes, errors: list[BaseException]) -> None:
    """Account for damage (``tvcache.recovery``): group the calls lost below missing nodes, mark again the
    tools a damaged line may have marked (JournalError when it cannot tell which), and keep new nodes off the
    ids the journal's lost records still use, so restoring a damaged line later cannot graft them elsewhere."""
    scan = journal.scan
    damaged = tuple(read_damage(line) for line in scan.damaged)
    marks = marks_to_recover(journal.path, damaged, notes)
    unapplied = store.unapplied
    lost = lost_calls(
        (record for _, record in unapplied),
        lambda task, node: store.has_task(task) and store.graph(task).get(node) is not None,
    )
    in_groups = {(group.task_id, node) for group in lost for node in group.nodes}
    skipped = [
        error
        for (_, record), error in zip(unapplied, errors, strict=True)
        if record.get("t") != "n" or (record.get("task"), record.get("id")) not in in_groups
    ]
    for task, ids in _ids_by_task([record for _, record in unapplied], damaged).items():
        if store.has_task(task):  # never a graph for a task name read from damaged bytes
            store.graph(task).reserve_ids(max(ids))
    for tool in marks:
        store.mark_nondeterministic(tool, f"a damaged journal record may have marked it ({journal.path})")
    store.recovery = JournalRecovery(
        journal=str(journal.path),
        damaged=damaged,
        lost=tuple(lost),
        skipped=len(skipped),
        first_error=repr(skipped[0]) if skipped else None,
        torn_tail=len(scan.torn_tail.data) if scan.torn_tail is not None else 0,
        torn_copy=str(scan.set_aside) if scan.set_aside is not None else None,
        recovered_marks=tuple(marks),
        removed=tuple(str(path) for path in scan.removed),
    )


def _remove_leftovers(store: DurableState, journal: Journal, notes: LoadNotes) -> None:
    """Remove snapshot files a killed process wrote but never journaled, and those of snapshots dropped because
    their storage is gone (counted in ``recovery.dropped``). Only where this store owns its snapshots (a server's
    belong to its clients), and never what another record, intact or damaged, may name."""
    recovery = store.recovery
    assert recovery is not None
    if not store.verify_snapshots:
        return
    attached = {
        Path(node.snapshot.path).name
        for graph in store.graphs()
        for node in graph.snapshot_nodes.values()
        if node.snapshot is not None
    }
    records, store.dropped = store.dropped, []
    gone = {Path(record.snapshot.path).name for record in records} - attached
    removed = remove_orphan_snapshots(store.snapshot_root, notes.snapshot_names - gone, journal.scan, journal.directory)
    leftovers = tuple(str(path) for path in removed if path.name.split(".", 1)[0] not in gone)
    dropped = tuple(record.snapshot.path for record in records)
    store.recovery = replace(recovery, removed=recovery.removed + leftovers, dropped=dropped)
    # Journaled as detached, so that the next open neither counts them again nor looks for their storage.
    with contextlib.suppress(JournalError):
        for record in records:
            graph = store.graph(record.task_id) if store.has_task(record.task_id) else None
            node = graph.get(record.node_id) if graph is not None else None
            if node is not None and node.snapshot is None:
                journal.append(DetachRecord(task_id=record.task_id, node_id=record.node_id).to_json())


def records(store: DurableState) -> Iterator[Record]:
    """The current state as journal records (what compaction writes)."""
    for mark in store.nondeterministic_marks():
        yield MarkRecord(tool=mark.tool, reason=mark.reason, task_id=mark.task_id)
    for task_id, tool in store.checked():
        yield CheckedRecord(task_id=task_id, tool=tool)
    for graph in store.graphs():
        task_id = graph.task_id
        nodes = sorted(graph.nodes(), key=lambda node: node.id)
        for node in nodes:
            if node.parent is None or node.call is None:
                continue
            yield NodeRecord(
                task_id=task_id,
                node_id=node.id,
                parent_id=node.parent.id,
                name=node.call.name,
                arguments=node.call.canonical_arguments.decode(),
                output=node.output,
                is_error=node.is_error,
                seconds=node.seconds,
                read_only=node.read_only,
            )
        for node in nodes:
            if node.snapshot is not None:
                yield SnapshotRecord(task_id=task_id, node_id=node.id, snapshot=node.snapshot)
            for key, value in (node.tests or {}).items():
                yield TestRecord(task_id=task_id, node_id=node.id, key=key, value=value)


def compact(store: DurableState, *, warn: bool) -> int:
    """Rewrite the journal to hold only ``store.records()``; what it drops is copied aside first."""
    journal = store.journal
    if journal is None:
        return 0
    with store.lock:
        result = journal.rewrite((record.to_json() for record in store.records()), lost=store.unapplied)
        store.unapplied = []
        if result.set_aside is not None and store.recovery is not None:
            store.recovery = replace(store.recovery, set_aside=(*store.recovery.set_aside, str(result.set_aside)))
    if warn and result.set_aside is not None:
        warnings.warn(
            f"{journal.path}: compacting dropped damaged lines and the records that depended on them; "
            f"copies are in {result.set_aside}",
            JournalWarning,
            stacklevel=4,
        )
    return result.records


def _ids_by_task(records: Iterable[dict[str, Any]], damaged: Iterable[DamagedRecord]) -> dict[str, list[int]]:
    """The node ids that records which did not load (and legible damaged lines) use, per task."""
    ids: dict[str, list[int]] = {}
    for record in records:
        task = record.get("task")
        for key in ("id", "p"):
            value = record.get(key)
            if isinstance(task, str) and isinstance(value, int) and not isinstance(value, bool):
                ids.setdefault(task, []).append(value)
    for damage in damaged:  # unverified: a damaged id is at worst a gap in the numbering
        if damage.task_id is not None and damage.node_id is not None and damage.node_id < 2**31:
            ids.setdefault(damage.task_id, []).append(damage.node_id)
    return ids
