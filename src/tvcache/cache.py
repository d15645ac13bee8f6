"""The cache: the tool call graphs of many tasks, their snapshots, budgets, durability and audits.

``Cache()`` keeps everything in memory (snapshots in a private temporary directory removed on close);
``Cache(path=...)`` journals every insert before acknowledging it and reloads on the next open. Rollouts talk
to the cache through sessions (``tvcache.session``).

``Cache`` is a facade over a graph store (``tvcache.store``), which holds the shared, thread-safe state:
``Cache(store=...)`` takes one, and by default builds a ``LocalStore`` from the constructor's arguments. The
facade keeps what is about tools and rollouts: tool specs, the non-determinism policy, cost models, audits,
counters and the sessions themselves.
"""

from __future__ import annotations

import random
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Unpack

from .calls import MAX_TASK_ID, ToolSpec
from .errors import UnknownTool
from .graph import Node, ToolCallGraph
from .policies import Budget, CostAwareSnapshots, CostModel, EvictionPolicy, SnapshotPolicy
from .protocol import SandboxFactory, cost_hints
from .recovery import JournalRecovery
from .results import AuditFinding, CacheStats, NondeterminismMark
from .session import Session, SyncSession
from .store.local import LocalStore, LocalStoreOptions
from .store.protocol import GraphStore

__all__ = ["MAX_TASK_ID", "Cache", "NondeterminismWarning"]

# The facade's counters; the store counts what happens to snapshots (``snapshots_taken``, ``snapshots_evicted``).
COUNTERS = (
    "hits",
    "misses",
    "coalesced",
    "uncacheable",
    "sandboxes_started",
    "sandboxes_forked",
    "forks_failed",
    "snapshots_declined",
    "calls_replayed",
    "audits",
    "audit_disagreements",
    "replay_divergences",
    "verified",
)


_SERVER_BUDGET = "a server enforces its own (`tvcache serve --max-snapshots-per-task`, `--max-snapshot-bytes`)"


class NondeterminismWarning(UserWarning):
    """A tool served from cache returned different results for the same call in the same state."""


