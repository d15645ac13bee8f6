"""``RemoteCache``: the embedded cache's session API, with the shared state on a ``tvcache serve`` server.

Sessions (``tvcache.session``) reach shared state only through the cache's "operations for sessions"; a
``RemoteCache`` is a ``Cache`` that implements those operations with HTTP calls and keeps everything else
local: sandboxes, snapshots (files on this machine), cost models, tool specs and counters.

It keeps a *replica* of each task's graph it has seen. Nodes are immutable once inserted and the server assigns
their ids, so a replica node is exactly the server's node: a call found in the replica is a hit without a round
trip (the hit is still counted on the server, in batches, for eviction priorities). Anything not in the replica
is asked of the server and the answer inserted into the replica under the server's id.

In-flight coalescing works across clients: a missed call is *claimed* on the server; other clients missing it
long-poll until the owner inserts it. The owner renews its claim by heartbeat while it executes; if it dies the
claim expires after ``claim_ttl`` and a waiting client takes over.

The operations are synchronous (that is the session seam): each server round trip blocks the calling event
loop for its duration (a fraction of a millisecond on one machine). Waiting for another client's execution does
not block: it runs on a background loop and the session awaits it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import httpx

from ..cache import Cache, InflightKey
from ..calls import ToolCall, ToolSpec, canonical_json
from ..errors import InvalidInput, InvalidToolCall, TVCacheError
from ..graph import Lease, Node, ToolCallGraph
from ..policies import SnapshotPolicy
from ..protocol import Outcome, SandboxFactory, Snapshot
from ..session import Session
from ..snapshots.publication import PUBLISHED

__all__ = ["ClaimLost", "RemoteCache", "ServerError"]

T = TypeVar("T")


class ServerError(TVCacheError):
    """The server refused a request or could not be reached. ``status`` is the HTTP status (0: unreachable)."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(message)


class ClaimLost(TVCacheError):
    """The client executing a call this session waited for failed or died; the session claims it again."""


