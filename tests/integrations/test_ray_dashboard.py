"""``tvcache ray dashboard`` against real shard actors: a one-node Ray on loopback, two shard actors, rollouts
through ``RayCache`` whose tasks land on both shards, and the dashboard app on a real uvicorn thread.

Checked: merged stats are the sums of each shard's own stats, the task lists hold every task with its shard,
per-task routes answer from the task's shard, ``/metrics`` is valid Prometheus text with a ``shard`` label whose
sums are the totals, a shard killed for good (or too slow) is reported down without a 500, and the page renders
the merged data, the shard table and a down shard's warning in headless Chromium."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only; read when Ray is first imported
pytest.importorskip("ray", reason="the 'ray' extra is not installed: pip install 'tvcache[ray]'")

import ray  # noqa: E402

from tvcache import AlwaysSnapshot  # noqa: E402
from tvcache.cli import main  # noqa: E402
from tvcache.client.sharding import rendezvous  # noqa: E402
from tvcache.integrations.ray import RayCache, create_dashboard_app, start_shards, stop_shards  # noqa: E402
from tvcache.server.runner import AppThread  # noqa: E402

from browser_support import chromium, missing_browser  # noqa: E402
from kvstore import KVFactory  # noqa: E402
from server_support import free_port, wait_until  # noqa: E402

TOKEN = "ray-dashboard-token"
MiB = 1024 * 1024
SHARDS = ["tvcache-shard-0", "tvcache-shard-1"]
# Task ids that rendezvous hashing spreads over both shards (checked in the fixture).
TASKS = [f"task-{index}" for index in range(6)]
ROLLOUTS: list[list[tuple[str, dict[str, Any]]]] = [
    [("set", {"key": "n", "value": 1}), ("get", {"key": "n"}), ("incr", {"key": "n"}), ("keys", {})],
    [("set", {"key": "n", "value": 1}), ("get", {"key": "n"}), ("incr", {"key": "m"})],
]


@dataclass(frozen=True)
class Deployment:
    namespace: str
    url: str
    http: httpx.Client


def run_rollouts(namespace: str, tasks: list[str], snapshot_dir: Path) -> None:
    """Each task: two rollouts in epoch 0 (the second hits the shared prefix), one again in epoch 1."""
    factory = KVFactory()

    async def rollout(cache: RayCache, task: str, calls: list[tuple[str, dict[str, Any]]]) -> None:
        async with cache.session(task, sandbox=factory) as session:
            for name, arguments in calls:
                await session.call(name, arguments)

    async def run(cache: RayCache) -> None:
        for epoch, rollouts in ((0, ROLLOUTS), (1, ROLLOUTS[:1])):
            cache.epoch = epoch
            for task in tasks:
                for calls in rollouts:
                    await rollout(cache, task, calls)

    with RayCache(namespace=namespace, snapshot_dir=snapshot_dir, snapshot_policy=AlwaysSnapshot()) as cache:
        asyncio.run(run(cache))


@pytest.fixture(scope="module")
def ray_namespace() -> Iterator[str]:
    namespace = f"tvcache-dashboard-{uuid.uuid4().hex[:8]}"
    try:
        ray.init(
            address="local",  # a cluster of its own, even when another Ray runs on this machine
            num_cpus=1,
            object_store_memory=80 * MiB,
            include_dashboard=False,
            namespace=namespace,
            log_to_driver=False,
        )
    except Exception as error:  # this machine cannot run Ray (no /dev/shm, sandboxed sockets, ...)
        pytest.skip(f"Ray cannot start here: {error!r}")
    try:
        yield namespace
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def deployment(ray_namespace: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    assert {rendezvous(task, SHARDS) for task in TASKS} == set(SHARDS)
    start_shards(2, data_dir=tmp_path_factory.mktemp("journals"), namespace=ray_namespace, detached=False)
    try:
        run_rollouts(ray_namespace, TASKS, tmp_path_factory.mktemp("snapshots"))
        app = create_dashboard_app(namespace=ray_namespace, token=TOKEN)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        with AppThread(app) as thread, httpx.Client(base_url=thread.url, headers=headers, timeout=30) as http:
            yield Deployment(namespace=ray_namespace, url=thread.url, http=http)
    finally:
        stop_shards(ray_namespace)


def shard_stats(namespace: str) -> dict[str, dict[str, Any]]:
    """Each shard's own ``/v1/stats``, asked through ``RayCache`` (not through the dashboard)."""
    with RayCache(namespace=namespace) as cache:
        return cache.server_stats()


