"""tvcache on a real two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``): shard actors,
rollouts on one node hitting entries inserted from the other and forking snapshots made there, and a shard
actor killed (``kill -9``) under write load losing nothing it acknowledged.

Rollouts run as Ray tasks pinned to a node (``NodeAffinitySchedulingStrategy``); sandboxes are real SQLite and
folder sandboxes. One cluster serves the module (starting it is most of the cost)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import sqlite3
import sys
import tarfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

# Every Ray process of these tests on loopback: without this, Ray advertises the machine's interface address.
# (Set before Ray is first imported: it reads it once.)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
pytest.importorskip("ray", reason="the 'ray' extra is not installed: pip install 'tvcache[ray]'")

import ray  # noqa: E402
import ray.cloudpickle  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from tvcache import AlwaysSnapshot, NeverSnapshot, ToolCall  # noqa: E402
from tvcache.errors import SandboxError  # noqa: E402
from tvcache.integrations.ray import (  # noqa: E402
    DirectoryStore,
    NodeCache,
    PublishedSnapshots,
    RayCache,
    RayObjectStore,
    find_shards,
    start_shards,
    stop_shards,
)
from tvcache.protocol import SandboxFactory  # noqa: E402
from tvcache.sandboxes import FolderSandbox, SQLiteSandbox  # noqa: E402
from tvcache.snapshots import pack, unpack  # noqa: E402


def lookup(cache: RayCache, task_id: str, history: list[dict[str, Any]]) -> dict[str, Any]:
    """``POST /v1/lookup`` of ``history`` on the shard that holds ``task_id``, through the shard's transport."""
    transport = cache.transports[cache.shard_name(task_id)]
    with httpx.Client(base_url="http://shard", transport=transport) as client:
        reply: dict[str, Any] = client.post("/v1/lookup", json={"task_id": task_id, "history": history}).json()
    return reply


# Ray workers cannot import this test module by name: ship its functions by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

MiB = 1024 * 1024


@dataclass(frozen=True)
class Deployment:
    namespace: str
    data_dir: Path
    work: Path
    node_a: str
    node_b: str
    database: Path
    template: Path
    cluster: Any


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    work = tmp_path_factory.mktemp("ray")
    node_args = {"num_cpus": 1, "object_store_memory": 80 * MiB}
    try:
        cluster = Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False})
        worker = cluster.add_node(**node_args)
        cluster.wait_for_nodes()
    except Exception as error:  # this machine cannot run Ray (no /dev/shm, sandboxed sockets, ...)
        pytest.skip(f"Ray cannot start a local cluster here: {error!r}")
    namespace = f"tvcache-test-{uuid.uuid4().hex[:8]}"
    try:
        ray.init(address=cluster.address, namespace=namespace, log_to_driver=False)
        data_dir = work / "shards"
        start_shards(2, data_dir=data_dir, namespace=namespace, detached=False)
        database = work / "base.db"
        with sqlite3.connect(database) as connection:
            connection.execute("CREATE TABLE items (name TEXT PRIMARY KEY, qty INTEGER)")
            connection.execute("INSERT INTO items VALUES ('apple', 3), ('pear', 5)")
        template = work / "template"
        template.mkdir()
        (template / "notes.txt").write_text("first line\n")
        yield Deployment(
            namespace=namespace,
            data_dir=data_dir,
            work=work,
            node_a=cluster.head_node.node_id,
            node_b=worker.node_id,
            database=database,
            template=template,
            cluster=cluster,
        )
    finally:
        ray.shutdown()
        cluster.shutdown()


# ------------------------------------------------------------------ rollouts, run as Ray tasks on one node

Plan = list[tuple[str, list[tuple[str, dict[str, Any]]]]]  # (task id, calls) per rollout


def _factory(kind: str, source: str) -> SandboxFactory:
    if kind == "sqlite":
        return SQLiteSandbox.factory(source)
    return FolderSandbox.factory(source)