class RemoteLease(Lease):
    """A snapshot lease held on the server as well as on the replica node."""

    __slots__ = ("lease_id",)

    def __init__(self, node: Node, lease_id: str) -> None:
        super().__init__(node)
        self.lease_id = lease_id


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
        if snapshot_dir is not None:
            self.snapshot_root = Path(snapshot_dir)
        self.url = url.rstrip("/")
        self.claim_ttl = claim_ttl
        self.wait_timeout = wait_timeout
        self.epoch = epoch
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = timeout
        self._http = httpx.Client(base_url=self.url, headers=self._headers, timeout=timeout, transport=transport)
        self._roots: dict[int, ToolCallGraph] = {}
        self._owned: dict[InflightKey, tuple[str, Future[None]]] = {}
        self._touches: dict[tuple[str, int | None], list[int]] = {}
        self._flush_scheduled = False
        self._flushing: Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._aclient: httpx.AsyncClient | None = None

    # ------------------------------------------------------------------ HTTP

    def _request(self, method: str, path: str, body: Any = None, params: Any = None) -> Any:
        try:
            response = self._http.request(method, path, json=body, params=params)
        except httpx.HTTPError as error:
            raise ServerError(0, f"cannot reach tvcache server {self.url}: {error!r}") from error
        return self._decode(response, path)

    def _decode(self, response: httpx.Response, path: str) -> Any:
        if response.status_code >= 400:
            message = f"{self.url}{path}: HTTP {response.status_code}: {_message(response)}"
            if response.status_code in (400, 422):
                raise InvalidInput(message)
            raise ServerError(response.status_code, message)
        return response.json()

    async def _arequest(self, path: str, body: Any) -> Any:
        if self._aclient is None:
            self._aclient = httpx.AsyncClient(base_url=self.url, headers=self._headers, timeout=self._timeout + 60)
        try:
            response = await self._aclient.post(path, json=body)
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
        graph = super().graph(task_id)
        self._roots[id(graph.root)] = graph
        return graph

    def _graph_of(self, node: Node) -> ToolCallGraph:
        root = node
        while root.parent is not None:
            root = root.parent
        return self._roots[id(root)]

    def _adopt(self, graph: ToolCallGraph, data: dict[str, Any]) -> Node:
        """The replica node for the server's node ``data``, inserted (with any missing ancestors) if new."""
        node = graph.get(data["id"])
        if node is None:
            parent_id = data["parent"]
            if graph.get(parent_id) is None:  # inserted by another client: fetch the path down to it
                path = self._request("GET", "/v1/path", params={"task_id": graph.task_id, "node_id": parent_id})
                for ancestor in path["nodes"]:
                    self._adopt(graph, ancestor)
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

    def session(self, task_id: str, *, sandbox: SandboxFactory) -> Session:
        self._refresh_nondeterministic()
        return super().session(task_id, sandbox=sandbox)

    def _lookup(self, graph: ToolCallGraph, state: Node, call: ToolCall) -> Node | None:
        node = state.step(call)
        if node is not None:
            self._touch(graph, node)
            return node
        body = {"task_id": graph.task_id, "state": state.id, "call": _call_json(call)}
        data = self._request("POST", "/v1/lookup", self._tagged(body))
        return None if data["node"] is None else self._adopt(graph, data["node"])

    def _tagged(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with this client's epoch, if it has one (servers before epochs reject the field)."""
        return body if self.epoch is None else {**body, "epoch": self.epoch}

    def _touch(self, graph: ToolCallGraph, node: Node) -> None:
        with self._lock:
            graph.touch(node)
            self._touches.setdefault((graph.task_id, self.epoch), []).append(node.id)
            if self._flush_scheduled:
                return
            self._flush_scheduled = True
        self._flushing = self._submit(self._flush_touches())

    async def _flush_touches(self) -> None:
        with self._lock:
            touches, self._touches = self._touches, {}
            self._flush_scheduled = False
        for (task_id, epoch), node_ids in touches.items():
            for start in range(0, len(node_ids), 10_000):
                body: dict[str, Any] = {"task_id": task_id, "node_ids": node_ids[start : start + 10_000]}
                if epoch is not None:
                    body["epoch"] = epoch
                try:
                    await self._arequest("/v1/touch", body)
                except TVCacheError:
                    pass  # hit counts only steer eviction; losing some never affects results

    def _claim(self, graph: ToolCallGraph, state: Node, call: ToolCall) -> tuple[bool, Future[Node | None]]:
        body = {"task_id": graph.task_id, "state": state.id, "call": _call_json(call), "ttl": self.claim_ttl}
        data = self._request("POST", "/v1/claim", body)
        status = data["status"]
        if status == "hit":
            done: Future[Node | None] = Future()
            done.set_result(self._adopt(graph, data["node"]))
            return False, done
        if status == "owner":
            claim_id = data["claim_id"]
            heartbeat = self._submit(self._heartbeat(claim_id, float(data["ttl"])))
            with self._lock:
                self._owned[(graph.task_id, state.id, call.digest)] = (claim_id, heartbeat)
            return True, Future()
        return False, self._submit(self._wait(graph, state, call))

    async def _heartbeat(self, claim_id: str, ttl: float) -> None:
        while True:
            await asyncio.sleep(ttl / 3)
            try:
                await self._arequest("/v1/claim/heartbeat", {"claim_id": claim_id, "ttl": ttl})
            except ServerError as error:
                if error.status == 404:  # taken over or finished: nothing left to renew
                    return

    async def _wait(self, graph: ToolCallGraph, state: Node, call: ToolCall) -> Node | None:
        body = {"task_id": graph.task_id, "state": state.id, "call": _call_json(call), "timeout": self.wait_timeout}
        while True:
            data = await self._arequest("/v1/claim/wait", body)
            status = data["status"]
            if status == "done":
                return None if data["node"] is None else self._adopt(graph, data["node"])
            if status != "pending":
                reason = data.get("error") or status
                raise ClaimLost(f"task {graph.task_id!r}: the client executing {call} gave up ({reason})")

    def _resolve(
        self, graph: ToolCallGraph, state: Node, call: ToolCall, node: Node | None, error: BaseException | None
    ) -> None:
        with self._lock:
            owned = self._owned.pop((graph.task_id, state.id, call.digest), None)
        if owned is None:
            return
        claim_id, heartbeat = owned
        heartbeat.cancel()
        if node is None:  # with a node, the insert already finished the claim on the server
            body = {"claim_id": claim_id, "error": None if error is None else repr(error)[:10_000]}
            self._request("POST", "/v1/claim/resolve", body)

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
        data = self._request("POST", "/v1/insert", self._tagged(body))
        return self._adopt(graph, data["node"])

    def _lookup_test(self, graph: ToolCallGraph, node: Node, key: str) -> tuple[bool, Any]:
        data = self._request("POST", "/v1/tests/get", {"task_id": graph.task_id, "node_id": node.id, "key": key})
        return bool(data["found"]), data.get("value")

    def _record_test(self, graph: ToolCallGraph, node: Node, key: str, value: Any) -> None:
        try:
            canonical_json(value)
        except InvalidToolCall as error:
            raise InvalidToolCall(f"test {key!r} returned a value that is not JSON: {error}") from error
        body = {"task_id": graph.task_id, "node_id": node.id, "key": key, "value": value}
        self._request("POST", "/v1/tests/put", body)

    def _lease_snapshot(self, state: Node, kind: str, *, skip: frozenset[str] = frozenset()) -> Lease | None:
        graph = self._graph_of(state)
        body: dict[str, Any] = {"task_id": graph.task_id, "state": state.state.id, "kind": kind}
        with self._lock:
            unforkable = sorted(self._unforkable_here | skip)
        if unforkable:  # sent only when needed: a server older than this field refuses it
            body["skip"] = unforkable[-1024:]
        data = self._request("POST", "/v1/snapshots/lease", body)
        if data["lease_id"] is None:
            return None
        node = self._adopt(graph, data["node"])
        with self._lock:
            if node.snapshot is None:  # leased locally: the marker could not be refreshed
                node.snapshot = Snapshot.from_json(data["node"]["snapshot"])
            return RemoteLease(node, data["lease_id"])

    def _release(self, lease: Lease) -> None:
        with self._lock:
            lease.release()
        if isinstance(lease, RemoteLease):
            self._request("POST", "/v1/snapshots/release", {"lease_id": lease.lease_id})

    def _drop_snapshot(self, graph: ToolCallGraph, node: Node) -> None:
        """The server forgets the snapshot (if the node still has it and no one holds a lease), then its data is
        freed here; the replica forgets it either way."""
        with self._lock:
            snapshot = node.snapshot
            if snapshot is None:
                return
            graph.detach_snapshot(node)
        body = {"task_id": graph.task_id, "node_id": node.id, "path": snapshot.path}
        data = self._request("POST", "/v1/snapshots/drop", body)
        for old in data["evicted"]:
            evicted = Snapshot.from_json(old)
            if evicted.kind in self._discarders and self._frees_here(evicted):
                self._discarder_for(evicted)(evicted)

    def _attach_snapshot(self, graph: ToolCallGraph, node: Node, snapshot: Snapshot) -> None:
        body = {"task_id": graph.task_id, "node_id": node.id, "snapshot": snapshot.to_json()}
        data = self._request("POST", "/v1/snapshots/attach", body)
        if data["attached"]:
            self._count("snapshots_taken")
            self._sync_snapshot(graph, node, snapshot.to_json())
        for old in data["evicted"]:
            evicted = Snapshot.from_json(old)
            discard = self._discarder_for(evicted)
            if evicted.kind in self._discarders and self._frees_here(evicted):
                discard(evicted)

    def _frees_here(self, snapshot: Snapshot) -> bool:
        """Whether this client frees an evicted snapshot: one on this machine, or a *published* one (its data is
        in a shared store, which any client with the backend can release, even after its maker has exited)."""
        return PUBLISHED in snapshot.meta or snapshot.exists()

    def mark_nondeterministic(self, tool: str, reason: str) -> None:
        self._request("POST", "/v1/tools/nondeterministic", {"tool": tool, "reason": reason[:10_000]})
        super().mark_nondeterministic(tool, reason)

    def _refresh_nondeterministic(self) -> None:
        data = self._request("GET", "/v1/tools/nondeterministic")
        with self._lock:
            self._nondeterministic.update(data["tools"])

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
