"""``RemoteCache``: the embedded cache's session API, with the shared state on a ``tvcache serve`` server.

Sessions (``tvcache.session``) reach shared state only through the cache's "operations for sessions"; a
``RemoteCache`` is a ``Cache`` that implements those operations with HTTP calls and keeps everything else
local: sandboxes, snapshots (files on this machine), cost models, tool specs and counters.

It keeps a *replica* of each task's graph it has seen. Nodes are immutable once inserted and the server assigns
their ids, so a replica node is exactly the server's node: a call found in the replica is a hit without a round
trip (the hit is still counted on the server, in batches, for eviction priorities). Anything not in the replica
is asked of the server and the answer inserted into the replica under the server's id.

Ids are the server's only within one server *instance*: a restarted server (or one that lost journal records)
hands the same ids out again for other states. Every answer names its instance (``X-TVCache-Instance``) and every
request naming node ids names the instance they came from, which the server refuses (409) if it is not itself.
When the instance changes, the client drops its replicas (with a warning) and new sessions read the new server;
a session already under way keeps its own copy, whose nodes are still exactly what was executed, and finishes on
it without the server (uncoalesced, unshared). A node the server sends under an id the replica knows for another
call (digest, parent or result differ) drops that task's replica the same way.

Snapshot records that come back from the server (evicted by the budget, dropped) are freed only if this process
made them, or if they lie in its ``snapshot_dir`` (``Cache._release_foreign``): any client can attach any path.

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
import threading
import warnings
import weakref
from collections.abc import Coroutine, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import httpx

from ..cache import Cache
from ..calls import ToolCall, ToolSpec, canonical_json
from ..errors import InvalidInput, InvalidToolCall, TVCacheError
from ..graph import Lease, Node, ToolCallGraph
from ..policies import CostModel, SnapshotPolicy
from ..protocol import Outcome, SandboxFactory, Snapshot
from ..session import Session

__all__ = ["ClaimLost", "RemoteCache", "ReplicaDropped", "ServerError"]

T = TypeVar("T")

INSTANCE_HEADER = "X-TVCache-Instance"  # tvcache.server.app.INSTANCE_HEADER (the client does not import the server)


class ServerError(TVCacheError):
    """The server refused a request or could not be reached. ``status`` is the HTTP status (0: unreachable)."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(message)


class ClaimLost(TVCacheError):
    """The client executing a call this session waited for failed or died; the session claims it again."""


class ReplicaDropped(ServerError):
    """The node ids of a request belong to a replica this client dropped (the server restarted, or sent a node
    that does not match the replica's). The operations for sessions catch it and go on without the server."""

    def __init__(self, message: str) -> None:
        super().__init__(409, message)


class RemoteLease(Lease):
    """A snapshot lease held on the server (the instance that granted it) as well as on the replica node."""

    __slots__ = ("instance", "lease_id")

    def __init__(self, node: Node, lease_id: str, instance: str | None) -> None:
        super().__init__(node)
        self.lease_id = lease_id
        self.instance = instance


def _call_json(call: ToolCall) -> dict[str, Any]:
    return {"name": call.name, "arguments": call.arguments}


def _message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
    except ValueError:
        return response.text[:500]
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error)


def _error_type(response: httpx.Response) -> str | None:
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    return str(error.get("type")) if isinstance(error, dict) else None


