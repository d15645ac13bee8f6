"""The tool call graph (TCG) of one task: a prefix tree of state-changing calls with read-only calls hanging
off the state they read.

A *state node* is the sandbox state reached by executing the stateful calls on the path from the root. Its
``children`` are the stateful calls executed in that state (each a new state); its ``reads`` are calls proven or
declared read-only there, whose results are keyed by the state and which do not move the rollout. Lookup of a
rollout's history is therefore a longest-prefix match over its stateful calls, with read-only calls checked at
the state they were made in.

The graph is not thread-safe by itself; the cache serialises access to it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .calls import ToolCall
from .protocol import Snapshot

__all__ = ["GraphInvariantError", "Lease", "MatchResult", "Node", "ToolCallGraph"]


class Node:
    """One executed call (or the root). Slotted: a graph holds hundreds of thousands of these."""

    __slots__ = (
        "call",
        "children",
        "depth",
        "hits",
        "id",
        "is_error",
        "last_used",
        "leases",
        "output",
        "parent",
        "read_only",
        "reads",
        "seconds",
        "snapshot",
        "subtree_hits",
        "tests",
    )

    def __init__(
        self,
        *,
        id: int,
        parent: Node | None,
        call: ToolCall | None,
        output: str,
        is_error: bool,
        seconds: float,
        read_only: bool,
        now: float,
    ) -> None:
        self.id = id
        self.parent = parent
        self.call = call
        self.output = output
        self.is_error = is_error
        self.seconds = seconds
        self.read_only = read_only
        self.depth: int = 0 if parent is None else parent.depth + (0 if read_only else 1)
        self.children: dict[bytes, Node] | None = None
        self.reads: dict[bytes, Node] | None = None
        self.snapshot: Snapshot | None = None
        self.tests: dict[str, Any] | None = None
        self.hits = 0
        self.subtree_hits = 0  # hits on this node and everything below it: the reuse a snapshot here serves
        self.leases = 0
        self.last_used = now

    @property
    def state(self) -> Node:
        """The state node this node's result was read in (itself for stateful nodes)."""
        if self.read_only:
            assert self.parent is not None  # a read-only node always hangs off a state
            return self.parent
        return self

    def step(self, call: ToolCall) -> Node | None:
        """The node for ``call`` executed in this state, if cached."""
        digest = call.digest
        if self.children is not None:
            child = self.children.get(digest)
            if child is not None:
                return child
        if self.reads is not None:
            return self.reads.get(digest)
        return None

    def path(self) -> list[Node]:
        """The stateful nodes from the root's first child down to this state (read-only nodes excluded)."""
        nodes: list[Node] = []
        node: Node | None = self.state
        while node is not None and node.parent is not None:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes

    def __repr__(self) -> str:
        kind = "read" if self.read_only else "state"
        return f"<Node {self.id} {kind} depth={self.depth} {self.call!r}>"


@dataclass(frozen=True, kw_only=True, slots=True)
class MatchResult:
    """The longest-prefix match of a history.

    ``hit``: the whole history matched and ``node`` holds the last call's cached result.
    ``state``: the deepest state reached by the matched prefix — where execution resumes on a miss.
    ``matched``: how many calls of the history matched (== len(history) on a hit).
    ``snapshot``: on a miss, the deepest node at or above ``state`` holding a snapshot (where a sandbox can be
    forked to resume), or None; always None on a hit, which needs no sandbox.
    """

    hit: bool
    node: Node | None
    state: Node
    matched: int
    snapshot: Node | None

    @property
    def output(self) -> str | None:
        return None if self.node is None else self.node.output


class Lease:
    """A receipt pinning a node's snapshot against eviction. Release it once (or use it as a context manager)."""

    __slots__ = ("_node",)

    def __init__(self, node: Node) -> None:
        node.leases += 1
        self._node: Node | None = node

    @property
    def node(self) -> Node:
        if self._node is None:
            raise RuntimeError("lease already released")
        return self._node

    def release(self) -> None:
        if self._node is not None:
            self._node.leases -= 1
            self._node = None

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class GraphInvariantError(AssertionError):
    """check_invariants() found the graph inconsistent (a bug in tvcache, never a user error)."""


