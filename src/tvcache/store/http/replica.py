"""The replica an ``HttpStore`` keeps of each task's graph it has seen.

Nodes are immutable once inserted and the server assigns their ids, so a replica node is exactly the server's
node: a call found in the replica is a hit without a round trip. Anything not in the replica is asked of the
server and the answer inserted here under the server's id (``adopt``).

Ids are the server's only within one server *instance*: a restarted server (or one that lost journal records)
hands the same ids out again for other states. When the instance changes, every replica is dropped (with a
warning) and new sessions read the new server; a session already under way keeps its own copy, whose nodes are
still exactly what was executed, and finishes on it without the server. A node the server sends under an id
the replica knows for another call (digest, parent or result differ) drops that task's replica the same way.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

from ...api import models as m
from ...api import routes
from ...calls import ToolCall, check_task_id
from ...errors import ReplicaDropped, ServerError
from ...graph import Node, ToolCallGraph
from ...protocol import Snapshot
from .transport import ServerConnection

__all__ = ["Replicas"]


def _same_node(node: Node, data: m.NodeOut) -> bool:
    """Whether the server's node ``data`` is the replica's ``node``: the same call after the same parent, with
    the same result (ids alone are not identities across server instances)."""
    call = node.call
    parent = None if node.parent is None else node.parent.id
    return (
        data.parent == parent
        and data.digest == (None if call is None else call.hexdigest)
        and data.output == node.output
        and data.is_error == node.is_error
    )


class Replicas:
    """The current replica of each task, under the ids of ``instance``; ``touches``: the hit counts served from
    them not yet sent, by (task, epoch). Every field is guarded by ``lock`` (the store's)."""

    def __init__(self, connection: ServerConnection, *, lock: threading.RLock, clock: Callable[[], float]) -> None:
        self.connection = connection
        self.lock = lock
        self.clock = clock
        self.graphs: dict[str, ToolCallGraph] = {}
        self._roots: dict[int, ToolCallGraph] = {}  # id(root) -> graph, for the current replicas only
        self.instance: str | None = None  # the server instance the replicas' ids belong to (None: not named yet)
        self.touches: dict[tuple[str, int | None], list[int]] = {}

    def graph(self, task_id: str) -> ToolCallGraph:
        with self.lock:
            graph = self.graphs.get(task_id)
            if graph is None:
                check_task_id(task_id)
                graph = self.graphs[task_id] = ToolCallGraph(task_id, clock=self.clock)
                self._roots[id(graph.root)] = graph
            return graph

    def graph_of(self, node: Node) -> ToolCallGraph | None:
        """The current replica ``node`` belongs to; None for a dropped one."""
        root = node
        while root.parent is not None:
            root = root.parent
        with self.lock:
            return self._roots.get(id(root))

    def ids_of(self, graph: ToolCallGraph) -> str | None:
        """The server instance ``graph``'s node ids belong to; ReplicaDropped if it is no longer the replica
        (read together, under the lock: a request must never carry a dropped replica's ids to a new instance)."""
        with self.lock:
            if self.graphs.get(graph.task_id) is not graph:
                raise ReplicaDropped(f"task {graph.task_id!r}: this replica was dropped")
            return self.instance

    def is_replica(self, graph: ToolCallGraph) -> bool:
        with self.lock:
            return self.graphs.get(graph.task_id) is graph

    def note_instance(self, answered: str) -> None:
        """The server named its instance: on a change, every replica's ids may name other states now."""
        with self.lock:
            before = self.instance
            if before == answered:
                return
            self.instance = answered
            if before is None:
                return
            dropped = self.drop(None)
        warnings.warn(
            f"tvcache server {self.connection.url} restarted (instance {before} is now {answered}): dropped what "
            f"this client held of {dropped} task(s); rollouts under way finish on their own copy, new ones read "
            "the server again",
            RuntimeWarning,
            stacklevel=2,
        )

    def drop(self, task_id: str | None) -> int:
        """Forget the replica of ``task_id`` (None: of every task); the caller holds the lock. Sessions still on a
        dropped replica keep it (``ids_of`` tells them apart) and go on without the server."""
        task_ids = list(self.graphs) if task_id is None else [task_id]
        for name in task_ids:
            graph = self.graphs.pop(name, None)
            if graph is not None:
                self._roots.pop(id(graph.root), None)
        if task_id is None:
            self.touches.clear()  # hit counts of the old ids must not reach the new instance
        else:
            for key in [key for key in self.touches if key[0] == task_id]:
                del self.touches[key]
        return len(task_ids)

    def adopt(self, graph: ToolCallGraph, data: m.NodeOut, instance: str | None) -> Node:
        """The replica node for the server's node ``data`` (from ``instance``), inserted (with any missing
        ancestors) if new. A node the replica knows under that id for another call drops the replica:
        ReplicaDropped."""
        node = graph.get(data.id)
        if node is not None and not _same_node(node, data):
            with self.lock:
                current = self.graphs.get(graph.task_id) is graph
                if current:
                    self.drop(graph.task_id)
            if current:
                warnings.warn(
                    f"tvcache server {self.connection.url}: node {data.id} of task {graph.task_id!r} does not "
                    "match what this client holds under that id (the server lost records, or is another one): "
                    "dropped its replica of the task; rollouts under way finish on their own copy",
                    RuntimeWarning,
                    stacklevel=2,
                )
            raise ReplicaDropped(f"task {graph.task_id!r}: node {data.id} is another node on the server now")
        if node is None:
            node = self._insert(graph, data, instance)
        self.sync_snapshot(graph, node, data.snapshot)
        return node

    def _insert(self, graph: ToolCallGraph, data: m.NodeOut, instance: str | None) -> Node:
        parent_id = data.parent
        if parent_id is None:
            raise ServerError(200, f"task {graph.task_id!r}: the server sent node {data.id} without a parent")
        if graph.get(parent_id) is None:  # inserted by another client: fetch the path down to it
            params = {"task_id": graph.task_id, "node_id": parent_id}
            path = self.connection.send(routes.PATH, None, params=params, instance=instance)
            for ancestor in path.nodes:
                self.adopt(graph, ancestor, instance)
        call = ToolCall(data.name or "", data.arguments or {})
        if call.hexdigest != data.digest:
            raise ServerError(200, f"node {data.id} of {graph.task_id!r}: the call's digest does not match")
        with self.lock:
            node = graph.insert(
                graph.node(parent_id),
                call,
                output=data.output,
                is_error=data.is_error,
                seconds=data.seconds,
                read_only=data.read_only,
                node_id=data.id,
            )
        if node.id != data.id:
            raise ServerError(200, f"task {graph.task_id!r}: replica and server disagree on node {data.id}")
        return node

    def sync_snapshot(self, graph: ToolCallGraph, node: Node, data: m.SnapshotOut | None) -> None:
        """Mirror the server's snapshot marker (used for cost estimates; leases come from the server)."""
        snapshot = None if data is None else Snapshot.from_json(data.model_dump())
        with self.lock:
            if node.snapshot == snapshot or node.leases:
                return
            if node.snapshot is not None:
                graph.detach_snapshot(node)
            if snapshot is not None:
                graph.attach_snapshot(node, snapshot)

    def forget(self, evicted: tuple[Snapshot, ...]) -> None:
        """Take evicted records off the replica's nodes (the markers of what the server holds)."""
        if not evicted:
            return
        paths = {snapshot.path for snapshot in evicted}
        with self.lock:
            for graph in [*self.graphs.values()]:
                for held in [*graph.snapshot_nodes.values()]:
                    if held.snapshot is not None and held.snapshot.path in paths and not held.leases:
                        graph.detach_snapshot(held)
