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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .calls import ToolCall, ToolSpec, canonical_json, stable_digest
from .errors import InvalidTaskId, InvalidToolCall, SandboxError, UnknownTool
from .graph import Lease, Node, ToolCallGraph
from .journal import Journal
from .policies import Budget, CostAwareSnapshots, CostModel, EvictionPolicy, LowReuseFirst, SnapshotPolicy
from .protocol import Outcome, SandboxFactory, Snapshot, discard_snapshot_files
from .results import AuditFinding, CacheStats
from .snapshots.publication import publication_available, release_dropped

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
)


class NondeterminismWarning(UserWarning):
    """A tool declared deterministic returned different results for the same call in the same state."""


InflightKey = tuple[str, int, bytes]


class Cache:
    """Tool call graphs of many tasks, shared by concurrent rollout sessions (threads or tasks).

    ``discard`` frees a snapshot evicted by the budget when no session registered its backend's own
    ``discard``; ``verify_snapshots=False`` keeps journaled snapshots whose files this process cannot see.
    A server sets both: its snapshots belong to its clients (``tvcache.server``).
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
        fsync: bool = False,
        compact_on_open: bool = True,
        clock: Callable[[], float] = time.monotonic,
        discard: Callable[[Snapshot], None] = discard_snapshot_files,
        verify_snapshots: bool = True,
    ) -> None:
        if not 0.0 <= audit_rate <= 1.0:
            raise ValueError(f"audit_rate must be between 0 and 1, got {audit_rate}")
        self._lock = threading.RLock()
        self._clock = clock
        self._graphs: dict[str, ToolCallGraph] = {}
        self._unforkable_here: set[str] = set()  # paths of snapshots whose fork failed in this process
        self._specs: dict[str, ToolSpec] = {spec.name: spec for spec in tools}
        self._nondeterministic: dict[str, str] = {}
        self._inflight: dict[InflightKey, Future[Node | None]] = {}
        self._costs: dict[str, CostModel] = {}
        self._discarders: dict[str, Callable[[Snapshot], None]] = {}
        self._owners: dict[str, Callable[[Snapshot], None]] = {}  # snapshot path -> its factory's discard
        # How snapshots of backends no session registered are freed, and whether reloading checks their files:
        # a server holds snapshots its clients own, so it neither deletes nor checks them (tvcache.server).
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
        self._audit_rng = random.Random(audit_seed)
        self._closed = False
        self._journal: Journal | None = None
        if path is None:
            self.root = Path(tempfile.mkdtemp(prefix="tvcache-"))
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.root, True)
        else:
            self.root = Path(path)
            self._cleanup = weakref.finalize(self, lambda: None)
            self._journal = Journal(self.root, fsync=fsync)
            self._load(compact=compact_on_open)
        self.snapshot_root = self.root / "snapshots"

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

    def is_deterministic(self, spec: ToolSpec) -> bool:
        return spec.deterministic and spec.name not in self._nondeterministic

    @property
    def nondeterministic_tools(self) -> dict[str, str]:
        """Tools found non-deterministic at run time, with the evidence."""
        with self._lock:
            return dict(self._nondeterministic)

    def mark_nondeterministic(self, tool: str, reason: str) -> None:
        """Never serve ``tool`` from cache again (persisted)."""
        with self._lock:
            if tool in self._nondeterministic:
                return
            self._nondeterministic[tool] = reason
            self._append({"t": "nondet", "tool": tool, "why": reason})
        warnings.warn(
            f"tool {tool!r} is non-deterministic ({reason}); it will be executed on every call from now on",
            NondeterminismWarning,
            stacklevel=3,
        )

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
        keep separate storage)."""
        with self._lock:
            self._owners[snapshot.path] = factory.discard

    def _discarder_for(self, snapshot: Snapshot) -> Callable[[Snapshot], None]:
        with self._lock:
            owner = self._owners.pop(snapshot.path, None)
            return owner or self._discarders.get(snapshot.kind, self._discard_default)

    def _attach_snapshot(self, graph: ToolCallGraph, node: Node, snapshot: Snapshot) -> None:
        with self._lock:
            if node.snapshot is not None:  # a concurrent session snapshotted the same state first
                evicted = [snapshot]
            else:
                graph.attach_snapshot(node, snapshot)
                self._counters["snapshots_taken"] += 1
                self._append({"t": "s", "task": graph.task_id, "id": node.id, "snap": snapshot.to_json()})
                evicted = self._enforce_budget(graph, keep=node)
        for old in evicted:
            self._discarder_for(old)(old)

    def _drop_snapshot(self, graph: ToolCallGraph, node: Node) -> None:
        """Evict a snapshot that turned out unusable (its fork failed), unless someone else holds a lease."""
        with self._lock:
            if node.snapshot is None or node.leases:
                return
            snapshot = graph.detach_snapshot(node)
            self._append({"t": "x", "task": graph.task_id, "id": node.id})
            self._counters["snapshots_evicted"] += 1
        self._discarder_for(snapshot)(snapshot)

    def _detach_snapshot(self, graph: ToolCallGraph, node: Node) -> Snapshot:
        """Forget a node's snapshot without freeing its storage (its owner moved it on); journaled."""
        with self._lock:
            snapshot = graph.detach_snapshot(node)
            self._append({"t": "x", "task": graph.task_id, "id": node.id})
            return snapshot

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
                snapshot = owner.detach_snapshot(node)
                self._append({"t": "x", "task": owner.task_id, "id": node.id})
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

    def _report_audit(self, finding: AuditFinding) -> None:
        with self._lock:
            self._findings.append(finding)
            self._counters["audits"] += 1
            if not finding.agrees:
                self._counters["audit_disagreements"] += 1
        if not finding.agrees:
            self.mark_nondeterministic(
                finding.call.name,
                f"audit of task {finding.task_id!r} node {finding.node_id}: cached and fresh results differ",
            )

    def _report_divergence(self, task_id: str, node: Node, output: str) -> None:
        """A replay re-executed a cached call and got a different result: the tool is not deterministic."""
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
                )
            )
        self.mark_nondeterministic(node.call.name, f"replay of task {task_id!r} node {node.id} gave another result")

    # ------------------------------------------------------------ inspection

    @property
    def findings(self) -> list[AuditFinding]:
        """Audit results and replay divergences, oldest first."""
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
        assert self._journal is not None
        records = 0
        dropped = 0
        for record in self._journal.load():
            records += 1
            try:
                self._apply(record)
            except (KeyError, ValueError, TypeError, InvalidToolCall) as error:
                dropped += 1
                warnings.warn(f"{self._journal.path}: ignoring a record that does not apply: {error!r}", stacklevel=3)
        live = sum(len(g) for g in self._graphs.values()) + len(self._nondeterministic)
        if compact and records > 2 * live + 1000:
            self.compact()

    def _apply(self, record: dict[str, Any]) -> None:
        kind = record["t"]
        if kind == "nondet":
            self._nondeterministic[record["tool"]] = record["why"]
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
        for tool, why in self._nondeterministic.items():
            yield {"t": "nondet", "tool": tool, "why": why}
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
        """Rewrite the journal to hold only the live state. Returns the number of records written."""
        if self._journal is None:
            return 0
        with self._lock:
            return self._journal.rewrite(self._records())

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


def _test_key(graph: ToolCallGraph, node: Node, key: str) -> InflightKey:
    return (graph.task_id, node.id, b"test\x00" + key.encode())


def _check_task_id(task_id: object) -> None:
    if not isinstance(task_id, str) or not task_id or len(task_id) > MAX_TASK_ID:
        raise InvalidTaskId(
            f"task id must be a non-empty string of at most {MAX_TASK_ID} characters, got {task_id!r:.80}"
        )
    if "\x00" in task_id:
        raise InvalidTaskId("task id must not contain NUL characters")