def _run_rollouts(
    namespace: str, kind: str, source: str, store: str, cache_dir: str, plan: Plan, snapshots: bool
) -> dict[str, Any]:
    """Run ``plan`` through a RayCache on this node; what each rollout saw and did."""
    blob_store = RayObjectStore(namespace=namespace) if store == "ray" else DirectoryStore(store)
    factory = PublishedSnapshots(_factory(kind, source), blob_store, cache=NodeCache(cache_dir))
    policy = AlwaysSnapshot() if snapshots else NeverSnapshot()
    rollouts = []
    with RayCache(namespace=namespace, snapshot_policy=policy) as cache:
        for task_id, calls in plan:
            with cache.session_sync(task_id, sandbox=factory) as session:
                results = [session.call(name, arguments) for name, arguments in calls]
                stats = session.stats
            rollouts.append(
                {
                    "outputs": [result.output for result in results],
                    "hits": [result.hit for result in results],
                    "started": stats.sandboxes_started,
                    "forked": stats.sandboxes_forked,
                }
            )
    return {
        "node": ray.get_runtime_context().get_node_id(),
        "rollouts": rollouts,
        "published": factory.published,
        "fetched": factory.cache.fetched,
    }


def run_on(node_id: str, *args: Any) -> dict[str, Any]:
    remote = ray.remote(_run_rollouts).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    )
    result: dict[str, Any] = ray.get(remote.remote(*args), timeout=120)
    assert result["node"] == node_id
    return result


