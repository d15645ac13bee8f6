"""``HttpStore``: the graph store (``tvcache.store.protocol``) over a ``tvcache serve`` server's native API.

Requests and answers are the server's own models (``tvcache.api.models``) sent to the routes of its one table
(``tvcache.api.routes``), and refusals become exceptions through its one error table (``tvcache.api.errors``).
The transport is the seam: ``transport`` (blocking requests) and ``async_transport`` (long-polls, heartbeats,
batched hit counts) are httpx transports, by default HTTP over the network; tests pass the real app in-process,
and ``tvcache.integrations.ray`` passes one that hands requests to a shard actor.

It keeps a *replica* of each task's graph it has seen. Nodes are immutable once inserted and the server assigns
their ids, so a replica node is exactly the server's node: a call found in the replica is a hit without a round
trip (the hit is still counted on the server, in batches, for eviction priorities). Anything not in the replica
is asked of the server and the answer inserted into the replica under the server's id.

Ids are the server's only within one server *instance*: a restarted server (or one that lost journal records)
hands the same ids out again for other states. Every answer names its instance (``X-TVCache-Instance``) and every
request naming node ids names the instance they came from, which the server refuses (409) if it is not itself.
When the instance changes, the store drops its replicas (with a warning) and new sessions read the new server;
a session already under way keeps its own copy, whose nodes are still exactly what was executed, and finishes on
it without the server (uncoalesced, unshared). A node the server sends under an id the replica knows for another
call (digest, parent or result differ) drops that task's replica the same way.

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
import json
import shutil
import tempfile
import threading
import warnings
import weakref
from collections.abc import Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from ..api import models as m
from ..api.errors import client_error
from ..calls import ToolCall, canonical_json
from ..errors import ClaimLost, InvalidToolCall, ReplicaDropped, SandboxError, ServerError, TVCacheError
from ..graph import Lease, Node, ToolCallGraph
from ..policies import CostModel, SnapshotPolicy
from ..protocol import Outcome, SandboxFactory, Snapshot
from ..results import NondeterminismMark
from .inflight import Inflight
from .local import LocalStore, check_task_id
from .owners import SnapshotOwners
from .protocol import Attached, Claim, Dropped, StoreStats, TestLookup

__all__ = ["INSTANCE_HEADER", "HttpStore", "RemoteLease"]

T = TypeVar("T")
R = TypeVar("R", bound=BaseModel)

INSTANCE_HEADER = "X-TVCache-Instance"  # tvcache.server.app.INSTANCE_HEADER (the store does not import the server)
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


def _body(model: BaseModel) -> bytes:
    """The request body: the fields set, as strict JSON (a NaN is refused here, not sent as null)."""
    return json.dumps(model.model_dump(exclude_unset=True), ensure_ascii=False, allow_nan=False).encode()


def _error_of(response: httpx.Response) -> tuple[str | None, str]:
    """The error type and message of a refusal."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return None, response.text[:500]
    if isinstance(error, dict):
        kind = error.get("type")
        return (None if kind is None else str(kind)), str(error.get("message", error))
    return None, str(error)


