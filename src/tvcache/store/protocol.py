"""The graph store contract: what rollout sessions (and the server) need from shared state, by name.

A session (``tvcache.session``) follows one rollout through a task's tool call graph. Everything it shares
with other sessions goes through a :class:`GraphStore`: looking calls up, claiming the execution of a missed
call so concurrent sessions run it once (a :class:`Claim` receipt), recording what ran, end-of-rollout checks,
snapshot leases and attachments (an :class:`Attached` result says what the budget evicted), the marks of tools
found non-deterministic, and the first-hit checks of undeclared tools.

Implementations:

- ``LocalStore`` (``tvcache.store.local``): the graphs in this process, one lock, the journal, the snapshot
  budget and eviction, the in-flight table. ``Cache()`` uses one; so does the server (``tvcache.server``).
- ``HttpStore`` (``tvcache.store.http``): the same operations over a ``tvcache serve`` server, keeping a replica
  of each graph it has seen. Ray is a transport to the shard actors under it, not another store.

``Cache`` (``tvcache.cache``) is the facade over a store: tool specs, the non-determinism policy, cost models,
audits, counters and sessions. Nodes, graphs and leases are the graph module's own types (``tvcache.graph``);
every operation taking a node takes one of ``graph(task_id)``'s nodes.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from ..errors import SandboxError
from ..graph import Lease, Node, ToolCallGraph
from ..protocol import Outcome, SandboxFactory, Snapshot
from ..results import NondeterminismMark

if TYPE_CHECKING:
    from ..calls import ToolCall
    from ..policies import CostModel, SnapshotPolicy

__all__ = ["Attached", "Claim", "Dropped", "GraphStore", "StoreStats", "TestLookup", "check_output"]


def check_output(call: ToolCall, outcome: Outcome) -> None:
    """SandboxError unless ``outcome``'s output is valid Unicode: what every store's ``record`` refuses first."""
    try:
        outcome.output.encode()
    except UnicodeEncodeError as error:
        raise SandboxError(
            f"the sandbox returned output for {call} that is not valid Unicode ({error.reason}); backends "
            "must decode tool output with errors='replace'"
        ) from error


V = TypeVar("V")


@dataclass(frozen=True, kw_only=True, slots=True)
class Claim(Generic[V]):
    """The receipt of a claim on an in-flight execution. ``owner``: this caller must execute and then resolve
    the claim (``resolve``/``resolve_test``), which completes ``ready`` for every waiter. Otherwise ``ready``
    completes when the owner resolves (already done when the result was there by the time of the claim); it
    raises the owner's error if the owner failed, after which a waiter looks again and may claim itself."""

    owner: bool
    ready: Future[V]


