"""The dashboard's server side: the page and its assets, the read-only routes it reads (``/v1/activity``,
``/v1/graph/outline``, ``/v1/node``), per-epoch tallies from real ``RemoteCache`` sessions, and auth."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tvcache import RemoteCache
from tvcache.server import CacheService, ServerSettings, ServerThread

from kvstore import KVFactory
from server_support import TASKS, populate_dashboard


@pytest.fixture
def client(service: CacheService) -> Iterator[httpx.Client]:
    with ServerThread(service) as thread, httpx.Client(base_url=thread.url, timeout=10) as client:
        yield client


def insert(client: httpx.Client, parent: int, name: str, seconds: float = 0.5, **extra: object) -> int:
    body = {"task_id": "t", "parent": parent, "call": {"name": name}, "output": f"{name} out", "seconds": seconds}
    response = client.post("/v1/insert", json=body | extra)
    assert response.status_code == 200, response.text
    node_id: int = response.json()["node"]["id"]
    return node_id


def test_the_page_and_assets_are_served_with_a_strict_policy(client: httpx.Client) -> None:
    page = client.get("/dashboard")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy
    assert "default-src 'none'" in policy
    assert page.headers["referrer-policy"] == "no-referrer"
    assert '<script src="/dashboard/dashboard.js"' in page.text
    assert "https://" not in page.text  # nothing from a CDN
    script = client.get("/dashboard/dashboard.js")
    assert script.headers["content-type"].startswith("text/javascript")
    assert "innerHTML" not in script.text  # data is rendered as text only
    assert client.get("/dashboard/dashboard.css").headers["content-type"].startswith("text/css")
    assert client.get("/dashboard/nothing.js").status_code == 404


def test_with_a_token_the_page_is_open_and_the_data_is_not(service: CacheService) -> None:
    settings = ServerSettings(token="s3cret")
    with ServerThread(service, settings) as thread, httpx.Client(base_url=thread.url, timeout=10) as client:
        for path in ("/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css", "/healthz"):
            assert client.get(path).status_code == 200, path
        for path in ("/v1/activity", "/v1/graph/outline?task_id=t", "/v1/node?task_id=t&node_id=0", "/v1/stats"):
            assert client.get(path).status_code == 401, path
        assert client.get("/dashboard?token=s3cret").status_code == 200  # a token in the URL is never needed
        assert client.get("/v1/activity?token=s3cret").status_code == 401  # ... nor accepted
        authorized = client.get("/v1/activity", headers={"Authorization": "Bearer s3cret"})
        assert authorized.status_code == 200


def test_hits_and_misses_are_tallied_by_epoch(client: httpx.Client) -> None:
    a = insert(client, 0, "a", seconds=2.0, epoch=0)
    insert(client, a, "b", seconds=1.0, epoch=0)
    insert(client, a, "c", seconds=3.0)  # untagged
    step = {"task_id": "t", "state": 0, "call": {"name": "a"}}
    assert client.post("/v1/lookup", json=step | {"epoch": 1}).json()["hit"]
    assert not client.post("/v1/lookup", json=step | {"call": {"name": "zzz"}, "epoch": 1}).json()["hit"]
    history = {"task_id": "t", "history": [{"name": "a"}, {"name": "b"}], "epoch": 1}
    b = client.post("/v1/lookup", json=history).json()["node"]["id"]
    assert client.post("/v1/touch", json={"task_id": "t", "node_ids": [a, b, 999], "epoch": 2}).status_code == 200

    activity = client.get("/v1/activity").json()
    (task,) = activity["tasks"]
    epochs = {e["epoch"]: e for e in task["epochs"]}
    assert [e["epoch"] for e in task["epochs"]] == [0, 1, 2, None]  # tagged in order, then untagged
    assert (epochs[0]["hits"], epochs[0]["misses"], epochs[0]["seconds_executed"]) == (0, 2, 3.0)
    assert (epochs[1]["hits"], epochs[1]["misses"], epochs[1]["seconds_saved"]) == (2, 0, 3.0)  # a miss lookup: 0
    assert (epochs[2]["hits"], epochs[2]["seconds_saved"]) == (2, 3.0)  # the unknown node id is not a hit
    assert (epochs[None]["misses"], epochs[None]["hit_rate"]) == (1, 0.0)
    assert epochs[0]["hit_rate"] == 0.0
    assert (task["total"]["hits"], task["total"]["misses"]) == (4, 3)
    assert task["total"]["hit_rate"] == pytest.approx(4 / 7)
    assert (task["nodes"], task["snapshots"]) == (3, 0)
    stats = client.get("/v1/stats").json()
    assert (stats["hits"], stats["misses"], stats["seconds_saved"]) == (4, 3, 6.0)
    metrics = client.get("/metrics").text
    assert "tvcache_hits_total 4" in metrics
    assert "tvcache_misses_total 3" in metrics


def test_epochs_are_validated(client: httpx.Client) -> None:
    body = {"task_id": "t", "parent": 0, "call": {"name": "a"}, "output": "", "seconds": 0.0}
    for epoch in (-1, "3", 1.5, True, 2**31 + 1):
        response = client.post("/v1/insert", json=body | {"epoch": epoch})
        assert response.status_code == 422, epoch
    assert client.get("/v1/activity").json()["tasks"] == []  # nothing was tallied for refused requests


def test_the_wire_format_is_tallied_untagged(client: httpx.Client) -> None:
    key = json.dumps({"function_name": "a", "arguments": {}})  # how the reference client names a call
    put = {"task_name": "w", "history": [key], "values": ["out"], "tool_exec_times": [1.5]}
    assert client.put("/put", json=put).status_code == 200
    assert client.get("/get", params={"task_name": "w", "tool_calls": [key]}).json()["found"]
    assert not client.get("/get", params={"task_name": "w", "tool_calls": [key, key]}).json()["found"]
    (task,) = client.get("/v1/activity").json()["tasks"]
    assert task["epochs"] == [
        {"epoch": None, "hits": 1, "misses": 1, "hit_rate": 0.5, "seconds_saved": 1.5, "seconds_executed": 1.5}
    ]


def test_outline_and_node(client: httpx.Client) -> None:
    a = insert(client, 0, "a")
    body = {"task_id": "t", "parent": a, "call": {"name": "sh", "arguments": {"cmd": "make   all\n" + "x" * 100}}}
    b = client.post("/v1/insert", json=body | {"output": "built", "seconds": 1.0}).json()["node"]["id"]
    read = {"task_id": "t", "parent": b, "call": {"name": "cat", "arguments": {"path": "a", "n": 2}}}
    client.post("/v1/insert", json=read | {"output": "text", "seconds": 0.1, "read_only": True, "is_error": True})
    outline = client.get("/v1/graph/outline", params={"task_id": "t"}).json()
    assert (outline["total"], outline["truncated"]) == (4, False)
    labels = {node["id"]: node["label"] for node in outline["nodes"]}
    assert labels[0] == "root"
    assert labels[b].startswith("make all xxx")
    assert len(labels[b]) == 60
    assert labels[b].endswith("\u2026")
    assert labels[3] == 'n=2 path="a"'  # arguments in canonical (sorted) order
    assert "output" not in outline["nodes"][1]
    read_node = outline["nodes"][3]
    assert (read_node["read_only"], read_node["is_error"], read_node["parent"]) == (True, True, b)

    first = client.get("/v1/graph/outline", params={"task_id": "t", "limit": 2}).json()
    assert (first["truncated"], [node["id"] for node in first["nodes"]]) == (True, [0, a])

    node = client.get("/v1/node", params={"task_id": "t", "node_id": b}).json()
    assert (node["name"], node["arguments"]["cmd"][:4], node["output"], node["parent"]) == ("sh", "make", "built", a)

    assert client.get("/v1/node", params={"task_id": "t", "node_id": 99}).status_code == 404
    assert client.get("/v1/node", params={"task_id": "nope", "node_id": 0}).status_code == 404
    assert client.get("/v1/node", params={"task_id": "t", "node_id": "-1"}).status_code == 422
    assert client.get("/v1/graph/outline", params={"task_id": "nope"}).status_code == 404
    for limit in ("0", "x", "100001"):
        assert client.get("/v1/graph/outline", params={"task_id": "t", "limit": limit}).status_code == 422


def test_the_openapi_document_lists_the_dashboard_routes(client: httpx.Client) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/v1/activity", "/v1/graph/outline", "/v1/node"):
        assert "get" in paths[path]
    assert "epoch" in client.get("/openapi.json").json()["components"]["schemas"]["InsertIn"]["properties"]


def test_remote_sessions_tally_by_epoch_exactly_what_they_counted(service: CacheService, tmp_path: Path) -> None:
    with ServerThread(service) as thread:
        counted = populate_dashboard(thread.url, tmp_path, epochs=2, group=3)
        with httpx.Client(base_url=thread.url) as http:
            activity = http.get("/v1/activity").json()
    tallied = {
        (task["task_id"], epoch["epoch"]): (epoch["hits"], epoch["misses"])
        for task in activity["tasks"]
        for epoch in task["epochs"]
    }
    assert tallied == {key: (value.hits, value.misses) for key, value in counted.items()}
    assert {task for task, _ in tallied} == set(TASKS)
    assert {epoch for _, epoch in tallied} == {0, 1, None}
    later = sum(hits for (_, epoch), (hits, _) in tallied.items() if epoch == 1)
    earlier = sum(hits for (_, epoch), (hits, _) in tallied.items() if epoch == 0)
    assert later > earlier  # the graph fills up: the second epoch hits more


def test_an_untagged_client_sends_no_epoch_field(service: CacheService) -> None:
    """Servers from before epochs reject unknown fields: a client without an epoch must not send one."""
    seen: list[bytes] = []

    class Recording(httpx.HTTPTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            seen.append(request.read())
            return super().handle_request(request)

    with ServerThread(service) as thread:
        cache = RemoteCache(thread.url, transport=Recording())
        with cache, cache.session_sync("t", sandbox=KVFactory()) as session:
            session.call("set", {"key": "a", "value": 1})
            session.call("get", {"key": "a"})
    assert seen
    assert all(b'"epoch"' not in body for body in seen)
