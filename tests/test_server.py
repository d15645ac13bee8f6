"""The server's native /v1 API and its guards, over real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tvcache import Budget
from tvcache.server import CacheService, ServerSettings, ServerThread
from tvcache.server.runner import check_token, is_loopback

from server_support import wait_until

LS = {"name": "sh", "arguments": {"cmd": "ls"}}
MAKE = {"name": "sh", "arguments": {"cmd": "make", "jobs": 2}}


@pytest.fixture
def server() -> Iterator[ServerThread]:
    service = CacheService()
    with ServerThread(service) as thread:
        yield thread
    service.close()


@pytest.fixture
def client(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url) as client:
        yield client


def insert(client: httpx.Client, parent: int, call: dict, output: str, task: str = "t", **extra: object) -> dict:
    body = {"task_id": task, "parent": parent, "call": call, "output": output, "seconds": 1.0, **extra}
    response = client.post("/v1/insert", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_insert_then_lookup_by_history_and_by_step(client: httpx.Client) -> None:
    first = insert(client, 0, LS, "a b")
    assert first["created"] is True
    node = first["node"]
    second = insert(client, node["id"], MAKE, "built")["node"]
    # Argument key order does not matter: the call is canonical.
    reordered = {"name": "sh", "arguments": {"jobs": 2, "cmd": "make"}}
    match = client.post("/v1/lookup", json={"task_id": "t", "history": [LS, reordered]}).json()
    assert match["hit"] is True
    assert match["node"]["output"] == "built"
    assert match["node"]["id"] == second["id"]
    step = client.post("/v1/lookup", json={"task_id": "t", "state": node["id"], "call": MAKE}).json()
    assert step["node"]["id"] == second["id"]
    miss = client.post("/v1/lookup", json={"task_id": "t", "history": [LS, LS]}).json()
    assert miss == {"hit": False, "node": None, "state": node["id"], "matched": 1, "snapshot": None}
    assert insert(client, 0, LS, "other output")["created"] is False  # first writer wins, idempotent
    path = client.get("/v1/path", params={"task_id": "t", "node_id": second["id"]}).json()
    assert [n["id"] for n in path["nodes"]] == [node["id"], second["id"]]


def test_lookup_of_an_unknown_task_creates_nothing(client: httpx.Client, server: ServerThread) -> None:
    response = client.post("/v1/lookup", json={"task_id": "never", "history": [LS]})
    assert response.json()["hit"] is False
    assert "never" not in server.service.cache


def test_read_only_tools_are_skipped_in_a_history_match(client: httpx.Client) -> None:
    node = insert(client, 0, MAKE, "built")["node"]
    cat = {"name": "cat", "arguments": {"path": "a"}}
    insert(client, node["id"], cat, "A", read_only=True)
    body = {"task_id": "t", "history": [cat, MAKE, cat], "read_only_tools": ["cat"]}
    match = client.post("/v1/lookup", json=body).json()
    assert match["hit"] is True
    assert match["node"]["output"] == "A"


def test_claims_coalesce_and_expire() -> None:
    now = [0.0]
    service = CacheService(clock=lambda: now[0])
    with ServerThread(service) as server, httpx.Client(base_url=server.url) as client:
        body = {"task_id": "t", "state": 0, "call": LS, "ttl": 5}
        wait = {"task_id": "t", "state": 0, "call": LS, "timeout": 0.05}
        owner = client.post("/v1/claim", json=body).json()
        assert owner["status"] == "owner"
        assert client.post("/v1/claim", json=body).json()["status"] == "wait"
        assert client.post("/v1/claim/wait", json=wait).json()["status"] == "pending"
        # The owner never heartbeats: once its TTL passes, waiters are told to retry and the next claim owns it.
        now[0] = 10.0
        assert client.post("/v1/claim/wait", json=wait).json()["status"] in ("none", "expired")
        again = client.post("/v1/claim", json=body).json()
        assert again["status"] == "owner"
        assert client.post("/v1/claim/heartbeat", json={"claim_id": owner["claim_id"]}).status_code == 404
        assert client.post("/v1/claim/heartbeat", json={"claim_id": again["claim_id"]}).json()["status"] == "owner"
        insert(client, 0, LS, "listing")  # the insert finishes the claim
        done = client.post("/v1/claim/wait", json=wait).json()
        assert done["status"] == "done"
        assert done["node"]["output"] == "listing"
        assert client.post("/v1/claim", json=body).json()["status"] == "hit"
        assert client.get("/v1/stats").json()["claims_taken_over"] == 1
    service.close()


def test_a_failed_claim_tells_waiters_to_retry(client: httpx.Client) -> None:
    owner = client.post("/v1/claim", json={"task_id": "t", "state": 0, "call": LS}).json()
    client.post("/v1/claim/resolve", json={"claim_id": owner["claim_id"], "error": "sandbox broke"})
    waited = client.post("/v1/claim/wait", json={"task_id": "t", "state": 0, "call": LS, "timeout": 1}).json()
    assert waited["status"] == "none"  # finished: nobody holds it any more, so the waiter claims it itself


def test_snapshots_attach_lease_release_and_budget(tmp_path: Path) -> None:
    service = CacheService(budget=Budget(max_snapshots_per_task=1))
    with ServerThread(service) as server, httpx.Client(base_url=server.url) as client:
        a = insert(client, 0, LS, "x")["node"]["id"]
        b = insert(client, a, MAKE, "y")["node"]["id"]
        snap = {"kind": "kv", "path": "/definitely/not/on/the/server", "bytes": 10}
        first = client.post("/v1/snapshots/attach", json={"task_id": "t", "node_id": a, "snapshot": snap}).json()
        assert first == {"attached": True, "evicted": []}
        lease = client.post("/v1/snapshots/lease", json={"task_id": "t", "state": b, "kind": "kv"}).json()
        assert lease["node"]["id"] == a
        assert lease["node"]["snapshot"]["path"] == snap["path"]
        # The budget allows one snapshot, but the leased one cannot be evicted: the new one goes back instead.
        other = {**snap, "path": "/elsewhere"}
        second = client.post("/v1/snapshots/attach", json={"task_id": "t", "node_id": b, "snapshot": other}).json()
        assert second["attached"] is True
        assert service.cache.graph("t").node(a).snapshot is not None
        assert client.post("/v1/snapshots/release", json={"lease_id": lease["lease_id"]}).json() == {"ok": True}
        assert client.post("/v1/snapshots/release", json={"lease_id": lease["lease_id"]}).json() == {"ok": False}
        # The same record again (a retried attach): not attached twice, and not handed back to be freed either,
        # since node a still holds that storage.
        third = client.post("/v1/snapshots/attach", json={"task_id": "t", "node_id": a, "snapshot": snap}).json()
        assert third == {"attached": False, "evicted": []}
        # Another record at a node that holds one goes back to its sender, who made it, to free.
        fourth = {**snap, "path": "/third"}
        assert client.post("/v1/snapshots/attach", json={"task_id": "t", "node_id": a, "snapshot": fourth}).json() == {
            "attached": False,
            "evicted": [{**fourth, "meta": {}}],
        }
    service.close()
    assert not Path("/definitely").exists()


def test_leases_expire(tmp_path: Path) -> None:
    now = [0.0]
    service = CacheService(lease_ttl=5.0, clock=lambda: now[0])
    with (
        ServerThread(service, ServerSettings(sweep_interval=0.01)) as server,
        httpx.Client(base_url=server.url) as client,
    ):
        a = insert(client, 0, LS, "x")["node"]["id"]
        snap = {"kind": "kv", "path": "p", "bytes": 1}
        client.post("/v1/snapshots/attach", json={"task_id": "t", "node_id": a, "snapshot": snap})
        client.post("/v1/snapshots/lease", json={"task_id": "t", "state": a, "kind": "kv"})
        assert service.cache.graph("t").node(a).leases == 1
        now[0] = 6.0
        wait_until(lambda: service.cache.graph("t").node(a).leases == 0)
        assert client.get("/v1/stats").json()["leases_expired"] == 1
    service.close()


def test_test_results_and_graph_export(client: httpx.Client) -> None:
    a = insert(client, 0, LS, "x")["node"]["id"]
    put = {"task_id": "t", "node_id": a, "key": "reward", "value": {"passed": 3}}
    assert client.post("/v1/tests/put", json=put).json() == {"ok": True}
    got = client.post("/v1/tests/get", json={"task_id": "t", "node_id": a, "key": "reward"}).json()
    assert got == {"found": True, "value": {"passed": 3}}
    missing = client.post("/v1/tests/get", json={"task_id": "t", "node_id": a, "key": "other"}).json()
    assert missing["found"] is False
    graph = client.get("/v1/graph", params={"task_id": "t"}).json()
    assert [n["id"] for n in graph["nodes"]] == [0, a]
    assert client.get("/v1/tasks").json()["tasks"][0]["task_id"] == "t"
    assert client.get("/v1/graph", params={"task_id": "nope"}).status_code == 404


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/v1/lookup", b"not json", 422, "JSON"),
        ("/v1/lookup", {"task_id": "t", "history": [LS], "bogus": 1}, 422, "bogus"),
        ("/v1/lookup", {"task_id": "", "history": []}, 422, "task_id"),
        ("/v1/lookup", {"task_id": "t"}, 400, "history"),
        ("/v1/insert", {"task_id": "t", "parent": 0, "call": LS, "output": "x", "seconds": -1}, 422, "seconds"),
        ("/v1/insert", {"task_id": "t", "parent": 99, "call": LS, "output": "x", "seconds": 1}, 404, "node 99"),
        ("/v1/insert", {"task_id": "t\x00x", "parent": 0, "call": LS, "output": "x", "seconds": 1}, 400, "NUL"),
        ("/v1/insert", {"task_id": "t", "parent": 0, "call": {"name": "sh", "arguments": {"x": "\ud800"}},
                        "output": "x", "seconds": 1}, 422, "hex escape"),
        ("/v1/claim/heartbeat", {"claim_id": "nope"}, 404, "no longer held"),
        ("/v1/tests/put", {"task_id": "t", "node_id": 0, "key": "k", "value": 1, "x": 2}, 422, "x"),
    ],
)  # fmt: skip
def test_bad_input_is_a_clear_4xx(client: httpx.Client, path: str, body: object, status: int, words: str) -> None:
    if isinstance(body, bytes):
        response = client.post(path, content=body)
    else:
        response = client.post(path, content=json.dumps(body).encode())  # ASCII escapes keep lone surrogates
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words.lower() in (error["message"] + str(error.get("detail", ""))).lower()


def test_unknown_routes_and_methods(client: httpx.Client) -> None:
    assert client.get("/v2/nothing").status_code == 404
    assert client.get("/v1/lookup").status_code == 405
    assert client.get("/v1/path", params={"task_id": "t", "node_id": "x"}).status_code == 422


def test_request_size_limits() -> None:
    service = CacheService()
    settings = ServerSettings(max_body_bytes=1000, max_query_bytes=1000)
    with ServerThread(service, settings) as server, httpx.Client(base_url=server.url) as client:
        big = {"task_id": "t", "parent": 0, "call": LS, "output": "x" * 2000, "seconds": 1}
        response = client.post("/v1/insert", json=big)
        assert response.status_code == 413
        assert "1000 bytes" in response.json()["error"]["message"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while streaming
            yield b'{"task_id": "t", "output": "'
            yield b"x" * 2000

        assert client.post("/v1/insert", content=chunks()).status_code == 413
        assert client.get("/get", params={"task_name": "t", "tool_calls": ["x" * 2000]}).status_code == 414
        assert service.cache.tasks() == []
    service.close()


def test_bearer_token_is_required_when_set() -> None:
    service = CacheService()
    with ServerThread(service, ServerSettings(token="s3cret")) as server:
        with httpx.Client(base_url=server.url) as anonymous:
            assert anonymous.get("/healthz").status_code == 200
            denied = anonymous.post("/v1/lookup", json={"task_id": "t", "history": []})
            assert denied.status_code == 401
            assert anonymous.get("/get", params={"task_name": "t"}).status_code == 401
            wrong = anonymous.get("/v1/stats", headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
        with httpx.Client(base_url=server.url, headers={"Authorization": "Bearer s3cret"}) as client:
            assert client.get("/v1/stats").status_code == 200
            assert client.get("/openapi.json").json()["security"] == [{"bearer": []}]
    service.close()


def test_non_loopback_binding_needs_a_token() -> None:
    assert is_loopback("127.0.0.1")
    assert is_loopback("::1")
    assert is_loopback("localhost")
    assert not is_loopback("0.0.0.0")
    assert not is_loopback("10.1.2.3")
    check_token("127.0.0.1", None)
    check_token("0.0.0.0", "token")
    with pytest.raises(ValueError, match="--token"):
        check_token("0.0.0.0", None)


def test_task_ids_never_reach_the_filesystem(tmp_path: Path) -> None:
    data = tmp_path / "data"
    service = CacheService(data)
    with ServerThread(service) as server, httpx.Client(base_url=server.url) as client:
        for task in ("../../escape", "/etc/passwd", "a/b/../../c", "..", "x" * 1024):
            insert(client, 0, LS, "x", task=task)
            snap = {"kind": "kv", "path": str(tmp_path / "victim"), "bytes": 1}
            client.post("/v1/snapshots/attach", json={"task_id": task, "node_id": 1, "snapshot": snap})
    service.close()
    assert sorted(p.name for p in data.iterdir()) == ["journal.log", "lock"]
    assert not (tmp_path / "escape").exists()
    reopened = CacheService(data)
    assert "../../escape" in reopened.cache.tasks()
    reopened.close()


def test_inserts_survive_a_restart_of_a_durable_server(tmp_path: Path) -> None:
    service = CacheService(tmp_path)
    with ServerThread(service) as server, httpx.Client(base_url=server.url) as client:
        a = insert(client, 0, LS, "x")["node"]["id"]
        snap = {"kind": "kv", "path": "/not/on/server", "bytes": 1}
        client.post("/v1/snapshots/attach", json={"task_id": "t", "node_id": a, "snapshot": snap})
    service.close()
    reopened = CacheService(tmp_path)
    node = reopened.cache.graph("t").node(a)
    assert node.output == "x"
    assert node.snapshot is not None  # a client's snapshot is kept although its path is not on the server
    reopened.close()


def test_openapi_metrics_and_health(client: httpx.Client) -> None:
    document = client.get("/openapi.json").json()
    assert document["openapi"].startswith("3.")
    for path in ("/v1/lookup", "/v1/claim", "/v1/insert", "/v1/snapshots/lease", "/get", "/put", "/prefix_match"):
        assert path in document["paths"]
    assert "LookupIn" in document["components"]["schemas"]
    insert(client, 0, LS, "x")
    client.post("/v1/lookup", json={"task_id": "t", "history": [LS]})
    text = client.get("/metrics").text
    assert "tvcache_lookup_hits_total 1" in text
    assert 'tvcache_lookup_seconds_count{route="/v1/lookup"} 1' in text
    assert "tvcache_nodes 1" in text
    assert client.get("/healthz").json()["status"] == "ok"
