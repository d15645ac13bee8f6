"""The original TVCache wire format, written from its documented routes (docs/wire-compat.md), over real HTTP.

The client flow is the reference client's (tvclient's TVCacheClient + AsyncSemanticStatefulExecutor): put a
history with a forked env, exact get, prefix match to find an env to fork, unref it afterwards.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tvcache import Budget
from tvcache.server import CacheService, ServerThread
from tvcache.server.wire import WIRE_TOOL, wire_call


def key(**call: object) -> str:
    return json.dumps(call)  # how the reference client names a tool call


CLONE = key(function_name="sh", arguments={"cmd": "git clone repo"})
BUILD = key(function_name="sh", arguments={"cmd": "make"})
TEST = key(function_name="sh", arguments={"cmd": "make test"})


@pytest.fixture
def service() -> Iterator[CacheService]:
    service = CacheService(budget=Budget(max_snapshots_per_task=3))
    yield service
    service.close()


@pytest.fixture
def client(service: CacheService) -> Iterator[httpx.Client]:
    with ServerThread(service) as server, httpx.Client(base_url=server.url, headers={"X-Task-Name": "t"}) as client:
        yield client


def get(client: httpx.Client, task: str, calls: list[str]) -> dict:
    response = client.get("/get", params={"task_name": task, "tool_calls": calls})
    assert response.status_code == 200, response.text
    return response.json()


def put(client: httpx.Client, task: str, history: list[str], env_id: str | None, values: list, **extra: object) -> dict:
    body = {"task_name": task, "history": history, "env_id": env_id, "values": values,
            "tool_exec_times": [1.5] * len(values), "start_idx": 0, **extra}  # fmt: skip
    response = client.put("/put", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_reference_client_flow(client: httpx.Client, service: CacheService) -> None:
    # A rollout executes clone and build, forks its env after each and puts the history.
    assert put(client, "t", [CLONE], "env-1", ["cloned"]) == {"success": True, "removed_env_ids": []}
    assert put(client, "t", [CLONE, BUILD], "env-2", ["ok"], start_idx=1)["success"] is True
    # Another rollout of the same task: exact hits for both calls, with the env holding each state.
    assert get(client, "t", [CLONE]) == {"found": True, "env_id": "env-1", "value": "cloned", "tool_exec_time": 1.5}
    assert get(client, "t", [CLONE, BUILD])["value"] == "ok"
    miss = get(client, "t", [CLONE, BUILD, TEST])
    assert miss == {"found": False, "env_id": None, "value": None, "tool_exec_time": None}
    # It misses on the test: prefix match names the deepest env to fork, and references it.
    match = client.post("/prefix_match", json={"task_name": "t", "tool_calls": [CLONE, BUILD, TEST]}).json()
    assert match == {"found": True, "env_id": "env-2", "history": [CLONE, BUILD]}
    node = service.cache.graph("t").match([wire_call(CLONE), wire_call(BUILD)]).node
    assert node is not None
    assert node.leases == 1  # referenced: the budget cannot evict it
    assert client.post("/unref", json={"env_id": "env-2", "task_name": "t"}).json() == {"success": True}
    assert node.leases == 0
    # Unref of an env with no reference is reported, not a 500 (the reference raises KeyError).
    assert client.post("/unref", json={"env_id": "env-2", "task_name": "t"}).json()["success"] is False
    # A task nobody has put anything in.
    assert get(client, "other", [CLONE])["found"] is False
    assert client.post("/prefix_match", json={"task_name": "other", "tool_calls": [CLONE]}).json() == {
        "found": False,
        "env_id": None,
        "history": None,
    }
    service.cache.graph("t").check_invariants()


def test_values_keep_their_json_type_and_calls_their_exact_string(client: httpx.Client) -> None:
    spaced = CLONE.replace(":", " : ")
    put(client, "t", [CLONE], None, [{"rows": [1, 2.5, None]}])
    put(client, "t", [spaced], None, ["other"])
    assert get(client, "t", [CLONE])["value"] == {"rows": [1, 2.5, None]}
    assert get(client, "t", [spaced])["value"] == "other"  # a different string is a different call
    assert get(client, "t", [CLONE])["env_id"] is None


def test_put_moves_an_env_down_and_returns_a_redundant_one(client: httpx.Client) -> None:
    put(client, "t", [CLONE], "env-1", ["a"])
    # The same env advanced in place: it no longer holds the state after CLONE.
    put(client, "t", [CLONE, BUILD], "env-1", ["b"], start_idx=1)
    assert get(client, "t", [CLONE])["env_id"] is None
    assert get(client, "t", [CLONE, BUILD])["env_id"] == "env-1"
    # A second env for a state that already has one is handed back for the client to stop.
    assert put(client, "t", [CLONE, BUILD], "env-9", [], start_idx=2)["removed_env_ids"] == ["env-9"]


def test_budget_evicts_unreferenced_envs_and_reports_them(client: httpx.Client) -> None:
    chain: list[str] = []
    removed: list[str] = []
    for index in range(3):
        chain.append(key(cmd=f"step {index}"))
        removed += put(client, "t", chain, f"env-{index}", ["v"], start_idx=index)["removed_env_ids"]
    assert removed == []
    client.post("/prefix_match", json={"task_name": "t", "tool_calls": chain[:1]})  # references env-0
    chain.append(key(cmd="step 3"))
    removed = put(client, "t", chain, "env-3", ["v"], start_idx=3)["removed_env_ids"]
    assert len(removed) == 1
    assert removed[0] in ("env-1", "env-2")  # never the referenced env-0 or the new env-3
    assert get(client, "t", chain[:1])["env_id"] == "env-0"


def test_put_without_values_for_new_calls_is_a_400_and_changes_nothing(client: httpx.Client) -> None:
    response = client.put("/put", json={"task_name": "t", "history": [CLONE, BUILD], "env_id": "e", "start_idx": 1,
                                        "values": ["x"], "tool_exec_times": [1]})  # fmt: skip
    assert response.status_code == 400
    assert "start_idx" in response.json()["error"]["message"]
    response = client.put("/put", json={"task_name": "t", "history": [CLONE], "env_id": "e"})
    assert response.status_code == 400
    assert get(client, "t", [CLONE])["found"] is False
    assert client.put("/put", json={"task_name": "t", "history": "notalist"}).status_code == 422


def test_mark_stateless_and_test_results(client: httpx.Client) -> None:
    put(client, "t", [CLONE, CLONE], "env-1", ["a", "b"])
    ok = client.post("/mark_stateless", json={"task_name": "t", "history": [CLONE, CLONE], "env_id": "env-1"})
    assert ok.json() == {"success": True}
    # The env id must match the node's (400 like the reference); the first CLONE node has no env.
    wrong = client.post("/mark_stateless", json={"task_name": "t", "history": [CLONE], "env_id": "env-1"})
    assert wrong.status_code == 400
    assert wrong.json() == {"success": False}
    stored = client.post(
        "/store_test_result", json={"task_name": "t", "history": [CLONE, CLONE], "test_result": "PASS"}
    )
    assert stored.json() == {"success": True}
    # Exactly the node at the whole history (the reference stops early when the last call repeats an earlier one).
    first = client.get("/get_test_result", params={"task_name": "t", "tool_calls": [CLONE]}).json()
    assert first == {"found": False, "test_result": None}
    both = client.get("/get_test_result", params={"task_name": "t", "tool_calls": [CLONE, CLONE]}).json()
    assert both == {"found": True, "test_result": "PASS"}
    missing = client.post("/store_test_result", json={"task_name": "t", "history": [BUILD], "test_result": "x"})
    assert missing.json() == {"success": False}
    assert client.post(
        "/store_test_result", json={"task_name": "t", "history": [], "test_result": "x"}
    ).status_code in (
        400,
        422,
    )
    assert client.get("/get_test_result", params={"task_name": "t"}).status_code == 400
    tree = client.get("/visualize").json()["t"]
    node = tree["children"][CLONE]["children"][CLONE]
    assert node["stateless"] is True
    assert node["test_result"] == "PASS"
    assert node["env_id"] == "env-1"


def test_get_all_envs_references_each(client: httpx.Client, service: CacheService) -> None:
    put(client, "t", [CLONE], "env-1", ["a"])
    put(client, "t", [CLONE, BUILD], "env-2", ["b"], start_idx=1)
    assert client.get("/get_all_envs", params={"task_name": "t"}).json() == {"env_ids": ["env-1", "env-2"]}
    assert len(service.leases) == 2
    for env in ("env-1", "env-2"):
        assert client.post("/unref", json={"env_id": env}).json()["success"] is True  # task_name is optional
    assert service.leases == {}
    assert client.get("/get_all_envs").status_code == 400


def test_visualize_shape_and_native_tasks(client: httpx.Client) -> None:
    put(client, "t", [CLONE], "env-1", ["a"])
    client.post("/v1/insert", json={"task_id": "native", "parent": 0, "call": {"name": "sh", "arguments": {"c": 1}},
                                    "output": "o", "seconds": 1})  # fmt: skip
    tree = client.get("/visualize").json()
    node = tree["t"]["children"][CLONE]
    assert set(node) == {"env_id", "value", "tool_exec_time", "init_time", "ttl", "test_result", "cache_hits",
                         "prefix_hits", "stateless", "children"}  # fmt: skip
    assert tree["native"]["children"]['{"arguments":{"c":1},"name":"sh"}']["value"] == "o"
    assert client.get("/visualize", params={"path": "../../etc/passwd"}).status_code == 400
    assert WIRE_TOOL == "tvcache.wire"
