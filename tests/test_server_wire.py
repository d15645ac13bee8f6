"""The original TVCache wire format, written from its documented routes (docs/wire-compat.md), over real HTTP.

The client flow is the reference client's (tvclient's TVCacheClient + its executors): put a history with a forked
env, exact get, prefix match to find an env to fork, should_fork, unref it afterwards. The whole request sequence
of the released executor is replayed in tests/test_wire_sequence.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tvcache import Budget
from tvcache.protocol import Outcome
from tvcache.server import CacheService, ServerThread
from tvcache.server.wire import WIRE_ROUTES, WIRE_TOOL, wire_call

from server_support import wait_until


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
    with ServerThread(service) as server, httpx.Client(base_url=server.url) as client:
        yield client


def get(client: httpx.Client, task: str, calls: list[str]) -> dict[str, Any]:
    response = client.get("/get", params={"task_name": task, "tool_calls": calls}, headers={"X-Task-Name": task})
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def put(
    client: httpx.Client, task: str, history: list[str], env_id: str | None, values: list[Any], **extra: object
) -> dict[str, Any]:
    body = {"task_name": task, "history": history, "env_id": env_id, "values": values,
            "tool_exec_times": [1.5] * len(values), "start_idx": 0, **extra}  # fmt: skip
    response = client.put("/put", json=body, headers={"X-Task-Name": task})
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def post(client: httpx.Client, path: str, **body: Any) -> httpx.Response:
    return client.post(path, json=body)


def env_leases(service: CacheService) -> int:
    return sum(1 for held in service.leases.values() if held.tag is not None)


def test_reference_client_flow(client: httpx.Client, service: CacheService) -> None:
    # A rollout executes clone and build, forks its env after each and puts the history.
    assert put(client, "t", [CLONE], "env-1", ["cloned"]) == {
        "success": True,
        "removed_env_ids": [],
        "over_budget_leased": 0,
    }
    assert put(client, "t", [CLONE, BUILD], "env-2", ["ok"], start_idx=1)["success"] is True
    # Another rollout of the same task: exact hits for both calls, with the env holding each state.
    assert get(client, "t", [CLONE]) == {"found": True, "env_id": "env-1", "value": "cloned", "tool_exec_time": 1.5}
    assert get(client, "t", [CLONE, BUILD])["value"] == "ok"
    miss = get(client, "t", [CLONE, BUILD, TEST])
    assert miss == {"found": False, "env_id": None, "value": None, "tool_exec_time": None}
    # It misses on the test: prefix match names the deepest env to fork, and references it ...
    match = post(client, "/prefix_match", task_name="t", tool_calls=[CLONE, BUILD, TEST]).json()
    assert match == {"found": True, "env_id": "env-2", "history": [CLONE, BUILD]}
    node = service.cache.graph("t").match([wire_call(CLONE), wire_call(BUILD)]).node
    assert node is not None
    assert node.leases == 1  # referenced: the budget cannot evict it
    # ... should_fork confirms that reference rather than taking a second one (the executor unrefs once).
    fork = post(client, "/should_fork", task_name="t", history=[CLONE, BUILD])
    assert fork.json() == {"should_fork": True, "env_id": "env-2"}
    assert node.leases == 1
    assert post(client, "/unref", env_id="env-2", task_name="t").json() == {"success": True}
    assert node.leases == 0
    # Unref of an env with no reference is a 404 with a message (the reference raises KeyError: a 500).
    again = post(client, "/unref", env_id="env-2", task_name="t")
    assert again.status_code == 404
    assert "env-2" in again.json()["error"]["message"]
    # A task nobody has put anything in.
    assert get(client, "other", [CLONE])["found"] is False
    assert post(client, "/prefix_match", task_name="other", tool_calls=[CLONE]).json() == {
        "found": False,
        "env_id": None,
        "history": None,
    }
    service.cache.graph("t").check_invariants()


def test_a_prefix_match_at_the_whole_history_takes_no_reference(client: httpx.Client, service: CacheService) -> None:
    # The released executors answer such a match with /get and never /unref it.
    put(client, "t", [CLONE], "env-1", ["cloned"])
    match = post(client, "/prefix_match", task_name="t", tool_calls=[CLONE]).json()
    assert match == {"found": True, "env_id": "env-1", "history": [CLONE]}
    assert env_leases(service) == 0


def test_intel_prefix_match_returns_the_suffix_to_execute(client: httpx.Client, service: CacheService) -> None:
    put(client, "t", [CLONE], "env-1", ["cloned"])
    put(client, "t", [CLONE, BUILD], None, ["built"], start_idx=1)
    answer = post(client, "/intel_prefix_match", task_name="t", tool_calls=[CLONE, BUILD, TEST]).json()
    assert answer == {"found": True, "env_id": "env-1", "history": [CLONE], "suffix": [BUILD, TEST]}
    assert env_leases(service) == 1
    assert post(client, "/should_fork", task_name="t", history=[CLONE]).json()["should_fork"] is True
    assert env_leases(service) == 1
    post(client, "/unref", env_id="env-1", task_name="t")
    assert env_leases(service) == 0
    none = post(client, "/intel_prefix_match", task_name="t", tool_calls=[TEST]).json()
    assert none == {"found": False, "env_id": None, "history": None, "suffix": None}


def test_can_extend_never_hands_out_a_cached_env_and_gives_back_the_reference(
    client: httpx.Client, service: CacheService
) -> None:
    # The mutable-tree client (ToolCallExecutor): prefix_match, then can_extend; after a false it never unrefs.
    put(client, "t", [CLONE], "env-1", ["cloned"])
    post(client, "/prefix_match", task_name="t", tool_calls=[CLONE, BUILD])
    assert env_leases(service) == 1
    answer = post(client, "/can_extend", task_name="t", history=[CLONE], suffix=[BUILD]).json()
    assert answer == {"can_extend": False, "suffix": []}
    assert env_leases(service) == 0
    assert post(client, "/can_extend", task_name="t", history=[BUILD], suffix=[]).status_code == 404


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
    post(client, "/prefix_match", task_name="t", tool_calls=chain[:1] + [key(cmd="x")])  # references env-0
    chain.append(key(cmd="step 3"))
    removed = put(client, "t", chain, "env-3", ["v"], start_idx=3)["removed_env_ids"]
    assert len(removed) == 1
    assert removed[0] in ("env-1", "env-2")  # never the referenced env-0 or the new env-3
    assert get(client, "t", chain[:1])["env_id"] == "env-0"


def metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def test_envs_kept_over_the_budget_by_leases_are_reported_and_evicted_when_the_leases_go(
    client: httpx.Client, service: CacheService
) -> None:
    chain: list[str] = []
    for index in range(3):
        chain.append(key(cmd=f"step {index}"))
        put(client, "t", chain, f"env-{index}", ["v"], start_idx=index)
    for depth in (1, 2, 3):  # every env referenced, as three rollouts about to fork would
        post(client, "/prefix_match", task_name="t", tool_calls=[*chain[:depth], key(cmd="next")])
    chain.append(key(cmd="step 3"))
    answer = put(client, "t", chain, "env-3", ["v"], start_idx=3)
    assert answer["removed_env_ids"] == []
    assert answer["over_budget_leased"] == 1
    assert metric(client, "tvcache_wire_envs_over_budget_leased") == 1
    assert len(service.cache.graph("t").snapshot_nodes) == 4
    # The first reference goes: the budget holds again at once ...
    assert post(client, "/unref", env_id="env-1", task_name="t").json() == {"success": True}
    held = {get(client, "t", chain[:depth])["env_id"] for depth in (1, 2, 3, 4)}
    (evicted,) = {"env-1", "env-3"} - held  # the two unreferenced ones: the lower expected reuse goes
    assert len(service.cache.graph("t").snapshot_nodes) == 3
    assert metric(client, "tvcache_wire_envs_over_budget_leased") == 0
    assert metric(client, "tvcache_wire_envs_pending_removal") == 1
    # ... and the evicted env goes back to its owners with the task's next PUT.
    later = put(client, "t", [key(cmd="other")], None, ["w"])
    assert later["removed_env_ids"] == [evicted]
    assert metric(client, "tvcache_wire_envs_pending_removal") == 0


def test_an_expired_reference_lets_the_budget_evict() -> None:
    now = [0.0]
    service = CacheService(budget=Budget(max_snapshots_per_task=1), lease_ttl=10.0, clock=lambda: now[0])
    try:
        with ServerThread(service) as server, httpx.Client(base_url=server.url) as client:
            put(client, "t", [CLONE], "env-1", ["a"])
            post(client, "/prefix_match", task_name="t", tool_calls=[CLONE, BUILD])  # a client that then died
            assert put(client, "t", [CLONE, BUILD], "env-2", ["b"], start_idx=1)["over_budget_leased"] == 1
            now[0] = 11.0  # past the lease's TTL: the server's sweeper (every 1 s) releases it
            wait_until(lambda: len(service.cache.graph("t").snapshot_nodes) == 1)
            kept = {get(client, "t", history)["env_id"] for history in ([CLONE], [CLONE, BUILD])} - {None}
            (evicted,) = {"env-1", "env-2"} - kept
            assert put(client, "t", [BUILD], None, ["c"])["removed_env_ids"] == [evicted]
    finally:
        service.close()


def test_put_without_values_for_new_calls_is_a_400_and_changes_nothing(client: httpx.Client) -> None:
    response = client.put("/put", json={"task_name": "t", "history": [CLONE, BUILD], "env_id": "e", "start_idx": 1,
                                        "values": ["x"], "tool_exec_times": [1]})  # fmt: skip
    assert response.status_code == 400
    assert "start_idx" in response.json()["error"]["message"]
    response = client.put("/put", json={"task_name": "t", "history": [CLONE], "env_id": "e"})
    assert response.status_code == 400
    assert get(client, "t", [CLONE])["found"] is False
    assert client.put("/put", json={"task_name": "t", "history": "notalist"}).status_code == 422


def test_a_bad_value_late_in_a_put_writes_nothing(client: httpx.Client, service: CacheService) -> None:
    deep: Any = "x"
    for _ in range(100):
        deep = [deep]
    response = client.put("/put", json={"task_name": "t", "history": [CLONE, BUILD], "values": ["ok", deep]})
    assert response.status_code == 400
    assert "values[1]" in response.json()["error"]["message"]
    assert "t" not in service.cache


def test_mark_stateless_and_test_results(client: httpx.Client) -> None:
    put(client, "t", [CLONE, CLONE], "env-1", ["a", "b"])
    ok = post(client, "/mark_stateless", task_name="t", history=[CLONE, CLONE], env_id="env-1")
    assert ok.json() == {"success": True}
    # The env id must match the node's (400 like the reference); the first CLONE node has no env.
    wrong = post(client, "/mark_stateless", task_name="t", history=[CLONE], env_id="env-1")
    assert wrong.status_code == 400
    assert wrong.json()["success"] is False
    stored = post(client, "/store_test_result", task_name="t", history=[CLONE, CLONE], test_result="PASS")
    assert stored.json() == {"success": True}
    # Exactly the node at the whole history (the reference stops early when the last call repeats an earlier one).
    first = client.get("/get_test_result", params={"task_name": "t", "tool_calls": [CLONE]}).json()
    assert first == {"found": False, "test_result": None}
    both = client.get("/get_test_result", params={"task_name": "t", "tool_calls": [CLONE, CLONE]}).json()
    assert both == {"found": True, "test_result": "PASS"}
    assert post(client, "/store_test_result", task_name="t", history=[BUILD], test_result="x").status_code == 404
    assert post(client, "/store_test_result", task_name="t", history=[], test_result="x").status_code == 422
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
        assert post(client, "/unref", env_id=env).json()["success"] is True  # task_name is optional
    assert service.leases == {}
    assert client.get("/get_all_envs").status_code == 400


def test_remove_forgets_a_history_and_hands_its_envs_back(client: httpx.Client, service: CacheService) -> None:
    put(client, "t", [CLONE], "env-1", ["a"])
    put(client, "t", [CLONE, BUILD], "env-2", ["b"], start_idx=1)
    put(client, "t", [CLONE, BUILD, TEST], None, ["c"], start_idx=2)
    post(client, "/prefix_match", task_name="t", tool_calls=[CLONE, BUILD, TEST, TEST])
    refused = client.request("DELETE", "/remove", json={"task_name": "t", "history": [CLONE, BUILD]})
    assert refused.status_code == 400  # env-2 is referenced: a fork is using it
    assert get(client, "t", [CLONE, BUILD])["found"] is True
    post(client, "/unref", env_id="env-2", task_name="t")
    removed = client.request("DELETE", "/remove", json={"task_name": "t", "history": [CLONE, BUILD]})
    assert removed.json() == {"success": True}
    assert get(client, "t", [CLONE, BUILD])["found"] is False
    assert get(client, "t", [CLONE, BUILD, TEST])["found"] is False
    assert get(client, "t", [CLONE])["value"] == "a"
    assert client.request("DELETE", "/remove", json={"task_name": "t", "history": [BUILD]}).status_code == 404
    assert put(client, "t", [CLONE, BUILD], None, ["new"], start_idx=1)["removed_env_ids"] == ["env-2"]
    assert get(client, "t", [CLONE, BUILD])["value"] == "new"
    service.cache.graph("t").check_invariants()


def test_remove_is_journaled(tmp_path: Path) -> None:
    service = CacheService(tmp_path)
    with ServerThread(service) as server, httpx.Client(base_url=server.url) as client:
        put(client, "t", [CLONE, BUILD], None, ["a", "b"])
        client.request("DELETE", "/remove", json={"task_name": "t", "history": [CLONE, BUILD]})
    service.close()
    reopened = CacheService(tmp_path)
    try:
        with ServerThread(reopened) as server, httpx.Client(base_url=server.url) as client:
            assert get(client, "t", [CLONE])["found"] is True
            assert get(client, "t", [CLONE, BUILD])["found"] is False
    finally:
        reopened.close()


def test_hot_nodes_and_marked_envs(client: httpx.Client) -> None:
    put(client, "t", [CLONE, BUILD], "env-1", ["a", "b"])
    put(client, "t", [CLONE, TEST], None, ["c"], start_idx=1)
    put(client, "t", [CLONE, CLONE], None, ["d"], start_idx=1)
    assert client.get("/get_hot_nodes").json() == {"hot_nodes": {"t": [[CLONE]]}}  # more than k=1 calls after it
    assert client.get("/get_hot_nodes", params={"k": 3}).json() == {"hot_nodes": {"t": []}}
    assert client.get("/get_hot_nodes", params={"k": "many"}).status_code == 400
    assert client.get("/check_env_marked", params={"env_id": "env-1"}).json() == {"marked": True}
    assert client.get("/check_env_marked", params={"env_id": "env-9"}).json() == {"marked": False}
    admin = client.get("/check_env_marked", params={"env_id": "env-1"}, headers={"X-Task-Name": "__admin__"})
    assert admin.json() == {"marked": True}
    other = client.get("/check_env_marked", params={"env_id": "env-1"}, headers={"X-Task-Name": "other"})
    assert other.json() == {"marked": False}
    assert client.get("/check_env_marked").status_code == 400


def test_the_task_header_must_agree_with_the_task(client: httpx.Client) -> None:
    put(client, "t", [CLONE], None, ["a"])
    wrong = client.get("/get", params={"task_name": "t", "tool_calls": [CLONE]}, headers={"X-Task-Name": "u"})
    assert wrong.status_code == 400
    assert "X-Task-Name" in wrong.json()["error"]["message"]
    admin = client.get("/get", params={"task_name": "t", "tool_calls": [CLONE]}, headers={"X-Task-Name": "__admin__"})
    assert admin.json()["found"] is True


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


def test_every_reference_route_is_served_and_documented(client: httpx.Client) -> None:
    reference = {
        ("GET", "/get"), ("PUT", "/put"), ("POST", "/prefix_match"), ("POST", "/intel_prefix_match"),
        ("POST", "/mark_stateless"), ("DELETE", "/remove"), ("POST", "/can_extend"), ("POST", "/should_fork"),
        ("GET", "/visualize"), ("GET", "/get_hot_nodes"), ("GET", "/check_env_marked"),
        ("POST", "/store_test_result"), ("GET", "/get_test_result"), ("POST", "/unref"), ("GET", "/get_all_envs"),
    }  # fmt: skip
    assert {(route.method, route.path) for route in WIRE_ROUTES} == reference
    paths = client.get("/openapi.json").json()["paths"]
    for route in WIRE_ROUTES:
        operation = paths[route.path][route.method.lower()]
        assert any(p["name"] == "X-Task-Name" and p["in"] == "header" for p in operation["parameters"]), route.path
        if route.body is None and not any(query.required for query in route.query):
            continue  # /visualize, /get_hot_nodes: nothing is required
        response = client.request(route.method, route.path)  # no body, no query: a 4xx with a message
        assert 400 <= response.status_code < 500, (route.path, response.status_code)
        assert response.json()["error"]["message"]


def test_wire_traffic_is_tallied_like_native_traffic(client: httpx.Client) -> None:
    put(client, "w", [CLONE, BUILD], None, ["a", "b"])  # two executed calls
    assert get(client, "w", [CLONE])["found"]
    assert not get(client, "w", [TEST])["found"]  # a lookup miss: counted when its execution is put
    (task,) = client.get("/v1/activity").json()["tasks"]
    assert task["total"]["hits"] == 1
    assert task["total"]["misses"] == 2
    assert task["total"]["seconds_executed"] == 3.0
    assert task["total"]["seconds_saved"] == 1.5


BAD_INPUTS: list[tuple[str, str, dict[str, Any]]] = [
    ("POST", "/should_fork", {"json": {"task_name": "nobody", "history": [CLONE]}}),
    ("POST", "/should_fork", {"json": {"task_name": "t", "history": []}}),
    ("POST", "/should_fork", {"json": {"task_name": "t", "history": [CLONE, BUILD, TEST, TEST]}}),
    ("POST", "/should_fork", {"json": {"task_name": "t", "history": [CLONE, BUILD]}}),  # its env was evicted
    ("POST", "/unref", {"json": {"env_id": "evicted"}}),
    ("POST", "/prefix_match", {"json": {"task_name": "t", "tool_calls": []}}),
    ("POST", "/prefix_match", {"content": b"{not json"}),
    ("POST", "/can_extend", {"json": {"task_name": "t", "history": [TEST], "suffix": [TEST]}}),
    ("DELETE", "/remove", {"json": {"task_name": "nobody", "history": [CLONE]}}),
    ("DELETE", "/remove", {"json": {"task_name": "t", "history": []}}),
    ("PUT", "/put", {"json": {"task_name": "t", "history": [], "env_id": "e"}}),
    ("PUT", "/put", {"content": b'{"task_name": "t", "history": ["x"], "values": [Infinity]}'}),
    ("PUT", "/put", {"content": b'{"task_name": "t", "history": ["x"], "values": [NaN]}'}),
    ("GET", "/get", {"params": {"task_name": "t"}}),
    ("GET", "/get", {"params": [("task_name", "t"), ("task_name", "u"), ("tool_calls", CLONE)]}),
    ("GET", "/get_hot_nodes", {"params": {"k": "-1"}}),
    ("GET", "/get_hot_nodes", {"params": [("k", "1"), ("k", "2")]}),
    ("GET", "/get_test_result", {"params": [("task_name", "t"), ("task_name", "t"), ("tool_calls", CLONE)]}),
    ("POST", "/get", {}),
    ("GET", "/put", {}),
    ("PUT", "/should_fork", {}),
    ("GET", "/remove", {}),
    ("POST", "/store_test_result", {"json": {"task_name": "t", "history": [CLONE], "test_result": None}}),
]


@pytest.mark.parametrize(("method", "path", "request_args"), BAD_INPUTS)
def test_bad_input_is_a_4xx_with_a_message_and_writes_nothing(
    client: httpx.Client, service: CacheService, method: str, path: str, request_args: dict[str, Any]
) -> None:
    put(client, "t", [CLONE], "env-1", ["a"])
    put(client, "t", [CLONE, BUILD], "evicted", ["b"], start_idx=1)
    graph = service.cache.graph("t")
    node = graph.match([wire_call(CLONE), wire_call(BUILD)]).node
    assert node is not None
    service.store.detach_snapshot(graph, node)  # as the budget does
    before = (client.get("/v1/graph", params={"task_id": "t"}).json(), sorted(service.cache.tasks()))
    leases = dict(service.leases)
    response = client.request(method, path, **request_args)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["message"]
    after = (client.get("/v1/graph", params={"task_id": "t"}).json(), sorted(service.cache.tasks()))
    assert after == before
    assert service.leases == leases


# ------------------------------------------------------------------ issue 19 item 10: non-JSON wire outputs


def test_a_native_insert_of_a_wire_call_must_hold_what_the_wire_format_serves(
    client: httpx.Client, service: CacheService
) -> None:
    base = {"task_id": "t", "parent": 0, "seconds": 1.0}
    wire = {"name": WIRE_TOOL, "arguments": {"call": CLONE}}
    for bad in ("not json", "NaN", "[1, 2", "1e999"):
        response = client.post("/v1/insert", json=base | {"call": wire, "output": bad})
        assert response.status_code == 400, bad
        assert "JSON" in response.json()["error"]["message"]
    wrong_arguments = {"name": WIRE_TOOL, "arguments": {"call": 1}}
    assert client.post("/v1/insert", json=base | {"call": wrong_arguments, "output": '"x"'}).status_code == 400
    assert "t" not in service.cache or len(service.cache.graph("t")) == 1
    assert client.post("/v1/insert", json=base | {"call": wire, "output": '{"a": 1}'}).status_code == 200
    assert get(client, "t", [CLONE])["value"] == {"a": 1}


def test_a_persisted_non_json_wire_record_breaks_no_read(tmp_path: Path) -> None:
    # A record from before /v1/insert checked wire outputs: written straight into the journal.
    service = CacheService(tmp_path)
    graph = service.cache.graph("bad")
    service.store.record(
        graph, graph.root, wire_call(CLONE), Outcome(output="not json {"), seconds=1.0, read_only=False
    )
    service.close()
    for _ in range(2):  # and again after a restart
        reopened = CacheService(tmp_path)
        try:
            with ServerThread(reopened) as server, httpx.Client(base_url=server.url) as client:
                put(client, "good", [BUILD], None, ["fine"])
                assert get(client, "bad", [CLONE])["value"] == "not json {"  # served as its text
                tree = client.get("/visualize")
                assert tree.status_code == 200
                assert tree.json()["good"]["children"][BUILD]["value"] == "fine"
                assert tree.json()["bad"]["children"][CLONE]["value"] == "not json {"
        finally:
            reopened.close()