async def _finish_background() -> None:
    """Cancel what still runs on the background loop (heartbeats of claims just resolved, waits given up) and
    let it finish, so the loop stops with no task pending."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


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
        claim_ttl: float = 30.0,
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
        self._graphs: dict[str, ToolCallGraph] = {}
        self._roots: dict[int, ToolCallGraph] = {}  # id(root) -> graph, for the current replicas only
        self._instance: str | None = None  # the server instance the replicas' ids belong to (None: not named yet)
        # Claims this client owns on the server: (id(graph), state id, call digest) -> (claim id, heartbeat, instance).
        self._owned: dict[tuple[int, int, bytes], tuple[str, Future[None], str | None]] = {}
        self._touches: dict[tuple[str, int | None], list[int]] = {}
        self._flush_scheduled = False
        self._flushing: Future[None] | None = None
        self._taken = 0
        self._closed = False
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = timeout
        self._http = httpx.Client(base_url=self.url, headers=self._headers, timeout=timeout, transport=transport)
        given: object = transport
        if async_transport is None and isinstance(given, httpx.AsyncBaseTransport):
            async_transport = given  # one transport for both clients (the Ray shards')
        self._async_transport = async_transport
        self._aclient: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None

    @property
    def snapshot_root(self) -> Path:
        return self._snapshot_root

    # ------------------------------------------------------------------ HTTP

    def request(
        self, method: str, path: str, body: BaseModel | None, reply: type[R], *, instance: str | None = None,
        params: dict[str, Any] | None = None,
    ) -> R:  # fmt: skip
        """One blocking round trip: ``body`` to ``method path``, the answer read as ``reply``. ``instance``: the
        server instance the node ids in the request belong to (the server refuses another: ``ReplicaDropped``)."""
        return reply.model_validate_json(self._send(method, path, body, instance=instance, params=params))

    def _send(
        self, method: str, path: str, body: BaseModel | None, *, instance: str | None = None,
        params: dict[str, Any] | None = None,
    ) -> bytes:  # fmt: skip
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if instance is not None:
            headers[INSTANCE_HEADER] = instance
        content = None if body is None else _body(body)
        try:
            response = self._http.request(method, path, content=content, params=params, headers=headers)
        except httpx.HTTPError as error:
            raise ServerError(0, f"cannot reach tvcache server {self.url}: {error!r}") from error
        return self._decode(response, path)

    async def arequest(self, path: str, body: BaseModel, reply: type[R], *, instance: str | None = None) -> R:
        """``request`` for the background loop (POST only)."""
        if self._aclient is None:
            self._aclient = httpx.AsyncClient(
                base_url=self.url, headers=self._headers, timeout=self._timeout + 60, transport=self._async_transport
            )
        headers = {"Content-Type": "application/json"}
        if instance is not None:
            headers[INSTANCE_HEADER] = instance
        try:
            response = await self._aclient.post(path, content=_body(body), headers=headers)
        except httpx.HTTPError as error:
            raise ServerError(0, f"cannot reach tvcache server {self.url}: {error!r}") from error
        return reply.model_validate_json(self._decode(response, path))

    def _decode(self, response: httpx.Response, path: str) -> bytes:
        answered = response.headers.get(INSTANCE_HEADER)
        if answered is not None:
            self._note_instance(answered)
        status = response.status_code
        if status >= 400:
            kind, message = _error_of(response)
            raise client_error(status, kind, f"{self.url}{path}: HTTP {status}: {message}")
        return response.content

    def _background(self) -> asyncio.AbstractEventLoop:
        """A loop on a daemon thread for long-polls, heartbeats and batched hit counts."""
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="tvcache-remote", daemon=True)
                thread.start()
                self._loop, self._loop_thread = loop, thread
            return self._loop

    def _submit(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self._background())

    # ------------------------------------------------------------------ replica

    def graph(self, task_id: str) -> ToolCallGraph:
        with self._lock:
            graph = self._graphs.get(task_id)
            if graph is None:
                check_task_id(task_id)
                graph = self._graphs[task_id] = ToolCallGraph(task_id, clock=self.local.clock)
                self._roots[id(graph.root)] = graph
            return graph

    def tasks(self) -> list[str]:
        with self._lock:
            return list(self._graphs)

    def has_task(self, task_id: object) -> bool:
        return task_id in self._graphs

    def _graph_of(self, node: Node) -> ToolCallGraph | None:
        """The current replica ``node`` belongs to; None for a dropped one."""
        root = node
        while root.parent is not None:
            root = root.parent
        with self._lock:
            return self._roots.get(id(root))

    def _ids_of(self, graph: ToolCallGraph) -> str | None:
        """The server instance ``graph``'s node ids belong to; ReplicaDropped if it is no longer the replica
        (read together, under the lock: a request must never carry a dropped replica's ids to a new instance)."""
        with self._lock:
            if self._graphs.get(graph.task_id) is not graph:
                raise ReplicaDropped(f"task {graph.task_id!r}: this replica was dropped")
            return self._instance

    def _is_replica(self, graph: ToolCallGraph) -> bool:
        with self._lock:
            return self._graphs.get(graph.task_id) is graph

    def _note_instance(self, answered: str) -> None:
        """The server named its instance: on a change, every replica's ids may name other states now."""
        with self._lock:
            before = self._instance
            if before == answered:
                return
            self._instance = answered
            if before is None:
                return
            dropped = self._drop_replicas(None)
        warnings.warn(
            f"tvcache server {self.url} restarted (instance {before} is now {answered}): dropped what this client "
            f"held of {dropped} task(s); rollouts under way finish on their own copy, new ones read the server again",
            RuntimeWarning,
            stacklevel=2,
        )

    def _drop_replicas(self, task_id: str | None) -> int:
        """Forget the replica of ``task_id`` (None: of every task); the caller holds the lock. Sessions still on a
        dropped replica keep it (``_ids_of`` tells them apart) and go on without the server."""
        task_ids = list(self._graphs) if task_id is None else [task_id]
        for name in task_ids:
            graph = self._graphs.pop(name, None)
            if graph is not None:
                self._roots.pop(id(graph.root), None)
        if task_id is None:
            self._touches.clear()  # hit counts of the old ids must not reach the new instance
        else:
            for key in [key for key in self._touches if key[0] == task_id]:
                del self._touches[key]
        return len(task_ids)

    def _adopt(self, graph: ToolCallGraph, data: m.NodeOut, instance: str | None) -> Node:
        """The replica node for the server's node ``data`` (from ``instance``), inserted (with any missing
        ancestors) if new. A node the replica knows under that id for another call drops the replica:
        ReplicaDropped."""
        node = graph.get(data.id)
        if node is not None and not _same_node(node, data):
            with self._lock:
                current = self._graphs.get(graph.task_id) is graph
                if current:
                    self._drop_replicas(graph.task_id)
            if current:
                warnings.warn(
                    f"tvcache server {self.url}: node {data.id} of task {graph.task_id!r} does not match what "
                    "this client holds under that id (the server lost records, or is another one): dropped its "
                    "replica of the task; rollouts under way finish on their own copy",
                    RuntimeWarning,
                    stacklevel=2,
                )
            raise ReplicaDropped(f"task {graph.task_id!r}: node {data.id} is another node on the server now")
        if node is None:
            parent_id = data.parent
            if parent_id is None:
                raise ServerError(200, f"task {graph.task_id!r}: the server sent node {data.id} without a parent")
            if graph.get(parent_id) is None:  # inserted by another client: fetch the path down to it
                params = {"task_id": graph.task_id, "node_id": parent_id}
                path = self.request("GET", "/v1/path", None, m.PathOut, params=params, instance=instance)
                for ancestor in path.nodes:
                    self._adopt(graph, ancestor, instance)
            call = ToolCall(data.name or "", data.arguments or {})
            if call.hexdigest != data.digest:
                raise ServerError(200, f"node {data.id} of {graph.task_id!r}: the call's digest does not match")
            with self._lock:
                parent = graph.node(parent_id)
                node = graph.insert(
                    parent,
                    call,
                    output=data.output,
                    is_error=data.is_error,
                    seconds=data.seconds,
                    read_only=data.read_only,
                    node_id=data.id,
                )
            if node.id != data.id:
                raise ServerError(200, f"task {graph.task_id!r}: replica and server disagree on node {data.id}")
        self._sync_snapshot(graph, node, data.snapshot)
        return node

    def _sync_snapshot(self, graph: ToolCallGraph, node: Node, data: m.SnapshotOut | None) -> None:
        """Mirror the server's snapshot marker (used for cost estimates; leases come from the server)."""
        snapshot = None if data is None else Snapshot.from_json(data.model_dump())
        with self._lock:
            if node.snapshot == snapshot or node.leases:
                return
            if node.snapshot is not None:
                graph.detach_snapshot(node)
            if snapshot is not None:
                graph.attach_snapshot(node, snapshot)

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
            instance = self._ids_of(graph)
            data = self.request("POST", "/v1/lookup", body, m.LookupOut, instance=instance)
            return None if data.node is None else self._adopt(graph, data.node, instance)
        except ReplicaDropped:
            return None

    def touch(self, graph: ToolCallGraph, node: Node) -> None:
        with self._lock:
            graph.touch(node)
            if self._graphs.get(graph.task_id) is not graph:  # a dropped replica: its ids are not the server's
                return
            self._touches.setdefault((graph.task_id, self.epoch), []).append(node.id)
            if self._flush_scheduled:
                return
            self._flush_scheduled = True
        self._flushing = self._submit(self._flush_touches())

    async def _flush_touches(self) -> None:
        with self._lock:
            touches, self._touches = self._touches, {}
            self._flush_scheduled = False
            instance = self._instance
        for (task_id, epoch), node_ids in touches.items():
            for start in range(0, len(node_ids), TOUCH_BATCH):
                batch = node_ids[start : start + TOUCH_BATCH]
                if epoch is None:
                    body = m.TouchIn.model_construct(task_id=task_id, node_ids=batch)
                else:
                    body = m.TouchIn.model_construct(task_id=task_id, node_ids=batch, epoch=epoch)
                try:
                    await self.arequest("/v1/touch", body, m.OkOut, instance=instance)
                except TVCacheError:
                    pass  # hit counts only steer eviction; losing some never affects results

    def claim(self, graph: ToolCallGraph, state: Node, call: ToolCall) -> Claim[Node | None]:
        body = m.ClaimIn.model_construct(task_id=graph.task_id, state=state.id, call=_call(call), ttl=self.claim_ttl)
        try:
            instance = self._ids_of(graph)
            data = self.request("POST", "/v1/claim", body, m.ClaimOut, instance=instance)
            if data.status == "hit" and data.node is not None:
                return Inflight.done(self._adopt(graph, data.node, instance))
        except ReplicaDropped:
            return self.local.claim(graph, state, call)
        if data.status == "owner" and data.claim_id is not None:
            ttl = self.claim_ttl if data.ttl is None else float(data.ttl)
            heartbeat = self._submit(self._heartbeat(data.claim_id, ttl, instance))
            with self._lock:
                self._owned[(id(graph), state.id, call.digest)] = (data.claim_id, heartbeat, instance)
            return Claim(owner=True, ready=Future())
        return Claim(owner=False, ready=self._submit(self._wait(graph, state, call, instance)))

    async def _heartbeat(self, claim_id: str, ttl: float, instance: str | None) -> None:
        while True:
            await asyncio.sleep(ttl / 3)
            try:
                body = m.HeartbeatIn.model_construct(claim_id=claim_id, ttl=ttl)
                await self.arequest("/v1/claim/heartbeat", body, m.ClaimOut, instance=instance)
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
            data = await self.arequest("/v1/claim/wait", body, m.WaitOut, instance=instance)
            if data.status == "done":
                return None if data.node is None else self._adopt(graph, data.node, instance)
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
                self.request("POST", "/v1/claim/resolve", body, m.OkOut, instance=instance)
            except ReplicaDropped:
                pass  # the claim died with the server that granted it

    def record(
        self, graph: ToolCallGraph, state: Node, call: ToolCall, outcome: Outcome, *, seconds: float, read_only: bool
    ) -> Node:
        try:
            outcome.output.encode()
        except UnicodeEncodeError as error:
            raise SandboxError(
                f"the sandbox returned output for {call} that is not valid Unicode ({error.reason}); backends "
                "must decode tool output with errors='replace'"
            ) from error
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
            instance = self._ids_of(graph)
            data = self.request(
                "POST", "/v1/insert", m.InsertIn.model_construct(**fields), m.InsertOut, instance=instance
            )
            return self._adopt(graph, data.node, instance)
        except ReplicaDropped:
            return self.local.record(graph, state, call, outcome, seconds=seconds, read_only=read_only)

    # ------------------------------------------------------------------ end-of-rollout checks

    def lookup_test(self, graph: ToolCallGraph, node: Node, key: str) -> TestLookup:
        body = m.TestGetIn.model_construct(task_id=graph.task_id, node_id=node.id, key=key)
        try:
            data = self.request("POST", "/v1/tests/get", body, m.TestOut, instance=self._ids_of(graph))
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
            self.request("POST", "/v1/tests/put", body, m.OkOut, instance=self._ids_of(graph))
        except ReplicaDropped:
            self.local.record_test(graph, node, key, value)
            return
        with self._lock:
            graph.set_test(node, key, value)  # the replica's copy: later claims of the check find it done

    # ------------------------------------------------------------------ snapshots

    def wants_snapshot(self, graph: ToolCallGraph, node: Node, *, policy: SnapshotPolicy, costs: CostModel) -> bool:
        # A dropped replica's snapshots could be shared with no one: its sessions replay instead.
        if not self._is_replica(graph):
            return False
        with self._lock:
            return policy.should_snapshot(graph, node, costs)

    def snapshot_path(self, task_id: str, node: Node) -> Path:
        return self.local.snapshot_path(task_id, node)

    def lease_snapshot(self, state: Node, kind: str, *, skip: frozenset[str] = frozenset()) -> Lease | None:
        graph = self._graph_of(state)
        if graph is None:  # a dropped replica: its snapshot markers name what the old server held
            return None
        fields: dict[str, Any] = {"task_id": graph.task_id, "state": state.state.id, "kind": kind}
        unforkable = sorted(self.local.unforkable() | skip)
        if unforkable:  # sent only when needed: a server older than this field refuses it
            fields["skip"] = unforkable[-1024:]
        try:
            instance = self._ids_of(graph)
            data = self.request("POST", "/v1/snapshots/lease", m.LeaseIn.model_construct(**fields), m.LeaseOut,
                                instance=instance)  # fmt: skip
            if data.lease_id is None or data.node is None:
                return None
            node = self._adopt(graph, data.node, instance)
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
                self.request("POST", "/v1/snapshots/release", body, m.OkOut, instance=lease.instance)
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
            data = self.request("POST", "/v1/snapshots/attach", body, m.AttachOut, instance=self._ids_of(graph))
        except ReplicaDropped:  # no server will ever lease it
            self.free(snapshot)
            return Attached(attached=False, evicted=(snapshot,))
        if data.attached:
            with self._lock:
                self._taken += 1
            self._sync_snapshot(graph, node, m.SnapshotOut.model_construct(**snapshot.to_json()))
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
            data = self.request("POST", "/v1/snapshots/drop", body, m.DropOut, instance=self._ids_of(graph))
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
        if evicted:
            paths = {snapshot.path for snapshot in evicted}
            with self._lock:
                for graph in [*self._graphs.values()]:
                    for held in [*graph.snapshot_nodes.values()]:
                        if held.snapshot is not None and held.snapshot.path in paths and not held.leases:
                            graph.detach_snapshot(held)
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
        self.request("POST", "/v1/tools/nondeterministic", body, m.NondeterministicOut)
        return self.local.mark_nondeterministic(tool, reason, task_id=task_id)

    def clear_nondeterministic(self, tool: str | None = None, *, task_id: str | None = None) -> int:
        """Lift the marks on the server (for every client, returning how many it held) and here."""
        body = m.ClearNondeterministicIn.model_construct(tool=tool, task_id=task_id)
        data = self.request("POST", "/v1/tools/nondeterministic/clear", body, m.ClearedOut)
        self.local.clear_nondeterministic(tool, task_id=task_id)
        return int(data.cleared)

    def refresh_marks(self) -> None:
        """Replace the marks held here by the server's: it holds every client's (each is sent there when found),
        so a mark another client cleared is lifted here too."""
        data = self.request("GET", "/v1/tools/nondeterministic", None, m.NondeterministicOut)
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
        stats: dict[str, Any] = json.loads(self._send("GET", "/v1/stats", None))
        return stats

    def stats(self) -> StoreStats:
        with self._lock:
            graphs = list(self._graphs.values())
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
            for graph in self._graphs.values():
                graph.check_invariants()

    def leased(self) -> bool:
        """Whether this process holds a lease on a replica's snapshot."""
        with self._lock:
            return any(node.leases for graph in self._graphs.values() for node in graph.nodes())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        loop, thread = self._loop, self._loop_thread
        if loop is not None and thread is not None:
            if self._flushing is not None:  # a flush may have taken its batch and still be sending it
                self._flushing.result(timeout=self._timeout)
            if self._flush_scheduled or self._touches:
                self._submit(self._flush_touches()).result(timeout=self._timeout)
            self._submit(_finish_background()).result(timeout=self._timeout)
            if self._aclient is not None:
                self._submit(self._aclient.aclose()).result(timeout=self._timeout)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(self._timeout)
            loop.close()
        self._http.close()
        self.local.close()
        self._cleanup()

    def __repr__(self) -> str:
        return f"<HttpStore {self.url} tasks={len(self._graphs)}>"
