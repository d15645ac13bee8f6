"""One contract suite for every graph store (``tvcache.store.protocol.GraphStore``), the way cachetools runs one
``CacheTestMixin`` over every cache class: each test below runs against

- ``local``: a ``LocalStore`` in memory, on a fake clock;
- ``http-asgi``: an ``HttpStore`` whose transports (sync and async) call the real server app in this process
  (``create_app`` over a ``CacheService`` on the fake clock; the store's replicas run on the real clock, as
  ``HttpStore`` takes none): no socket;
- ``http-socket``: an ``HttpStore`` talking HTTP to a real server on 127.0.0.1 (``ServerThread``), fake clock;
- ``ray``: an ``HttpStore`` over the Ray transport to a real shard actor (its clock is the actor's own), where
  ``import ray`` works.

Every store is opened with the same small budget (``BUDGET`` snapshots per task) so that eviction is part of the
contract. Each test works in a task of its own (and tools named after it), so a shared backend (the Ray shard
serves the whole module) keeps the tests independent; counts are compared as differences.

A store's *peer* is a second client of the same shared state: another ``HttpStore`` on the same server, and the
``LocalStore`` itself (one process's store is its shared state). Tests that say "across clients" use it.

Nothing sleeps to let time pass: the fake clock moves by ``tick``. Every wait is bounded by ``WAIT`` seconds: on
a claim's future, and the one poll (``Harness.await_waiters``: until an ``HttpStore`` waiter's long poll, sent
from its background loop, is parked on the server).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tvcache.calls import ToolCall
from tvcache.errors import ClaimLost, InvalidTaskId, InvalidToolCall, SandboxError
from tvcache.graph import Lease, Node, ToolCallGraph
from tvcache.policies import AlwaysSnapshot, Budget, CostModel, NeverSnapshot
from tvcache.protocol import Outcome, Snapshot
from tvcache.store.local import LocalStore
from tvcache.store.protocol import Attached, Claim, Dropped, GraphStore, StoreStats, TestLookup

from kvstore import KVFactory, KVSandbox
from server_support import wait_until

BUDGET = 2  # snapshots per task every store under test keeps
WAIT = 10.0  # seconds any wait on another client may take before the test fails


class Timer:
    """A fake monotonic clock: time moves only by ``tick``."""

    def __init__(self, start: float = 1_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float = 1.0) -> float:
        self.now += seconds
        return self.now


@dataclass
class Harness:
    """One store under test.

    ``timer``: the fake clock of the store's own graphs (``graph(task)``'s nodes), None where the store takes no
    clock (``HttpStore``: its replicas run on the real monotonic clock; its server runs on ``timer`` all the
    same, except Ray's, which runs in the actor's process). ``peer()``: another client of the same shared state.
    ``await_waiters(before, n)``: return once ``n`` more waits than ``before`` (``waits()``) are parked on the
    shared state (a no-op for ``LocalStore``, whose waiters join at claim time; an ``HttpStore`` waiter's long
    poll reaches the server from a background loop, and a poll arriving after the claim ended finds no claim)."""

    kind: str
    store: GraphStore
    timer: Timer | None
    open_peer: Callable[[], GraphStore]
    closing: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def peer(self) -> GraphStore:
        return self.open_peer()

    def waits(self) -> int:
        server_stats = getattr(self.store, "server_stats", None)
        return 0 if server_stats is None else int(server_stats()["waits"])

    def await_waiters(self, before: int, n: int) -> None:
        if self.kind == "local":
            return
        wait_until(lambda: self.waits() >= before + n, timeout=WAIT)


# ------------------------------------------------------------------ the stores


def open_http_store(closing: contextlib.ExitStack, url: str, **transports: Any) -> GraphStore:
    """An ``HttpStore`` on ``url``, closed with ``closing``."""
    from tvcache.store.http import HttpStore

    store = HttpStore(url, **transports)
    closing.callback(store.close)
    return store


@contextlib.contextmanager
def local_harness() -> Iterator[Harness]:
    timer = Timer()
    store = LocalStore(budget=Budget(max_snapshots_per_task=BUDGET), clock=timer)
    harness = Harness("local", store, timer, lambda: store)
    with harness.closing:
        harness.closing.callback(store.close)
        yield harness


def _service(timer: Timer) -> Any:
    from tvcache.server import CacheService

    return CacheService(budget=Budget(max_snapshots_per_task=BUDGET), clock=timer)


class InProcessApp(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """An httpx transport, blocking and async, that serves each request with the real ASGI ``app`` in this
    process: no socket. Every request runs on one event loop thread of its own, as on a server (the service is
    not thread-safe: it lives on its server's loop), whichever thread or loop the client sends it from."""

    def __init__(self, app: Any) -> None:
        self._asgi = httpx.ASGITransport(app=app)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="contract-app", daemon=True)
        self._thread.start()

    async def _serve(self, method: str, url: httpx.URL, headers: httpx.Headers, body: bytes) -> httpx.Response:
        request = httpx.Request(method, url, headers=headers, content=body)
        response = await self._asgi.handle_async_request(request)
        content = await response.aread()
        return httpx.Response(response.status_code, headers=response.headers, content=content)

    def _submit(self, request: httpx.Request) -> Future[httpx.Response]:
        body = request.read()
        return asyncio.run_coroutine_threadsafe(
            self._serve(request.method, request.url, request.headers, body), self._loop
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._submit(request).result(timeout=WAIT + 60)
        response.request = request
        return response

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await asyncio.wrap_future(self._submit(request))
        response.request = request
        return response

    def close(self) -> None:  # the clients close their transports; the harness stops the loop
        pass

    async def aclose(self) -> None:
        pass

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(WAIT)
        self._loop.close()


@contextlib.contextmanager
def http_asgi_harness() -> Iterator[Harness]:
    from tvcache.server.app import ServerSettings, create_app

    timer = Timer()
    closing = contextlib.ExitStack()
    with closing:
        service = _service(timer)
        closing.callback(service.close)
        app = InProcessApp(create_app(service, ServerSettings()))
        closing.callback(app.stop)

        def open_client() -> GraphStore:
            return open_http_store(closing, "http://tvcache.test", transport=app, async_transport=app)

        yield Harness("http-asgi", open_client(), None, open_client, closing)


@contextlib.contextmanager
def http_socket_harness() -> Iterator[Harness]:
    from tvcache.server import ServerThread

    timer = Timer()
    closing = contextlib.ExitStack()
    with closing:
        service = _service(timer)
        closing.callback(service.close)
        thread = ServerThread(service).start()
        closing.callback(thread.stop)

        def open_client() -> GraphStore:
            return open_http_store(closing, thread.url)

        yield Harness("http-socket", open_client(), None, open_client, closing)


@pytest.fixture(scope="module")
def ray_shard() -> Iterator[Any]:
    """One shard actor for the module (starting Ray is most of the cost), with the suite's budget."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = pytest.importorskip("ray", reason="the 'ray' extra is not installed: pip install 'tvcache[ray]'")
    from tvcache.integrations.ray import shards

    namespace = f"tvcache-contract-{uuid.uuid4().hex[:8]}"
    # A cluster of its own ("local"), never one another process of this machine runs.
    ray.init(address="local", num_cpus=1, include_dashboard=False, namespace=namespace, log_to_driver=False)
    try:
        (name,) = shards.start_shards(
            1, data_dir=None, namespace=namespace, detached=False, budget=Budget(max_snapshots_per_task=BUDGET)
        )
        yield ray.get_actor(name, namespace=namespace), name, namespace
    finally:
        ray.shutdown()


@contextlib.contextmanager
def ray_harness(shard: Any) -> Iterator[Harness]:
    from tvcache.integrations.ray import shards

    actor, name, namespace = shard
    closing = contextlib.ExitStack()
    with closing:

        def open_client() -> GraphStore:
            transport = shards.RayTransport(actor, name)
            return open_http_store(closing, f"http://{name}.ray", transport=transport)

        yield Harness("ray", open_client(), None, open_client, closing)


KINDS = ["local", "http-asgi", "http-socket", "ray"]


@pytest.fixture(params=KINDS)
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    kind = request.param
    if kind == "ray":
        opened = ray_harness(request.getfixturevalue("ray_shard"))
    else:
        opened = {"local": local_harness, "http-asgi": http_asgi_harness, "http-socket": http_socket_harness}[kind]()
    with opened as harness:
        yield harness


@pytest.fixture
def store(harness: Harness) -> GraphStore:
    return harness.store


@pytest.fixture
def task() -> str:
    return f"contract-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def tool() -> str:
    """A tool name no other test uses (marks are shared by every task of a store)."""
    return f"tool-{uuid.uuid4().hex[:8]}"


# ------------------------------------------------------------------ helpers

SET_A = ToolCall("set", {"key": "a", "value": 1})
SET_B = ToolCall("set", {"key": "b", "value": 2})
SET_C = ToolCall("set", {"key": "c", "value": 3})
GET_A = ToolCall("get", {"key": "a"})


def record(store: GraphStore, graph: ToolCallGraph, state: Node, call: ToolCall, output: str, **kw: Any) -> Node:
    options: dict[str, Any] = {"seconds": 1.0, "read_only": False, **kw}
    return store.record(graph, state, call, Outcome(output=output), **options)


def chain(store: GraphStore, graph: ToolCallGraph, *calls: ToolCall) -> list[Node]:
    """Record ``calls`` one after another from the root; returns their nodes."""
    nodes: list[Node] = []
    state = graph.root
    for call in calls:
        state = record(store, graph, state, call, f"{call.name} {call.arguments}")
        nodes.append(state)
    return nodes


def take(store: GraphStore, task: str, node: Node, factory: KVFactory) -> Snapshot:
    """A real KV snapshot of a sandbox holding the node's id, at a path the store hands out."""
    sandbox = KVSandbox(factory, {"node": node.id})
    return asyncio.run(sandbox.snapshot(store.snapshot_path(task, node)))


def attach(store: GraphStore, graph: ToolCallGraph, node: Node, factory: KVFactory) -> tuple[Snapshot, Attached]:
    snapshot = take(store, graph.task_id, node, factory)
    return snapshot, store.attach_snapshot(graph, node, snapshot, made_by=factory)


def result(future: Future[Any]) -> Any:
    return future.result(timeout=WAIT)


def held(node: Node) -> Snapshot | None:
    """The snapshot ``node`` holds now (a call, so that type checkers do not narrow it across operations)."""
    return node.snapshot


def same_node(a: Node | None, b: Node | None) -> bool:
    """The same recorded node, seen by two clients (each has its own objects)."""
    assert a is not None
    assert b is not None
    return (a.id, a.call, a.output, a.is_error, a.read_only) == (b.id, b.call, b.output, b.is_error, b.read_only)


# ------------------------------------------------------------------ tasks


def test_graph_is_created_once_per_task(store: GraphStore, task: str) -> None:
    graph = store.graph(task)
    assert isinstance(graph, ToolCallGraph)
    assert graph.task_id == task
    assert store.graph(task) is graph
    assert len(graph) == 1
    assert graph.root.call is None
    record(store, graph, graph.root, SET_A, "a=1")
    assert task in store.tasks()
    assert store.has_task(task)
    assert not store.has_task(f"{task}-never-used")


@pytest.mark.parametrize("bad", ["", "x" * 1025, "nul\x00byte"], ids=["empty", "too-long", "nul"])
def test_graph_refuses_a_bad_task_id(store: GraphStore, bad: str) -> None:
    with pytest.raises(InvalidTaskId):
        store.graph(bad)
    assert bad not in store.tasks()


# ------------------------------------------------------------------ lookup and record


def test_lookup_miss_is_none_then_record_then_hit(store: GraphStore, task: str) -> None:
    graph = store.graph(task)
    assert store.lookup(graph, graph.root, SET_A) is None
    node = record(store, graph, graph.root, SET_A, "a=1", seconds=2.5)
    assert (node.call, node.output, node.is_error, node.seconds, node.read_only) == (SET_A, "a=1", False, 2.5, False)
    assert node.parent is graph.root
    assert node.id != graph.root.id
    assert store.lookup(graph, graph.root, SET_A) is node
    assert store.lookup(graph, node, SET_A) is None  # keyed by the state it ran in


def test_lookup_across_clients(harness: Harness, task: str) -> None:
    """A call one client records is a hit for another client of the same shared state, with its id and result."""
    graph = harness.store.graph(task)
    first = record(harness.store, graph, graph.root, SET_A, "a=1")
    second = record(harness.store, graph, first, SET_B, "b=2")
    peer = harness.peer()
    other = peer.graph(task)
    found = peer.lookup(other, other.root, SET_A)
    assert same_node(found, first)
    assert found is not None
    assert same_node(peer.lookup(other, found, SET_B), second)


def test_a_hit_is_touched(harness: Harness, task: str) -> None:
    """A hit counts on the node (and its ancestors' subtrees) in the store's own graph. Where the store runs on
    the fake clock, the hit's time is the clock's. (HttpStore counts it on its replica at once and sends hits to
    the server in batches: the server's counts are not part of this contract.)"""
    store = harness.store
    graph = store.graph(task)
    first, second = chain(store, graph, SET_A, SET_B)
    before = (second.hits, first.subtree_hits)
    if harness.timer is not None:
        harness.timer.tick(5)
    assert store.lookup(graph, first, SET_B) is second
    assert (second.hits, first.subtree_hits) == (before[0] + 1, before[1] + 1)
    if harness.timer is not None:
        assert second.last_used == harness.timer()
    store.touch(graph, second)
    assert second.hits == before[0] + 2


def test_record_of_an_existing_call_returns_the_existing_node(store: GraphStore, task: str) -> None:
    graph = store.graph(task)
    node = record(store, graph, graph.root, SET_A, "first")
    again = record(store, graph, graph.root, SET_A, "second", seconds=9.0)
    assert again is node
    assert (again.output, again.seconds) == ("first", 1.0)
    assert len(graph) == 2


def test_record_of_a_call_another_client_recorded_returns_its_node(harness: Harness, task: str) -> None:
    """The first writer wins across clients too: the later record returns the node there, with its result."""
    graph = harness.store.graph(task)
    node = record(harness.store, graph, graph.root, SET_A, "first")
    peer = harness.peer()
    other = peer.graph(task)
    again = record(peer, other, other.root, SET_A, "second")
    assert same_node(again, node)
    assert again.output == "first"


def test_read_only_calls_hang_off_their_state(store: GraphStore, task: str) -> None:
    graph = store.graph(task)
    (state,) = chain(store, graph, SET_A)
    read = record(store, graph, state, GET_A, "1", read_only=True)
    assert read.read_only
    assert read.parent is state
    assert read.state is state
    assert read.depth == state.depth
    assert state.reads is not None
    assert read in state.reads.values()
    assert store.lookup(graph, state, GET_A) is read
    # A state-changing call after the read runs in the same state.
    after = record(store, graph, read.state, SET_B, "b=2")
    assert after.parent is state
    assert after.depth == state.depth + 1


def test_record_refuses_output_that_is_not_unicode(store: GraphStore, task: str) -> None:
    graph = store.graph(task)
    with pytest.raises(SandboxError):
        record(store, graph, graph.root, SET_A, "bad \udcff byte")
    assert store.lookup(graph, graph.root, SET_A) is None
    assert len(graph) == 1


# ------------------------------------------------------------------ claims


def test_claim_of_a_recorded_call_is_done_with_its_node(store: GraphStore, task: str) -> None:
    graph = store.graph(task)
    node = record(store, graph, graph.root, SET_A, "a=1")
    claim = store.claim(graph, graph.root, SET_A)
    assert isinstance(claim, Claim)
    assert not claim.owner
    assert claim.ready.done()
    assert claim.ready.result() is node


def test_claim_first_owns_second_waits_for_the_node(store: GraphStore, task: str) -> None:
    graph = store.graph(task)
    first = store.claim(graph, graph.root, SET_A)
    second = store.claim(graph, graph.root, SET_A)
    assert first.owner
    assert not second.owner
    assert not second.ready.done()
    node = record(store, graph, graph.root, SET_A, "a=1")
    store.resolve(graph, graph.root, SET_A, node=node, error=None)
    assert result(second.ready) is node
    assert not store.claim(graph, graph.root, SET_A).owner  # recorded now: a hit


def test_claim_coalesces_across_clients(harness: Harness, task: str) -> None:
    """A client missing a call another client is executing waits for that execution and gets its node (for
    ``local`` the peer is the store itself)."""
    graph = harness.store.graph(task)
    peer = harness.peer()
    other = peer.graph(task)
    owner = harness.store.claim(graph, graph.root, SET_A)
    waiter = peer.claim(other, other.root, SET_A)
    assert owner.owner
    assert not waiter.owner
    node = record(harness.store, graph, graph.root, SET_A, "a=1")
    harness.store.resolve(graph, graph.root, SET_A, node=node, error=None)
    got = result(waiter.ready)
    assert same_node(got, node)
    assert peer.lookup(other, other.root, SET_A) is got  # the waiter's own graph holds it


def test_concurrent_claims_have_exactly_one_owner(harness: Harness, task: str) -> None:
    """Claims made at once from many threads (half through the peer): one owner, every other claim gets the
    owner's node."""
    clients = [harness.store, harness.peer()]
    graphs = [client.graph(task) for client in clients]
    start = threading.Barrier(8)
    claims: list[tuple[int, Claim[Node | None]]] = []
    lock = threading.Lock()

    def claim(index: int) -> None:
        side = index % 2
        start.wait(WAIT)
        got = clients[side].claim(graphs[side], graphs[side].root, SET_A)
        with lock:
            claims.append((side, got))

    threads = [threading.Thread(target=claim, args=(index,)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert len(claims) == 8
    owners = [(side, got) for side, got in claims if got.owner]
    assert len(owners) == 1
    ((side, _),) = owners
    node = record(clients[side], graphs[side], graphs[side].root, SET_A, "a=1")
    clients[side].resolve(graphs[side], graphs[side].root, SET_A, node=node, error=None)
    for _, got in claims:
        if not got.owner:
            assert same_node(result(got.ready), node)


def test_claims_of_different_calls_or_states_are_independent(store: GraphStore, task: str) -> None:
    graph = store.graph(task)
    (state,) = chain(store, graph, SET_A)
    claims = [store.claim(graph, graph.root, SET_B), store.claim(graph, state, SET_B), store.claim(graph, state, SET_C)]
    assert [claim.owner for claim in claims] == [True, True, True]
    other = store.graph(f"{task}-other")
    assert store.claim(other, other.root, SET_B).owner  # another task
    for claim_state, call in ((graph.root, SET_B), (state, SET_B), (state, SET_C)):
        store.resolve(graph, claim_state, call, node=None, error=None)
    store.resolve(other, other.root, SET_B, node=None, error=None)


def test_owner_failure_reaches_waiters_then_a_waiter_claims(harness: Harness, task: str) -> None:
    """The owner's failure completes every waiter's ``ready`` with an error, after which the call can be claimed
    again. ``LocalStore`` raises the owner's own exception; an ``HttpStore`` waiter (which only hears from the
    server that the owner gave up) raises ``ClaimLost`` naming the owner's error."""
    store = harness.store
    graph = store.graph(task)
    peer = harness.peer()
    other = peer.graph(task)
    owner = store.claim(graph, graph.root, SET_A)
    waits = harness.waits()
    waiter = peer.claim(other, other.root, SET_A)
    assert owner.owner
    assert not waiter.owner
    harness.await_waiters(waits, 1)
    failure = RuntimeError("the sandbox broke")
    store.resolve(graph, graph.root, SET_A, node=None, error=failure)
    with pytest.raises((RuntimeError, ClaimLost)) as raised:
        result(waiter.ready)
    if harness.kind == "local":
        assert raised.value is failure
    else:
        assert isinstance(raised.value, ClaimLost)
        assert "the sandbox broke" in str(raised.value)
    retry = peer.claim(other, other.root, SET_A)
    assert retry.owner
    node = record(peer, other, other.root, SET_A, "a=1")
    peer.resolve(other, other.root, SET_A, node=node, error=None)
    assert same_node(store.lookup(graph, graph.root, SET_A), node)


def test_resolve_with_none_means_not_cacheable(harness: Harness, task: str) -> None:
    """Waiters get None (execute it yourselves, uncached); nothing is recorded and the next claim owns it.

    Difference: an ``HttpStore`` waiter whose long poll reaches the server only after the owner ended the claim
    finds no claim there and raises ``ClaimLost`` instead (the session then claims again, as after a failure);
    so the test lets both waits reach the server first."""
    store = harness.store
    graph = store.graph(task)
    peer = harness.peer()
    other = peer.graph(task)
    owner = store.claim(graph, graph.root, SET_A)
    waits = harness.waits()
    waiters = [store.claim(graph, graph.root, SET_A), peer.claim(other, other.root, SET_A)]
    assert owner.owner
    assert not any(w.owner for w in waiters)
    harness.await_waiters(waits, 2)
    store.resolve(graph, graph.root, SET_A, node=None, error=None)
    assert [result(w.ready) for w in waiters] == [None, None]
    assert store.lookup(graph, graph.root, SET_A) is None
    again = store.claim(graph, graph.root, SET_A)
    assert again.owner
    store.resolve(graph, graph.root, SET_A, node=None, error=None)


def test_resolve_of_an_unheld_claim_does_nothing(store: GraphStore, task: str) -> None:
    graph = store.graph(task)
    store.resolve(graph, graph.root, SET_A, node=None, error=None)
    store.resolve(graph, graph.root, SET_A, node=None, error=RuntimeError("nobody waits"))
    claim = store.claim(graph, graph.root, SET_A)
    assert claim.owner
    assert not claim.ready.done()
    store.resolve(graph, graph.root, SET_A, node=None, error=None)
    store.resolve(graph, graph.root, SET_A, node=None, error=None)  # twice: the second is a no-op


# ------------------------------------------------------------------ end-of-rollout checks


def test_lookup_test_miss_then_record_test_hits(store: GraphStore, task: str) -> None:
    graph = store.graph(task)
    (node,) = chain(store, graph, SET_A)
    miss = store.lookup_test(graph, node, "pytest")
    assert isinstance(miss, TestLookup)
    assert miss == TestLookup(found=False, value=None)
    value = {"passed": 3, "failed": ["test_x"], "score": 0.5}
    store.record_test(graph, node, "pytest", value)
    assert store.lookup_test(graph, node, "pytest") == TestLookup(found=True, value=value)
    assert store.lookup_test(graph, node, "other") == TestLookup(found=False)
    assert store.lookup_test(graph, graph.root, "pytest") == TestLookup(found=False)
    store.record_test(graph, node, "none", None)  # None is a value
    assert store.lookup_test(graph, node, "none") == TestLookup(found=True, value=None)


def test_record_test_across_clients(harness: Harness, task: str) -> None:
    graph = harness.store.graph(task)
    (node,) = chain(harness.store, graph, SET_A)
    harness.store.record_test(graph, node, "pytest", [1, 2])
    peer = harness.peer()
    other = peer.graph(task)
    found = peer.lookup(other, other.root, SET_A)
    assert found is not None
    assert peer.lookup_test(other, found, "pytest") == TestLookup(found=True, value=[1, 2])


@pytest.mark.parametrize("value", [{1, 2}, object(), float("nan")], ids=["set", "object", "nan"])
def test_record_test_refuses_values_that_are_not_json(store: GraphStore, task: str, value: Any) -> None:
    graph = store.graph(task)
    (node,) = chain(store, graph, SET_A)
    with pytest.raises(InvalidToolCall):
        store.record_test(graph, node, "pytest", value)
    assert store.lookup_test(graph, node, "pytest") == TestLookup(found=False)


def test_claim_test_coalesces(store: GraphStore, task: str) -> None:
    graph = store.graph(task)
    (node,) = chain(store, graph, SET_A)
    owner = store.claim_test(graph, node, "pytest")
    waiter = store.claim_test(graph, node, "pytest")
    assert owner.owner
    assert not waiter.owner
    assert not waiter.ready.done()
    assert store.claim_test(graph, node, "other").owner  # another check at the same state
    store.resolve_test(graph, node, "other", error=None)
    store.record_test(graph, node, "pytest", "ok")
    store.resolve_test(graph, node, "pytest", error=None)
    result(waiter.ready)
    assert store.lookup_test(graph, node, "pytest") == TestLookup(found=True, value="ok")
    done = store.claim_test(graph, node, "pytest")
    assert not done.owner
    assert done.ready.done()


def test_claim_test_owner_failure_reaches_waiters(store: GraphStore, task: str) -> None:
    graph = store.graph(task)
    (node,) = chain(store, graph, SET_A)
    owner = store.claim_test(graph, node, "pytest")
    waiter = store.claim_test(graph, node, "pytest")
    assert owner.owner
    assert not waiter.owner
    store.resolve_test(graph, node, "pytest", error=RuntimeError("the check crashed"))
    with pytest.raises((RuntimeError, ClaimLost)):  # the owner's error, or the store's word for it
        result(waiter.ready)
    again = store.claim_test(graph, node, "pytest")
    assert again.owner
    store.resolve_test(graph, node, "pytest", error=None)


# ------------------------------------------------------------------ snapshots


def test_wants_snapshot_follows_the_policy(store: GraphStore, task: str) -> None:
    graph = store.graph(task)
    (node,) = chain(store, graph, SET_A)
    costs = CostModel()
    assert store.wants_snapshot(graph, node, policy=AlwaysSnapshot(), costs=costs) is True
    assert store.wants_snapshot(graph, node, policy=NeverSnapshot(), costs=costs) is False


def test_snapshot_path_is_fresh_and_under_the_root(store: GraphStore, task: str) -> None:
    graph = store.graph(task)
    (node,) = chain(store, graph, SET_A)
    first, second = store.snapshot_path(task, node), store.snapshot_path(task, node)
    assert first != second
    assert first.parent.is_dir()
    assert not first.exists()
    assert Path(store.snapshot_root) in first.parents


def test_lease_is_none_without_a_snapshot(store: GraphStore, task: str) -> None:
    graph = store.graph(task)
    (node,) = chain(store, graph, SET_A)
    assert store.lease_snapshot(node, "kv") is None
    assert store.lease_snapshot(graph.root, "kv") is None


def test_attach_then_lease_the_deepest_snapshot_at_or_above(store: GraphStore, task: str) -> None:
    graph = store.graph(task)
    first, second, third = chain(store, graph, SET_A, SET_B, SET_C)
    factory = KVFactory()
    snapshot, attached = attach(store, graph, first, factory)
    assert isinstance(attached, Attached)
    assert attached == Attached(attached=True, evicted=())
    assert first.snapshot == snapshot
    read = record(store, graph, third, GET_A, "1", read_only=True)
    for state in (first, second, third, read):  # a read's state is its parent's
        lease = store.lease_snapshot(state, "kv")
        assert isinstance(lease, Lease)
        assert lease.node is first or same_node(lease.node, first)
        assert lease.node.snapshot == snapshot
        store.release(lease)
    assert store.lease_snapshot(graph.root, "kv") is None  # above it: nothing
    assert store.lease_snapshot(third, "docker") is None  # another backend's kind
    assert store.lease_snapshot(third, "kv", skip=frozenset({snapshot.path})) is None
    deeper, _ = attach(store, graph, second, factory)
    lease = store.lease_snapshot(third, "kv")
    assert lease is not None
    assert lease.node.snapshot == deeper
    store.release(lease)
    lease = store.lease_snapshot(third, "kv", skip=frozenset({deeper.path}))
    assert lease is not None
    assert lease.node.snapshot == snapshot
    store.release(lease)


def test_a_lease_pins_the_snapshot_until_released(store: GraphStore, task: str) -> None:
    graph = store.graph(task)
    (node,) = chain(store, graph, SET_A)
    factory = KVFactory()
    snapshot, _ = attach(store, graph, node, factory)
    lease = store.lease_snapshot(node, "kv")
    assert lease is not None
    assert store.drop_snapshot(graph, node) == Dropped()  # leased: kept
    assert node.snapshot == snapshot
    store.release(lease)
    dropped = store.drop_snapshot(graph, node)
    assert isinstance(dropped, Dropped)
    assert dropped.dropped
    assert dropped.evicted == (snapshot,)
    assert held(node) is None
    assert factory.discarded == [snapshot.path]  # freed by the factory that made it
    assert store.lease_snapshot(node, "kv") is None


def test_leases_across_clients(harness: Harness, task: str) -> None:
    """A snapshot one client attached is leased by another; its lease pins it for everyone."""
    graph = harness.store.graph(task)
    (node,) = chain(harness.store, graph, SET_A)
    factory = KVFactory()
    snapshot, _ = attach(harness.store, graph, node, factory)
    peer = harness.peer()
    other = peer.graph(task)
    found = peer.lookup(other, other.root, SET_A)
    assert found is not None
    lease = peer.lease_snapshot(found, "kv")
    assert lease is not None
    assert lease.node.snapshot == snapshot
    assert harness.store.drop_snapshot(graph, node) == Dropped()
    peer.release(lease)
    assert harness.store.drop_snapshot(graph, node).evicted == (snapshot,)


def test_a_second_attach_on_a_node_is_refused_and_handed_back(store: GraphStore, task: str) -> None:
    graph = store.graph(task)
    (node,) = chain(store, graph, SET_A)
    factory = KVFactory()
    first, attached = attach(store, graph, node, factory)
    assert attached.attached
    second, refused = attach(store, graph, node, factory)
    assert refused == Attached(attached=False, evicted=(second,))
    assert node.snapshot == first
    assert factory.discarded == [second.path]  # the refused one is freed by its maker, the first kept
    assert Path(first.path).exists()
    assert not Path(second.path).exists()


def test_budget_eviction_is_reported(store: GraphStore, task: str) -> None:
    """Over ``BUDGET`` snapshots in a task, attaching one evicts another (LowReuseFirst: with no hits and
    children everywhere, the deepest goes), reported in ``evicted`` and freed by the factory that made it."""
    graph = store.graph(task)
    nodes = chain(store, graph, *(ToolCall("set", {"key": "k", "value": i}) for i in range(BUDGET + 2)))
    factory = KVFactory()
    snapshots = []
    for node in nodes[:BUDGET]:
        snapshot, attached = attach(store, graph, node, factory)
        assert attached == Attached(attached=True, evicted=())
        snapshots.append(snapshot)
    newest, attached = attach(store, graph, nodes[BUDGET], factory)
    assert attached.attached
    assert attached.evicted == (snapshots[-1],)
    assert newest not in attached.evicted
    assert factory.discarded == [snapshots[-1].path]
    lease = store.lease_snapshot(nodes[BUDGET - 1], "kv")  # the evicted one is leased no more
    assert lease is not None
    assert lease.node.snapshot == snapshots[-2]
    store.release(lease)


def test_an_evicted_snapshot_leaves_the_stores_graph(store: GraphStore, task: str) -> None:
    """The store's own graph shows what the budget evicted: the evicted node holds no snapshot any more, and the
    task holds ``BUDGET`` of them."""
    graph = store.graph(task)
    nodes = chain(store, graph, *(ToolCall("set", {"key": "k", "value": i}) for i in range(BUDGET + 2)))
    factory = KVFactory()
    for node in nodes[:BUDGET]:
        attach(store, graph, node, factory)
    newest, attached = attach(store, graph, nodes[BUDGET], factory)
    assert len(attached.evicted) == 1
    assert nodes[BUDGET - 1].snapshot is None
    assert nodes[BUDGET].snapshot == newest
    assert sum(1 for node in nodes if node.snapshot is not None) == BUDGET
    assert len(graph.snapshot_nodes) == BUDGET
    graph.check_invariants()


def test_a_leased_snapshot_is_never_evicted(store: GraphStore, task: str) -> None:
    graph = store.graph(task)
    nodes = chain(store, graph, *(ToolCall("set", {"key": "k", "value": i}) for i in range(BUDGET + 2)))
    factory = KVFactory()
    snapshots = [attach(store, graph, node, factory)[0] for node in nodes[:BUDGET]]
    lease = store.lease_snapshot(nodes[BUDGET - 1], "kv")  # the one eviction would choose
    assert lease is not None
    assert lease.node.snapshot == snapshots[-1]
    _, attached = attach(store, graph, nodes[BUDGET], factory)
    assert attached.attached
    assert attached.evicted == (snapshots[-2],)
    store.release(lease)


def test_an_evicted_snapshot_no_factory_made_is_freed_inside_the_snapshot_directory(
    store: GraphStore, task: str
) -> None:
    """A record attached without ``made_by`` (another process made it) is freed on eviction because it lies in
    this store's snapshot directory."""
    graph = store.graph(task)
    nodes = chain(store, graph, *(ToolCall("set", {"key": "k", "value": i}) for i in range(BUDGET + 2)))
    factory = KVFactory()
    store.register_backend(factory)
    for node in nodes[: BUDGET - 1]:
        attach(store, graph, node, factory)
    inside = take(store, task, nodes[BUDGET - 1], factory)
    assert store.attach_snapshot(graph, nodes[BUDGET - 1], inside).attached
    evicted = store.attach_snapshot(graph, nodes[BUDGET], take(store, task, nodes[BUDGET], factory)).evicted
    assert evicted == (inside,)
    assert not Path(inside.path).exists()


def test_an_evicted_snapshot_outside_the_snapshot_directory_is_left_alone(
    store: GraphStore, task: str, tmp_path: Path
) -> None:
    """A record no factory of this process made, naming a path outside its snapshot directory, only claims where
    storage is: evicting it forgets it (with a warning) and leaves the file."""
    graph = store.graph(task)
    nodes = chain(store, graph, *(ToolCall("set", {"key": "k", "value": i}) for i in range(BUDGET + 2)))
    factory = KVFactory()
    for node in nodes[: BUDGET - 1]:
        attach(store, graph, node, factory)
    path = tmp_path / "elsewhere.json"
    path.write_text("{}")
    outside = Snapshot(kind="kv", path=str(path), bytes=2)
    assert store.attach_snapshot(graph, nodes[BUDGET - 1], outside).attached
    with pytest.warns(RuntimeWarning, match="not deleting"):
        evicted = store.attach_snapshot(graph, nodes[BUDGET], take(store, task, nodes[BUDGET], factory)).evicted
    assert evicted == (outside,)
    assert path.exists()
    assert factory.discarded == []


def test_drop_snapshot_without_one_drops_nothing(store: GraphStore, task: str) -> None:
    graph = store.graph(task)
    (node,) = chain(store, graph, SET_A)
    dropped = store.drop_snapshot(graph, node)
    assert dropped == Dropped()
    assert not dropped.dropped


def test_detach_snapshot_forgets_without_freeing(harness: Harness, task: str) -> None:
    """Difference: ``LocalStore`` forgets the record (journaled: no later lease finds it); ``HttpStore`` forgets
    its replica's marker only, and the server, which keeps the record, still leases it (only the server's own
    ``LocalStore`` detaches records: the wire routes and the facade)."""
    store = harness.store
    graph = store.graph(task)
    (node,) = chain(store, graph, SET_A)
    factory = KVFactory()
    snapshot, _ = attach(store, graph, node, factory)
    assert store.detach_snapshot(graph, node) == snapshot
    assert node.snapshot is None
    with pytest.raises(ValueError):  # noqa: PT011
        store.detach_snapshot(graph, node)
    lease = store.lease_snapshot(node, "kv")
    if harness.kind == "local":
        assert lease is None
    else:
        assert lease is not None
        assert lease.node.snapshot == snapshot
        store.release(lease)
    assert factory.discarded == []
    assert Path(snapshot.path).exists()


def test_mark_unforkable_then_lease_skips_it(store: GraphStore, task: str) -> None:
    graph = store.graph(task)
    first, second = chain(store, graph, SET_A, SET_B)
    factory = KVFactory()
    shallow, _ = attach(store, graph, first, factory)
    deep, _ = attach(store, graph, second, factory)
    store.mark_unforkable(deep)
    lease = store.lease_snapshot(second, "kv")
    assert lease is not None
    assert lease.node.snapshot == shallow
    store.release(lease)
    store.mark_unforkable(shallow)
    assert store.lease_snapshot(second, "kv") is None
    assert second.snapshot == deep
    assert first.snapshot == shallow
    assert factory.discarded == []


# ------------------------------------------------------------------ non-determinism marks


def hold(store: GraphStore, *tasks: str) -> None:
    """Record a call in each task: a server takes task-scoped marks only in tasks it holds."""
    for task_id in tasks:
        graph = store.graph(task_id)
        record(store, graph, graph.root, SET_A, "a=1")


def test_marks_tool_wide(store: GraphStore, tool: str, task: str) -> None:
    hold(store, task)
    assert not store.is_marked(tool)
    assert store.mark_nondeterministic(tool, "it read the clock") is True
    assert store.mark_nondeterministic(tool, "again") is False
    assert store.is_marked(tool)
    assert store.is_marked(tool, task)
    assert store.mark_nondeterministic(tool, "in a task", task_id=task) is False  # covered by the tool-wide mark
    mine = [mark for mark in store.nondeterministic_marks() if mark.tool == tool]
    assert [(m.tool, m.task_id, m.reason) for m in mine] == [(tool, None, "it read the clock")]
    assert store.clear_nondeterministic(tool) == 1
    assert not store.is_marked(tool)
    assert not store.is_marked(tool, task)
    assert store.clear_nondeterministic(tool) == 0


def test_marks_scoped_to_a_task(store: GraphStore, tool: str, task: str) -> None:
    """Difference: the server refuses (NotFound) a task-scoped mark in a task it does not hold, so the tasks are
    recorded in first; ``LocalStore`` takes a mark in any task."""
    other_task = f"{task}-other"
    hold(store, task, other_task)
    wide = f"{tool}-wide"
    assert store.mark_nondeterministic(tool, "differed on replay", task_id=task) is True
    assert store.mark_nondeterministic(tool, "again", task_id=task) is False
    assert store.mark_nondeterministic(tool, "elsewhere", task_id=other_task) is True
    assert store.mark_nondeterministic(wide, "declared") is True
    assert store.is_marked(tool, task)
    assert store.is_marked(tool, other_task)
    assert not store.is_marked(tool)
    assert not store.is_marked(tool, f"{task}-third")
    ours = {tool, wide}
    marks = [(m.tool, m.task_id) for m in store.nondeterministic_marks() if m.tool in ours]
    assert marks[0] == (wide, None)  # tool-wide marks first
    assert sorted(marks[1:], key=str) == sorted([(tool, task), (tool, other_task)], key=str)
    in_task = [(m.tool, m.task_id) for m in store.nondeterministic_marks(task) if m.tool in ours]
    assert in_task == [(wide, None), (tool, task)]
    assert store.clear_nondeterministic(tool, task_id=task) == 1  # one scope only
    assert not store.is_marked(tool, task)
    assert store.is_marked(tool, other_task)
    assert store.clear_nondeterministic(wide, task_id=task) == 0  # a tool-wide mark is cleared tool-wide only
    assert store.clear_nondeterministic(tool) == 1  # any scope
    assert store.clear_nondeterministic(wide) == 1
    assert not any(m.tool in ours for m in store.nondeterministic_marks())


def test_clear_marks_of_a_task(store: GraphStore, tool: str, task: str) -> None:
    second = f"{tool}-second"
    hold(store, task)
    store.mark_nondeterministic(tool, "r", task_id=task)
    store.mark_nondeterministic(second, "r", task_id=task)
    assert store.clear_nondeterministic(task_id=task) == 2
    assert not store.is_marked(tool, task)
    assert not store.is_marked(second, task)
    assert store.nondeterministic_marks(task) == [m for m in store.nondeterministic_marks(task) if m.task_id is None]


# ------------------------------------------------------------------ first-hit checks


def test_first_hit_checks_are_claimed_once(store: GraphStore, tool: str, task: str) -> None:
    assert store.claim_check(task, tool) is True
    assert store.claim_check(task, tool) is False
    assert store.claim_check(f"{task}-other", tool) is True  # per task
    store.release_check(task, tool)  # it could not run: claimed again
    assert store.claim_check(task, tool) is True
    store.pass_check(task, tool)
    assert store.claim_check(task, tool) is False


def test_clearing_a_mark_checks_the_tool_again(store: GraphStore, tool: str, task: str) -> None:
    hold(store, task)
    assert store.claim_check(task, tool) is True
    store.mark_nondeterministic(tool, "disagreed", task_id=task)
    store.clear_nondeterministic(tool, task_id=task)
    assert store.claim_check(task, tool) is True


# ------------------------------------------------------------------ stats and lifetime


def test_stats_count_what_the_store_holds(store: GraphStore, task: str) -> None:
    """Nodes are the recorded calls (a graph's root is no call); snapshots and their bytes are those held."""
    before = store.stats()
    assert isinstance(before, StoreStats)
    graph = store.graph(task)
    nodes = chain(store, graph, *(ToolCall("set", {"key": "k", "value": i}) for i in range(BUDGET + 1)))
    record(store, graph, nodes[0], GET_A, "1", read_only=True)
    factory = KVFactory()
    snapshots = [attach(store, graph, node, factory)[0] for node in nodes[:BUDGET]]
    middle = store.stats()
    assert middle.tasks == before.tasks + 1
    assert middle.nodes == before.nodes + len(nodes) + 1
    assert middle.snapshots == before.snapshots + BUDGET
    assert middle.snapshot_bytes == before.snapshot_bytes + sum(s.bytes for s in snapshots)
    assert middle.snapshots_taken == before.snapshots_taken + BUDGET
    assert not attach(store, graph, nodes[0], factory)[1].attached  # refused: not taken
    assert store.drop_snapshot(graph, nodes[0]).evicted == (snapshots[0],)
    after = store.stats()
    assert after.snapshots_taken == middle.snapshots_taken
    assert after.snapshots == middle.snapshots - 1
    assert after.snapshot_bytes == middle.snapshot_bytes - snapshots[0].bytes
    assert (after.tasks, after.nodes) == (middle.tasks, middle.nodes)


def test_stats_count_evictions(harness: Harness, task: str) -> None:
    """``LocalStore`` counts each snapshot the budget evicts and each it drops. Difference: ``HttpStore`` counts
    none (its server counts them; ``RemoteCache`` never did), so for it the count stays where it was."""
    store = harness.store
    before = store.stats()
    graph = store.graph(task)
    nodes = chain(store, graph, *(ToolCall("set", {"key": "k", "value": i}) for i in range(BUDGET + 1)))
    factory = KVFactory()
    for node in nodes[:BUDGET]:
        attach(store, graph, node, factory)
    assert store.stats().snapshots_evicted == before.snapshots_evicted
    assert len(attach(store, graph, nodes[BUDGET], factory)[1].evicted) == 1
    assert store.drop_snapshot(graph, nodes[0]).dropped
    after = store.stats()
    counted = 2 if harness.kind == "local" else 0  # the budget's eviction and the drop
    assert after.snapshots_evicted == before.snapshots_evicted + counted
    assert after.snapshots_taken == before.snapshots_taken + BUDGET + 1


def test_close_is_idempotent(harness: Harness, task: str) -> None:
    store = harness.store
    graph = store.graph(task)
    chain(store, graph, SET_A)
    store.close()
    store.close()
