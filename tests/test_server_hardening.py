"""Hostile and oversized input to the server (issue 19): non-finite numbers in stored JSON, query strings up to
the documented limit over a real socket, traffic that must not grow the server's memory, and WebSocket
connections past the auth guard."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tvcache.server import CacheService, ServerSettings, ServerThread, create_app
from tvcache.server.activity import Activity
from tvcache.server.app import Guard
from tvcache.server.runner import AppThread

LS = {"name": "sh", "arguments": {"cmd": "ls"}}


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


def insert(client: httpx.Client, task: str = "t", parent: int = 0) -> int:
    body = {"task_id": task, "parent": parent, "call": LS, "output": "a b", "seconds": 1.0}
    response = client.post("/v1/insert", json=body)
    assert response.status_code == 200, response.text
    node_id: int = response.json()["node"]["id"]
    return node_id


# ------------------------------------------------------------------ item 9: non-finite numbers in snapshot meta


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_a_non_finite_number_in_snapshot_meta_is_a_422_and_changes_nothing(tmp_path: Path, number: str) -> None:
    service = CacheService(tmp_path / "data")
    with ServerThread(service) as server, httpx.Client(base_url=server.url) as client:
        node = insert(client)
        # The JSON parser takes these literals; the journal cannot store them.
        body = '{"task_id":"t","node_id":%d,"snapshot":{"kind":"k","path":"/a","bytes":1,"meta":{"n":[1,%s]}}}'
        refused = client.post("/v1/snapshots/attach", content=(body % (node, number)).encode())
        assert refused.status_code == 422, refused.text
        error = refused.json()["error"]
        assert error["message"].startswith("snapshot.meta.n")
        assert "finite number" in error["message"]
        assert service.cache.graph("t").node(node).snapshot is None
        good = {"kind": "k", "path": "/b", "bytes": 1, "meta": {"n": 1.5}}
        attached = client.post("/v1/snapshots/attach", json={"task_id": "t", "node_id": node, "snapshot": good})
        assert attached.json() == {"attached": True, "evicted": []}
    service.close()
    reopened = CacheService(tmp_path / "data")
    snapshot = reopened.cache.graph("t").node(node).snapshot
    assert snapshot is not None
    assert (snapshot.path, dict(snapshot.meta)) == ("/b", {"n": 1.5})
    reopened.close()


# ------------------------------------------------------------------ item 12: long query strings


def raw_get(url: str, target: bytes) -> tuple[int, bytes, bytes]:
    """One GET over a plain socket: (status, content-type, body). The server may refuse the request before
    reading all of it; its answer is read all the same."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            sock.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        except OSError:  # refused mid-request: the response is already on its way
            pass
        data = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:  # the unread rest of the request resets the connection after the answer
                break
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers.get(b"content-type", b""), body


@pytest.mark.parametrize("parser", ["default", "h11"])
def test_long_wire_queries_work_up_to_the_documented_limit_and_are_refused_in_json(parser: str) -> None:
    """``default`` is what ``tvcache serve`` runs (httptools, installed with the server extra); h11 its fallback."""
    service = CacheService()
    limit = ServerSettings.max_query_bytes
    thread = ServerThread(service) if parser == "default" else AppThread(create_app(service), parser=parser)
    with thread as server, httpx.Client(base_url=server.url) as client:
        # A history whose query string is over 64 KiB (where the HTTP parsers stopped) but under 1 MiB.
        history = [json.dumps({"name": "write", "arguments": {"text": str(i) * 40_000}}) for i in range(10)]
        put = {"task_name": "w", "history": history, "values": [f"v{i}" for i in range(10)]}
        assert client.put("/put", json=put).status_code == 200
        # (httpx itself refuses a query over 64 KiB: a plain socket sends it, as `requests` would.)
        query = urlencode({"task_name": "w", "tool_calls": history}, doseq=True).encode()
        assert 64 * 1024 < len(query) < limit
        status, kind, body = raw_get(server.url, b"/get?" + query)
        assert (status, kind) == (200, b"application/json"), body[:200]
        assert json.loads(body)["value"] == "v9"

        prefix = b"/get?task_name=w&tool_calls="
        status, kind, body = raw_get(server.url, prefix + b"x" * (limit - 200))  # just under the limit
        assert (status, json.loads(body)["found"]) == (200, False)
        for size in (limit + 1, 4 * limit):  # over it: refused by the app, or by the parser as it arrives
            status, kind, body = raw_get(server.url, prefix + b"x" * size)
            assert kind == b"application/json", (size, body[:100])
            error = json.loads(body)["error"]
            if parser == "default" or size == limit + 1:
                assert (status, error["type"]) == (414, "too_large")
                assert f"exceeds {limit} bytes" in error["message"]
            else:  # h11 cannot tell a head that is too long from a malformed one
                assert (status, error["type"]) == (400, "bad_request")
        assert client.get("/healthz").status_code == 200
    service.close()


