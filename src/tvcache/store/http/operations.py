"""``HttpStore``: the graph store (``tvcache.store.protocol``) over a ``tvcache serve`` server's native API.

Its operations send the server's own models (``tvcache.api.models``) to the routes of its one table, each taken
by name (``tvcache.api.routes``: ``routes.LOOKUP``...), through a ``ServerConnection`` (``transport``), and keep a
replica of each task's graph it has seen (``replica``): a call found in the replica is a hit without a round
trip (the hit is still counted on the server, in batches, for eviction priorities).

The transport is the seam: ``transport`` (blocking requests) and ``async_transport`` (long-polls, heartbeats,
batched hit counts) are httpx transports, by default HTTP over the network; tests pass the real app in-process,
and ``tvcache.integrations.ray`` passes one that hands requests to a shard actor.

Snapshot records that come back from the server (evicted by the budget, dropped) are freed only if this process
made them, or if they lie in its ``snapshot_dir`` (``SnapshotOwners``): any client can attach any path.

In-flight coalescing works across clients: a missed call is *claimed* on the server; other clients missing it
long-poll until the owner inserts it. The owner renews its claim by heartbeat while it executes; if it dies the
claim expires after ``claim_ttl`` and a waiting client takes over.

The operations are synchronous (that is the session seam): each server round trip blocks the calling event
loop for its duration (a fraction of a millisecond on one machine). Waiting for another client's execution does
not block: it runs on a background loop and the session awaits it.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypedDict, TypeVar

import httpx
from pydantic import BaseModel

from ...api import models as m
from ...api import routes
from ...calls import ToolCall, canonical_json
from ...defaults import CLAIM_TTL
from ...errors import ClaimLost, InvalidToolCall, ReplicaDropped, ServerError, TVCacheError
from ...graph import Lease, Node, ToolCallGraph
from ...policies import CostModel, SnapshotPolicy
from ...protocol import Outcome, SandboxFactory, Snapshot
from ...results import NondeterminismMark
from ..inflight import Inflight
from ..local import LocalStore
from ..owners import SnapshotOwners
from ..protocol import Attached, Claim, Dropped, StoreStats, TestLookup, check_output
from .replica import Replicas
from .transport import ServerConnection

__all__ = ["HttpStore", "HttpStoreOptions", "RemoteLease"]

R = TypeVar("R", bound=BaseModel)

TOUCH_BATCH = 10_000  # TouchIn.node_ids' limit


class RemoteLease(Lease):
    """A snapshot lease held on the server (the instance that granted it) as well as on the replica node."""

    __slots__ = ("instance", "lease_id")

    def __init__(self, node: Node, lease_id: str, instance: str | None) -> None:
        super().__init__(node)
        self.lease_id = lease_id
        self.instance = instance


def _call(call: ToolCall) -> m.CallIn:
    return m.CallIn.model_construct(name=call.name, arguments=dict(call.arguments))


class HttpStoreOptions(TypedDict, total=False):
    """``HttpStore``'s keyword options (defaults and meaning there), for what builds one (``RemoteCache``)."""

    token: str | None
    snapshot_dir: str | Path | None
    timeout: float
    claim_ttl: float
    wait_timeout: float
    transport: httpx.BaseTransport | None
    async_transport: httpx.AsyncBaseTransport | None
    epoch: int | None