def shard_get(namespace: str, shard: str, path: str, **params: str) -> tuple[int, Any]:
    actor: Any = ray.get_actor(shard, namespace=namespace)
    status, body = ray.get(actor.request.remote("GET", path, None, params or None), timeout=30)
    return int(status), json.loads(body)  # the JSON body the server would send


# ------------------------------------------------------------------ Prometheus text, parsed strictly

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{({_LABEL}(?:,{_LABEL})*)\}})? (\S+)$")
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("",), "gauge": ("",)}


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a text exposition; fails on anything the format (version 0.0.4) does not allow: a sample
    before or outside its family's ``# TYPE`` line, a family typed twice or split, a malformed line or value."""
    assert text.endswith("\n")
    samples: list[tuple[str, dict[str, str], float]] = []
    typed: dict[str, str] = {}
    current: str | None = None
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert re.fullmatch(_NAME, name), line
            assert kind in _SUFFIXES, line
            assert name not in typed, f"{name} typed twice"
            typed[name] = kind
            current = name
            continue
        if line.startswith("# HELP ") or not line:
            continue
        match = _SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        name, labels, value = match.groups()
        assert current is not None, f"{line!r} before any # TYPE"
        assert name in {current + suffix for suffix in _SUFFIXES[typed[current]]}, f"{name} outside its family"
        pairs = re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', labels or "")
        assert len({key for key, _ in pairs}) == len(pairs), f"a label repeated in {line!r}"
        samples.append((name, dict(pairs), float(value)))
    return samples


def total(samples: list[tuple[str, dict[str, str], float]], name: str) -> float:
    return sum(value for sample, _, value in samples if sample == name)


# ------------------------------------------------------------------ tests


def test_merged_stats_are_the_sums_of_each_shards_own_stats(deployment: Deployment) -> None:
    own = shard_stats(deployment.namespace)
    merged = deployment.http.get("/v1/stats").json()
    assert set(own) == set(SHARDS)
    assert all(stats["tasks"] > 0 for stats in own.values())  # the tasks landed on both shards
    for key in own[SHARDS[0]]:
        if key != "nondeterministic_tools":  # a union, see test_a_shard_killed_for_good_is_reported_down
            assert merged[key] == pytest.approx(sum(stats[key] for stats in own.values())), key
    assert merged["tasks"] == len(TASKS)
    assert min(merged["hits"], merged["misses"], merged["snapshots"]) > 0
    assert (merged["shards_up"], merged["shards_down"], merged["message"]) == (2, 0, None)
    node = ray.get_runtime_context().get_node_id()
    shards = {shard["name"]: shard for shard in merged["shards"]}
    assert set(shards) == set(SHARDS)
    for name, shard in shards.items():
        assert (shard["up"], shard["node_id"], shard["node_ip"]) == (True, node, "127.0.0.1")
        assert shard["stats"]["nodes"] == own[name]["nodes"]


def test_the_task_lists_hold_every_task_with_the_shard_that_owns_it(deployment: Deployment) -> None:
    tasks = deployment.http.get("/v1/tasks").json()
    assert [task["task_id"] for task in tasks["tasks"]] == sorted(TASKS)
    assert tasks["shards_down"] == []
    with RayCache(namespace=deployment.namespace) as cache:
        for task in tasks["tasks"]:
            assert task["shard"] == cache.shard_name(task["task_id"])  # RayCache's router
            assert task["node_id"] == ray.get_runtime_context().get_node_id()
            assert task["nodes"] > 0

    activity = deployment.http.get("/v1/activity").json()
    assert [task["task_id"] for task in activity["tasks"]] == sorted(TASKS)
    own = [shard_get(deployment.namespace, shard, "/v1/activity")[1] for shard in SHARDS]
    for key in ("hits", "misses", "seconds_saved", "seconds_executed"):
        assert activity["total"][key] == pytest.approx(sum(report["total"][key] for report in own))
    hits, misses = activity["total"]["hits"], activity["total"]["misses"]
    assert activity["total"]["hit_rate"] == pytest.approx(hits / (hits + misses))
    assert activity["since"] == min(report["since"] for report in own)
    by_task = {task["task_id"]: task for report in own for task in report["tasks"]}
    for task in activity["tasks"]:
        assert task["epochs"] == by_task[task["task_id"]]["epochs"]  # a task's epochs are its shard's
        assert [epoch["epoch"] for epoch in task["epochs"]] == [0, 1]