async def _finish_background() -> None:
    """Cancel what still runs on the background loop (heartbeats of claims just resolved, waits given up) and
    let it finish, so the loop stops with no task pending."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _same_node(node: Node, data: dict[str, Any]) -> bool:
    """Whether the server's node ``data`` is the replica's ``node``: the same call after the same parent, with
    the same result (ids alone are not identities across server instances)."""
    call = node.call
    parent = None if node.parent is None else node.parent.id
    return (
        data.get("parent") == parent
        and data.get("digest") == (None if call is None else call.hexdigest)
        and data.get("output") == node.output
        and data.get("is_error") == node.is_error
    )


class RemoteCache(Cache):
    """A cache whose graphs live on ``url`` (``tvcache serve``). Use like ``Cache``::

        cache = RemoteCache("http://127.0.0.1:8000", token=None)
        async with cache.session("task-1", sandbox=factory) as s:
            await s.call("sh", {"cmd": "make"})

    ``snapshot_dir``: where this client's sandboxes write snapshots (default: a private temporary directory;
    point all clients on a machine at one shared directory so they can fork each other's snapshots).
    ``claim_ttl``: how long the server waits for this client's heartbeat before letting another client take
    over a call it is executing. ``transport``: an httpx transport (tests).
    ``epoch``: the training epoch (or step) this client's calls belong to, for the server's per-epoch hit rates
    (``/v1/activity``, the dashboard); set ``cache.epoch = n`` as the run advances. ``None`` leaves calls untagged.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        tools: Iterable[ToolSpec] = (),
        snapshot_policy: SnapshotPolicy | None = None,
        snapshot_dir: str | Path | None = None,
        audit_rate: float = 0.0,
        audit_seed: int | None = 0,
        timeout: float = 60.0,
        claim_ttl: float = 30.0,
        wait_timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
        epoch: int | None = None,
    ) -> None:
        super().__init__(
            None, tools=tools, snapshot_policy=snapshot_policy, audit_rate=audit_rate, audit_seed=audit_seed
        )
        # The snapshots this client makes belong to the server's graph once attached: other workers fork them (a
        # published snapshot from the shared store) after this client is gone, and they are freed on eviction.
        # So closing frees none of them; only this client's private directory goes.
        self._cleanup.detach()
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.root, True)
        if snapshot_dir is not None:
            self.snapshot_root = Path(snapshot_dir)
        self.url = url.rstrip("/")
        self.claim_ttl = claim_ttl
        self.wait_timeout = wait_timeout
        self.epoch = epoch
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = timeout
        self._http = httpx.Client(base_url=self.url, headers=self._headers, timeout=timeout, transport=transport)
        self._roots: dict[int, ToolCallGraph] = {}  # id(root) -> graph, for the current replicas only
        # The server instance the replicas' node ids belong to (None until the server first names it).
        self._instance: str | None = None
        # Claims this client owns on the server: (id(graph), state id, call digest) -> (claim id, heartbeat, instance).
        self._owned: dict[tuple[int, int, bytes], tuple[str, Future[None], str | None]] = {}
        self._touches: dict[tuple[str, int | None], list[int]] = {}
        self._flush_scheduled = False
        self._flushing: Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._aclient: httpx.AsyncClient | None = None

    # ------------------------------------------------------------------ HTTP

    def _request(
        self, method: str, path: str, body: Any = None, params: Any = None, *, instance: str | None = None
    ) -> Any:
        """One round trip. ``instance``: the server instance the node ids in the request belong to (the server
        refuses the request if it is another one: ``ReplicaDropped``)."""
        headers = None if instance is None else {INSTANCE_HEADER: instance}
        try:
            response = self._http.request(method, path, json=body, params=params, headers=headers)
        except httpx.HTTPError as error:
            raise ServerError(0, f"cannot reach tvcache server {self.url}: {error!r}") from error
        return self._decode(response, path)

    def _decode(self, response: httpx.Response, path: str) -> Any:
        answered = response.headers.get(INSTANCE_HEADER)
        if answered is not None:
            self._note_instance(answered)
        if response.status_code == 409 and _error_type(response) == "instance_changed":
            raise ReplicaDropped(f"{self.url}{path}: {_message(response)}")
        if response.status_code >= 400:
            message = f"{self.url}{path}: HTTP {response.status_code}: {_message(response)}"
            if response.status_code in (400, 422):
                raise InvalidInput(message)
            raise ServerError(response.status_code, message)
        return response.json()

    async def _arequest(self, path: str, body: Any, *, instance: str | None = None) -> Any:
        if self._aclient is None:
            self._aclient = httpx.AsyncClient(base_url=self.url, headers=self._headers, timeout=self._timeout + 60)
        headers = None if instance is None else {INSTANCE_HEADER: instance}
        try:
            response = await self._aclient.post(path, json=body, headers=headers)
        except httpx.HTTPError as error:
            raise ServerError(0, f"cannot reach tvcache server {self.url}: {error!r}") from error
        return self._decode(response, path)

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
            graph = super().graph(task_id)
            self._roots[id(graph.root)] = graph
            return graph

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

    def _adopt(self, graph: ToolCallGraph, data: dict[str, Any], instance: str | None) -> Node:
        """The replica node for the server's node ``data`` (from ``instance``), inserted (with any missing
        ancestors) if new. A node the replica knows under that id for another call drops the replica:
        ReplicaDropped."""
        node = graph.get(data["id"])
        if node is not None and not _same_node(node, data):
            with self._lock:
                current = self._graphs.get(graph.task_id) is graph
                if current:
                    self._drop_replicas(graph.task_id)
            if current:
                warnings.warn(
                    f"tvcache server {self.url}: node {data['id']} of task {graph.task_id!r} does not match what "
                    "this client holds under that id (the server lost records, or is another one): dropped its "
                    "replica of the task; rollouts under way finish on their own copy",
                    RuntimeWarning,
                    stacklevel=2,
                )
            raise ReplicaDropped(f"task {graph.task_id!r}: node {data['id']} is another node on the server now")
        if node is None:
            parent_id = data["parent"]
            if graph.get(parent_id) is None:  # inserted by another client: fetch the path down to it
                params = {"task_id": graph.task_id, "node_id": parent_id}
                path = self._request("GET", "/v1/path", params=params, instance=instance)
                for ancestor in path["nodes"]:
                    self._adopt(graph, ancestor, instance)
            call = ToolCall(data["name"], data["arguments"])
            if call.hexdigest != data["digest"]:
                raise ServerError(200, f"node {data['id']} of {graph.task_id!r}: the call's digest does not match")
            with self._lock:
                parent = graph.node(parent_id)
                node = graph.insert(
                    parent,
                    call,
                    output=data["output"],
                    is_error=data["is_error"],
                    seconds=data["seconds"],
                    read_only=data["read_only"],
                    node_id=data["id"],
                )
            if node.id != data["id"]:
                raise ServerError(200, f"task {graph.task_id!r}: replica and server disagree on node {data['id']}")
        self._sync_snapshot(graph, node, data.get("snapshot"))
        return node

    def _sync_snapshot(self, graph: ToolCallGraph, node: Node, data: dict[str, Any] | None) -> None:
        """Mirror the server's snapshot marker (used for cost estimates; leases come from the server)."""
        snapshot = None if data is None else Snapshot.from_json(data)
        with self._lock:
            if node.snapshot == snapshot or node.leases:
                return
            if node.snapshot is not None:
                graph.detach_snapshot(node)
            if snapshot is not None:
                graph.attach_snapshot(node, snapshot)

    # ------------------------------------------------------------------ operations for sessions
    # Each operation on a dropped replica (``ReplicaDropped``, before or during its request) goes on without the
    # server: ``Cache``'s own implementation on the session's copy of the graph, which only that session sees.

    def session(self, task_id: str, *, sandbox: SandboxFactory) -> Session:
        self._refresh_nondeterministic()
        return super().session(task_id, sandbox=sandbox)

    def _lookup(self, graph: ToolCallGraph, state: Node, call: ToolCall) -> Node | None:
        node = state.step(call)
        if node is not None:
            self._touch(graph, node)
            return node
        body = {"task_id": graph.task_id, "state": state.id, "call": _call_json(call)}
        try:
            instance = self._ids_of(graph)
            data = self._request("POST", "/v1/lookup", self._tagged(body), instance=instance)
            return None if data["node"] is None else self._adopt(graph, data["node"], instance)
        except ReplicaDropped:
            return None

    def _tagged(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with this client's epoch, if it has one (servers before epochs reject the field)."""
        return body if self.epoch is None else {**body, "epoch": self.epoch}

    def _touch(self, graph: ToolCallGraph, node: Node) -> None:
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
            for start in range(0, len(node_ids), 10_000):
                body: dict[str, Any] = {"task_id": task_id, "node_ids": node_ids[start : start + 10_000]}
                if epoch is not None:
                    body["epoch"] = epoch
                try:
                    await self._arequest("/v1/touch", body, instance=instance)
                except TVCacheError:
                    pass  # hit counts only steer eviction; losing some never affects results

    def _claim(self, graph: ToolCallGraph, state: Node, call: ToolCall) -> tuple[bool, Future[Node | None]]:
        body = {"task_id": graph.task_id, "state": state.id, "call": _call_json(call), "ttl": self.claim_ttl}
        try:
            instance = self._ids_of(graph)
            data = self._request("POST", "/v1/claim", body, instance=instance)
            status = data["status"]
            if status == "hit":
                done: Future[Node | None] = Future()
                done.set_result(self._adopt(graph, data["node"], instance))
                return False, done
        except ReplicaDropped:
            return super()._claim(graph, state, call)
        if status == "owner":
            claim_id = data["claim_id"]
            heartbeat = self._submit(self._heartbeat(claim_id, float(data["ttl"]), instance))
            with self._lock:
                self._owned[(id(graph), state.id, call.digest)] = (claim_id, heartbeat, instance)
            return True, Future()
        return False, self._submit(self._wait(graph, state, call, instance))

    async def _heartbeat(self, claim_id: str, ttl: float, instance: str | None) -> None:
        while True:
            await asyncio.sleep(ttl / 3)
            try:
                await self._arequest("/v1/claim/heartbeat", {"claim_id": claim_id, "ttl": ttl}, instance=instance)
            except ReplicaDropped:
                return  # the server that granted the claim is gone
            except ServerError as error:
                if error.status == 404:  # taken over or finished: nothing left to renew
                    return

    async def _wait(self, graph: ToolCallGraph, state: Node, call: ToolCall, instance: str | None) -> Node | None:
        body = {"task_id": graph.task_id, "state": state.id, "call": _call_json(call), "timeout": self.wait_timeout}
        while True:
            data = await self._arequest("/v1/claim/wait", body, instance=instance)
            status = data["status"]
            if status == "done":
                return None if data["node"] is None else self._adopt(graph, data["node"], instance)
            if status != "pending":
                reason = data.get("error") or status
                raise ClaimLost(f"task {graph.task_id!r}: the client executing {call} gave up ({reason})")

    def _resolve(
        self, graph: ToolCallGraph, state: Node, call: ToolCall, node: Node | None, error: BaseException | None
    ) -> None:
        super()._resolve(graph, state, call, node, error)  # a claim taken without the server, if any
        with self._lock:
            owned = self._owned.pop((id(graph), state.id, call.digest), None)
        if owned is None:
            return
        claim_id, heartbeat, instance = owned
        heartbeat.cancel()
        if node is None:  # with a node, the insert already finished the claim on the server
            body = {"claim_id": claim_id, "error": None if error is None else repr(error)[:10_000]}
            try:
                self._request("POST", "/v1/claim/resolve", body, instance=instance)
            except ReplicaDropped:
                pass  # the claim died with the server that granted it

    def _record(
        self, graph: ToolCallGraph, state: Node, call: ToolCall, outcome: Outcome, seconds: float, read_only: bool
    ) -> Node:
        body = {
            "task_id": graph.task_id,
            "parent": state.id,
            "call": _call_json(call),
            "output": outcome.output,
            "is_error": outcome.is_error,
            "seconds": seconds,
            "read_only": read_only,
        }
        try:
            instance = self._ids_of(graph)
            data = self._request("POST", "/v1/insert", self._tagged(body), instance=instance)
            return self._adopt(graph, data["node"], instance)
        except ReplicaDropped:
            return super()._record(graph, state, call, outcome, seconds, read_only)

    def _lookup_test(self, graph: ToolCallGraph, node: Node, key: str) -> tuple[bool, Any]:
        body = {"task_id": graph.task_id, "node_id": node.id, "key": key}
        try:
            data = self._request("POST", "/v1/tests/get", body, instance=self._ids_of(graph))
        except ReplicaDropped:
            return super()._lookup_test(graph, node, key)
        return bool(data["found"]), data.get("value")

    def _record_test(self, graph: ToolCallGraph, node: Node, key: str, value: Any) -> None:
        try:
            canonical_json(value)
        except InvalidToolCall as error:
            raise InvalidToolCall(f"test {key!r} returned a value that is not JSON: {error}") from error
        body = {"task_id": graph.task_id, "node_id": node.id, "key": key, "value": value}
        try:
            self._request("POST", "/v1/tests/put", body, instance=self._ids_of(graph))
        except ReplicaDropped:
            super()._record_test(graph, node, key, value)

    def _wants_snapshot(self, graph: ToolCallGraph, node: Node, costs: CostModel) -> bool:
        # A dropped replica's snapshots could be shared with no one: its sessions replay instead.
        return self._is_replica(graph) and super()._wants_snapshot(graph, node, costs)

    def _lease_snapshot(self, state: Node, kind: str, *, skip: frozenset[str] = frozenset()) -> Lease | None:
        graph = self._graph_of(state)
        if graph is None:  # a dropped replica: its snapshot markers name what the old server held
            return None
        body: dict[str, Any] = {"task_id": graph.task_id, "state": state.state.id, "kind": kind}
        with self._lock:
            unforkable = sorted(self._unforkable_here | skip)
        if unforkable:  # sent only when needed: a server older than this field refuses it
            body["skip"] = unforkable[-1024:]
        try:
            instance = self._ids_of(graph)
            data = self._request("POST", "/v1/snapshots/lease", body, instance=instance)
            if data["lease_id"] is None:
                return None
            node = self._adopt(graph, data["node"], instance)
        except ReplicaDropped:
            return None
        with self._lock:
            if node.snapshot is None:  # leased locally: the marker could not be refreshed
                node.snapshot = Snapshot.from_json(data["node"]["snapshot"])
            return RemoteLease(node, data["lease_id"], instance)

    def _release(self, lease: Lease) -> None:
        with self._lock:
            lease.release()
        if isinstance(lease, RemoteLease):
            try:
                self._request("POST", "/v1/snapshots/release", {"lease_id": lease.lease_id}, instance=lease.instance)
            except ReplicaDropped:
                pass  # the lease died with the server that granted it

    def _drop_snapshot(self, graph: ToolCallGraph, node: Node) -> None:
        """The server forgets the snapshot (if the node still has it and no one holds a lease), then its data is
        freed here if it is this client's to free; the replica forgets it either way."""
        with self._lock:
            snapshot = node.snapshot
            if snapshot is None:
                return
            graph.detach_snapshot(node)
        body = {"task_id": graph.task_id, "node_id": node.id, "path": snapshot.path}
        try:
            data = self._request("POST", "/v1/snapshots/drop", body, instance=self._ids_of(graph))
        except ReplicaDropped:  # no server holds it any more: it is unusable, so free it if it is ours
            self._free_snapshot(snapshot)
            return
        for old in data["evicted"]:
            self._free_snapshot(Snapshot.from_json(old))

    def _attach_snapshot(self, graph: ToolCallGraph, node: Node, snapshot: Snapshot) -> bool:
        body = {"task_id": graph.task_id, "node_id": node.id, "snapshot": snapshot.to_json()}
        try:
            data = self._request("POST", "/v1/snapshots/attach", body, instance=self._ids_of(graph))
        except ReplicaDropped:  # no server will ever lease it
            self._free_snapshot(snapshot)
            return False
        if data["attached"]:
            self._count("snapshots_taken")
            self._sync_snapshot(graph, node, snapshot.to_json())
        # Evicted records may be anyone's (any client can attach any path): freed only if this process made
        # them or they lie in its snapshot directory (``Cache._free_snapshot``), else forgotten.
        for old in data["evicted"]:
            self._free_snapshot(Snapshot.from_json(old))
        return bool(data["attached"])

    def mark_nondeterministic(self, tool: str, reason: str) -> None:
        self._request("POST", "/v1/tools/nondeterministic", {"tool": tool, "reason": reason[:10_000]})
        super().mark_nondeterministic(tool, reason)

    def _mark_nondeterministic_in(self, task_id: str, tool: str, reason: str) -> None:
        # The server keeps the mark in its scope, so every client of the task stops serving the tool there.
        self._request(
            "POST", "/v1/tools/nondeterministic", {"tool": tool, "reason": reason[:10_000], "task_id": task_id}
        )
        super()._mark_nondeterministic_in(task_id, tool, reason)

    def clear_nondeterministic(self, tool: str | None = None, *, task_id: str | None = None) -> int:
        """Lift the marks on the server (for every client, returning how many it held) and here."""
        data = self._request("POST", "/v1/tools/nondeterministic/clear", {"tool": tool, "task_id": task_id})
        super().clear_nondeterministic(tool, task_id=task_id)
        return int(data["cleared"])

    def _refresh_nondeterministic(self) -> None:
        data = self._request("GET", "/v1/tools/nondeterministic")
        # The server holds every client's marks (each is sent there when found), so its set replaces ours: a mark
        # another client cleared is lifted here too.
        scoped: dict[str, dict[str, str]] = {}
        for mark in data.get("marks", []):
            if mark["task_id"] is not None:
                scoped.setdefault(mark["task_id"], {})[mark["tool"]] = mark["reason"]
        with self._lock:
            self._nondeterministic = dict(data["tools"])
            self._nondeterministic_in = scoped

    # ------------------------------------------------------------------ inspection and lifetime

    def server_stats(self) -> dict[str, Any]:
        """The server's counters (all clients), as ``GET /v1/stats``."""
        stats: dict[str, Any] = self._request("GET", "/v1/stats")
        return stats

    def close(self) -> None:
        if self._closed:
            return
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
        super().close()

    def __enter__(self) -> RemoteCache:
        return self

    def __repr__(self) -> str:
        return f"<RemoteCache {self.url} tasks={len(self._graphs)}>"