def uncached(kind: str, source: str, calls: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The outputs of executing ``calls`` in a fresh sandbox, no cache anywhere."""

    async def run() -> list[str]:
        sandbox = await _factory(kind, source).start()
        try:
            return [(await sandbox.execute(ToolCall(name, arguments))).output for name, arguments in calls]
        finally:
            await sandbox.stop()

    return asyncio.run(run())


# ------------------------------------------------------------------ tests


def test_shards_are_named_actors_spread_and_journaled(deployment: Deployment) -> None:
    assert find_shards(deployment.namespace) == ["tvcache-shard-0", "tvcache-shard-1"]
    with RayCache(namespace=deployment.namespace) as cache:
        infos = list(cache.shard_info().values())
        assert {info["name"] for info in infos} == {"tvcache-shard-0", "tvcache-shard-1"}
        assert {info["node_id"] for info in infos} <= {deployment.node_a, deployment.node_b}
        metrics = cache.metrics()
        assert all("tvcache" in text for text in metrics.values())
    assert (deployment.data_dir / "shard-0" / "journal.log").exists()


SQL_A = [
    ("sql", {"query": "UPDATE items SET qty = qty + 10 WHERE name = 'apple'"}),
    ("sql", {"query": "SELECT name, qty FROM items ORDER BY name"}),
    ("sql", {"query": "INSERT INTO items VALUES ('plum', 7)"}),
    ("sql", {"query": "SELECT sum(qty) FROM items"}),
]
# Shares the first (snapshotted) call with SQL_A, then diverges: a miss that forks A's snapshot on node B.
SQL_B = [
    SQL_A[0],
    ("sql", {"query": "DELETE FROM items WHERE name = 'pear'"}),
    ("sql", {"query": "SELECT name, qty FROM items ORDER BY name"}),
]


def test_rollouts_on_one_node_hit_and_fork_what_another_node_made(deployment: Deployment) -> None:
    d = deployment
    args = (d.namespace, "sqlite", str(d.database), "ray")
    made = run_on(d.node_a, *args, str(d.work / "cache-a"), [("sql-task", SQL_A)], True)
    assert made["rollouts"][0]["hits"] == [False] * 4
    assert made["published"] >= 2  # after each stateful call

    seen = run_on(d.node_b, *args, str(d.work / "cache-b"), [("sql-task", SQL_A), ("sql-task", SQL_B)], True)
    replay, diverged = seen["rollouts"]
    assert replay["hits"] == [True] * 4  # inserted from node A, served on node B
    assert replay["started"] == replay["forked"] == 0  # all hits: no sandbox at all
    assert diverged["hits"] == [True, False, False]
    assert diverged["forked"] == 1  # A's snapshot, fetched through the object store ...
    assert diverged["started"] == 0  # ... instead of starting fresh and replaying
    assert seen["fetched"] == 1  # verified and unpacked into node B's cache once

    assert replay["outputs"] == made["rollouts"][0]["outputs"] == uncached("sqlite", str(d.database), SQL_A)
    assert diverged["outputs"] == uncached("sqlite", str(d.database), SQL_B)


SH_A = [
    ("sh", {"cmd": "echo second line >> notes.txt && mkdir -p out && echo x > out/a"}),
    ("sh", {"cmd": "cat notes.txt; ls out"}),
    ("sh", {"cmd": "rm notes.txt"}),
]
SH_B = [SH_A[0], ("sh", {"cmd": "echo third >> notes.txt; wc -l < notes.txt"}), ("sh", {"cmd": "cat out/a"})]


def test_folder_snapshots_cross_nodes_through_a_shared_directory(deployment: Deployment) -> None:
    d = deployment
    store = str(d.work / "blobs")
    args = (d.namespace, "folder", str(d.template), store)
    made = run_on(d.node_a, *args, str(d.work / "fcache-a"), [("folder-task", SH_A)], True)
    seen = run_on(d.node_b, *args, str(d.work / "fcache-b"), [("folder-task", SH_A), ("folder-task", SH_B)], True)
    replay, diverged = seen["rollouts"]
    assert replay["hits"] == [True, True, True]
    assert diverged["hits"][0] is True
    assert diverged["forked"] == 1
    assert diverged["started"] == 0
    assert seen["fetched"] == 1
    assert made["rollouts"][0]["outputs"] == replay["outputs"] == uncached("folder", str(d.template), SH_A)
    assert diverged["outputs"] == uncached("folder", str(d.template), SH_B)


def test_a_published_folder_keeps_its_modes_and_refuses_paths_leaving_it(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "bin").mkdir(parents=True)
    for name, mode in [("bin/tool", 0o4755), ("shared", 0o664), ("bin", 0o2775)]:
        if not (tree / name).exists():
            (tree / name).write_text(name)
        os.chmod(tree / name, mode)
    data, fmt = pack(tree)
    assert fmt == "tree"
    unpack(data, fmt, tmp_path / "copy")
    for name in ["bin/tool", "shared", "bin"]:
        assert oct((tmp_path / "copy" / name).stat().st_mode) == oct((tree / name).stat().st_mode), name

    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w") as archive:
        member = tarfile.TarInfo("../escaped")
        archive.addfile(member, io.BytesIO(b""))
    with pytest.raises(SandboxError, match="cannot unpack a published tree"):
        unpack(evil.getvalue(), "tree", tmp_path / "evil")
    assert not (tmp_path / "escaped").exists()


def test_a_digest_mismatch_is_refused_and_the_state_rebuilt_by_replay(deployment: Deployment) -> None:
    d = deployment
    store = d.work / "tampered"
    args = (d.namespace, "sqlite", str(d.database), str(store))
    run_on(d.node_a, *args, str(d.work / "tcache-a"), [("tamper-task", SQL_A)], True)
    for blob in (store / "blobs").rglob("*"):
        if blob.is_file():
            blob.write_bytes(blob.read_bytes() + b"corrupt")
    seen = run_on(d.node_b, *args, str(d.work / "tcache-b"), [("tamper-task", SQL_B)], True)
    (diverged,) = seen["rollouts"]
    assert diverged["forked"] == 0  # the tampered blob was refused ...
    assert diverged["started"] == 1  # ... and the state rebuilt by a fresh start and replay
    assert seen["fetched"] == 0
    assert diverged["outputs"] == uncached("sqlite", str(d.database), SQL_B)


def _load(namespace: str, source: str, tasks: int, calls: int) -> list[tuple[str, list[str], list[str]]]:
    """Write load: every call a new insert. Returns each rollout's acknowledged calls and outputs."""
    factory = SQLiteSandbox.factory(source)
    done = []
    with RayCache(namespace=namespace, snapshot_policy=NeverSnapshot()) as cache:
        for task in range(tasks):
            task_id = f"load-{task}"
            queries = [f"INSERT INTO items VALUES ('k{task}-{i}', {i})" for i in range(calls)]
            outputs = []
            with cache.session_sync(task_id, sandbox=factory) as session:
                for query in queries:
                    result = session.call("sql", {"query": query})
                    assert not result.hit
                    outputs.append(result.output)  # acknowledged: journaled by the shard before it answered
            done.append((task_id, queries, outputs))
    return done


def test_killing_a_shard_under_load_loses_no_acknowledged_insert(deployment: Deployment) -> None:
    d = deployment
    victim = ray.get_actor("tvcache-shard-0", namespace=d.namespace)
    old_pid = ray.get(victim.pid.remote())
    with RayCache(namespace=d.namespace) as cache:
        stats = cache.shards["tvcache-shard-0"].server_stats
        before = stats()["inserts"]
        load = (
            ray.remote(_load)
            .options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=d.node_b, soft=False))
            .remote(d.namespace, str(d.database), 8, 60)
        )
        deadline = time.monotonic() + 60
        while stats()["inserts"] < before + 20:  # under load: the shard has acknowledged inserts already
            assert time.monotonic() < deadline, "the load never reached shard 0"
            ready, _ = ray.wait([load], timeout=0.01)
            assert not ready, "the load finished before the kill; make it longer"
        os.kill(old_pid, signal.SIGKILL)
        acknowledged = ray.get(load, timeout=120)  # the run continued through the restart
        assert ray.get(victim.pid.remote()) != old_pid  # restarted by Ray (max_restarts)

    assert sum(len(queries) for _, queries, _ in acknowledged) == 8 * 60
    with RayCache(namespace=d.namespace) as cache:
        for task_id, queries, outputs in acknowledged:
            history = [{"name": "sql", "arguments": {"query": query}} for query in queries]
            for depth in range(1, len(history) + 1):
                match = lookup(cache, task_id, history[:depth])
                assert match["hit"], f"{task_id}: acknowledged insert {depth} was lost"
                assert match["node"]["output"] == outputs[depth - 1]


