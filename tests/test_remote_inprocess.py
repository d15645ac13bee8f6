"""The HTTP store against the real app in this process, through ``InProcessTransport``: blocking requests and the
async ones (long-polls, heartbeats, hit counts) alike, with no socket; the one route and error tables on both
sides."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from tvcache import ToolCall
from tvcache.api import models as m
from tvcache.api.errors import ERRORS, client_error
from tvcache.api.routes import ROUTES
from tvcache.errors import InvalidInput, NotFound, ReplicaDropped, ServerError
from tvcache.protocol import Outcome, Snapshot
from tvcache.server import CacheService, create_app
from tvcache.server.runner import InProcessTransport
from tvcache.store.http import HttpStore, RemoteLease

from kvstore import KVFactory

URL = "http://tvcache.test"


@pytest.fixture
def transport(service: CacheService) -> Iterator[InProcessTransport]:
    with InProcessTransport(create_app(service)) as transport:
        yield transport


def store(transport: InProcessTransport, **options: object) -> HttpStore:
    return HttpStore(URL, transport=transport, **options)  # type: ignore[arg-type]


def test_a_call_recorded_by_one_store_is_a_hit_for_another(transport: InProcessTransport) -> None:
    first, second = store(transport), store(transport)
    try:
        call = ToolCall("set", {"key": "a", "value": 1})
        graph = first.graph("t")
        assert first.lookup(graph, graph.root, call) is None  # a miss is a value
        claim = first.claim(graph, graph.root, call)
        assert claim.owner
        node = first.record(graph, graph.root, call, Outcome(output="ok"), seconds=0.5, read_only=False)
        first.resolve(graph, graph.root, call, node=node, error=None)

        other = second.graph("t")
        found = second.lookup(other, other.root, call)
        assert found is not None
        assert (found.id, found.output) == (node.id, "ok")
        assert second.lookup(other, other.root, call) is found  # now from the replica
        assert second.stats().nodes == 1
    finally:
        first.close()
        second.close()


def test_a_waiter_long_polls_through_the_async_transport(transport: InProcessTransport) -> None:
    owner, waiter = store(transport), store(transport, wait_timeout=5.0)
    try:
        call = ToolCall("slow", {"key": "n", "seconds": 1})
        graph, other = owner.graph("t"), waiter.graph("t")
        assert owner.claim(graph, graph.root, call).owner
        claim = waiter.claim(other, other.root, call)
        assert not claim.owner
        assert not claim.ready.done()
        node = owner.record(graph, graph.root, call, Outcome(output="done"), seconds=1.0, read_only=False)
        owner.resolve(graph, graph.root, call, node=node, error=None)
        got = claim.ready.result(timeout=10)
        assert got is not None
        assert (got.id, got.output) == (node.id, "done")
    finally:
        owner.close()
        waiter.close()


def test_the_async_requests_run_on_any_loop(transport: InProcessTransport) -> None:
    client = store(transport)
    try:
        graph = client.graph("t")
        call = ToolCall("get", {"key": "a"})
        client.record(graph, graph.root, call, Outcome(output="1"), seconds=0.1, read_only=True)

        async def ask() -> m.LookupOut:
            body = m.LookupIn(task_id="t", history=[m.CallIn(name="get", arguments={"key": "a"})])
            return await client.arequest("/v1/lookup", body, m.LookupOut)

        answer = asyncio.run(ask())
        assert answer.hit
        assert answer.node is not None
        assert answer.node.output == "1"
    finally:
        client.close()


def test_snapshots_are_leased_released_and_evictions_returned(transport: InProcessTransport) -> None:
    client = store(transport)
    try:
        graph = client.graph("t")
        call = ToolCall("set", {"key": "a", "value": 1})
        node = client.record(graph, graph.root, call, Outcome(output="ok"), seconds=1.0, read_only=False)
        paths = [str(client.snapshot_path("t", node)) for _ in range(2)]
        snapshot = Snapshot(kind="kv", path=paths[0], bytes=10, meta={})
        attached = client.attach_snapshot(graph, node, snapshot)
        assert attached.attached
        assert attached.evicted == ()
        again = client.attach_snapshot(graph, node, Snapshot(kind="kv", path=paths[1], bytes=10, meta={}))
        assert not again.attached
        assert [s.path for s in again.evicted] == [paths[1]]
        lease = client.lease_snapshot(node, "kv")
        assert isinstance(lease, RemoteLease)
        assert lease.node is node
        assert node.snapshot == snapshot
        client.release(lease)
        assert client.stats().snapshots_taken == 1
        dropped = client.drop_snapshot(graph, node)
        assert dropped.dropped
        assert dropped.evicted == (snapshot,)
        assert node.snapshot is None
        assert client.lease_snapshot(node, "kv") is None
    finally:
        client.close()


def test_refusals_come_back_as_the_error_table_says(transport: InProcessTransport) -> None:
    client = store(transport)
    try:
        with pytest.raises(ServerError) as missing:
            client.request("POST", "/v1/claim/heartbeat", m.HeartbeatIn(claim_id="none"), m.ClaimOut)
        assert missing.value.status == 404
        with pytest.raises(InvalidInput, match="HTTP 422"):
            client.request("POST", "/v1/claim/resolve", m.ResolveIn.model_construct(claim_id=""), m.OkOut)
        with pytest.raises(ReplicaDropped):
            client.request("GET", "/v1/tasks", None, m.TasksOut, instance="another-instance")
    finally:
        client.close()


def test_every_route_of_the_table_is_served_and_every_error_maps_back() -> None:
    service = CacheService()
    try:
        app_paths = {(r.method, r.path) for r in ROUTES}
        with InProcessTransport(create_app(service)) as transport, httpx.Client(transport=transport) as client:
            document = client.get(f"{URL}/openapi.json").json()
        for method, path in app_paths:
            assert method.lower() in document["paths"][path]
    finally:
        service.close()
    for code in ERRORS:
        error = client_error(code.status, code.kind, "m")
        assert isinstance(error, code.raises)
    assert isinstance(NotFound("x"), InvalidInput)


def test_a_remote_cache_session_over_the_in_process_app(transport: InProcessTransport) -> None:
    from tvcache import RemoteCache

    with RemoteCache(URL, transport=transport) as cache:
        with cache.session_sync("t", sandbox=KVFactory()) as session:
            session.call("set", {"key": "a", "value": 1})
            assert session.call("get", {"key": "a"}).output
        with cache.session_sync("t", sandbox=KVFactory()) as session:
            assert session.call("set", {"key": "a", "value": 1}).hit
        assert cache.server_stats()["nodes"] == cache.stats().nodes  # the replica holds what the server holds