def test_per_task_routes_answer_from_the_shard_that_owns_the_task(deployment: Deployment) -> None:
    http, namespace = deployment.http, deployment.namespace
    for shard in SHARDS:
        task = next(task for task in TASKS if rendezvous(task, SHARDS) == shard)
        response = http.get("/v1/graph", params={"task_id": task})
        assert response.status_code == 200
        assert response.headers["X-Tvcache-Shard"] == shard
        assert response.json() == shard_get(namespace, shard, "/v1/graph", task_id=task)[1]
        nodes = response.json()["nodes"]
        assert len(nodes) > 1

        outline = http.get("/v1/graph/outline", params={"task_id": task}).json()
        assert (outline["total"], outline["truncated"]) == (len(nodes), False)
        assert [node["id"] for node in outline["nodes"]] == [node["id"] for node in nodes]
        assert http.get("/v1/graph/outline", params={"task_id": task, "limit": "2"}).json()["truncated"]

        leaf = nodes[-1]
        node = http.get("/v1/node", params={"task_id": task, "node_id": str(leaf["id"])}).json()
        assert (node["output"], node["name"]) == (leaf["output"], leaf["name"])
        path = http.get("/v1/path", params={"task_id": task, "node_id": str(leaf["id"])}).json()
        assert path["nodes"][-1]["id"] == leaf["id"]

    # The shard's own answers pass through (404 for a task it does not hold); the query is checked first (422).
    missing = http.get("/v1/graph", params={"task_id": "no-such-task"})
    assert missing.status_code == 404
    assert missing.headers["X-Tvcache-Shard"] == rendezvous("no-such-task", SHARDS)
    assert "no-such-task" in missing.json()["error"]["message"]
    assert http.get("/v1/graph").status_code == 422
    assert http.get("/v1/node", params={"task_id": TASKS[0], "node_id": "x"}).status_code == 422
    assert http.get("/v1/graph/outline", params={"task_id": TASKS[0], "limit": "0"}).status_code == 422


def test_metrics_are_prometheus_text_with_a_shard_label_summing_to_the_totals(deployment: Deployment) -> None:
    response = deployment.http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = parse_prometheus(response.text)
    merged = deployment.http.get("/v1/stats").json()
    for name, key in (("tvcache_hits_total", "hits"), ("tvcache_misses_total", "misses"), ("tvcache_nodes", "nodes"),
                      ("tvcache_snapshots", "snapshots"), ("tvcache_tasks", "tasks")):  # fmt: skip
        assert total(samples, name) == merged[key], name
        assert {labels["shard"] for sample, labels, _ in samples if sample == name} == set(SHARDS)
    assert math.isclose(total(samples, "tvcache_seconds_saved_total"), merged["seconds_saved"])
    up = {labels["shard"]: value for name, labels, value in samples if name == "tvcache_shard_up"}
    assert up == dict.fromkeys(SHARDS, 1.0)
    info = [labels for name, labels, _ in samples if name == "tvcache_shard_info"]
    assert {labels["node_id"] for labels in info} == {ray.get_runtime_context().get_node_id()}
    # Each shard's lookup latency histogram, under its own label.
    counts = [labels for name, labels, _ in samples if name == "tvcache_lookup_seconds_count"]
    assert {labels["shard"] for labels in counts} == set(SHARDS)