# ------------------------------------------------------------------ item 13: memory bounded under junk traffic


def test_read_misses_on_unknown_tasks_add_no_row(client: httpx.Client) -> None:
    for i in range(300):
        miss = client.get("/get", params={"task_name": f"made-up-{i}" + "x" * 500, "tool_calls": ["a"]})
        assert miss.json()["found"] is False
    activity = client.get("/v1/activity")
    assert activity.json()["tasks"] == []
    assert len(activity.content) < 1000


def test_activity_keeps_rows_only_for_tasks_the_cache_holds() -> None:
    held = {"t"}
    activity = Activity(tracked=held.__contains__)
    for i in range(1000):
        activity.miss(f"unknown-{i}", None, seconds_executed=1.0)
    activity.miss("t", 3, seconds_executed=2.0)
    activity.hit("t", 3, seconds_saved=5.0)
    assert activity.tasks() == ["t"]
    total = activity.total()
    assert (total.hits, total.misses, total.seconds_executed) == (1, 1001, 1002.0)  # nothing is lost from totals
    assert [(epoch, tally.hits, tally.misses) for epoch, tally in activity.epochs("t")] == [(3, 1, 1)]
    held.add("unknown-0")  # once the cache holds a task, it gets a row from then on
    activity.hit("unknown-0", None, seconds_saved=1.0)
    assert activity.tasks() == ["t", "unknown-0"]
    assert activity.total("unknown-0").hits == 1


def test_claims_and_refused_writes_on_unknown_tasks_create_no_graph(client: httpx.Client, server: ServerThread) -> None:
    for i in range(100):
        claim = client.post("/v1/claim", json={"task_id": f"new-{i}", "state": 0, "call": LS, "ttl": 86_400})
        assert claim.json()["status"] == "owner"
    refused = [
        ("/v1/claim", {"task_id": "u", "state": 5, "call": LS}),
        ("/v1/insert", {"task_id": "u", "parent": 5, "call": LS, "output": "", "seconds": 0.0}),
        ("/v1/snapshots/attach", {"task_id": "u", "node_id": 5, "snapshot": {"kind": "k", "path": "p", "bytes": 1}}),
        ("/v1/tests/put", {"task_id": "u", "node_id": 5, "key": "k", "value": 1}),
    ]
    for path, body in refused:
        response = client.post(path, json=body)
        assert response.status_code == 404, (path, response.text)
        assert "has no node 5" in response.json()["error"]["message"]
    assert server.service.cache.tasks() == []
    assert client.get("/v1/stats").json()["tasks"] == 0
    assert client.post("/v1/claim", json={"task_id": "a\x00b", "state": 0, "call": LS}).status_code == 400


