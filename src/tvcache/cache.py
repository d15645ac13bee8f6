"""The cache: the tool call graphs of many tasks, their snapshots, budgets, durability and audits.

``Cache()`` keeps everything in memory (snapshots in a private temporary directory removed on close);
``Cache(path=...)`` journals every insert before acknowledging it and reloads on the next open. Rollouts talk
to the cache through sessions (``tvcache.session``); this module holds the shared, thread-safe state they use.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .calls import ToolCall, ToolSpec, canonical_json, stable_digest
from .errors import InvalidTaskId, InvalidToolCall, JournalError, SandboxError, UnknownTool
from .graph import Lease, Node, ToolCallGraph
from .journal import Journal, JournalWarning
from .policies import Budget, CostAwareSnapshots, CostModel, EvictionPolicy, LowReuseFirst, SnapshotPolicy
from .protocol import Outcome, SandboxFactory, Snapshot, discard_snapshot_files, snapshot_inside
from .recovery import (
    DamagedRecord,
    JournalRecovery,
    LoadNotes,
    lost_calls,
    marks_to_recover,
    read_damage,
    remove_orphan_snapshots,
)
from .results import AuditFinding, CacheStats, NondeterminismMark
from .snapshots.publication import PUBLISHED, publication_available, release_dropped

if TYPE_CHECKING:
    from .session import Session, SyncSession

__all__ = ["Cache", "NondeterminismWarning"]

MAX_TASK_ID = 1024
_COUNTERS = (
    "hits",
    "misses",
    "coalesced",
    "uncacheable",
    "sandboxes_started",
    "sandboxes_forked",
    "forks_failed",
    "snapshots_taken",
    "snapshots_declined",
    "snapshots_evicted",
    "calls_replayed",
    "audits",
    "audit_disagreements",
    "replay_divergences",
    "verified",
)


class NondeterminismWarning(UserWarning):
    """A tool served from cache returned different results for the same call in the same state."""


InflightKey = tuple[str, int, bytes]


class Cache:
    """Tool call graphs of many tasks, shared by concurrent rollout sessions (threads or tasks).

    A process frees only storage it made: an evicted snapshot one of its sessions took is freed by the factory
    that made it, from the record that factory returned. Any other record (reloaded from the journal, handed back
    by a server any client writes to) is only a claim about where storage is, so by default only a path that
    really lies in this cache's snapshot directory is freed, and the rest is forgotten (``_release_foreign``).
    ``discard`` replaces that default for such records; ``verify_snapshots=False`` keeps journaled snapshots
    whose files this process cannot see. A server sets both: its snapshots belong to its clients, to whom it
    hands evicted records back (``tvcache.server``).

    Non-determinism is guarded three ways: a replay compares every call it re-executes with its cached result;
    ``verify_undeclared`` (on by default) executes once more, and compares, the first result of each tool whose
    determinism nobody declared (``ToolSpec(deterministic=None)``) that would be served from cache in a task;
    ``audit_rate`` re-executes that fraction of all hits in a fresh sandbox. A disagreement marks the tool
    non-deterministic in that task (``nondeterministic_marks``, ``clear_nondeterministic``).
    """

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        tools: Iterable[ToolSpec] = (),
        snapshot_policy: SnapshotPolicy | None = None,
        eviction: EvictionPolicy | None = None,
        budget: Budget | None = None,
        audit_rate: float = 0.0,
        audit_seed: int | None = 0,
        verify_undeclared: bool = True,
        fsync: bool = False,
        compact_on_open: bool = True,
        clock: Callable[[], float] = time.monotonic,
        discard: Callable[[Snapshot], None] | None = None,
        verify_snapshots: bool = True,
    ) -> None:
        if not 0.0 <= audit_rate <= 1.0:
            raise ValueError(f"audit_rate must be between 0 and 1, got {audit_rate}")
        self._lock = threading.RLock()
        self._clock = clock
        self._graphs: dict[str, ToolCallGraph] = {}
        self._unforkable_here: set[str] = set()  # paths of snapshots whose fork failed in this process
        self._specs: dict[str, ToolSpec] = {spec.name: spec for spec in tools}
        # Tools never served from cache: in every task (declared, or journaled before marks were scoped), and per
        # task where a replay, audit or first-hit check saw one disagree (task -> tool -> evidence).
        self._nondeterministic: dict[str, str] = {}
        self._nondeterministic_in: dict[str, dict[str, str]] = {}
        # (task, tool) pairs whose first-hit check has been done or is running; those done and agreeing are
        # journaled (``_checked``), so a reopened cache — a proxy runs one process per connection — does not
        # start a sandbox on every open just to check again what it already checked.
        self._verified: set[tuple[str, str]] = set()
        self._checked: set[tuple[str, str]] = set()
        self._inflight: dict[InflightKey, Future[Node | None]] = {}
        self._costs: dict[str, CostModel] = {}
        self._discarders: dict[str, Callable[[Snapshot], None]] = {}
        # Snapshots this process's sessions made: path -> (the record their factory returned, its discard).
        self._owners: dict[str, tuple[Snapshot, Callable[[Snapshot], None]]] = {}
        # Backends that can release what a record they did not make holds in their own storage (a published
        # snapshot's references in their store): kind -> ``factory.discard_foreign``.
        self._foreign_discarders: dict[str, Callable[[Snapshot], None]] = {}
        self._forgotten = 0  # evicted records naming storage this process does not own, left alone
        # How evicted records this process did not make are handled (None: ``_release_foreign``), and whether
        # reloading checks their files: a server holds snapshots its clients own, so it neither deletes nor
        # checks them (tvcache.server).
        self._discard_default = discard
        self._verify_snapshots = verify_snapshots
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._seconds_executed = 0.0
        self._seconds_saved = 0.0
        self._findings: list[AuditFinding] = []
        self._sessions: weakref.WeakSet[Session] = weakref.WeakSet()
        self.snapshot_policy: SnapshotPolicy = snapshot_policy or CostAwareSnapshots()
        self.eviction: EvictionPolicy = eviction or LowReuseFirst()
        self.budget = budget or Budget()
        self.audit_rate = audit_rate
        self.verify_undeclared = verify_undeclared
        self._audit_rng = random.Random(audit_seed)
        self._closed = False
        self._journal: Journal | None = None
        self._recovery: JournalRecovery | None = None
        self._unapplied: list[tuple[int, dict[str, Any]]] = []  # loaded records that no longer apply
        if path is None:
            self.root = Path(tempfile.mkdtemp(prefix="tvcache-"))
            # Its snapshots die with it, each freed by the factory that made it (a docker image lives outside
            # the directory), at close or when the process exits.
            self._cleanup = weakref.finalize(self, _remove_memory_cache, self.root, self._owners)
        else:
            self.root = Path(path)
            self._cleanup = weakref.finalize(self, lambda: None)
        self.snapshot_root = self.root / "snapshots"
        if path is not None:
            self._journal = Journal(self.root, fsync=fsync)
            self._load(compact=compact_on_open)

    # ------------------------------------------------------------- sessions

    def session(self, task_id: str, *, sandbox: SandboxFactory) -> Session:
        """A rollout session of ``task_id`` (async context manager). Sandboxes are created only on a miss."""
        from .session import Session

        session = Session(self, task_id, sandbox)
        with self._lock:
            self._sessions.add(session)
        return session

    def session_sync(self, task_id: str, *, sandbox: SandboxFactory) -> SyncSession:
        """The blocking twin of ``session`` (a context manager running its own event loop)."""
        from .session import SyncSession

        return SyncSession(self.session(task_id, sandbox=sandbox))

    # ---------------------------------------------------------------- tasks

    def graph(self, task_id: str) -> ToolCallGraph:
        """The graph of ``task_id``, created empty on first use."""
        with self._lock:
            graph = self._graphs.get(task_id)
            if graph is None:
                _check_task_id(task_id)
                graph = self._graphs[task_id] = ToolCallGraph(task_id, clock=self._clock)
            return graph

    def tasks(self) -> list[str]:
        with self._lock:
            return list(self._graphs)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._graphs

    # ---------------------------------------------------------------- tools

    def spec(self, name: str, factory: SandboxFactory | None = None) -> ToolSpec:
        """The spec of tool ``name``: the cache's declaration wins over the sandbox's."""
        spec = self._specs.get(name)
        if spec is None and factory is not None:
            spec = factory.tools.get(name)
        if spec is None:
            known = set(self._specs) | (set(factory.tools) if factory is not None else set())
            raise UnknownTool(name, list(known))
        return spec

    def is_deterministic(self, spec: ToolSpec, task_id: str | None = None) -> bool:
        """Whether ``spec``'s results may be served from cache (in ``task_id``, when given): not declared
        non-deterministic and not marked so, tool-wide or in that task."""
        if spec.deterministic is False or spec.name in self._nondeterministic:
            return False
        return task_id is None or spec.name not in self._nondeterministic_in.get(task_id, ())

    @property
    def nondeterministic_tools(self) -> dict[str, str]:
        """Tools marked non-deterministic in every task, with the evidence (see ``nondeterministic_marks`` for
        the marks scoped to one task)."""
        with self._lock:
            return dict(self._nondeterministic)

    def nondeterministic_marks(self, task_id: str | None = None) -> list[NondeterminismMark]:
        """Every non-determinism mark, tool-wide ones first; with ``task_id``, those that apply in that task."""
        with self._lock:
            marks = [NondeterminismMark(tool=t, task_id=None, reason=r) for t, r in self._nondeterministic.items()]
            for task, tools in self._nondeterministic_in.items():
                if task_id is None or task == task_id:
                    marks.extend(NondeterminismMark(tool=t, task_id=task, reason=r) for t, r in tools.items())
            return marks

    def mark_nondeterministic(self, tool: str, reason: str) -> None:
        """Never serve ``tool`` from cache again, in any task (persisted). Evidence seen in one task marks the
        tool in that task only (``_mark_nondeterministic_in``)."""
        with self._lock:
            if tool in self._nondeterministic:
                return
            self._append({"t": "nondet", "tool": tool, "why": reason})
            self._nondeterministic[tool] = reason
        warnings.warn(
            f"tool {tool!r} is non-deterministic ({reason}); it will be executed on every call from now on",
            NondeterminismWarning,
            stacklevel=3,
        )

    def _mark_nondeterministic_in(self, task_id: str, tool: str, reason: str) -> None:
        """Never serve ``tool`` from cache again in task ``task_id`` (persisted): the evidence (one call that
        gave two results in one state of this task) says nothing about other tasks, whose environments may
        differ; their own first-hit checks and replays judge the tool there."""
        with self._lock:
            tools = self._nondeterministic_in.get(task_id, {})
            if tool in tools or tool in self._nondeterministic:
                return
            self._append({"t": "nondet", "tool": tool, "why": reason, "task": task_id})
            self._nondeterministic_in.setdefault(task_id, tools)[tool] = reason
        warnings.warn(
            f"tool {tool!r} is non-deterministic in task {task_id!r} ({reason}); it will be executed on every "
            "call of that task from now on",
            NondeterminismWarning,
            stacklevel=3,
        )

    def clear_nondeterministic(self, tool: str | None = None, *, task_id: str | None = None) -> int:
        """Forget non-determinism marks (persisted), so the tool is cached (and checked) again; returns how many
        were cleared. ``tool`` and ``task_id`` filter (None: any); a tool-wide mark has no task, so it is cleared
        only when ``task_id`` is None. The tools' own ``ToolSpec(deterministic=False)`` declarations stay."""
        with self._lock:
            cleared: list[tuple[str, str | None]] = []
            if task_id is None:
                cleared.extend((name, None) for name in self._nondeterministic if tool in (None, name))
            for marked_in, tools in self._nondeterministic_in.items():
                if task_id in (None, marked_in):
                    cleared.extend((name, marked_in) for name in tools if tool in (None, name))
            for name, scope in cleared:
                self._append({"t": "det", "tool": name, "task": scope})
                self._forget_mark(name, scope)
            return len(cleared)

    def _forget_mark(self, tool: str, task_id: str | None) -> None:
        if task_id is None:
            self._nondeterministic.pop(tool, None)
            self._verified = {pair for pair in self._verified if pair[1] != tool}
            self._checked = {pair for pair in self._checked if pair[1] != tool}
            return
        tools = self._nondeterministic_in.get(task_id)
        if tools is not None:
            tools.pop(tool, None)
            if not tools:
                del self._nondeterministic_in[task_id]
        self._verified.discard((task_id, tool))  # cached again: its next first hit is checked again
        self._checked.discard((task_id, tool))

    def costs(self, factory: SandboxFactory) -> CostModel:
        """The measured costs of a backend, seeded with its hints until measured."""
        with self._lock:
            model = self._costs.get(factory.kind)
            if model is None:
                hints: Mapping[str, float] = getattr(factory, "cost_hints", {})
                model = self._costs[factory.kind] = CostModel(
                    start=hints.get("start", 0.0),
                    fork=hints.get("fork", 0.0),
                    snapshot=hints.get("snapshot", 0.0),
                )
            self._discarders.setdefault(factory.kind, factory.discard)
            discard_foreign = getattr(factory, "discard_foreign", None)
            if discard_foreign is not None:
                self._foreign_discarders.setdefault(factory.kind, discard_foreign)
            return model

    # ------------------------------------------------- operations for sessions
    # Sessions reach the shared state only through the methods below (and ``graph``, ``costs``, ``spec``,
    # ``is_deterministic``), so another store — a remote server — can stand behind the same session logic by
    # providing them.

    def _lookup(self, graph: ToolCallGraph, state: Node, call: ToolCall) -> Node | None:
        with self._lock:
            node = state.step(call)
            if node is not None:
                graph.touch(node)
            return node

    def _touch(self, graph: ToolCallGraph, node: Node) -> None:
        with self._lock:
            graph.touch(node)

    def _claim(self, graph: ToolCallGraph, state: Node, call: ToolCall) -> tuple[bool, Future[Node | None]]:
        """Claim the execution of a missed call, or join the session already executing it.

        Returns (True, future) to the one session that must execute and resolve the future, (False, future)
        to every other session missing on the same call in the same state, which waits for it.
        """
        with self._lock:
            return self._join((graph.task_id, state.id, call.digest), state.step(call))

    def _resolve(
        self, graph: ToolCallGraph, state: Node, call: ToolCall, node: Node | None, error: BaseException | None
    ) -> None:
        self._settle((graph.task_id, state.id, call.digest), node, error)

    def _join(self, key: InflightKey, ready: Node | None) -> tuple[bool, Future[Node | None]]:
        """The in-flight future for ``key`` (the caller holds the lock): already resolved when ``ready``."""
        if ready is not None:  # finished while the caller was getting here
            done: Future[Node | None] = Future()
            done.set_result(ready)
            return False, done
        future = self._inflight.get(key)
        if future is not None:
            return False, future
        future = self._inflight[key] = Future()
        # Running futures cannot be cancelled: one waiter giving up must not cancel the call for everyone.
        future.set_running_or_notify_cancel()
        return True, future

    def _settle(self, key: InflightKey, node: Node | None, error: BaseException | None) -> None:
        with self._lock:
            future = self._inflight.pop(key, None)
        if future is None:
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(node)

    def _record(
        self,
        graph: ToolCallGraph,
        state: Node,
        call: ToolCall,
        outcome: Outcome,
        seconds: float,
        read_only: bool,
    ) -> Node:
        """Insert an executed call; journaled before it is inserted and returned (that is the acknowledgement).
        If the journal cannot take it, nothing is inserted and the error propagates."""
        try:
            outcome.output.encode()
        except UnicodeEncodeError as error:
            raise SandboxError(
                f"the sandbox returned output for {call} that is not valid Unicode ({error.reason}); backends "
                "must decode tool output with errors='replace'"
            ) from error
        with self._lock:
            existing = state.step(call)
            if existing is not None:
                return existing
            node_id = graph.next_id
            self._append(
                {
                    "t": "n",
                    "task": graph.task_id,
                    "id": node_id,
                    "p": state.id,
                    "name": call.name,
                    "a": call.canonical_arguments.decode(),
                    "o": outcome.output,
                    "e": outcome.is_error,
                    "s": seconds,
                    "r": read_only,
                }
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

    def _claim_test(self, graph: ToolCallGraph, node: Node, key: str) -> tuple[bool, Future[Node | None]]:
        """Like ``_claim`` for an end-of-rollout check: sessions finishing in the same state run it once.
        A waiter's future resolves when the owner has recorded the value (or failed); it then looks again."""
        with self._lock:
            ready = node if node.tests is not None and key in node.tests else None
            return self._join(_test_key(graph, node, key), ready)

    def _resolve_test(self, graph: ToolCallGraph, node: Node, key: str, error: BaseException | None) -> None:
        self._settle(_test_key(graph, node, key), node, error)

    def _lookup_test(self, graph: ToolCallGraph, node: Node, key: str) -> tuple[bool, Any]:
        with self._lock:
            if node.tests is not None and key in node.tests:
                return True, node.tests[key]
            return False, None

    def _wants_snapshot(self, graph: ToolCallGraph, node: Node, costs: CostModel) -> bool:
        with self._lock:
            return self.snapshot_policy.should_snapshot(graph, node, costs)

    def _record_test(self, graph: ToolCallGraph, node: Node, key: str, value: Any) -> None:
        try:
            canonical_json(value)
        except InvalidToolCall as error:
            raise InvalidToolCall(f"test {key!r} returned a value that is not JSON: {error}") from error
        with self._lock:
            graph.set_test(node, key, value)
            self._append({"t": "test", "task": graph.task_id, "id": node.id, "k": key, "v": value})

    def _lease_snapshot(self, state: Node, kind: str, *, skip: frozenset[str] = frozenset()) -> Lease | None:
        """Lease the deepest snapshot of backend ``kind`` at or above ``state``, passing over those whose path is
        in ``skip`` or that failed to fork in this process."""
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

    def _unforkable(self, snapshot: Snapshot) -> None:
        """Leave ``snapshot`` alone in this process from now on: forking it failed here for a reason that may be
        this process's own (see :class:`SnapshotUnusable` for the failures that drop a snapshot everywhere).
        Keyed by path, which is unique to each snapshot taken."""
        with self._lock:
            self._unforkable_here.add(snapshot.path)

    def _release(self, lease: Lease) -> None:
        with self._lock:
            lease.release()

    def _snapshot_path(self, task_id: str, node: Node) -> Path:
        directory = self.snapshot_root / stable_digest(task_id.encode()).hex()[:20]
        directory.mkdir(parents=True, exist_ok=True)
        return directory / f"{node.id}-{random.getrandbits(32):08x}"

    def _remember_owner(self, snapshot: Snapshot, factory: SandboxFactory) -> None:
        """Evicting ``snapshot`` frees it through the factory that made it (two factories of one backend kind
        keep separate storage), from this record: the one evicted may have come back over the wire."""
        with self._lock:
            self._owners[snapshot.path] = (snapshot, factory.discard)

    def _free_snapshot(self, snapshot: Snapshot) -> None:
        """Free an evicted snapshot's storage if this process made it; hand any other record to ``discard``."""
        with self._lock:
            owned = self._owners.pop(snapshot.path, None)
        if owned is not None:
            record, discard = owned
            discard(record)
        elif self._discard_default is not None:
            self._discard_default(snapshot)
        else:
            self._release_foreign(snapshot)

    def _release_foreign(self, snapshot: Snapshot) -> None:
        """An evicted record no session of this process made: a reopened cache's journal, or a server's answer
        (any of its clients may have written it, naming any path). Never delete what it names unless it lies in
        this cache's snapshot directory, symlinks resolved:

        - a durable cache's own directory: what its journal records there, an earlier process of this cache
          made, so its backend frees it as if made here;
        - anywhere else in the snapshot directory (clients on one machine sharing a ``snapshot_dir``): only the
          verified path is removed, since the record's ``meta`` (layers, images) is not this process's to trust;
        - a backend with ``discard_foreign`` releases what it can verify in its own storage (a published
          snapshot's references in its store);
        - nothing else is touched: the record is forgotten (with a warning the first time, unless its data is
          published: that lives in a store, not on this machine).
        """
        inside = snapshot_inside(snapshot, self.snapshot_root)
        with self._lock:
            discard = self._discarders.get(snapshot.kind)
            foreign = self._foreign_discarders.get(snapshot.kind)
        if inside is not None and self._journal is not None:
            (discard or discard_snapshot_files)(snapshot)
            return
        if foreign is not None:
            foreign(snapshot)
        if inside is not None:
            discard_snapshot_files(snapshot, root=self.snapshot_root)
        elif PUBLISHED not in snapshot.meta:  # a published one's data is in a store, released above
            with self._lock:
                self._forgotten += 1
                first = self._forgotten == 1
            if first:
                warnings.warn(
                    f"not deleting {snapshot.path!r}, an evicted {snapshot.kind!r} snapshot this process did not "
                    f"make and that is not in its snapshot directory {str(self.snapshot_root)!r}: a snapshot record "
                    "names storage, it does not prove whose it is. Such records are forgotten (this warning is "
                    "given once); point the processes of one machine at one snapshot directory so that whichever "
                    "evicts a snapshot frees it",
                    RuntimeWarning,
                    stacklevel=3,
                )

    def _attach_snapshot(self, graph: ToolCallGraph, node: Node, snapshot: Snapshot) -> bool:
        """Attach ``snapshot`` to ``node``; returns whether it was. It is not, and goes back to be freed, when the
        node holds a snapshot already (a concurrent session got there first)."""
        with self._lock:
            if node.snapshot is not None:
                evicted = [snapshot]
                attached = False
            else:
                attached = True
                graph.attach_snapshot(node, snapshot)
                try:
                    self._append({"t": "s", "task": graph.task_id, "id": node.id, "snap": snapshot.to_json()})
                except BaseException:
                    # Memory must never hold what the journal does not (a restart would lose it, and until then
                    # the node refuses every other snapshot): undo the attach, the caller keeps its snapshot.
                    graph.detach_snapshot(node)
                    raise
                self._counters["snapshots_taken"] += 1
                evicted = self._enforce_budget(graph, keep=node)
        for old in evicted:
            self._free_snapshot(old)
        return attached

    def _drop_snapshot(self, graph: ToolCallGraph, node: Node) -> None:
        """Evict a snapshot that turned out unusable (its fork failed), unless someone else holds a lease."""
        with self._lock:
            if node.snapshot is None or node.leases:
                return
            snapshot = graph.detach_snapshot(node)
            self._append({"t": "x", "task": graph.task_id, "id": node.id})
            self._counters["snapshots_evicted"] += 1
        self._free_snapshot(snapshot)

    def _detach_snapshot(self, graph: ToolCallGraph, node: Node) -> Snapshot:
        """Forget a node's snapshot without freeing its storage (its owner moved it on); journaled."""
        with self._lock:
            snapshot = graph.detach_snapshot(node)
            self._append({"t": "x", "task": graph.task_id, "id": node.id})
            return snapshot

    def _remove(self, graph: ToolCallGraph, node: Node) -> list[Snapshot]:
        """Forget ``node`` and everything below it (journaled first); returns the snapshots they held, for their
        owners to free. Refuses (ValueError, nothing changed) the root and subtrees holding a leased snapshot."""
        with self._lock:
            graph.check_removable(node)
            self._append({"t": "rm", "task": graph.task_id, "id": node.id})
            return graph.remove(node)

    def _enforce_budget(self, graph: ToolCallGraph, *, keep: Node) -> list[Snapshot]:
        """Evict snapshots until the budget holds; returns the evicted snapshots for their storage to be freed.
        Leased snapshots and the one just taken are never chosen."""
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
                self._append({"t": "x", "task": owner.task_id, "id": node.id})  # journal first, as above
                snapshot = owner.detach_snapshot(node)
                self._counters["snapshots_evicted"] += 1
                evicted.append(snapshot)
                count -= 1
                size -= snapshot.bytes

        evict_from([graph], budget.max_snapshots_per_task, budget.max_bytes_per_task)
        evict_from(list(self._graphs.values()), budget.max_snapshots, budget.max_bytes)
        return evicted

    def _count(self, counter: str, amount: int = 1) -> None:
        with self._lock:
            self._counters[counter] += amount

    def _account(self, *, executed: float = 0.0, saved: float = 0.0) -> None:
        with self._lock:
            self._seconds_executed += executed
            self._seconds_saved += saved

    def _should_audit(self) -> bool:
        if self.audit_rate <= 0.0:
            return False
        with self._lock:
            return self._audit_rng.random() < self.audit_rate

    def _claim_verification(self, task_id: str, spec: ToolSpec) -> bool:
        """True once per task and undeclared tool (``spec.deterministic is None``), to the session that is to
        check that tool's first hit in the task; False when checks are off, the tool is declared, or it was
        (or is being) checked already."""
        if not self.verify_undeclared or spec.deterministic is not None:
            return False
        with self._lock:
            key = (task_id, spec.name)
            if key in self._verified:
                return False
            self._verified.add(key)
            return True

    def _passed_verification(self, task_id: str, tool: str) -> None:
        """The first-hit check agreed: journaled, so a reopened cache does not check that tool in the task again."""
        with self._lock:
            if (task_id, tool) in self._checked:
                return
            try:
                self._append({"t": "checked", "task": task_id, "tool": tool})
            except JournalError as error:  # losing it costs one more check after a reopen, never a wrong answer
                warnings.warn(f"{error} (a passed first-hit check stays in memory only)", JournalWarning, stacklevel=2)
                return
            self._checked.add((task_id, tool))

    def _release_verification(self, task_id: str, tool: str) -> None:
        """The check could not run (the sandbox failed, the session was cancelled): a later hit tries again."""
        with self._lock:
            self._verified.discard((task_id, tool))

    def _report_audit(self, finding: AuditFinding) -> None:
        with self._lock:
            self._findings.append(finding)
            self._counters["audits"] += 1
            if not finding.agrees:
                self._counters["audit_disagreements"] += 1
        if not finding.agrees:
            self._mark_nondeterministic_in(
                finding.task_id,
                finding.call.name,
                f"audit of node {finding.node_id}: cached and fresh results differ",
            )

    def _report_divergence(self, task_id: str, node: Node, output: str, *, source: str = "replay") -> None:
        """Re-executing a cached call in its state gave another result (``source``: a "replay", the "first-hit"
        check, or a "record" that found the call recorded with another result): the tool is not deterministic,
        in this task at least. Counted, kept as a finding, and the tool marked in the task."""
        assert node.call is not None
        self._count("replay_divergences")
        with self._lock:
            self._findings.append(
                AuditFinding(
                    task_id=task_id,
                    node_id=node.id,
                    call=node.call,
                    cached_output=node.output,
                    fresh_output=output,
                    source=source,
                )
            )
        what = {"replay": "a replay", "first-hit": "the first-hit check", "record": "a second execution"}
        self._mark_nondeterministic_in(
            task_id, node.call.name, f"{what.get(source, source)} of node {node.id} gave another result"
        )

    # ------------------------------------------------------------ inspection

    @property
    def findings(self) -> list[AuditFinding]:
        """Audit results, replay divergences and first-hit checks that disagreed, oldest first."""
        with self._lock:
            return list(self._findings)

    def stats(self) -> CacheStats:
        with self._lock:
            counters = dict(self._counters)
            return CacheStats(
                tasks=len(self._graphs),
                nodes=sum(len(g) - 1 for g in self._graphs.values()),
                snapshots=sum(len(g.snapshot_nodes) for g in self._graphs.values()),
                snapshot_bytes=sum(g.snapshot_bytes for g in self._graphs.values()),
                seconds_executed=self._seconds_executed,
                seconds_saved=self._seconds_saved,
                nondeterministic=tuple(self.nondeterministic_marks()),
                **counters,
            )

    def check_invariants(self) -> None:
        with self._lock:
            for graph in self._graphs.values():
                graph.check_invariants()
            if any(node.leases for g in self._graphs.values() for node in g.nodes()) and not self._sessions:
                raise AssertionError("snapshots are leased while no session is open")

    # ---------------------------------------------------------- durability

    def _append(self, record: dict[str, Any]) -> None:
        if self._journal is not None:
            self._journal.append(record)

    def _load(self, *, compact: bool) -> None:
        """Replay the journal, then deal with what it held besides intact records (``_recover``). If the cache
        cannot open, the journal is closed again before the error propagates."""
        journal = self._journal
        assert journal is not None
        notes = LoadNotes()
        records = 0
        errors: list[BaseException] = []
        try:
            for line, record in journal.load():
                records += 1
                notes.note(line, record)
                try:
                    self._apply(record)
                except (KeyError, ValueError, TypeError, InvalidToolCall) as error:
                    self._unapplied.append((line, record))
                    errors.append(error)
            self._recover(journal, notes, errors)
            self._remove_leftovers(journal, notes)  # before a compaction moves damaged lines out of sight
            live = sum(len(g) for g in self._graphs.values()) + len(self.nondeterministic_marks())
            if compact and records > 2 * live + 1000:
                try:
                    self._compact(warn=False)
                except JournalError as error:  # optional: the journal is whole as it is (a full disk, say)
                    warnings.warn(f"{error}; opening without compacting", JournalWarning, stacklevel=3)
        except BaseException:
            journal.close()
            raise
        assert self._recovery is not None
        if self._recovery.lost_records or self._recovery.torn_tail or self._recovery.recovered_marks:
            warnings.warn(self._recovery.describe(), JournalWarning, stacklevel=3)

    def _recover(self, journal: Journal, notes: LoadNotes, errors: list[BaseException]) -> None:
        """Account for damage (``tvcache.recovery``): group the calls lost below missing nodes, mark again the
        tools a damaged line may have marked (JournalError when it cannot tell which), and keep new nodes off the
        ids the journal's lost records still use, so restoring a damaged line later cannot graft them elsewhere."""
        scan = journal.scan
        damaged = tuple(read_damage(line) for line in scan.damaged)
        marks = marks_to_recover(journal.path, damaged, notes)
        lost = lost_calls(
            (record for _, record in self._unapplied),
            lambda task, node: task in self._graphs and self._graphs[task].get(node) is not None,
        )
        in_groups = {(group.task_id, node) for group in lost for node in group.nodes}
        skipped = [
            error
            for (_, record), error in zip(self._unapplied, errors, strict=True)
            if record.get("t") != "n" or (record.get("task"), record.get("id")) not in in_groups
        ]
        for task, ids in _ids_by_task([record for _, record in self._unapplied], damaged).items():
            graph = self._graphs.get(task)  # never a graph for a task name read from damaged bytes
            if graph is not None:
                graph.reserve_ids(max(ids))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NondeterminismWarning)  # the recovery warning says it once
            for tool in marks:
                self.mark_nondeterministic(tool, f"a damaged journal record may have marked it ({journal.path})")
        self._recovery = JournalRecovery(
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

    def _remove_leftovers(self, journal: Journal, notes: LoadNotes) -> None:
        """Remove snapshot files a killed process wrote but never journaled. Only where this cache owns its
        snapshots (a server's belong to its clients), and never what a record, intact or damaged, may name."""
        assert self._recovery is not None
        if not self._verify_snapshots:
            return
        removed = remove_orphan_snapshots(self.snapshot_root, notes.snapshot_names, journal.scan, journal.directory)
        if removed:
            self._recovery = replace(
                self._recovery, removed=self._recovery.removed + tuple(str(path) for path in removed)
            )

    @property
    def recovery(self) -> JournalRecovery | None:
        """What opening this durable cache found and did: damaged records and what they took with them, copies
        set aside, leftovers of killed processes removed (None for an in-memory cache)."""
        with self._lock:
            return self._recovery

    def _apply(self, record: dict[str, Any]) -> None:
        kind = record["t"]
        if kind == "nondet":
            # Records without a task were written before marks were scoped, when every divergence marked the
            # tool everywhere: they keep that meaning (executing more is never wrong); clear_nondeterministic()
            # lifts them.
            tool, why, task = str(record["tool"]), str(record["why"]), record.get("task")
            if task is None:
                self._nondeterministic[tool] = why
            else:
                _check_task_id(task)
                self._nondeterministic_in.setdefault(task, {})[tool] = why
            return
        if kind == "checked":
            task, tool = record["task"], str(record["tool"])
            _check_task_id(task)
            self._verified.add((task, tool))
            self._checked.add((task, tool))
            return
        if kind == "det":
            task = record.get("task")
            if task is not None:
                _check_task_id(task)
            self._forget_mark(str(record["tool"]), task)
            return
        graph = self.graph(record["task"])
        if kind == "n":
            parent = graph.node(record["p"])
            call = ToolCall.from_json(record["name"], record["a"])
            graph.insert(
                parent,
                call,
                output=record["o"],
                is_error=bool(record["e"]),
                seconds=float(record["s"]),
                read_only=bool(record["r"]),
                node_id=int(record["id"]),
            )
        elif kind == "s":
            snapshot = Snapshot.from_json(record["snap"])
            node = graph.node(record["id"])
            # Snapshots whose data is gone are dropped; a published one's data may live on in its store.
            usable = not self._verify_snapshots or snapshot.exists() or publication_available(snapshot)
            if not usable:
                self._release_dropped(snapshot)
            elif node.snapshot is None:
                graph.attach_snapshot(node, snapshot)
        elif kind == "x":
            node = graph.node(record["id"])
            if node.snapshot is not None:
                graph.detach_snapshot(node)
        elif kind == "test":
            graph.set_test(graph.node(record["id"]), record["k"], record["v"])
        elif kind == "rm":
            graph.remove(graph.node(record["id"]))
        else:
            raise ValueError(f"unknown record type {kind!r}")

    def _release_dropped(self, snapshot: Snapshot) -> None:
        """A published record dropped on load still holds references on the blobs its store kept: no eviction
        will ever release them now, so release them here (a store that fails only costs a warning)."""
        try:
            release_dropped(snapshot)
        except SandboxError as error:
            warnings.warn(f"{self.root}: a dropped snapshot's blobs were not released: {error}", stacklevel=4)

    def _records(self) -> Iterator[dict[str, Any]]:
        """The current state as journal records (what compaction writes)."""
        for mark in self.nondeterministic_marks():
            record = {"t": "nondet", "tool": mark.tool, "why": mark.reason}
            yield record if mark.task_id is None else {**record, "task": mark.task_id}
        for task_id, tool in sorted(self._checked):
            yield {"t": "checked", "task": task_id, "tool": tool}
        for task_id, graph in self._graphs.items():
            nodes = sorted(graph.nodes(), key=lambda node: node.id)
            for node in nodes:
                if node.parent is None or node.call is None:
                    continue
                yield {
                    "t": "n",
                    "task": task_id,
                    "id": node.id,
                    "p": node.parent.id,
                    "name": node.call.name,
                    "a": node.call.canonical_arguments.decode(),
                    "o": node.output,
                    "e": node.is_error,
                    "s": node.seconds,
                    "r": node.read_only,
                }
            for node in nodes:
                if node.snapshot is not None:
                    yield {"t": "s", "task": task_id, "id": node.id, "snap": node.snapshot.to_json()}
                for key, value in (node.tests or {}).items():
                    yield {"t": "test", "task": task_id, "id": node.id, "k": key, "v": value}

    def compact(self) -> int:
        """Rewrite the journal to hold only the live state. Returns the number of records written. Damaged lines
        and the records that depended on them are copied aside first (``recovery.set_aside``, and a warning)."""
        return self._compact(warn=True)

    def _compact(self, *, warn: bool) -> int:
        if self._journal is None:
            return 0
        with self._lock:
            result = self._journal.rewrite(self._records(), lost=self._unapplied)
            self._unapplied = []
            if result.set_aside is not None and self._recovery is not None:
                self._recovery = replace(self._recovery, set_aside=(*self._recovery.set_aside, str(result.set_aside)))
        if warn and result.set_aside is not None:
            warnings.warn(
                f"{self._journal.path}: compacting dropped damaged lines and the records that depended on them; "
                f"copies are in {result.set_aside}",
                JournalWarning,
                stacklevel=3,
            )
        return result.records

    # ---------------------------------------------------------------- close

    def close(self) -> None:
        """Close the journal (and remove an in-memory cache's snapshots). Idempotent. Sessions must be closed
        first: they own sandboxes."""
        if self._closed:
            return
        self._closed = True
        open_sessions = [session for session in self._sessions if not session.closed]
        if open_sessions:
            warnings.warn(
                f"closing a cache with {len(open_sessions)} open session(s); close sessions first so their "
                "sandboxes are stopped",
                ResourceWarning,
                stacklevel=2,
            )
        if self._journal is not None:
            self._journal.close()
        self._cleanup()

    def __enter__(self) -> Cache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = "memory" if self._journal is None else str(self.root)
        return f"<Cache {where} tasks={len(self._graphs)}>"


def _remove_memory_cache(root: Path, owners: dict[str, tuple[Snapshot, Callable[[Snapshot], None]]]) -> None:
    for record, discard in list(owners.values()):
        try:
            discard(record)
        except Exception as error:  # one backend's failure must not keep the others' storage
            warnings.warn(f"freeing snapshot {record.path} at close failed: {error}", RuntimeWarning, stacklevel=1)
    owners.clear()
    shutil.rmtree(root, ignore_errors=True)


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


def _test_key(graph: ToolCallGraph, node: Node, key: str) -> InflightKey:
    return (graph.task_id, node.id, b"test\x00" + key.encode())


def _check_task_id(task_id: object) -> None:
    if not isinstance(task_id, str) or not task_id or len(task_id) > MAX_TASK_ID:
        raise InvalidTaskId(
            f"task id must be a non-empty string of at most {MAX_TASK_ID} characters, got {task_id!r:.80}"
        )
    if "\x00" in task_id:
        raise InvalidTaskId("task id must not contain NUL characters")
