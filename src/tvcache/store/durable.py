"""A ``LocalStore``'s durability: replaying its journal on open, accounting for damage, compacting.

Every change is journaled as a typed record (``tvcache.store.records``) before it is applied; opening replays
them. What the journal held besides intact records that apply — damaged lines, records depending on lost ones,
a torn tail, snapshot files a killed process never journaled, snapshots whose storage is gone — is dealt with
by ``tvcache.recovery`` and reported in ``LocalStore.recovery``.

A snapshot record whose storage is gone (``Snapshot.exists`` fails: a shell snapshot's layers live in a store of
the process that made them, so after a restart they are gone unless the snapshot was published, and then
``publication_available`` keeps it) is dropped on open, and what it left in the cache's own ``snapshots/``
directory (its file, a CRIU image beside it) is removed with it: nothing will ever fork or evict it again.

Opening does not grow with the cache: a compaction also writes a checkpoint of what it wrote
(``tvcache.store.checkpoint``), and an open that finds one describing the journal's first bytes takes the
records that belong to no graph from it, replays only the journal's tail, and leaves each task of the checkpoint
*pending*: its nodes are read the first time the task is used (``LocalStore.graph``), and the tail's records for
it are applied then, in journal order. Everything recovery accounts for is still found while opening: damage in
the tail loads the pending tasks it may concern first, so lost calls are grouped as before, and snapshot records
are checked for their storage without loading their task. Only a record that does not apply although nothing is
damaged — something no tvcache writes — is found when its task is loaded, and reported then (``load_task``).
A compaction is due when opening finds the journal mostly dead, and when closing finds ``CHECKPOINT_TAIL``
records or more not covered by a checkpoint.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
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
from .checkpoint import Checkpoint, CheckpointUnusable, CheckpointWriter, TaskSection, remove, remove_partial
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

__all__ = [
    "CHECKPOINT_TAIL",
    "DurableState",
    "PendingTask",
    "apply_to_graph",
    "compact",
    "load",
    "load_task",
    "records",
]

# Records not covered by a checkpoint past which closing compacts: replaying them costs ~0.3 s at the next open.
CHECKPOINT_TAIL = 20_000
_GRAPH_RECORDS = (NodeRecord, SnapshotRecord, DetachRecord, TestRecord, RemoveRecord)
_LOAD_ERRORS = (KeyError, ValueError, TypeError, InvalidToolCall)
Failure = tuple[int, dict[str, Any], BaseException]  # a journal line whose record did not apply, and why


@dataclass(eq=False, kw_only=True)
class PendingTask:
    """A task of the checkpoint whose nodes are not read yet: where they are, its snapshot records that passed
    the open-time check for their storage, and the journal tail's records for it (line, JSON, record), applied
    after the nodes when the task is first used."""

    section: TaskSection
    snapshots: list[SnapshotRecord]
    deferred: list[tuple[int, dict[str, Any], Record]] = field(default_factory=list)
    snapshots_changed: bool = False  # a deferred record attaches, detaches or removes: ``snapshots`` may be off


class DurableState(Protocol):
    """What replaying and compacting need of a store (``LocalStore`` has it all)."""

    journal: Journal | None
    recovery: JournalRecovery | None
    unapplied: list[tuple[int, dict[str, Any]]]
    dropped: list[SnapshotRecord]
    verify_snapshots: bool
    snapshot_root: Path
    root: Path
    checkpoint: Checkpoint | None
    pending: dict[str, PendingTask]
    records_since_checkpoint: int

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

    def load_pending(self, task_id: str) -> list[Failure]: ...

    def live_nodes(self) -> int: ...

    def attached_snapshots(self) -> list[Snapshot]: ...


def load(store: DurableState, *, compact_due: bool) -> None:
    """Take what a checkpoint holds (``_take_checkpoint``) and replay the journal's tail after it (or the whole
    journal), then deal with what the journal held besides intact records (``_recover``). If the store cannot
    open, the journal is closed again before the error propagates."""
    journal = store.journal
    assert journal is not None
    make_private(store.snapshot_root)  # an older version's 0755 one
    failures: list[Failure] = []
    try:
        checkpoint, unused = _take_checkpoint(store, journal)
        notes = checkpoint.notes if checkpoint is not None else LoadNotes()
        covered = checkpoint.prefix.lines if checkpoint is not None else 0
        count = covered
        for line, data in journal.load(after=checkpoint.prefix if checkpoint is not None else None):
            count += 1
            notes.note(line, data)
            try:
                record = parse(data)
                pending = store.pending.get(record.task_id) if isinstance(record, _GRAPH_RECORDS) else None
                if pending is not None:
                    _defer(store, pending, line, data, record)
                else:
                    store.apply(record)
                if isinstance(record, DetachRecord) and store.dropped:  # dropped on an earlier open already
                    store.dropped = [
                        old for old in store.dropped if (old.task_id, old.node_id) != (record.task_id, record.node_id)
                    ]
            except _LOAD_ERRORS as error:
                failures.append((line, data, error))
        if journal.scan.damaged:  # the tail lost records: what depends on them is found now, as without checkpoint
            for task_id in [task_id for task_id, pending in store.pending.items() if pending.deferred]:
                failures.extend(store.load_pending(task_id))
        failures.sort(key=lambda failure: failure[0])
        store.unapplied.extend((line, data) for line, data, _ in failures)
        store.records_since_checkpoint = count - covered
        _recover(store, journal, notes, [error for _, _, error in failures])
        store.recovery = replace(_required(store.recovery), from_checkpoint=covered, checkpoint=unused)
        _remove_leftovers(store, journal, notes)  # before a compaction moves damaged lines out of sight
        live = store.live_nodes() + len(store.nondeterministic_marks())
        if compact_due and count > 2 * live + 1000:
            try:
                compact(store, warn=False)
            except JournalError as error:  # optional: the journal is whole as it is (a full disk, say)
                warnings.warn(f"{error}; opening without compacting", JournalWarning, stacklevel=4)
    except BaseException:
        journal.close()
        raise
    recovery = _required(store.recovery)
    if recovery.lost_records or recovery.torn_tail or recovery.recovered_marks or recovery.checkpoint:
        warnings.warn(recovery.describe(), JournalWarning, stacklevel=4)


def _required(recovery: JournalRecovery | None) -> JournalRecovery:
    assert recovery is not None  # set by _recover
    return recovery


def _take_checkpoint(store: DurableState, journal: Journal) -> tuple[Checkpoint | None, str | None]:
    """Open the checkpoint, if there is one that describes the journal's first bytes, and take from it what
    opening needs: the records that belong to no graph (applied), and each task, pending. Returns it, and why
    one found was not used (it is removed then)."""
    # Half a checkpoint is what a compaction killed halfway leaves beside its ``journal.compact`` (which the
    # journal removes and reports): derived bytes nobody needs, removed without a word of its own.
    remove_partial(store.root)
    try:
        checkpoint = Checkpoint.open(store.root)
    except CheckpointUnusable as error:
        remove(store.root)
        return None, str(error)
    if checkpoint is None:
        return None, None
    if not journal.covers(checkpoint.prefix):
        checkpoint.close()
        remove(store.root)
        unused = (
            f"it describes the first {checkpoint.prefix.size:,} bytes of a journal, and {journal.path} does not "
            "begin with them: it was rewritten or changed after the checkpoint was written"
        )
        return None, unused
    store.checkpoint = checkpoint
    for record in checkpoint.records:
        store.apply(record)
    for section in checkpoint.sections:
        pending = PendingTask(section=section, snapshots=[])
        for snapshot in section.snapshots:
            if _usable(store, snapshot):
                pending.snapshots.append(snapshot)
        store.pending[section.task_id] = pending
    return checkpoint, None


def _usable(store: DurableState, record: SnapshotRecord) -> bool:
    """Whether a snapshot record's storage is still there (a published one's data may live on in its store);
    one that is not is dropped here, as replay drops it."""
    snapshot = record.snapshot
    if not store.verify_snapshots or snapshot.exists() or publication_available(snapshot):
        return True
    store.release_dropped(snapshot)
    store.dropped.append(record)
    return False


def _defer(store: DurableState, pending: PendingTask, line: int, data: dict[str, Any], record: Record) -> None:
    """Keep a tail record of a pending task for when the task is loaded; a snapshot record's storage is checked
    now, as replay checks it, since what opening does about missing storage it does while opening."""
    if isinstance(record, SnapshotRecord) and not _usable(store, record):
        return
    pending.deferred.append((line, data, record))
    pending.snapshots_changed |= isinstance(record, SnapshotRecord | DetachRecord | RemoveRecord)


def load_task(
    store: DurableState, pending: PendingTask, *, clock: Callable[[], float]
) -> tuple[ToolCallGraph, list[Failure]]:
    """The graph of a pending task (its clock: the store's), its nodes from the checkpoint, its snapshots, then
    the tail's records for it. Returns the records that did not apply (``account_late`` reports them when
    opening is over)."""
    checkpoint = store.checkpoint
    assert checkpoint is not None  # pending tasks exist only while their checkpoint is open
    graph = checkpoint.read_graph(pending.section, clock=clock)
    for snapshot in pending.snapshots:
        node = graph.node(snapshot.node_id)
        if node.snapshot is None:
            graph.attach_snapshot(node, snapshot.snapshot)
    failures: list[Failure] = []
    for line, data, record in pending.deferred:
        try:
            apply_to_graph(store, graph, record, checked=True)
        except _LOAD_ERRORS as error:
            failures.append((line, data, error))
    return graph, failures


def account_late(store: DurableState, failures: list[Failure]) -> None:
    """Report tail records of a task loaded after opening that did not apply although the journal showed no
    damage (no tvcache writes such records): counted into ``recovery`` as opening would have, and warned."""
    records = [data for _, data, _ in failures]
    store.unapplied.extend((line, data) for line, data, _ in failures)
    lost = lost_calls(records, lambda task, node: store.has_task(task) and store.graph(task).get(node) is not None)
    in_groups = {(group.task_id, node) for group in lost for node in group.nodes}
    skipped = [
        error
        for _, data, error in failures
        if data.get("t") != "n" or (data.get("task"), data.get("id")) not in in_groups
    ]
    for task, ids in _ids_by_task(records, ()).items():
        if store.has_task(task):
            store.graph(task).reserve_ids(max(ids))
    recovery = _required(store.recovery)
    store.recovery = replace(
        recovery,
        lost=tuple(sorted((*recovery.lost, *lost), key=lambda group: (group.task_id, group.below))),
        skipped=recovery.skipped + len(skipped),
        first_error=recovery.first_error or (repr(skipped[0]) if skipped else None),
    )
    warnings.warn(store.recovery.describe(), JournalWarning, stacklevel=5)


def apply_to_graph(store: DurableState, graph: ToolCallGraph, record: Record, *, checked: bool = False) -> None:
    """Replay a record of one task's graph (``checked``: a snapshot record's storage was found already)."""
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
        node = graph.node(record.node_id)
        if (checked or _usable(store, record)) and node.snapshot is None:
            graph.attach_snapshot(node, record.snapshot)
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
    attached = {Path(snapshot.path).name for snapshot in store.attached_snapshots()}
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
    """Rewrite the journal to hold only ``store.records()``, and write a checkpoint of them; what the journal
    drops is copied aside first. Loads every pending task (their records are rewritten)."""
    journal = store.journal
    if journal is None:
        return 0
    with store.lock:
        for task_id in list(store.pending):  # every task is rewritten: read the pending ones first
            failures = store.load_pending(task_id)
            if failures:
                account_late(store, failures)
        writer = CheckpointWriter(store.root)

        def stream() -> Iterator[dict[str, Any]]:
            for line, record in enumerate(store.records(), 1):
                data = record.to_json()
                writer.add(line, record, data, _call_of(store, record))
                yield data

        try:
            result = journal.rewrite(stream(), lost=store.unapplied)
        except BaseException:
            writer.abandon()
            raise
        _close_checkpoint(store)
        store.unapplied = []
        written = writer.commit(result.written)
        store.records_since_checkpoint = 0 if written else result.records
        if result.set_aside is not None and store.recovery is not None:
            store.recovery = replace(store.recovery, set_aside=(*store.recovery.set_aside, str(result.set_aside)))
    if not written:
        warnings.warn(
            f"{journal.path}: compacted, but no checkpoint could be written ({writer.error}); the next open "
            "replays the whole journal",
            JournalWarning,
            stacklevel=4,
        )
    if warn and result.set_aside is not None:
        warnings.warn(
            f"{journal.path}: compacting dropped damaged lines and the records that depended on them; "
            f"copies are in {result.set_aside}",
            JournalWarning,
            stacklevel=4,
        )
    return result.records


def _call_of(store: DurableState, record: Record) -> ToolCall | None:
    """The call a node record was written from, whose canonical bytes and digest a checkpoint keeps."""
    if not isinstance(record, NodeRecord) or not store.has_task(record.task_id):
        return None
    node = store.graph(record.task_id).get(record.node_id)
    return node.call if node is not None else None


def _close_checkpoint(store: DurableState) -> None:
    if store.checkpoint is not None:
        store.checkpoint.close()
        store.checkpoint = None


def checkpoint_due(store: DurableState) -> bool:
    """Whether closing should compact: ``CHECKPOINT_TAIL`` records or more would be replayed at the next open."""
    return store.journal is not None and store.records_since_checkpoint >= CHECKPOINT_TAIL


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