class ToolCallGraph:
    """The tool call graph of one task."""

    def __init__(self, task_id: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.task_id = task_id
        self._clock = clock
        self.root = Node(
            id=0, parent=None, call=None, output="", is_error=False, seconds=0.0, read_only=False, now=clock()
        )
        self._nodes: dict[int, Node] = {0: self.root}
        self._next_id = 1
        self.snapshot_nodes: dict[int, Node] = {}
        # node id by snapshot path (normalised): a path is one snapshot's storage, so it is attached at most once
        self.snapshot_paths: dict[str, int] = {}
        self.snapshot_bytes = 0

    # ----------------------------------------------------------------- lookup

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def next_id(self) -> int:
        """The id the next inserted node gets (journals write it before inserting)."""
        return self._next_id

    def reserve_ids(self, node_id: int) -> None:
        """Never give ``node_id`` or a lower id to a new node (records that did not load still use them)."""
        self._next_id = max(self._next_id, node_id + 1)

    def node(self, node_id: int) -> Node:
        return self._nodes[node_id]

    def get(self, node_id: int) -> Node | None:
        return self._nodes.get(node_id)

    def nodes(self) -> Iterator[Node]:
        return iter(self._nodes.values())

    def match(
        self, history: Sequence[ToolCall], *, is_read_only: Callable[[ToolCall], bool] | None = None
    ) -> MatchResult:
        """Longest-prefix match of ``history`` (all calls of a rollout so far, the newest last).

        A call that is not cached at the current state stops the match, except one that ``is_read_only`` declares
        read-only and is not the last: it cannot have moved the state, so the walk continues past it.
        """
        state = self.root
        last = len(history) - 1
        for index, call in enumerate(history):
            node = state.step(call)
            if node is None:
                if index < last and is_read_only is not None and is_read_only(call):
                    continue
                return MatchResult(
                    hit=False, node=None, state=state, matched=index, snapshot=self.snapshot_ancestor(state)
                )
            if index == last:
                return MatchResult(hit=True, node=node, state=node.state, matched=len(history), snapshot=None)
            if not node.read_only:
                state = node
        return MatchResult(hit=False, node=None, state=state, matched=0, snapshot=self.snapshot_ancestor(state))

    def snapshot_ancestor(self, state: Node) -> Node | None:
        """The deepest node at or above ``state`` that holds a snapshot."""
        node: Node | None = state.state
        while node is not None:
            if node.snapshot is not None:
                return node
            node = node.parent
        return None

    def replay_seconds(self, state: Node, *, since: Node | None = None) -> float:
        """Measured seconds to re-execute the stateful calls from ``since`` (exclusive; default: the nearest
        snapshotted ancestor, or the root) down to ``state`` (inclusive)."""
        if since is None:
            since = self.snapshot_ancestor(state) or self.root
        total = 0.0
        node: Node | None = state.state
        while node is not None and node is not since:
            total += node.seconds
            node = node.parent
        if node is None:
            raise ValueError(f"{since!r} is not an ancestor of {state!r}")
        return total

    # --------------------------------------------------------------- mutation

    def insert(
        self,
        parent: Node,
        call: ToolCall,
        *,
        output: str,
        is_error: bool = False,
        seconds: float,
        read_only: bool,
        node_id: int | None = None,
    ) -> Node:
        """Record ``call`` executed in state ``parent``. Idempotent: an existing node for the call is returned."""
        if parent.read_only:
            raise ValueError("calls are executed in states, not after read-only nodes; pass node.state")
        existing = parent.step(call)
        if existing is not None:
            return existing
        if node_id is None:
            node_id = self._next_id
        elif node_id in self._nodes:
            raise ValueError(f"node id {node_id} is already used in task {self.task_id!r}")
        self._next_id = max(self._next_id, node_id + 1)
        node = Node(
            id=node_id,
            parent=parent,
            call=call,
            output=output,
            is_error=is_error,
            seconds=seconds,
            read_only=read_only,
            now=self._clock(),
        )
        if read_only:
            if parent.reads is None:
                parent.reads = {}
            parent.reads[call.digest] = node
        else:
            if parent.children is None:
                parent.children = {}
            parent.children[call.digest] = node
        self._nodes[node_id] = node
        return node

    def touch(self, node: Node) -> None:
        """Count a hit on ``node`` (and on every ancestor's subtree: O(depth), so eviction needs no walks)."""
        node.hits += 1
        node.last_used = self._clock()
        current: Node | None = node
        while current is not None:
            current.subtree_hits += 1
            current = current.parent

    def attach_snapshot(self, node: Node, snapshot: Snapshot) -> None:
        if node.read_only:
            raise ValueError("a read-only node has no state of its own to snapshot")
        if node.snapshot is not None:
            raise ValueError(f"{node!r} already holds a snapshot")
        node.snapshot = snapshot
        self.snapshot_nodes[node.id] = node
        self.snapshot_paths[snapshot_key(snapshot)] = node.id
        self.snapshot_bytes += snapshot.bytes

    def detach_snapshot(self, node: Node) -> Snapshot:
        """Remove a node's snapshot from the graph (the caller frees its storage). Refuses leased snapshots."""
        snapshot = node.snapshot
        if snapshot is None:
            raise ValueError(f"{node!r} holds no snapshot")
        if node.leases:
            raise ValueError(f"{node!r} is leased {node.leases} time(s); it cannot be evicted")
        node.snapshot = None
        del self.snapshot_nodes[node.id]
        if self.snapshot_paths.get(snapshot_key(snapshot)) == node.id:
            del self.snapshot_paths[snapshot_key(snapshot)]
        self.snapshot_bytes -= snapshot.bytes
        return snapshot

    def subtree(self, node: Node) -> list[Node]:
        """``node`` and every node below it (iterative: paths can be deeper than the recursion limit)."""
        nodes: list[Node] = []
        stack = [node]
        while stack:
            current = stack.pop()
            nodes.append(current)
            for table in (current.children, current.reads):
                stack.extend((table or {}).values())
        return nodes

    def check_removable(self, node: Node) -> None:
        """ValueError unless ``remove(node)`` would succeed."""
        if node.parent is None:
            raise ValueError("the root of a graph cannot be removed")
        if self._nodes.get(node.id) is not node:
            raise ValueError(f"{node!r} is not in task {self.task_id!r}")
        leased = sum(1 for current in self.subtree(node) if current.leases)
        if leased:
            raise ValueError(f"{leased} snapshot(s) below {node!r} are leased; they cannot be removed")

    def remove(self, node: Node) -> list[Snapshot]:
        """Forget ``node`` and its subtree; returns their snapshots (the caller frees their storage). Node ids are
        not reused while the graph lives: ``next_id`` keeps counting."""
        self.check_removable(node)
        parent = node.parent
        assert parent is not None and node.call is not None
        table = parent.reads if node.read_only else parent.children
        assert table is not None
        del table[node.call.digest]
        snapshots: list[Snapshot] = []
        for current in self.subtree(node):
            if current.snapshot is not None:
                snapshots.append(self.detach_snapshot(current))
            del self._nodes[current.id]
        return snapshots

    @contextmanager
    def leased(self, node: Node) -> Iterator[Lease]:
        lease = Lease(node)
        try:
            yield lease
        finally:
            lease.release()

    def set_test(self, node: Node, key: str, value: Any) -> None:
        if node.tests is None:
            node.tests = {}
        node.tests[key] = value

    # ------------------------------------------------------------- inspection

    def stats(self) -> dict[str, int]:
        reads = sum(1 for node in self._nodes.values() if node.read_only)
        return {
            "nodes": len(self._nodes) - 1,
            "state_nodes": len(self._nodes) - 1 - reads,
            "read_nodes": reads,
            "snapshots": len(self.snapshot_nodes),
            "snapshot_bytes": self.snapshot_bytes,
            "hits": sum(node.hits for node in self._nodes.values()),
        }

    def check_invariants(self) -> None:
        """Verify every structural invariant; raise GraphInvariantError on the first violation."""

        def require(condition: bool, message: str) -> None:
            if not condition:
                raise GraphInvariantError(f"task {self.task_id!r}: {message}")

        require(self.root.parent is None and self.root.call is None, "root must have no parent and no call")
        require(self._nodes.get(0) is self.root, "node 0 must be the root")
        reachable = 0
        stack = [self.root]
        snapshot_bytes = 0
        snapshots: set[int] = set()
        while stack:
            node = stack.pop()
            reachable += 1
            require(self._nodes.get(node.id) is node, f"{node!r} is not registered under its id")
            require(node.id < self._next_id or node is self.root, f"{node!r} id is not below the next id")
            require(node.leases >= 0, f"{node!r} has negative leases")
            require(node.hits >= 0, f"{node!r} has negative hits")
            if node.snapshot is not None:
                snapshots.add(node.id)
                snapshot_bytes += node.snapshot.bytes
            if node.read_only:
                require(node.children is None and node.reads is None, f"read-only {node!r} has children")
                require(node.snapshot is None, f"read-only {node!r} holds a snapshot")
            for table, read_only in ((node.children, False), (node.reads, True)):
                for digest, child in (table or {}).items():
                    require(child.parent is node, f"{child!r} does not point back to its parent {node!r}")
                    require(child.call is not None and child.call.digest == digest, f"{child!r} keyed wrongly")
                    require(child.read_only is read_only, f"{child!r} is in the wrong table")
                    expected = node.depth + (0 if read_only else 1)
                    require(child.depth == expected, f"{child!r} depth {child.depth} != {expected}")
                    stack.append(child)
            if node.children and node.reads:
                overlap = node.children.keys() & node.reads.keys()
                require(not overlap, f"{node!r} has calls that are both stateful and read-only")
        require(reachable == len(self._nodes), f"{len(self._nodes) - reachable} registered nodes are unreachable")
        require(snapshots == set(self.snapshot_nodes), "snapshot index disagrees with the nodes")
        require(set(self.snapshot_paths.values()) <= snapshots, "snapshot path index names a node without one")
        require(snapshot_bytes == self.snapshot_bytes, "snapshot byte count disagrees with the snapshots")


def snapshot_key(snapshot: Snapshot) -> str:
    """The storage a snapshot record names, as one string per path (``a/./b`` and ``a/b`` are one)."""
    return os.path.normpath(snapshot.path)