@dataclass(frozen=True, kw_only=True, slots=True)
class Attached:
    """What attaching a snapshot did. ``attached``: whether the node took it (False when the node held one
    already: then ``evicted`` holds the new snapshot itself). ``evicted``: the snapshots the budget evicted to
    make room (the new one never among them when attached). The store has already handed each to its free
    policy (``LocalStore``'s ``discard``), so a caller only passes them on to whoever owns them."""

    attached: bool
    evicted: tuple[Snapshot, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Dropped:
    """What dropping an unusable snapshot did: ``evicted`` holds it when it was dropped (nothing when the node
    had no snapshot or someone held a lease on it)."""

    evicted: tuple[Snapshot, ...] = ()

    @property
    def dropped(self) -> bool:
        return bool(self.evicted)


@dataclass(frozen=True, kw_only=True, slots=True)
class TestLookup:
    """The cached value of an end-of-rollout check at a state; a miss is ``found=False`` (value None)."""

    __test__ = False  # not a pytest test class

    found: bool
    value: Any = None


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreStats:
    """The store's share of ``Cache.stats()``: what it holds and what happened to snapshots."""

    tasks: int
    nodes: int
    snapshots: int
    snapshot_bytes: int
    snapshots_taken: int
    snapshots_evicted: int


class GraphStore(Protocol):
    """Shared, thread-safe state of the tool call graphs of many tasks. See the module docstring."""

    @property
    def snapshot_root(self) -> Path:
        """Where this process's sandboxes write snapshots (``snapshot_path`` hands out paths below it)."""
        ...

    # ------------------------------------------------------------- tasks

    def graph(self, task_id: str) -> ToolCallGraph:
        """The graph of ``task_id``, created empty on first use (InvalidTaskId for a bad id)."""
        ...

    def tasks(self) -> list[str]: ...

    def has_task(self, task_id: object) -> bool: ...

    # ------------------------------------------------------------- calls

    def lookup(self, graph: ToolCallGraph, state: Node, call: ToolCall) -> Node | None:
        """The node of ``call`` at ``state`` (touched: a hit), or None: a miss is a value, not an error."""
        ...

    def touch(self, graph: ToolCallGraph, node: Node) -> None:
        """Count a hit on ``node`` (eviction priorities) without looking it up."""
        ...

    def claim(self, graph: ToolCallGraph, state: Node, call: ToolCall) -> Claim[Node | None]:
        """Claim the execution of a missed call, or join the session already executing it. ``ready`` resolves
        to the recorded node, or None when the owner found the call not cacheable in this state."""
        ...

    def resolve(
        self, graph: ToolCallGraph, state: Node, call: ToolCall, *, node: Node | None, error: BaseException | None
    ) -> None:
        """End a claim this caller owns: waiters get ``node`` (None: execute it yourselves, uncached) or
        ``error``. Resolving a claim that is not held does nothing."""
        ...

    def record(
        self, graph: ToolCallGraph, state: Node, call: ToolCall, outcome: Outcome, *, seconds: float, read_only: bool
    ) -> Node:
        """Insert an executed call, durably before returning (the acknowledgement). Returns the node now at
        (state, call): an existing one, with its own result, if someone recorded the call first. SandboxError
        for output that is not valid Unicode; a JournalError propagates with nothing inserted."""
        ...

    # ------------------------------------------------------------- end-of-rollout checks

    def lookup_test(self, graph: ToolCallGraph, node: Node, key: str) -> TestLookup: ...

    def claim_test(self, graph: ToolCallGraph, node: Node, key: str) -> Claim[Node | None]:
        """Like ``claim`` for a check: sessions finishing in one state run it once; a waiter looks again once
        ``ready`` completes."""
        ...

    def resolve_test(self, graph: ToolCallGraph, node: Node, key: str, *, error: BaseException | None) -> None: ...

    def record_test(self, graph: ToolCallGraph, node: Node, key: str, value: Any) -> None:
        """Store a check's value (InvalidToolCall when it is not JSON), journaled."""
        ...

    # ------------------------------------------------------------- snapshots

    def wants_snapshot(self, graph: ToolCallGraph, node: Node, *, policy: SnapshotPolicy, costs: CostModel) -> bool:
        """Whether to snapshot ``node`` now (``policy`` decides; a store whose snapshots nobody else could
        fork may say no)."""
        ...

    def snapshot_path(self, task_id: str, node: Node) -> Path:
        """A fresh path for a snapshot of ``node``, its directory created."""
        ...

    def lease_snapshot(self, state: Node, kind: str, *, skip: frozenset[str] = frozenset()) -> Lease | None:
        """Lease the deepest snapshot of backend ``kind`` at or above ``state`` (None: there is none), passing
        over paths in ``skip`` and those marked unforkable here. Release the receipt through ``release``."""
        ...

    def release(self, lease: Lease) -> None: ...

    def mark_unforkable(self, snapshot: Snapshot) -> None:
        """Leave ``snapshot`` alone in this process from now on (forking it failed here)."""
        ...

    def attach_snapshot(
        self, graph: ToolCallGraph, node: Node, snapshot: Snapshot, *, made_by: SandboxFactory | None = None
    ) -> Attached:
        """Attach ``snapshot`` to ``node`` (journaled) and keep the budget. ``made_by``: the factory that made it
        in this process, which then frees it when it is evicted."""
        ...

    def drop_snapshot(self, graph: ToolCallGraph, node: Node) -> Dropped:
        """Evict ``node``'s snapshot because it proved unusable everywhere, unless someone holds a lease."""
        ...

    def detach_snapshot(self, graph: ToolCallGraph, node: Node) -> Snapshot:
        """Forget ``node``'s snapshot without freeing its storage (journaled); ValueError if it has none."""
        ...

    def register_backend(self, factory: SandboxFactory) -> None:
        """Learn how a backend frees storage (``discard``, ``discard_foreign``) for evicted records of its kind."""
        ...

    # ------------------------------------------------------------- non-determinism marks

    def mark_nondeterministic(self, tool: str, reason: str, *, task_id: str | None = None) -> bool:
        """Never serve ``tool`` from cache again (in ``task_id`` only, when given); persisted. Returns whether
        the mark is new (False: it, or a tool-wide mark, was there)."""
        ...

    def clear_nondeterministic(self, tool: str | None = None, *, task_id: str | None = None) -> int:
        """Lift marks (None: any tool / any scope; a tool-wide mark only when ``task_id`` is None); returns how
        many were lifted."""
        ...

    def nondeterministic_marks(self, task_id: str | None = None) -> list[NondeterminismMark]:
        """Tool-wide marks first, then the task-scoped ones (only ``task_id``'s, when given)."""
        ...

    def is_marked(self, tool: str, task_id: str | None = None) -> bool:
        """Whether ``tool`` is marked tool-wide, or (given ``task_id``) in that task."""
        ...

    # ------------------------------------------------------------- first-hit checks

    def claim_check(self, task_id: str, tool: str) -> bool:
        """True once per (task, tool): to the session that is to check that tool's first hit in the task."""
        ...

    def pass_check(self, task_id: str, tool: str) -> None:
        """The check agreed: remembered (journaled where the store is durable)."""
        ...

    def release_check(self, task_id: str, tool: str) -> None:
        """The check could not run: a later hit claims it again."""
        ...

    # ------------------------------------------------------------- lifetime

    def stats(self) -> StoreStats: ...

    def close(self) -> None:
        """Release what the store holds (journal, private directories). Idempotent."""
        ...