class Cache:
    """Tool call graphs of many tasks, shared by concurrent rollout sessions (threads or tasks).

    ``store_options`` (``fsync``, ``compact_on_open``, ``clock``, ``discard``, ``verify_snapshots``) are those of
    the ``LocalStore`` opened at ``path`` (``LocalStoreOptions``, with their defaults there; unused with ``store``).
    A process frees only storage it made (``tvcache.store.owners``): ``discard`` replaces the default for
    evicted records it did not make; ``verify_snapshots=False`` keeps journaled snapshots whose files this
    process cannot see. A server sets both: its snapshots belong to its clients (``tvcache.server``).

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
        store: GraphStore | None = None,
        tools: Iterable[ToolSpec] = (),
        snapshot_policy: SnapshotPolicy | None = None,
        eviction: EvictionPolicy | None = None,
        budget: Budget | None = None,
        audit_rate: float = 0.0,
        audit_seed: int | None = 0,
        verify_undeclared: bool = True,
        **store_options: Unpack[LocalStoreOptions],
    ) -> None:
        if not 0.0 <= audit_rate <= 1.0:
            raise ValueError(f"audit_rate must be between 0 and 1, got {audit_rate}")
        if store is not None and path is not None:
            raise TypeError("pass either path or store: a store given is opened already")
        if store is None:
            store = LocalStore(path, budget=budget, eviction=eviction, **store_options)
        elif isinstance(store, LocalStore):
            if budget is not None:
                store.budget = budget
            if eviction is not None:
                store.eviction = eviction
        elif budget is not None or eviction is not None:
            raise TypeError(f"budget and eviction are {store!r}'s own: it enforces them, not this process")
        self._store: GraphStore = store
        self._telemetry_lock = threading.RLock()  # the facade's own state: counters, findings, costs, sessions
        self._specs: dict[str, ToolSpec] = {spec.name: spec for spec in tools}
        self._costs: dict[str, CostModel] = {}
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._seconds_executed = 0.0
        self._seconds_saved = 0.0
        self._findings: list[AuditFinding] = []
        self._sessions: weakref.WeakSet[Session] = weakref.WeakSet()
        self.snapshot_policy: SnapshotPolicy = snapshot_policy or CostAwareSnapshots()
        self.audit_rate = audit_rate
        self.verify_undeclared = verify_undeclared
        self._audit_rng = random.Random(audit_seed)
        self._closed = False

    @property
    def store(self) -> GraphStore:
        """The graph store behind this cache: what sessions share."""
        return self._store

    def _local_store(self, what: str, hint: str) -> LocalStore:
        """The store, when it is a ``LocalStore``: the budget, eviction policy and journal are this process's
        only then; another store (an ``HttpStore``: a ``RemoteCache``) has them where it enforces them."""
        if isinstance(self._store, LocalStore):
            return self._store
        raise AttributeError(f"the {what} of a cache over {self._store!r} is not in this process: {hint}")

    @property
    def budget(self) -> Budget:
        """The snapshot budget (a ``LocalStore``'s; a remote cache's is its server's: AttributeError)."""
        return self._local_store("budget", _SERVER_BUDGET).budget

    @budget.setter
    def budget(self, budget: Budget) -> None:
        self._local_store("budget", _SERVER_BUDGET).budget = budget

    @property
    def eviction(self) -> EvictionPolicy:
        """The eviction policy (a ``LocalStore``'s; a remote cache's is its server's: AttributeError)."""
        return self._local_store("eviction policy", _SERVER_BUDGET).eviction

    @eviction.setter
    def eviction(self, eviction: EvictionPolicy) -> None:
        self._local_store("eviction policy", _SERVER_BUDGET).eviction = eviction

    @property
    def root(self) -> Path:
        """The cache's directory (a private temporary one for an in-memory cache; for a store without one of its
        own, such as an ``HttpStore``, that store's private directory)."""
        root = getattr(self._store, "root", None)
        if not isinstance(root, Path):
            raise AttributeError(f"{self._store!r} has no directory")
        return root

    @property
    def snapshot_root(self) -> Path:
        return self._store.snapshot_root

    # ------------------------------------------------------------- sessions

    def session(self, task_id: str, *, sandbox: SandboxFactory) -> Session:
        """A rollout session of ``task_id`` (async context manager). Sandboxes are created only on a miss."""
        session = Session(self, task_id, sandbox)
        with self._telemetry_lock:
            self._sessions.add(session)
        return session

    def session_sync(self, task_id: str, *, sandbox: SandboxFactory) -> SyncSession:
        """The blocking twin of ``session`` (a context manager running its own event loop)."""
        return SyncSession(self.session(task_id, sandbox=sandbox))

    # ---------------------------------------------------------------- tasks

    def graph(self, task_id: str) -> ToolCallGraph:
        """The graph of ``task_id``, created empty on first use."""
        return self._store.graph(task_id)

    def tasks(self) -> list[str]:
        return self._store.tasks()

    def __contains__(self, task_id: object) -> bool:
        return self._store.has_task(task_id)

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
        return spec.deterministic is not False and not self._store.is_marked(spec.name, task_id)

    @property
    def nondeterministic_tools(self) -> dict[str, str]:
        """Tools marked non-deterministic in every task, with the evidence (see ``nondeterministic_marks`` for
        the marks scoped to one task)."""
        return {mark.tool: mark.reason for mark in self.nondeterministic_marks() if mark.task_id is None}

    def nondeterministic_marks(self, task_id: str | None = None) -> list[NondeterminismMark]:
        """Every non-determinism mark, tool-wide ones first; with ``task_id``, those that apply in that task."""
        return self._store.nondeterministic_marks(task_id)

    def mark_nondeterministic(self, tool: str, reason: str) -> None:
        """Never serve ``tool`` from cache again, in any task (persisted). Evidence seen in one task marks the
        tool in that task only (``report_divergence``, ``report_audit``)."""
        if not self._store.mark_nondeterministic(tool, reason):
            return
        warnings.warn(
            f"tool {tool!r} is non-deterministic ({reason}); it will be executed on every call from now on",
            NondeterminismWarning,
            stacklevel=3,
        )

    def _mark_nondeterministic_in(self, task_id: str, tool: str, reason: str) -> None:
        """Never serve ``tool`` from cache again in task ``task_id`` (persisted): the evidence (one call that
        gave two results in one state of this task) says nothing about other tasks, whose environments may
        differ; their own first-hit checks and replays judge the tool there."""
        if not self._store.mark_nondeterministic(tool, reason, task_id=task_id):
            return
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
        return self._store.clear_nondeterministic(tool, task_id=task_id)

    def costs(self, factory: SandboxFactory) -> CostModel:
        """The measured costs of a backend, seeded with its hints until measured."""
        with self._telemetry_lock:
            model = self._costs.get(factory.kind)
            if model is None:
                hints = cost_hints(factory)
                model = self._costs[factory.kind] = CostModel(
                    start=hints.get("start", 0.0),
                    fork=hints.get("fork", 0.0),
                    snapshot=hints.get("snapshot", 0.0),
                )
            self._store.register_backend(factory)
            return model

    # --------------------------------------------------- telemetry for sessions

    def count(self, counter: str, amount: int = 1) -> None:
        """Add to one of the counters ``stats()`` reports."""
        with self._telemetry_lock:
            self._counters[counter] += amount

    def account(self, *, executed: float = 0.0, saved: float = 0.0) -> None:
        """Add seconds spent executing, and seconds hits saved."""
        with self._telemetry_lock:
            self._seconds_executed += executed
            self._seconds_saved += saved

    def should_audit(self) -> bool:
        """Whether to audit the hit just served (``audit_rate``)."""
        if self.audit_rate <= 0.0:
            return False
        with self._telemetry_lock:
            return self._audit_rng.random() < self.audit_rate

    def claim_check(self, task_id: str, spec: ToolSpec) -> bool:
        """True once per task and undeclared tool (``spec.deterministic is None``), to the session that is to
        check that tool's first hit in the task; False when checks are off, the tool is declared, or it was
        (or is being) checked already."""
        if not self.verify_undeclared or spec.deterministic is not None:
            return False
        return self._store.claim_check(task_id, spec.name)

    def pass_check(self, task_id: str, tool: str) -> None:
        """The first-hit check agreed: a reopened cache does not check that tool in the task again."""
        self._store.pass_check(task_id, tool)

    def release_check(self, task_id: str, tool: str) -> None:
        """The check could not run (the sandbox failed, the session was cancelled): a later hit tries again."""
        self._store.release_check(task_id, tool)

    def report_audit(self, finding: AuditFinding) -> None:
        """An audit re-executed a hit: kept, counted, and a disagreement marks the tool in the task."""
        with self._telemetry_lock:
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

    def report_divergence(self, task_id: str, node: Node, output: str, *, source: str = "replay") -> None:
        """Re-executing a cached call in its state gave another result (``source``: a "replay", the "first-hit"
        check, or a "record" that found the call recorded with another result): the tool is not deterministic,
        in this task at least. Counted, kept as a finding, and the tool marked in the task."""
        assert node.call is not None
        self.count("replay_divergences")
        with self._telemetry_lock:
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
        with self._telemetry_lock:
            return list(self._findings)

    def stats(self) -> CacheStats:
        store = self._store.stats()
        with self._telemetry_lock:
            counters = dict(self._counters)
            seconds_executed, seconds_saved = self._seconds_executed, self._seconds_saved
        counters["snapshots_taken"] = store.snapshots_taken
        counters["snapshots_evicted"] = store.snapshots_evicted
        return CacheStats(
            tasks=store.tasks,
            nodes=store.nodes,
            snapshots=store.snapshots,
            snapshot_bytes=store.snapshot_bytes,
            seconds_executed=seconds_executed,
            seconds_saved=seconds_saved,
            nondeterministic=tuple(self.nondeterministic_marks()),
            **counters,
        )

    def check_invariants(self) -> None:
        """Check the store's graphs (a ``LocalStore``'s, an ``HttpStore``'s replicas) and that no snapshot is
        leased while no session is open. Raises AssertionError."""
        check: Callable[[], None] | None = getattr(self._store, "check_invariants", None)
        if check is not None:
            check()
        leased: Callable[[], bool] | None = getattr(self._store, "leased", None)
        if leased is not None and leased() and not self._sessions:
            raise AssertionError("snapshots are leased while no session is open")

    @property
    def recovery(self) -> JournalRecovery | None:
        """What opening this durable cache found and did: damaged records and what they took with them, copies
        set aside, leftovers of killed processes removed (None for an in-memory cache, and for a store whose
        journal is elsewhere, such as a server's)."""
        if not isinstance(self._store, LocalStore):
            return None
        with self._telemetry_lock:
            return self._store.recovery

    def compact(self) -> int:
        """Rewrite the journal to hold only the live state. Returns the number of records written. Damaged lines
        and the records that depended on them are copied aside first (``recovery.set_aside``, and a warning).
        A cache over another store (a server's) has no journal here: AttributeError."""
        return self._local_store("journal", "a server keeps and compacts its own (when it opens)").compact(warn=True)

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
        self._store.close()

    def __enter__(self) -> Cache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        store = self._store
        if isinstance(store, LocalStore):
            where = "memory" if store.journal is None else str(store.root)
        else:
            where = repr(store)
        return f"<Cache {where} tasks={len(self.tasks())}>"
