"""``LocalStore``: the graph store in this process — the graphs, one lock, the journal, the snapshot budget.

``LocalStore()`` keeps everything in memory (snapshots in a private temporary directory removed on close);
``LocalStore(path)`` journals every change before acknowledging it and reloads on the next open
(``tvcache.store.durable``). ``Cache()`` stands on one, and so does the server.

A process frees only storage it made: an evicted snapshot one of its sessions took (``attach_snapshot(...,
made_by=factory)``) is freed by the factory that made it, from the record that factory returned. Any other record
(reloaded from the journal, handed back by a server any client writes to) is only a claim about where storage is,
so by default only a path that really lies in this store's snapshot directory is freed, and the rest is
forgotten (``tvcache.store.owners``). ``discard`` replaces that default for such records; ``verify_snapshots=False``
keeps journaled snapshots whose files this process cannot see. A server sets both: its snapshots belong to its
clients, to whom it hands evicted records back (``Attached.evicted``).

A durable store opened from a checkpoint holds most tasks *pending* (``tvcache.store.durable``): known by name
and size, their nodes read the first time something needs them (``graph``, ``graphs``, a count a checkpoint
cannot give). ``compact_on_open=False`` keeps opening and closing from rewriting the directory; otherwise opening
compacts a mostly dead journal and closing compacts when ``CHECKPOINT_TAIL`` records are not in a checkpoint.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypedDict

from ..calls import MAX_TASK_ID, ToolCall, canonical_json, check_task_id, stable_digest
from ..errors import InvalidToolCall, JournalError, SandboxError
from ..graph import Lease, MatchResult, Node, ToolCallGraph
from ..journal import Journal, JournalWarning
from ..policies import Budget, CostModel, EvictionPolicy, LowReuseFirst, SnapshotPolicy
from ..private_storage import DIRECTORY_MODE
from ..protocol import Outcome, SandboxFactory, Snapshot
from ..recovery import JournalRecovery
from ..results import NondeterminismMark
from ..snapshots.publication import release_dropped
from . import durable
from .checkpoint import Checkpoint
from .inflight import ClaimKey, Inflight, check_key
from .owners import SnapshotOwners
from .protocol import Attached, Claim, Dropped, StoreStats, TestLookup, check_output
from .records import (
    CheckedRecord,
    ClearRecord,
    DetachRecord,
    MarkRecord,
    NodeRecord,
    Record,
    RemoveRecord,
    SnapshotRecord,
    TestRecord,
)

__all__ = ["MAX_TASK_ID", "LocalStore", "LocalStoreOptions", "check_task_id"]  # the task id rule: ``tvcache.calls``


class LocalStoreOptions(TypedDict, total=False):
    """``LocalStore``'s keyword options besides its policies (defaults and meaning there), for what opens one
    (``Cache``)."""

    fsync: bool
    compact_on_open: bool
    clock: Callable[[], float]
    discard: Callable[[Snapshot], None] | None
    verify_snapshots: bool


class LocalStore:
    """The graphs of many tasks in this process, shared by concurrent sessions (threads or tasks)."""

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        budget: Budget | None = None,
        eviction: EvictionPolicy | None = None,
        fsync: bool = False,
        compact_on_open: bool = True,
        clock: Callable[[], float] = time.monotonic,
        discard: Callable[[Snapshot], None] | None = None,
        verify_snapshots: bool = True,
    ) -> None:
        self._lock = threading.RLock()
        self._clock = clock
        self._graphs: dict[str, ToolCallGraph] = {}
        self._unforkable_here: set[str] = set()  # paths of snapshots whose fork failed in this process
        # Tools never served from cache: in every task (declared, or journaled before marks were scoped), and per
        # task where a replay, audit or first-hit check saw one disagree (task -> tool -> evidence).
        self._nondeterministic: dict[str, str] = {}
        self._nondeterministic_in: dict[str, dict[str, str]] = {}
        # (task, tool) pairs whose first-hit check has been done or is running; those done and agreeing are
        # journaled (``_checks_passed``), so a reopened cache — a proxy runs one process per connection — does not
        # start a sandbox on every open just to check again what it already checked.
        self._checks_claimed: set[tuple[str, str]] = set()
        self._checks_passed: set[tuple[str, str]] = set()
        self.inflight: Inflight[Node | None] = Inflight()
        self.owners = SnapshotOwners(discard=discard)
        self.verify_snapshots = verify_snapshots
        self.budget = budget or Budget()
        self.eviction: EvictionPolicy = eviction or LowReuseFirst()
        self._snapshots_taken = 0
        self._snapshots_evicted = 0
        self._closed = False
        self.journal: Journal | None = None
        self.recovery: JournalRecovery | None = None
        self.unapplied: list[tuple[int, dict[str, Any]]] = []  # loaded records that no longer apply
        self.dropped: list[SnapshotRecord] = []  # dropped on load: their storage is gone (durable.load)
        self.checkpoint: Checkpoint | None = None  # open while tasks of it are pending
        self.pending: dict[str, durable.PendingTask] = {}  # tasks of the checkpoint not read yet
        self.records_since_checkpoint = 0  # journal records a checkpoint does not cover: the next open replays them
        self._compact_automatically = compact_on_open
        if path is None:
            self.root = Path(tempfile.mkdtemp(prefix="tvcache-"))
            # Its snapshots die with it, each freed by the factory that made it (a docker image lives outside
            # the directory), at close or when the process exits.
            self._cleanup = weakref.finalize(self, _remove_memory_store, self.root, self.owners)
        else:
            self.root = Path(path)
            self._cleanup = weakref.finalize(self, lambda: None)
        self.snapshot_root = self.root / "snapshots"
        if path is not None:
            self.journal = Journal(self.root, fsync=fsync)
            durable.load(self, compact_due=compact_on_open)

    @property
    def lock(self) -> threading.RLock:
        """The lock every operation takes (reentrant); hold it to read several graphs consistently."""
        return self._lock

    def clock(self) -> float:
        return self._clock()

    # ------------------------------------------------------------- tasks

    def graph(self, task_id: str) -> ToolCallGraph:
        with self._lock:
            graph = self._graphs.get(task_id)
            if graph is None:
                if task_id in self.pending:
                    failures = self.load_pending(task_id)
                    if failures:
                        durable.account_late(self, failures)
                    return self._graphs[task_id]
                check_task_id(task_id)
                graph = self._graphs[task_id] = ToolCallGraph(task_id, clock=self._clock)
            return graph

    def load_pending(self, task_id: str) -> list[durable.Failure]:
        """Read a pending task's graph from the checkpoint (``durable.load_task``); returns the tail records that
        did not apply with it."""
        with self._lock:
            graph, failures = durable.load_task(self, self.pending[task_id], clock=self._clock)
            self._graphs[task_id] = graph
            del self.pending[task_id]
            if not self.pending and self.checkpoint is not None:
                self.checkpoint.close()
                self.checkpoint = None
            return failures

    def _load_all(self, select: Callable[[durable.PendingTask], bool] = lambda pending: True) -> None:
        with self._lock:
            for task_id in [task_id for task_id, pending in self.pending.items() if select(pending)]:
                self.graph(task_id)

    def adopt(self, graph: ToolCallGraph) -> None:
        """Hold a graph built elsewhere (a benchmark's) as its task's, in memory only (nothing is journaled)."""
        check_task_id(graph.task_id)
        with self._lock:
            self.pending.pop(graph.task_id, None)
            self._graphs[graph.task_id] = graph

    def tasks(self) -> list[str]:
        with self._lock:
            return [*self._graphs, *self.pending]

    def has_task(self, task_id: object) -> bool:
        return task_id in self._graphs or task_id in self.pending

    def graphs(self) -> list[ToolCallGraph]:
        """Every task's graph (pending ones are read first)."""
        with self._lock:
            self._load_all()
            return list(self._graphs.values())

    def live_nodes(self) -> int:
        """About how many nodes the graphs hold, roots included, without reading pending tasks (exact unless a
        pending task has tail records that remove nodes)."""
        with self._lock:
            loaded = sum(len(graph) for graph in self._graphs.values())
            return loaded + sum(pending.section.nodes + 1 + len(pending.deferred) for pending in self.pending.values())

    def attached_snapshots(self) -> list[Snapshot]:
        """Every snapshot attached, without reading pending tasks: theirs as far as the checkpoint and the tail's
        records tell (a pending snapshot a tail record detaches is still listed, never one left out)."""
        with self._lock:
            snapshots = [
                node.snapshot
                for graph in self._graphs.values()
                for node in graph.snapshot_nodes.values()
                if node.snapshot is not None
            ]
            for pending in self.pending.values():
                snapshots.extend(record.snapshot for record in pending.snapshots)
                snapshots.extend(
                    record.snapshot for _, _, record in pending.deferred if isinstance(record, SnapshotRecord)
                )
            return snapshots

    # ------------------------------------------------------------- calls

    def lookup(self, graph: ToolCallGraph, state: Node, call: ToolCall) -> Node | None:
        with self._lock:
            node = state.step(call)
            if node is not None:
                graph.touch(node)
            return node

    def match(
        self, graph: ToolCallGraph, history: Sequence[ToolCall], *, is_read_only: Callable[[ToolCall], bool] | None
    ) -> MatchResult:
        """``graph.match`` under the lock, touching the node it ends at."""
        with self._lock:
            match = graph.match(history, is_read_only=is_read_only)
            if match.node is not None:
                graph.touch(match.node)
            return match

    def touch(self, graph: ToolCallGraph, node: Node) -> None:
        with self._lock:
            graph.touch(node)

    def claim(self, graph: ToolCallGraph, state: Node, call: ToolCall) -> Claim[Node | None]:
        with self._lock:
            ready = state.step(call)
            if ready is not None:  # finished while the caller was getting here
                return Inflight.done(ready)
            return self.inflight.claim(call_key(graph, state, call))

    def resolve(
        self, graph: ToolCallGraph, state: Node, call: ToolCall, *, node: Node | None, error: BaseException | None
    ) -> None:
        self.inflight.settle(call_key(graph, state, call), node, error)

    def record(
        self, graph: ToolCallGraph, state: Node, call: ToolCall, outcome: Outcome, *, seconds: float, read_only: bool
    ) -> Node:
        check_output(call, outcome)
        with self._lock:
            existing = state.step(call)
            if existing is not None:
                return existing
            node_id = graph.next_id
            self.append(
                NodeRecord(
                    task_id=graph.task_id,
                    node_id=node_id,
                    parent_id=state.id,
                    name=call.name,
                    arguments=call.canonical_arguments.decode(),
                    output=outcome.output,
                    is_error=outcome.is_error,
                    seconds=seconds,
                    read_only=read_only,
                )
            )
            return graph.insert(
                state,
                call,
                output=outcome.output,
                is_error=outcome.is_error,
                seconds=seconds,
                read_only=read_only,
                node_id=node_id,
            )

    def remove(self, graph: ToolCallGraph, node: Node) -> list[Snapshot]:
        """Forget ``node`` and everything below it (journaled first); returns the snapshots they held, for their
        owners to free. Refuses (ValueError, nothing changed) the root and subtrees holding a leased snapshot."""
        with self._lock:
            graph.check_removable(node)
            self.append(RemoveRecord(task_id=graph.task_id, node_id=node.id))
            return graph.remove(node)

    # ------------------------------------------------------------- end-of-rollout checks

    def lookup_test(self, graph: ToolCallGraph, node: Node, key: str) -> TestLookup:
        with self._lock:
            if node.tests is not None and key in node.tests:
                return TestLookup(found=True, value=node.tests[key])
            return TestLookup(found=False)

    def claim_test(self, graph: ToolCallGraph, node: Node, key: str) -> Claim[Node | None]:
        with self._lock:
            if node.tests is not None and key in node.tests:
                return Inflight.done(node)
            return self.inflight.claim((graph.task_id, node.id, check_key(key)))

    def resolve_test(self, graph: ToolCallGraph, node: Node, key: str, *, error: BaseException | None) -> None:
        self.inflight.settle((graph.task_id, node.id, check_key(key)), node, error)

    def record_test(self, graph: ToolCallGraph, node: Node, key: str, value: Any) -> None:
        try:
            canonical_json(value)
        except InvalidToolCall as error:
            raise InvalidToolCall(f"test {key!r} returned a value that is not JSON: {error}") from error
        with self._lock:
            graph.set_test(node, key, value)
            self.append(TestRecord(task_id=graph.task_id, node_id=node.id, key=key, value=value))

    # ------------------------------------------------------------- snapshots

    def wants_snapshot(self, graph: ToolCallGraph, node: Node, *, policy: SnapshotPolicy, costs: CostModel) -> bool:
        with self._lock:
            return policy.should_snapshot(graph, node, costs)

    def snapshot_path(self, task_id: str, node: Node) -> Path:
        directory = self.snapshot_root / stable_digest(task_id.encode()).hex()[:20]
        # Private (``tvcache.private_storage``): snapshots hold what rollouts wrote, CRIU images their memory.
        self.snapshot_root.mkdir(DIRECTORY_MODE, exist_ok=True)
        directory.mkdir(DIRECTORY_MODE, exist_ok=True)
        return directory / f"{node.id}-{random.getrandbits(32):08x}"

    def lease_snapshot(self, state: Node, kind: str, *, skip: frozenset[str] = frozenset()) -> Lease | None:
        with self._lock:
            node: Node | None = state.state
            while node is not None:
                snapshot = node.snapshot
                if (
                    snapshot is not None
                    and snapshot.kind == kind
                    and snapshot.path not in skip
                    and snapshot.path not in self._unforkable_here
                ):
                    return Lease(node)
                node = node.parent
            return None

    def release(self, lease: Lease) -> None:
        with self._lock:
            lease.release()

    def mark_unforkable(self, snapshot: Snapshot) -> None:
        """Forking ``snapshot`` failed here for a reason that may be this process's own (see
        :class:`SnapshotUnusable` for the failures that drop a snapshot everywhere). Keyed by path, which is
        unique to each snapshot taken."""
        with self._lock:
            self._unforkable_here.add(snapshot.path)

    def unforkable(self) -> frozenset[str]:
        """The paths marked unforkable in this process."""
        with self._lock:
            return frozenset(self._unforkable_here)

    def attach_snapshot(
        self, graph: ToolCallGraph, node: Node, snapshot: Snapshot, *, made_by: SandboxFactory | None = None
    ) -> Attached:
        """Attach; not attached (handed back to be freed) when the node holds a snapshot already (a concurrent
        session got there first)."""
        if made_by is not None:
            self.own(snapshot, made_by)
        with self._lock:
            if node.snapshot is not None:
                evicted = [snapshot]
                attached = False
            else:
                attached = True
                graph.attach_snapshot(node, snapshot)
                try:
                    self.append(SnapshotRecord(task_id=graph.task_id, node_id=node.id, snapshot=snapshot))
                except BaseException:
                    # Memory must never hold what the journal does not (a restart would lose it, and until then
                    # the node refuses every other snapshot): undo the attach, the caller keeps its snapshot.
                    graph.detach_snapshot(node)
                    raise
                self._snapshots_taken += 1
                evicted = self._enforce_budget(graph, keep=node)
        for old in evicted:
            self.free(old)
        return Attached(attached=attached, evicted=tuple(evicted))

    def drop_snapshot(self, graph: ToolCallGraph, node: Node) -> Dropped:
        with self._lock:
            if node.snapshot is None or node.leases:
                return Dropped()
            snapshot = graph.detach_snapshot(node)
            self.append(DetachRecord(task_id=graph.task_id, node_id=node.id))
            self._snapshots_evicted += 1
        self.free(snapshot)
        return Dropped(evicted=(snapshot,))

    def detach_snapshot(self, graph: ToolCallGraph, node: Node) -> Snapshot:
        with self._lock:
            snapshot = graph.detach_snapshot(node)
            self.append(DetachRecord(task_id=graph.task_id, node_id=node.id))
            return snapshot

    def register_backend(self, factory: SandboxFactory) -> None:
        self.owners.register(factory)

    def own(self, snapshot: Snapshot, factory: SandboxFactory) -> None:
        """Evicting ``snapshot`` frees it through ``factory``, which made it in this process."""
        self.owners.own(snapshot, factory)

    def free(self, snapshot: Snapshot) -> None:
        """Free an evicted snapshot's storage if this process made it; hand any other record to ``discard``."""
        self.owners.free(snapshot, snapshot_root=self.snapshot_root, durable=self.journal is not None)

    def release_dropped(self, snapshot: Snapshot) -> None:
        """A published record dropped on load still holds references on the blobs its store kept: no eviction
        will ever release them now, so release them here (a store that fails only costs a warning)."""
        try:
            release_dropped(snapshot)
        except SandboxError as error:
            warnings.warn(f"{self.root}: a dropped snapshot's blobs were not released: {error}", stacklevel=5)

    def _enforce_budget(self, graph: ToolCallGraph, *, keep: Node) -> list[Snapshot]:
        """Evict snapshots until the budget holds (the caller holds the lock); returns the evicted snapshots for
        their storage to be freed. Leased snapshots and the one just taken are never chosen."""
        budget = self.budget
        evicted: list[Snapshot] = []

        def over(count: int, size: int, max_count: int | None, max_bytes: int | None) -> bool:
            return (max_count is not None and count > max_count) or (max_bytes is not None and size > max_bytes)

        def evict_from(graphs: list[ToolCallGraph], max_count: int | None, max_bytes: int | None) -> None:
            count = sum(len(g.snapshot_nodes) for g in graphs)
            size = sum(g.snapshot_bytes for g in graphs)
            if not over(count, size, max_count, max_bytes):
                return
            now = self._clock()
            candidates = [
                (self.eviction.priority(node, now), g, node)
                for g in graphs
                for node in g.snapshot_nodes.values()
                if node.leases == 0 and node is not keep
            ]
            candidates.sort(key=lambda item: item[0])
            for _, owner, node in candidates:
                if not over(count, size, max_count, max_bytes):
                    break
                self.append(DetachRecord(task_id=owner.task_id, node_id=node.id))  # journal first, as above
                snapshot = owner.detach_snapshot(node)
                self._snapshots_evicted += 1
                evicted.append(snapshot)
                count -= 1
                size -= snapshot.bytes

        evict_from([graph], budget.max_snapshots_per_task, budget.max_bytes_per_task)
        if budget.max_snapshots is not None or budget.max_bytes is not None:
            self._load_all(lambda pending: pending.snapshots_changed)
            if self.pending:
                count = sum(len(g.snapshot_nodes) for g in self._graphs.values())
                size = sum(g.snapshot_bytes for g in self._graphs.values())
                for pending in self.pending.values():
                    count += len(pending.snapshots)
                    size += sum(record.snapshot.bytes for record in pending.snapshots)
                if over(count, size, budget.max_snapshots, budget.max_bytes):
                    self._load_all(lambda pending: bool(pending.snapshots))  # their snapshots are candidates too
        evict_from(list(self._graphs.values()), budget.max_snapshots, budget.max_bytes)
        return evicted

    # ------------------------------------------------------------- non-determinism marks

    def mark_nondeterministic(self, tool: str, reason: str, *, task_id: str | None = None) -> bool:
        with self._lock:
            if tool in self._nondeterministic:
                return False
            if task_id is None:
                self.append(MarkRecord(tool=tool, reason=reason))
                self._nondeterministic[tool] = reason
                return True
            tools = self._nondeterministic_in.get(task_id, {})
            if tool in tools:
                return False
            self.append(MarkRecord(tool=tool, reason=reason, task_id=task_id))
            self._nondeterministic_in.setdefault(task_id, tools)[tool] = reason
            return True

    def clear_nondeterministic(self, tool: str | None = None, *, task_id: str | None = None) -> int:
        with self._lock:
            cleared: list[tuple[str, str | None]] = []
            if task_id is None:
                cleared.extend((name, None) for name in self._nondeterministic if tool in (None, name))
            for marked_in, tools in self._nondeterministic_in.items():
                if task_id in (None, marked_in):
                    cleared.extend((name, marked_in) for name in tools if tool in (None, name))
            for name, scope in cleared:
                self.append(ClearRecord(tool=name, task_id=scope))
                self.forget_mark(name, scope)
            return len(cleared)

    def forget_mark(self, tool: str, task_id: str | None) -> None:
        """Lift one mark in memory (the caller journals it, or is replaying the journal)."""
        if task_id is None:
            self._nondeterministic.pop(tool, None)
            self._checks_claimed = {pair for pair in self._checks_claimed if pair[1] != tool}
            self._checks_passed = {pair for pair in self._checks_passed if pair[1] != tool}
            return
        tools = self._nondeterministic_in.get(task_id)
        if tools is not None:
            tools.pop(tool, None)
            if not tools:
                del self._nondeterministic_in[task_id]
        self._checks_claimed.discard((task_id, tool))  # cached again: its next first hit is checked again
        self._checks_passed.discard((task_id, tool))

    def nondeterministic_marks(self, task_id: str | None = None) -> list[NondeterminismMark]:
        with self._lock:
            marks = [NondeterminismMark(tool=t, task_id=None, reason=r) for t, r in self._nondeterministic.items()]
            for task, tools in self._nondeterministic_in.items():
                if task_id is None or task == task_id:
                    marks.extend(NondeterminismMark(tool=t, task_id=task, reason=r) for t, r in tools.items())
            return marks

    def is_marked(self, tool: str, task_id: str | None = None) -> bool:
        if tool in self._nondeterministic:
            return True
        return task_id is not None and tool in self._nondeterministic_in.get(task_id, ())

    def replace_marks(self, tool_wide: dict[str, str], scoped: dict[str, dict[str, str]]) -> None:
        """Hold exactly these marks, in memory only (a replica of a server's, which keeps them durably)."""
        with self._lock:
            self._nondeterministic = dict(tool_wide)
            self._nondeterministic_in = {task: dict(tools) for task, tools in scoped.items()}

    # ------------------------------------------------------------- first-hit checks

    def claim_check(self, task_id: str, tool: str) -> bool:
        with self._lock:
            key = (task_id, tool)
            if key in self._checks_claimed:
                return False
            self._checks_claimed.add(key)
            return True

    def pass_check(self, task_id: str, tool: str) -> None:
        with self._lock:
            if (task_id, tool) in self._checks_passed:
                return
            try:
                self.append(CheckedRecord(task_id=task_id, tool=tool))
            except JournalError as error:  # losing it costs one more check after a reopen, never a wrong answer
                warnings.warn(f"{error} (a passed first-hit check stays in memory only)", JournalWarning, stacklevel=3)
                return
            self._checks_passed.add((task_id, tool))

    def release_check(self, task_id: str, tool: str) -> None:
        with self._lock:
            self._checks_claimed.discard((task_id, tool))

    # ------------------------------------------------------------- durability

    def append(self, record: Record) -> None:
        """Journal ``record`` (nothing for an in-memory store); JournalError when the journal refuses it."""
        if self.journal is not None:
            self.journal.append(record.to_json())
            self.records_since_checkpoint += 1

    def apply(self, record: Record) -> None:
        """Replay one journal record into memory (``durable.load``)."""
        if isinstance(record, MarkRecord):
            if record.task_id is None:
                self._nondeterministic[record.tool] = record.reason
            else:
                check_task_id(record.task_id)
                self._nondeterministic_in.setdefault(record.task_id, {})[record.tool] = record.reason
        elif isinstance(record, CheckedRecord):
            check_task_id(record.task_id)
            self._checks_claimed.add((record.task_id, record.tool))
            self._checks_passed.add((record.task_id, record.tool))
        elif isinstance(record, ClearRecord):
            if record.task_id is not None:
                check_task_id(record.task_id)
            self.forget_mark(record.tool, record.task_id)
        else:
            durable.apply_to_graph(self, self.graph(record.task_id), record)

    def checked(self) -> list[tuple[str, str]]:
        """The (task, tool) pairs whose first-hit check passed and was journaled, sorted."""
        with self._lock:
            return sorted(self._checks_passed)

    def records(self) -> Iterator[Record]:
        """The current state as journal records (what compaction writes)."""
        return durable.records(self)

    def compact(self, *, warn: bool = True) -> int:
        """Rewrite the journal to hold only the live state; returns the number of records written."""
        return durable.compact(self, warn=warn)

    # ------------------------------------------------------------- inspection and lifetime

    def stats(self) -> StoreStats:
        with self._lock:
            self._load_all(lambda pending: bool(pending.deferred))  # the checkpoint's counts are theirs no longer
            graphs = self._graphs.values()
            pending = self.pending.values()
            return StoreStats(
                tasks=len(self._graphs) + len(self.pending),
                nodes=sum(len(g) - 1 for g in graphs) + sum(p.section.nodes for p in pending),
                snapshots=sum(len(g.snapshot_nodes) for g in graphs) + sum(len(p.snapshots) for p in pending),
                snapshot_bytes=sum(g.snapshot_bytes for g in graphs)
                + sum(record.snapshot.bytes for p in pending for record in p.snapshots),
                snapshots_taken=self._snapshots_taken,
                snapshots_evicted=self._snapshots_evicted,
            )

    def check_invariants(self) -> None:
        with self._lock:
            for graph in self.graphs():
                graph.check_invariants()

    def leased(self) -> bool:
        """Whether any snapshot is leased."""
        with self._lock:
            return any(node.leases for g in self._graphs.values() for node in g.nodes())

    def close(self) -> None:
        """Close the journal; first compact (and so write a checkpoint) when ``CHECKPOINT_TAIL`` records or more
        are not in one, unless ``compact_on_open=False``. A compaction that fails only costs a warning."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._compact_automatically and durable.checkpoint_due(self):
                try:
                    durable.compact(self, warn=True)
                except JournalError as error:  # optional: the journal is whole as it is (a full disk, say)
                    warnings.warn(f"{error}; closing without compacting", JournalWarning, stacklevel=3)
        finally:
            if self.checkpoint is not None:
                self.checkpoint.close()
                self.checkpoint = None
            if self.journal is not None:
                self.journal.close()
            self._cleanup()

    def __repr__(self) -> str:
        where = "memory" if self.journal is None else str(self.root)
        return f"<LocalStore {where} tasks={len(self._graphs) + len(self.pending)}>"


def call_key(graph: ToolCallGraph, state: Node, call: ToolCall) -> ClaimKey:
    return (graph.task_id, state.id, call.digest)


def _remove_memory_store(root: Path, owners: SnapshotOwners) -> None:
    owners.free_all()
    shutil.rmtree(root, ignore_errors=True)