def test_the_ray_command_starts_reports_and_stops_detached_shards(
    deployment: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    from tvcache.cli import main

    namespace = f"{deployment.namespace}-cli"
    data_dir = str(deployment.work / "cli-shards")
    assert main(["ray", "up", "--shards", "2", "--data-dir", data_dir, "--namespace", namespace]) == 0
    assert main(["ray", "status", "--namespace", namespace]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [json.loads(line)["name"] for line in lines] == ["tvcache-shard-0", "tvcache-shard-1"]
    assert main(["ray", "down", "--namespace", namespace]) == 0
    assert find_shards(namespace) == []
    assert main(["ray", "up", "--namespace", namespace]) == 2  # no --data-dir: refused with what to do


def test_one_setting_picks_the_ray_shards_and_none_finds_them_inside_the_cluster(deployment: Deployment) -> None:
    from tvcache import Cache, InvalidInput
    from tvcache.integrations import open_cache

    for where in (None, "ray://", f"ray://{deployment.namespace}"):
        cache = open_cache(where)
        assert isinstance(cache, RayCache), where
        assert cache.namespace == deployment.namespace
        cache.close()
    with pytest.raises(InvalidInput, match="no tvcache shard actors"):
        open_cache("ray://no-such-namespace")
    assert isinstance(open_cache(str(deployment.work / "embedded")), Cache)  # a directory stays embedded


def test_removing_a_node_under_load_loses_no_acknowledged_insert(deployment: Deployment) -> None:
    """Last in this module: it removes node B for good. A shard placed on node B (soft affinity) is restarted on
    node A from its journal while a load on node A keeps inserting."""
    d = deployment
    placement = NodeAffinitySchedulingStrategy(node_id=d.node_b, soft=True)
    for attempt in range(10):  # soft affinity is a preference: the scheduler may still pick node A
        namespace = f"{d.namespace}-node-loss-{attempt}"
        (name,) = start_shards(
            1,
            data_dir=d.work / f"node-loss-{attempt}",
            namespace=namespace,
            detached=False,
            scheduling_strategy=placement,
        )
        shard = ray.get_actor(name, namespace=namespace)
        if ray.get(shard.info.remote(), timeout=60)["node_id"] == d.node_b:
            break
        stop_shards(namespace)
    else:
        pytest.fail("the shard never landed on node B in 10 attempts")
    load = (
        ray.remote(_load)
        .options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=d.node_a, soft=False))
        .remote(namespace, str(d.database), 6, 40)
    )
    with RayCache(namespace=namespace) as cache:
        stats = cache.shards[name].server_stats
        deadline = time.monotonic() + 60
        while stats()["inserts"] < 10:  # under load: the shard on node B has acknowledged inserts
            assert time.monotonic() < deadline, "the load never reached the shard on node B"
            ready, _ = ray.wait([load], timeout=0.01)
            assert not ready, "the load finished before the node was removed; make it longer"
    worker = next(node for node in d.cluster.worker_nodes if node.node_id == d.node_b)
    d.cluster.remove_node(worker)
    acknowledged = ray.get(load, timeout=300)  # the run continued while the shard moved to node A
    assert sum(len(queries) for _, queries, _ in acknowledged) == 6 * 40
    assert ray.get(shard.info.remote(), timeout=120)["node_id"] == d.node_a
    with RayCache(namespace=namespace) as cache:
        for task_id, queries, outputs in acknowledged:
            history = [{"name": "sql", "arguments": {"query": query}} for query in queries]
            match = lookup(cache, task_id, history)
            assert match["hit"], f"{task_id}: acknowledged inserts were lost with node B"
            assert match["node"]["output"] == outputs[-1]