def test_the_page_is_open_and_the_data_needs_the_token(deployment: Deployment) -> None:
    with httpx.Client(base_url=deployment.url, timeout=30) as anonymous:
        page = anonymous.get("/dashboard")
        assert page.status_code == 200
        assert "tvcache dashboard" in page.text
        assert "script-src 'self'" in page.headers["Content-Security-Policy"]
        assert anonymous.get("/dashboard/dashboard.js").status_code == 200
        health = anonymous.get("/healthz").json()
        assert set(health) == {"status", "version"}  # nothing about the deployment without the token
        assert health["status"] == "ok"
        for path in ("/v1/stats", "/v1/activity", "/metrics", "/v1/graph?task_id=task-0"):
            refused = anonymous.get(path)
            assert refused.status_code == 401, path
            assert refused.headers["WWW-Authenticate"] == "Bearer"
        wrong = anonymous.get("/v1/stats", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401


def test_shards_too_slow_to_answer_are_reported_down_and_the_page_still_gets_totals(deployment: Deployment) -> None:
    # A zero timeout: no actor call can be done at once, as when a shard is restarting or its node is gone.
    app = create_dashboard_app(namespace=deployment.namespace, timeout=0)
    with AppThread(app) as thread, httpx.Client(base_url=thread.url, timeout=30) as http:
        stats = http.get("/v1/stats")
        assert stats.status_code == 200
        merged = stats.json()
        assert (merged["shards_up"], merged["shards_down"]) == (0, 2)
        totals = ("hits", "misses", "tasks", "nodes", "seconds_saved")  # present, for the page's cards
        assert {key: merged[key] for key in totals} == dict.fromkeys(totals, 0)
        for shard in merged["shards"]:
            assert not shard["up"]
            assert shard["message"] == f"{shard['name']} is down: no answer within 0 s " + (
                "(restarting after a crash or the loss of its node, or overloaded)"
            )
        activity = http.get("/v1/activity").json()
        assert (activity["tasks"], activity["shards_down"]) == ([], SHARDS)
        graph = http.get("/v1/graph", params={"task_id": TASKS[0]})
        assert graph.status_code == 503
        assert graph.json()["error"]["type"] == "shard_down"
        up = [value for name, _, value in parse_prometheus(http.get("/metrics").text) if name == "tvcache_shard_up"]
        assert up == [0.0, 0.0]


@dataclass(frozen=True)
class HalfDown:
    """Two shards of their own namespace after rollouts, the second then killed for good, and the dashboard over
    both (no token). Nothing polled the dashboard since the kill: the first poll sees the actor die."""

    url: str
    http: httpx.Client
    survivor: dict[str, Any]  # the first shard's own /v1/stats
    before: dict[str, Any]  # the dashboard's /v1/stats and /v1/tools/nondeterministic while both were up


@pytest.fixture(scope="module")
def half_down(ray_namespace: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HalfDown]:
    namespace = f"{ray_namespace}-kill"
    start_shards(2, data_dir=None, namespace=namespace, detached=False)
    try:
        run_rollouts(namespace, TASKS, tmp_path_factory.mktemp("kill-snapshots"))
        actors: list[Any] = [ray.get_actor(name, namespace=namespace) for name in SHARDS]
        # The same tool marked non-deterministic on both shards is one tool in the merged stats.
        mark = b'{"tool": "keys", "reason": "test"}'
        ray.get([actor.request.remote("POST", "/v1/tools/nondeterministic", mark, None) for actor in actors])
        app = create_dashboard_app(namespace=namespace)
        with AppThread(app) as thread, httpx.Client(base_url=thread.url, timeout=30) as http:
            before = {path: http.get(path).json() for path in ("/v1/stats", "/v1/tools/nondeterministic")}
            survivor = shard_stats(namespace)[SHARDS[0]]
            ray.kill(actors[1], no_restart=True)
            yield HalfDown(url=thread.url, http=http, survivor=survivor, before=before)
    finally:
        stop_shards(namespace)


def test_a_shard_killed_for_good_is_reported_down(half_down: HalfDown) -> None:
    http, survivor = half_down.http, half_down.survivor
    assert half_down.before["/v1/stats"]["nondeterministic_tools"] == 1
    assert half_down.before["/v1/tools/nondeterministic"]["tools"] == {"keys": "test"}
    for attempt in range(2):  # the first poll sees the actor die, the next finds no actor of that name
        stats = http.get("/v1/stats")
        assert stats.status_code == 200, attempt
        merged = stats.json()
        assert (merged["shards_up"], merged["shards_down"]) == (1, 1)
        down = next(shard for shard in merged["shards"] if not shard["up"])
        assert down["name"] == SHARDS[1]
        assert down["message"].startswith(f"{SHARDS[1]} is down: ")
        assert merged["message"].startswith("1 of 2 shards down; the totals cover the others.")
        assert SHARDS[1] in merged["message"]
        for key in ("hits", "misses", "tasks", "nodes", "snapshots"):
            assert merged[key] == survivor[key], key
        assert merged["nondeterministic_tools"] == 1

    activity = http.get("/v1/activity")
    assert activity.status_code == 200
    assert activity.json()["shards_down"] == [SHARDS[1]]
    assert {task["shard"] for task in activity.json()["tasks"]} == {SHARDS[0]}
    lost = next(task for task in TASKS if rendezvous(task, SHARDS) == SHARDS[1])
    kept = next(task for task in TASKS if rendezvous(task, SHARDS) == SHARDS[0])
    refused = http.get("/v1/graph/outline", params={"task_id": lost})
    assert refused.status_code == 503
    assert f"lives on {SHARDS[1]}, which is down" in refused.json()["error"]["message"]
    assert http.get("/v1/graph/outline", params={"task_id": kept}).status_code == 200
    samples = parse_prometheus(http.get("/metrics").text)
    up = {labels["shard"]: value for name, labels, value in samples if name == "tvcache_shard_up"}
    assert up == {SHARDS[0]: 1.0, SHARDS[1]: 0.0}
    assert total(samples, "tvcache_nodes") == survivor["nodes"]
    assert http.get("/healthz").json()["status"] == "ok"


def test_the_command_refuses_a_public_address_without_a_token_and_an_empty_namespace(
    ray_namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ray", "dashboard", "--host", "0.0.0.0", "--namespace", ray_namespace]) == 2
    assert "pass --token" in capsys.readouterr().err
    assert main(["ray", "dashboard", "--namespace", f"{ray_namespace}-empty"]) == 2
    assert "no tvcache shard actors in Ray namespace" in capsys.readouterr().err


@pytest.mark.skipif(missing_browser() is not None, reason=str(missing_browser()))
def test_the_page_renders_the_merged_data_in_chromium(deployment: Deployment, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    stats = deployment.http.get("/v1/stats").json()
    with chromium(tmp_path / "profile", window="1400,1600") as browser:
        wait = WebDriverWait(browser, 20, poll_frequency=0.05)
        browser.get(f"{deployment.url}/dashboard")
        login = wait.until(lambda d: d.find_element(By.ID, "login") if d.find_element(By.ID, "login").is_displayed()
                           else None)  # fmt: skip
        login.find_element(By.ID, "token").send_keys(TOKEN)
        login.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#tasks tbody tr")) == len(TASKS))
        browser.get_log("browser")  # drop the 401s of the page's first, token-less requests
        assert browser.find_element(By.CSS_SELECTOR, "[data-card=hits] .value").text == str(stats["hits"])
        assert browser.find_element(By.CSS_SELECTOR, "[data-card=nodes] .value").text == str(stats["nodes"])

        # The shard table: each shard up, on this node, with its own counts; no warning; each task's shard.
        assert browser.find_element(By.ID, "shards-section").is_displayed()
        assert not browser.find_element(By.ID, "shard-warning").is_displayed()
        for shard in stats["shards"]:
            row = browser.find_element(By.CSS_SELECTOR, f'#shards tr[data-shard="{shard["name"]}"]')
            assert row.find_element(By.CSS_SELECTOR, "[data-field=status]").text == "up"
            assert row.find_element(By.CSS_SELECTOR, "[data-field=node]").text == shard["node_ip"]
            for key in ("tasks", "hits", "misses"):
                assert int(row.find_element(By.CSS_SELECTOR, f"[data-field={key}]").text) == shard["stats"][key], key
        assert browser.find_element(By.CSS_SELECTOR, "#tasks th[data-column=shard]").is_displayed()
        rows = browser.find_elements(By.CSS_SELECTOR, "#tasks tbody tr")
        shown = {row.get_attribute("data-task"): row.find_element(By.CSS_SELECTOR, "[data-field=shard]").text
                 for row in rows}  # fmt: skip
        assert shown == {task: rendezvous(task, SHARDS) for task in TASKS}

        # A task of the second shard: its graph is drawn from that shard, and a node's detail comes from it.
        task = next(task for task in TASKS if rendezvous(task, SHARDS) == SHARDS[1])
        nodes = deployment.http.get("/v1/graph", params={"task_id": task}).json()["nodes"]
        browser.find_element(By.CSS_SELECTOR, f'#tasks tr[data-task="{task}"]').click()
        drawn = f'#graph[data-task="{task}"] g.node'  # not the first task's graph, which looks the same
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, drawn)) == len(nodes))
        leaf = nodes[-1]
        browser.find_element(By.CSS_SELECTOR, f'#graph g.node[data-id="{leaf["id"]}"] .shape').click()
        output = wait.until(lambda d: d.find_element(By.ID, "detail-output"))
        assert output.text == leaf["output"].strip()
        screenshot = tmp_path / "ray-dashboard.png"
        assert browser.save_screenshot(str(screenshot))
        print(f"ray dashboard screenshot: {screenshot}")
        assert [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"] == []


@pytest.mark.skipif(missing_browser() is not None, reason=str(missing_browser()))
def test_the_page_warns_of_a_down_shard_in_chromium(half_down: HalfDown, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    survivor = half_down.survivor
    with chromium(tmp_path / "profile", window="1400,1600") as browser:
        wait = WebDriverWait(browser, 20, poll_frequency=0.05)
        browser.get(f"{half_down.url}/dashboard")  # no token on this dashboard: no login
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#tasks tbody tr")) == survivor["tasks"])
        warning = browser.find_element(By.ID, "shard-warning")
        assert warning.is_displayed()
        assert warning.text.startswith("1 of 2 shards down; the totals cover the others.")
        assert f"{SHARDS[1]} is down: " in warning.text
        assert warning.value_of_css_property("color") == "rgba(124, 45, 18, 1)"  # the stylesheet got through the CSP

        down = browser.find_element(By.CSS_SELECTOR, f'#shards tr[data-shard="{SHARDS[1]}"]')
        assert (down.get_attribute("data-up"), down.get_attribute("class")) == ("false", "down")
        assert down.find_element(By.CSS_SELECTOR, "[data-field=status]").text == "down"
        assert down.find_element(By.CSS_SELECTOR, "[data-field=message]").text.startswith(f"{SHARDS[1]} is down: ")
        assert down.find_element(By.CSS_SELECTOR, "[data-field=hits]").text == "\u2013"
        up = browser.find_element(By.CSS_SELECTOR, f'#shards tr[data-shard="{SHARDS[0]}"]')
        assert up.find_element(By.CSS_SELECTOR, "[data-field=status]").text == "up"
        for key in ("tasks", "hits", "misses"):
            assert int(up.find_element(By.CSS_SELECTOR, f"[data-field={key}]").text) == survivor[key], key
        # The totals and the task list are the survivor's.
        assert browser.find_element(By.CSS_SELECTOR, "[data-card=hits] .value").text == str(survivor["hits"])
        cells = browser.find_elements(By.CSS_SELECTOR, "#tasks td[data-field=shard]")
        assert [cell.text for cell in cells] == [SHARDS[0]] * survivor["tasks"]
        screenshot = tmp_path / "ray-dashboard-shard-down.png"
        assert browser.save_screenshot(str(screenshot))
        print(f"ray dashboard screenshot, a shard down: {screenshot}")
        assert [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"] == []


def test_the_command_serves_the_dashboard_from_its_own_ray_driver(deployment: Deployment, tmp_path: Path) -> None:
    port = free_port()
    address = ray.get_runtime_context().gcs_address
    command = [sys.executable, "-m", "tvcache.cli", "ray", "dashboard", "--namespace", deployment.namespace]
    command += ["--address", address, "--port", str(port)]
    log = tmp_path / "dashboard.log"
    with log.open("wb") as stderr:
        process = subprocess.Popen(command, stderr=stderr, env={**os.environ, "TVCACHE_TOKEN": TOKEN})
    try:
        url = f"http://127.0.0.1:{port}"

        def answers() -> bool:
            assert process.poll() is None, log.read_text()
            try:
                return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(answers, timeout=60, interval=0.1)
        assert f"tvcache ray dashboard: {url}/dashboard" in log.read_text()
        assert httpx.get(f"{url}/v1/stats", timeout=30).status_code == 401  # the token came from TVCACHE_TOKEN
        stats = httpx.get(f"{url}/v1/stats", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).json()
        assert (stats["tasks"], stats["shards_up"]) == (len(TASKS), 2)
    finally:
        process.send_signal(signal.SIGINT)  # Ctrl-C: uvicorn shuts down, then the command exits as interrupted
        assert process.wait(timeout=30) == 130, log.read_text()