def test_claims_and_leases_are_bounded_and_room_comes_back_as_they_expire() -> None:
    now = [0.0]
    service = CacheService(max_held=3, clock=lambda: now[0])
    with ServerThread(service) as server, httpx.Client(base_url=server.url) as client:
        node = insert(client)
        snapshot = {"kind": "k", "path": "/p", "bytes": 1}
        client.post("/v1/snapshots/attach", json={"task_id": "t", "node_id": node, "snapshot": snapshot})
        for i in range(3):
            claim = client.post("/v1/claim", json={"task_id": f"new-{i}", "state": 0, "call": LS, "ttl": 86_400})
            assert claim.json()["status"] == "owner"
        refused = client.post("/v1/claim", json={"task_id": "new-3", "state": 0, "call": LS, "ttl": 86_400})
        assert refused.status_code == 503
        assert "limit" in refused.json()["error"]["message"]
        for _ in range(3):
            lease = client.post("/v1/snapshots/lease", json={"task_id": "t", "state": node, "kind": "k", "ttl": 60})
            assert lease.json()["lease_id"] is not None
        refused = client.post("/v1/snapshots/lease", json={"task_id": "t", "state": node, "kind": "k"})
        assert refused.status_code == 503
        assert service.cache.graph("t").node(node).leases == 3  # the refused lease took nothing
        now[0] = 90_000.0  # every claim and lease has expired: the next request makes room by sweeping them
        claim = client.post("/v1/claim", json={"task_id": "new-3", "state": 0, "call": LS})
        assert claim.json()["status"] == "owner"
    service.close()


def test_a_mark_in_a_task_the_cache_does_not_hold_is_refused(client: httpx.Client, server: ServerThread) -> None:
    body = {"tool": "sh", "reason": "seen", "task_id": "never-recorded"}
    response = client.post("/v1/tools/nondeterministic", json=body)
    assert response.status_code == 404
    assert server.service.cache.nondeterministic_marks() == []


def test_a_claim_on_a_new_task_still_coalesces(client: httpx.Client, server: ServerThread) -> None:
    body = {"task_id": "new", "state": 0, "call": LS}
    owner = client.post("/v1/claim", json=body).json()
    assert owner["status"] == "owner"
    assert client.post("/v1/claim", json=body).json()["status"] == "wait"
    assert client.post("/v1/claim/wait", json=body | {"timeout": 0.01}).json()["status"] == "pending"
    assert "new" not in server.service.cache
    with httpx.Client(base_url=server.url) as waiter:
        # The owner's insert creates the task and wakes the waiter (a second connection, served concurrently).
        result: dict[str, object] = {}
        thread = threading.Thread(
            target=lambda: result.update(waiter.post("/v1/claim/wait", json=body | {"timeout": 10}).json())
        )
        thread.start()
        node = insert(client, task="new")
        thread.join(timeout=15)
    assert result["status"] == "done"
    assert result["node"]["id"] == node  # type: ignore[index]


# ------------------------------------------------------------------ item 15: WebSockets past the guard


async def echo(websocket: WebSocket) -> None:
    await websocket.accept()
    await websocket.send_text(await websocket.receive_text())
    await websocket.close()


def guarded_echo() -> Guard:
    return Guard(Starlette(routes=[WebSocketRoute("/ws", echo)]), token="s3cret")


def test_websockets_need_the_token_when_one_is_set() -> None:
    with AppThread(guarded_echo()) as server:
        url = server.url.replace("http://", "ws://") + "/ws"
        for headers in ({}, {"Authorization": "Bearer nope"}):
            with pytest.raises(InvalidStatus) as refused:
                connect(url, additional_headers=headers, open_timeout=10).close()
            assert refused.value.response.status_code == 403
        with connect(url, additional_headers={"Authorization": "Bearer s3cret"}, open_timeout=10) as ws:
            ws.send("hello")
            assert ws.recv(timeout=10) == "hello"
    # The close code says why: a policy violation.
    test_client = TestClient(guarded_echo())
    with pytest.raises(WebSocketDisconnect) as closed, test_client.websocket_connect("/ws"):
        pass
    assert closed.value.code == 1008
    assert "bearer token" in closed.value.reason