class HttpStore:
    """The graphs of ``url``'s server, with a replica here. See the module docstring.

    ``snapshot_dir``: where this process's sandboxes write snapshots (default: a private temporary directory;
    point all clients on a machine at one shared directory so they can fork each other's snapshots).
    ``claim_ttl``: how long the server waits for this client's heartbeat before letting another client take
    over a call it is executing. ``epoch``: the training epoch (or step) calls are tallied under on the server.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        snapshot_dir: str | Path | None = None,
        timeout: float = 60.0,
        claim_ttl: float = CLAIM_TTL,
        wait_timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
        async_transport: httpx.AsyncBaseTransport | None = None,
        epoch: int | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.claim_ttl = claim_ttl
        self.wait_timeout = wait_timeout
        self.epoch = epoch
        # The snapshots this client makes belong to the server's graph once attached: other workers fork them (a
        # published snapshot from the shared store) after this client is gone, and they are freed on eviction.
        # So closing frees none of them; only this client's private directory goes.
        self.root = Path(tempfile.mkdtemp(prefix="tvcache-client-"))
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.root, True)
        self._snapshot_root = Path(snapshot_dir) if snapshot_dir is not None else self.root / "snapshots"
        # In memory only: the fallbacks of dropped replicas, the end-of-rollout check claims, the replica of the
        # server's non-determinism marks and this process's first-hit checks.
        self.local = LocalStore()
        self.local.snapshot_root = self._snapshot_root
        self.owners = SnapshotOwners()
        self._lock = self.local.lock
        self.server = ServerConnection(
            self.url,
            token=token,
            timeout=timeout,
            transport=transport,
            async_transport=async_transport,
            on_instance=self._note_instance,
        )
        self.replicas = Replicas(self.server, lock=self._lock, clock=self.local.clock)
        # Claims this client owns on the server: (id(graph), state id, call digest) -> (claim id, heartbeat, instance).
        self._owned: dict[tuple[int, int, bytes], tuple[str, Future[None], str | None]] = {}
        self._flush_scheduled = False
        self._flushing: Future[None] | None = None
        self._taken = 0
        self._closed = False

    @property
    def snapshot_root(self) -> Path:
        return self._snapshot_root

    def _note_instance(self, answered: str) -> None:
        self.replicas.note_instance(answered)

    # ------------------------------------------------------------------ HTTP by path (tools and tests)

    def request(
        self, method: str, path: str, body: BaseModel | None, reply: type[R], *, instance: str | None = None,
        params: dict[str, Any] | None = None,
    ) -> R:  # fmt: skip
        """One blocking round trip: ``body`` to ``method path``, the answer read as ``reply``. ``instance``: the
        server instance the node ids in the request belong to (the server refuses another: ``ReplicaDropped``)."""
        return self.server.request(method, path, body, reply, instance=instance, params=params)

    async def arequest(self, path: str, body: BaseModel, reply: type[R], *, instance: str | None = None) -> R:
        """``request`` for any event loop (POST only)."""
        return await self.server.arequest(path, body, reply, instance=instance)

    # ------------------------------------------------------------------ replica

    def graph(self, task_id: str) -> ToolCallGraph:
        return self.replicas.graph(task_id)

    def tasks(self) -> list[str]:
        with self._lock:
            return list(self.replicas.graphs)

    def has_task(self, task_id: object) -> bool:
        return task_id in self.replicas.graphs

    def free(self, snapshot: Snapshot) -> None:
        """Free an evicted record's storage if this process made it or it lies in the snapshot directory."""
        self.owners.free(snapshot, snapshot_root=self.snapshot_root, durable=False)

    # ------------------------------------------------------------------ calls
    # Each operation on a dropped replica (``ReplicaDropped``, before or during its request) goes on without the
    # server: the in-memory ``local`` store's own operation on the session's copy of the graph.

    def lookup(self, graph: ToolCallGraph, state: Node, call: ToolCall) -> Node | None:
        node = state.step(call)
        if node is not None:
            self.touch(graph, node)
            return node
        body = m.LookupIn.model_construct(task_id=graph.task_id, state=state.id, call=_call(call))
        if self.epoch is not None:  # sent only when set: servers before epochs reject the field
            body = m.LookupIn.model_construct(task_id=graph.task_id, state=state.id, call=_call(call), epoch=self.epoch)
        try:
            instance = self.replicas.ids_of(graph)
            data = self.server.send(routes.LOOKUP, body, instance=instance)
            return None if data.node is None else self.replicas.adopt(graph, data.node, instance)
        except ReplicaDropped:
            return None

    def touch(self, graph: ToolCallGraph, node: Node) -> None:
        with self._lock:
            graph.touch(node)
            if not self.replicas.is_replica(graph):  # a dropped replica: its ids are not the server's
                return
            self.replicas.touches.setdefault((graph.task_id, self.epoch), []).append(node.id)
            if self._flush_scheduled:
                return
            self._flush_scheduled = True
        self._flushing = self.server.submit(self._flush_touches())

    async def _flush_touches(self) -> None:
        with self._lock:
            touches, self.replicas.touches = self.replicas.touches, {}
            self._flush_scheduled = False
            instance = self.replicas.instance
        for (task_id, epoch), node_ids in touches.items():
            for start in range(0, len(node_ids), TOUCH_BATCH):
                batch = node_ids[start : start + TOUCH_BATCH]
                if epoch is None:
                    body = m.TouchIn.model_construct(task_id=task_id, node_ids=batch)
                else:
                    body = m.TouchIn.model_construct(task_id=task_id, node_ids=batch, epoch=epoch)
                try:
                    await self.server.asend(routes.TOUCH, body, instance=instance)
                except TVCacheError:
                    pass  # hit counts only steer eviction; losing some never affects results

    def claim(self, graph: ToolCallGraph, state: Node, call: ToolCall) -> Claim[Node | None]:
        body = m.ClaimIn.model_construct(task_id=graph.task_id, state=state.id, call=_call(call), ttl=self.claim_ttl)
        try:
            instance = self.replicas.ids_of(graph)
            data = self.server.send(routes.CLAIM, body, instance=instance)
            if data.status == "hit" and data.node is not None:
                return Inflight.done(self.replicas.adopt(graph, data.node, instance))
        except ReplicaDropped:
            return self.local.claim(graph, state, call)
        if data.status == "owner" and data.claim_id is not None:
            ttl = self.claim_ttl if data.ttl is None else float(data.ttl)
            heartbeat = self.server.submit(self._heartbeat(data.claim_id, ttl, instance))
            with self._lock:
                self._owned[(id(graph), state.id, call.digest)] = (data.claim_id, heartbeat, instance)
            return Claim(owner=True, ready=Future())
        return Claim(owner=False, ready=self.server.submit(self._wait(graph, state, call, instance)))

    async def _heartbeat(self, claim_id: str, ttl: float, instance: str | None) -> None:
        while True:
            await asyncio.sleep(ttl / 3)
            try:
                body = m.HeartbeatIn.model_construct(claim_id=claim_id, ttl=ttl)
                await self.server.asend(routes.HEARTBEAT, body, instance=instance)
            except ReplicaDropped:
                return  # the server that granted the claim is gone
            except ServerError as error:
                if error.status == 404:  # taken over or finished: nothing left to renew
                    return

    async def _wait(self, graph: ToolCallGraph, state: Node, call: ToolCall, instance: str | None) -> Node | None:
        body = m.WaitIn.model_construct(
            task_id=graph.task_id, state=state.id, call=_call(call), timeout=self.wait_timeout
        )
        while True:
            data = await self.server.asend(routes.WAIT, body, instance=instance)
            if data.status == "done":
                return None if data.node is None else self.replicas.adopt(graph, data.node, instance)
            if data.status != "pending":
                reason = data.error or data.status
                raise ClaimLost(f"task {graph.task_id!r}: the client executing {call} gave up ({reason})")

    def resolve(
        self, graph: ToolCallGraph, state: Node, call: ToolCall, *, node: Node | None, error: BaseException | None
    ) -> None:
        self.local.resolve(graph, state, call, node=node, error=error)  # a claim taken without the server, if any
        with self._lock:
            owned = self._owned.pop((id(graph), state.id, call.digest), None)
        if owned is None:
            return
        claim_id, heartbeat, instance = owned
        heartbeat.cancel()
        if node is None:  # with a node, the insert already finished the claim on the server
            body = m.ResolveIn.model_construct(claim_id=claim_id, error=None if error is None else repr(error)[:10_000])
            try:
                self.server.send(routes.RESOLVE, body, instance=instance)
            except ReplicaDropped:
                pass  # the claim died with the server that granted it

    def record(
        self, graph: ToolCallGraph, state: Node, call: ToolCall, outcome: Outcome, *, seconds: float, read_only: bool
    ) -> Node:
        check_output(call, outcome)
        fields: dict[str, Any] = {
            "task_id": graph.task_id,
            "parent": state.id,
            "call": _call(call),
            "output": outcome.output,
            "is_error": outcome.is_error,
            "seconds": seconds,
            "read_only": read_only,
        }
        if self.epoch is not None:
            fields["epoch"] = self.epoch
        try:
            instance = self.replicas.ids_of(graph)
            data = self.server.send(routes.INSERT, m.InsertIn.model_construct(**fields), instance=instance)
            return self.replicas.adopt(graph, data.node, instance)
        except ReplicaDropped:
            return self.local.record(graph, state, call, outcome, seconds=seconds, read_only=read_only)

    # ------------------------------------------------------------------ end-of-rollout checks

    def lookup_test(self, graph: ToolCallGraph, node: Node, key: str) -> TestLookup:
        body = m.TestGetIn.model_construct(task_id=graph.task_id, node_id=node.id, key=key)
        try:
            data = self.server.send(routes.TEST_GET, body, instance=self.replicas.ids_of(graph))
        except ReplicaDropped:
            return self.local.lookup_test(graph, node, key)
        return TestLookup(found=bool(data.found), value=data.value)

    def claim_test(self, graph: ToolCallGraph, node: Node, key: str) -> Claim[Node | None]:
        return self.local.claim_test(graph, node, key)

    def resolve_test(self, graph: ToolCallGraph, node: Node, key: str, *, error: BaseException | None) -> None:
        self.local.resolve_test(graph, node, key, error=error)

    def record_test(self, graph: ToolCallGraph, node: Node, key: str, value: Any) -> None:
        try:
            canonical_json(value)
        except InvalidToolCall as error:
            raise InvalidToolCall(f"test {key!r} returned a value that is not JSON: {error}") from error
        body = m.TestPutIn.model_construct(task_id=graph.task_id, node_id=node.id, key=key, value=value)
        try:
            self.server.send(routes.TEST_PUT, body, instance=self.replicas.ids_of(graph))
        except ReplicaDropped:
            self.local.record_test(graph, node, key, value)
            return
        with self._lock:
            graph.set_test(node, key, value)  # the replica's copy: later claims of the check find it done

    # ------------------------------------------------------------------ snapshots

    def wants_snapshot(self, graph: ToolCallGraph, node: Node, *, policy: SnapshotPolicy, costs: CostModel) -> bool:
        # A dropped replica's snapshots could be shared with no one: its sessions replay instead.
        if not self.replicas.is_replica(graph):
            return False
        with self._lock:
            return policy.should_snapshot(graph, node, costs)

    def snapshot_path(self, task_id: str, node: Node) -> Path:
        return self.local.snapshot_path(task_id, node)

    def lease_snapshot(self, state: Node, kind: str, *, skip: frozenset[str] = frozenset()) -> Lease | None:
        graph = self.replicas.graph_of(state)
        if graph is None:  # a dropped replica: its snapshot markers name what the old server held
            return None
        fields: dict[str, Any] = {"task_id": graph.task_id, "state": state.state.id, "kind": kind}
        unforkable = sorted(self.local.unforkable() | skip)
        if unforkable:  # sent only when needed: a server older than this field refuses it
            fields["skip"] = unforkable[-1024:]
        try:
            instance = self.replicas.ids_of(graph)
            data = self.server.send(routes.LEASE, m.LeaseIn.model_construct(**fields), instance=instance)
            if data.lease_id is None or data.node is None:
                return None
            node = self.replicas.adopt(graph, data.node, instance)
        except ReplicaDropped:
            return None
        with self._lock:
            if node.snapshot is None and data.node.snapshot is not None:  # leased: the marker was not refreshed
                node.snapshot = Snapshot.from_json(data.node.snapshot.model_dump())
            return RemoteLease(node, data.lease_id, instance)

    def release(self, lease: Lease) -> None:
        with self._lock:
            lease.release()
        if isinstance(lease, RemoteLease):
            body = m.ReleaseIn.model_construct(lease_id=lease.lease_id)
            try:
                self.server.send(routes.RELEASE, body, instance=lease.instance)
            except ReplicaDropped:
                pass  # the lease died with the server that granted it

    def mark_unforkable(self, snapshot: Snapshot) -> None:
        self.local.mark_unforkable(snapshot)

    def attach_snapshot(
        self, graph: ToolCallGraph, node: Node, snapshot: Snapshot, *, made_by: SandboxFactory | None = None
    ) -> Attached:
        if made_by is not None:
            self.owners.own(snapshot, made_by)
        snapshot_in = m.SnapshotIn.model_construct(**snapshot.to_json())
        body = m.AttachIn.model_construct(task_id=graph.task_id, node_id=node.id, snapshot=snapshot_in)
        try:
            data = self.server.send(routes.ATTACH, body, instance=self.replicas.ids_of(graph))
        except ReplicaDropped:  # no server will ever lease it
            self.free(snapshot)
            return Attached(attached=False, evicted=(snapshot,))
        if data.attached:
            with self._lock:
                self._taken += 1
            self.replicas.sync_snapshot(graph, node, m.SnapshotOut.model_construct(**snapshot.to_json()))
        # Evicted records may be anyone's (any client can attach any path): freed only if this process made
        # them or they lie in its snapshot directory, else forgotten.
        evicted = tuple(Snapshot.from_json(old.model_dump()) for old in data.evicted)
        self._forget_evicted(evicted)
        return Attached(attached=bool(data.attached), evicted=evicted)

    def drop_snapshot(self, graph: ToolCallGraph, node: Node) -> Dropped:
        """The server forgets the snapshot (if the node still has it and no one holds a lease), then the replica
        does and its data is freed here if it is this process's to free."""
        with self._lock:
            snapshot = node.snapshot
            if snapshot is None or node.leases:  # none, or leased here (and so on the server)
                return Dropped()
        body = m.DropIn.model_construct(task_id=graph.task_id, node_id=node.id, path=snapshot.path)
        try:
            data = self.server.send(routes.DROP, body, instance=self.replicas.ids_of(graph))
            evicted = tuple(Snapshot.from_json(old.model_dump()) for old in data.evicted)
        except ReplicaDropped:  # no server holds it any more: it is unusable, so free it if it is ours
            evicted = (snapshot,)
            with self._lock:  # the session's own copy of the graph forgets it too
                if node.snapshot == snapshot and not node.leases:
                    graph.detach_snapshot(node)
        self._forget_evicted(evicted)
        return Dropped(evicted=evicted)

    def _forget_evicted(self, evicted: tuple[Snapshot, ...]) -> None:
        """Take the evicted records off the replica's nodes (the markers of what the server holds), then free
        each if it is this process's to free."""
        self.replicas.forget(evicted)
        for old in evicted:
            self.free(old)

    def detach_snapshot(self, graph: ToolCallGraph, node: Node) -> Snapshot:
        """Forget the replica's marker (the server keeps its record; leases come from it)."""
        with self._lock:
            return graph.detach_snapshot(node)

    def register_backend(self, factory: SandboxFactory) -> None:
        self.owners.register(factory)

    # ------------------------------------------------------------------ non-determinism marks

    def mark_nondeterministic(self, tool: str, reason: str, *, task_id: str | None = None) -> bool:
        # The server keeps the mark in its scope, so every client (of the task) stops serving the tool there.
        fields: dict[str, Any] = {"tool": tool, "reason": reason[:10_000]}
        if task_id is not None:
            fields["task_id"] = task_id
        body = m.NondeterministicIn.model_construct(**fields)
        self.server.send(routes.MARK_NONDETERMINISTIC, body)
        return self.local.mark_nondeterministic(tool, reason, task_id=task_id)

    def clear_nondeterministic(self, tool: str | None = None, *, task_id: str | None = None) -> int:
        """Lift the marks on the server (for every client, returning how many it held) and here."""
        body = m.ClearNondeterministicIn.model_construct(tool=tool, task_id=task_id)
        data = self.server.send(routes.CLEAR_NONDETERMINISTIC, body)
        self.local.clear_nondeterministic(tool, task_id=task_id)
        return int(data.cleared)

    def refresh_marks(self) -> None:
        """Replace the marks held here by the server's: it holds every client's (each is sent there when found),
        so a mark another client cleared is lifted here too."""
        data = self.server.send(routes.NONDETERMINISTIC, None)
        scoped: dict[str, dict[str, str]] = {}
        for mark in data.marks:
            if mark.task_id is not None:
                scoped.setdefault(mark.task_id, {})[mark.tool] = mark.reason
        self.local.replace_marks(dict(data.tools), scoped)

    def nondeterministic_marks(self, task_id: str | None = None) -> list[NondeterminismMark]:
        return self.local.nondeterministic_marks(task_id)

    def is_marked(self, tool: str, task_id: str | None = None) -> bool:
        return self.local.is_marked(tool, task_id)

    # ------------------------------------------------------------------ first-hit checks (this process's)

    def claim_check(self, task_id: str, tool: str) -> bool:
        return self.local.claim_check(task_id, tool)

    def pass_check(self, task_id: str, tool: str) -> None:
        self.local.pass_check(task_id, tool)

    def release_check(self, task_id: str, tool: str) -> None:
        self.local.release_check(task_id, tool)

    # ------------------------------------------------------------------ inspection and lifetime

    def server_stats(self) -> dict[str, Any]:
        """The server's counters (all clients), as ``GET /v1/stats``."""
        stats: dict[str, Any] = self.server.fetch(routes.STATS)
        return stats

    def stats(self) -> StoreStats:
        with self._lock:
            graphs = list(self.replicas.graphs.values())
            taken = self._taken
        return StoreStats(
            tasks=len(graphs),
            nodes=sum(len(graph) - 1 for graph in graphs),  # the roots are no calls
            snapshots=sum(len(graph.snapshot_nodes) for graph in graphs),
            snapshot_bytes=sum(graph.snapshot_bytes for graph in graphs),
            snapshots_taken=taken,
            snapshots_evicted=0,
        )

    def check_invariants(self) -> None:
        """Check the replicas (the server checks its own graphs)."""
        with self._lock:
            for graph in self.replicas.graphs.values():
                graph.check_invariants()

    def leased(self) -> bool:
        """Whether this process holds a lease on a replica's snapshot."""
        with self._lock:
            return any(node.leases for graph in self.replicas.graphs.values() for node in graph.nodes())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.server.started:
            timeout = self.server.timeout
            if self._flushing is not None:  # a flush may have taken its batch and still be sending it
                self._flushing.result(timeout=timeout)
            if self._flush_scheduled or self.replicas.touches:
                self.server.submit(self._flush_touches()).result(timeout=timeout)
        self.server.close()
        self.local.close()
        self._cleanup()

    def __repr__(self) -> str:
        return f"<HttpStore {self.url} tasks={len(self.replicas.graphs)}>"
