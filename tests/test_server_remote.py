"""RemoteCache and ShardedCache against real servers on 127.0.0.1: the embedded cache's session API, with
sandboxes on the client and coalescing across clients."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import tvcache
from tvcache import AlwaysSnapshot, Cache, InvalidToolCall, NeverSnapshot, RemoteCache, ShardedCache
from tvcache.client import rendezvous
from tvcache.server import CacheService, ServerThread

from kvstore import FaultyForks, KVFactory
from server_support import wait_until

ROLLOUT = [
    ("set", {"key": "a", "value": 1}),
    ("get", {"key": "a"}),
    ("incr", {"key": "a"}),
    ("get", {"key": "a"}),
    ("keys", {}),
]


async def run(cache: Cache, factory: KVFactory, calls: list[tuple[str, dict]], task: str = "t") -> list:
    async with cache.session(task, sandbox=factory) as session:
        return [await session.call(name, args) for name, args in calls]


@pytest.fixture
def server(service: CacheService) -> Iterator[ServerThread]:
    with ServerThread(service) as thread:
        yield thread


def test_lazy_exports_and_remote_is_a_cache() -> None:
    assert tvcache.RemoteCache is RemoteCache
    assert issubclass(RemoteCache, Cache)
    with pytest.raises(AttributeError):
        _ = tvcache.NoSuchThing  # type: ignore[attr-defined]


def test_a_second_client_hits_what_the_first_executed(server: ServerThread) -> None:
    factory = KVFactory()
    with RemoteCache(server.url) as first, RemoteCache(server.url) as second:
        executed = asyncio.run(run(first, factory, ROLLOUT))
        started = factory.started
        replayed = asyncio.run(run(second, factory, ROLLOUT))
        assert [r.hit for r in executed] == [False] * 5
        assert [r.hit for r in replayed] == [True] * 5
        assert [r.output for r in replayed] == [r.output for r in executed]
        assert factory.started == started == 1  # all hits: the second client never started a sandbox
        # The same rollouts through an embedded cache give the same outputs.
        embedded = asyncio.run(run(Cache(), KVFactory(), ROLLOUT))
        assert [r.output for r in embedded] == [r.output for r in executed]
        second.check_invariants()
        first.close()
        wait_until(lambda: server.service.cache.graph("t").stats()["hits"] >= 5)  # replica hits reach the server


def test_sync_sessions_and_cached_tests(server: ServerThread) -> None:
    factory = KVFactory()
    with RemoteCache(server.url) as cache:
        with cache.session_sync("t", sandbox=factory) as session:
            session.call("set", {"key": "a", "value": 2})
            first = session.session  # the async session underneath
            assert first.state is not None
        with cache.session_sync("t", sandbox=factory) as session:
            assert session.call("set", {"key": "a", "value": 2}).hit is True

        async def check() -> tuple[object, object]:
            async with cache.session("t", sandbox=factory) as session:
                await session.call("set", {"key": "a", "value": 2})
                one = await session.test(lambda sandbox: sandbox.data["a"] * 10, key="reward")
                two = await session.test(lambda sandbox: 0, key="reward")
                return one, two

        one, two = asyncio.run(check())
        assert (one.value, one.hit) == (20, False)  # type: ignore[attr-defined]
        assert (two.value, two.hit) == (20, True)  # type: ignore[attr-defined]
        with pytest.raises(InvalidToolCall), cache.session_sync("t", sandbox=factory) as session:
            session.call("set", {"key": "a"})


def test_two_clients_missing_the_same_call_execute_it_once(server: ServerThread) -> None:
    factory = KVFactory()
    gate = threading.Event()
    slow = [("slow", {"key": "k", "seconds": 0.2})]
    results: list[list] = []

    def rollout() -> None:
        with RemoteCache(server.url) as cache:
            gate.wait(5)
            results.append(asyncio.run(run(cache, factory, slow)))

    threads = [threading.Thread(target=rollout) for _ in range(3)]
    for thread in threads:
        thread.start()
    gate.set()
    for thread in threads:
        thread.join(30)
    assert factory.executed["slow"] == 1
    assert sorted(r[0].hit for r in results) == [False, True, True]
    assert {r[0].output for r in results} == {"k=1"}
    assert sum(r[0].coalesced for r in results) == 2


def test_a_dead_executing_client_is_taken_over(server: ServerThread) -> None:
    # A client claims the call and dies without a heartbeat: its claim expires and a live client executes it.
    call = {"name": "set", "arguments": {"key": "a", "value": 1}}
    with httpx.Client(base_url=server.url) as raw:
        dead = raw.post("/v1/claim", json={"task_id": "t", "state": 0, "call": call, "ttl": 0.3}).json()
    assert dead["status"] == "owner"
    factory = KVFactory()
    with RemoteCache(server.url, wait_timeout=0.1) as cache:
        results = asyncio.run(run(cache, factory, [("set", {"key": "a", "value": 1})]))
    assert results[0].hit is False
    assert results[0].output == "a=1"
    assert factory.executed["set"] == 1
    assert server.service.counters["claims_taken_over"] == 1


def test_a_failing_owner_lets_a_waiter_execute(server: ServerThread) -> None:
    broken, healthy = KVFactory(), KVFactory()
    broken.broken = True
    with RemoteCache(server.url) as one, RemoteCache(server.url) as two:

        async def both() -> list:
            async def failing() -> object:
                try:
                    return await run(one, broken, [("slow", {"key": "k", "seconds": 0.1})])
                except tvcache.SandboxError as error:
                    return error

            return await asyncio.gather(failing(), run(two, healthy, [("slow", {"key": "k", "seconds": 0.1})]))

        failed, succeeded = asyncio.run(both())
    assert isinstance(failed, tvcache.SandboxError)
    assert succeeded[0].output == "k=1"


def test_clients_fork_each_others_snapshots(server: ServerThread, tmp_path: Path) -> None:
    factory = KVFactory(start=1.0, fork=0.0, snapshot=0.0)
    shared = tmp_path / "snapshots"
    with (
        RemoteCache(server.url, snapshot_policy=AlwaysSnapshot(), snapshot_dir=shared) as first,
        RemoteCache(server.url, snapshot_policy=NeverSnapshot(), snapshot_dir=shared) as second,
    ):
        asyncio.run(run(first, factory, ROLLOUT[:3]))
        assert server.service.stats()["snapshots"] == 2
        started = factory.started
        results = asyncio.run(run(second, factory, [*ROLLOUT[:3], ("incr", {"key": "a"})]))
        assert [r.hit for r in results] == [True, True, True, False]
        assert results[-1].output == "a=3"
        assert factory.started == started
        assert factory.forked == 1  # forked the first client's snapshot
        assert server.service.leases == {}
        assert all(p.parent.parent == shared for p in shared.rglob("*") if p.is_file())


def test_a_fork_failing_on_one_client_is_passed_over_there_and_still_served_to_others(
    server: ServerThread, tmp_path: Path
) -> None:
    """One client's full disk must not cost every client the snapshot: the server keeps it, that client's lease
    requests skip it, another client forks it."""
    shared = tmp_path / "snapshots"
    options = {"snapshot_policy": NeverSnapshot(), "snapshot_dir": shared}
    with (
        RemoteCache(server.url, snapshot_policy=AlwaysSnapshot(), snapshot_dir=shared) as first,
        RemoteCache(server.url, **options) as second,
        RemoteCache(server.url, **options) as third,
    ):
        asyncio.run(run(first, KVFactory(), ROLLOUT[:3]))
        assert server.service.stats()["snapshots"] == 2
        full_disk = FaultyForks(OSError(28, "No space left on device"), start=1.0, fork=0.0, snapshot=0.0)
        full_disk.failing = {str(path) for path in shared.rglob("*") if path.is_file()}
        with pytest.warns(RuntimeWarning, match="not forking it in this process again"):
            results = asyncio.run(run(second, full_disk, [*ROLLOUT[:3], ("incr", {"key": "a"})]))
        assert results[-1].output == "a=3"
        assert (full_disk.started, full_disk.forked, len(full_disk.failed)) == (1, 0, 2)  # tried each once
        assert server.service.stats()["snapshots"] == 2  # nothing dropped on the server, nothing freed
        assert len(full_disk.failing & {str(path) for path in shared.rglob("*")}) == 2
        asyncio.run(run(second, full_disk, [*ROLLOUT[:3], ("incr", {"key": "b"})]))
        assert len(full_disk.failed) == 2  # the lease requests skip them now
        healthy = KVFactory(start=1.0, fork=0.0, snapshot=0.0)
        results = asyncio.run(run(third, healthy, [*ROLLOUT[:3], ("incr", {"key": "c"})]))
        assert (healthy.started, healthy.forked, results[-1].output) == (0, 1, "c=1")
        assert server.service.leases == {}


def test_a_snapshot_no_client_can_fork_is_dropped_on_the_server_and_freed(server: ServerThread, tmp_path: Path) -> None:
    shared = tmp_path / "snapshots"
    with (
        RemoteCache(server.url, snapshot_policy=AlwaysSnapshot(), snapshot_dir=shared) as first,
        RemoteCache(server.url, snapshot_policy=NeverSnapshot(), snapshot_dir=shared) as second,
    ):
        asyncio.run(run(first, KVFactory(), ROLLOUT[:3]))
        paths = {str(path) for path in shared.rglob("*") if path.is_file()}
        gone = FaultyForks(tvcache.SnapshotUnusable("its blob is gone from the store"), start=1.0, fork=0.0)
        gone.failing = paths
        with pytest.warns(RuntimeWarning, match="dropping it"):
            results = asyncio.run(run(second, gone, [*ROLLOUT[:3], ("incr", {"key": "a"})]))
        assert results[-1].output == "a=3"
        assert server.service.stats()["snapshots"] == 0
        # Freed by the client that met the failure: another client made them, so only their paths, verified to lie
        # in the shared snapshot directory, are removed (not through the factory, which would trust their meta).
        assert gone.discarded == []
        assert not any(path.is_file() for path in shared.rglob("*"))
        assert server.service.leases == {}


def test_nondeterminism_found_by_one_client_reaches_the_others(server: ServerThread) -> None:
    with RemoteCache(server.url) as first, RemoteCache(server.url) as second:
        with pytest.warns(tvcache.NondeterminismWarning):
            first.mark_nondeterministic("get", "seen differing")
        factory = KVFactory({"a": 1})
        asyncio.run(run(second, factory, [("get", {"key": "a"})]))
        results = asyncio.run(run(second, factory, [("get", {"key": "a"})]))
        assert results[0].hit is False
        assert results[0].cached is False
        assert factory.executed["get"] == 2


def test_a_mark_one_client_found_in_a_task_reaches_the_others_in_that_task_only(server: ServerThread) -> None:
    """Marks are scoped to the task whose evidence showed them (issue 19, item 2); through a server, the other
    clients must learn them too, or they would go on serving the tool in that task."""
    now = [tvcache.ToolSpec(name="now", read_only=True, arguments={})]  # a clock nobody declared
    with RemoteCache(server.url, tools=now) as first, RemoteCache(server.url, tools=now) as second:
        factory = KVFactory()
        asyncio.run(run(first, factory, [("now", {})]))
        with pytest.warns(tvcache.NondeterminismWarning):
            asyncio.run(run(first, factory, [("now", {})]))  # the first-hit check disagrees
        marks = httpx.get(f"{server.url}/v1/tools/nondeterministic").json()["marks"]
        assert [(mark["tool"], mark["task_id"]) for mark in marks] == [("now", "t")]
        (result,) = asyncio.run(run(second, factory, [("now", {})]))
        assert result.cached is False
        assert [(mark.tool, mark.task_id) for mark in second.nondeterministic_marks()] == [("now", "t")]
        (elsewhere,) = asyncio.run(run(second, factory, [("now", {})], task="u"))
        assert elsewhere.cached  # another task: the tool is cached there (and judged by its own first-hit check)


def test_marks_cleared_through_one_client_are_lifted_for_every_client(server: ServerThread) -> None:
    with RemoteCache(server.url) as first, RemoteCache(server.url) as second:
        factory = KVFactory({"a": 1})
        asyncio.run(run(second, factory, [("get", {"key": "a"})]))
        with pytest.warns(tvcache.NondeterminismWarning):
            first.mark_nondeterministic("get", "seen differing")
        (marked,) = asyncio.run(run(second, factory, [("get", {"key": "a"})]))  # second learns it at its session
        assert marked.cached is False
        assert first.clear_nondeterministic("get") == 1
        assert httpx.get(f"{server.url}/v1/tools/nondeterministic").json() == {"tools": {}, "marks": []}
        (again,) = asyncio.run(run(second, factory, [("get", {"key": "a"})]))
        assert again.hit  # lifted for the other client too, at its next session


def test_token_is_sent(tmp_path: Path) -> None:
    from tvcache.server import ServerSettings

    service = CacheService()
    with ServerThread(service, ServerSettings(token="tok")) as server:
        with RemoteCache(server.url, token="tok") as cache:
            assert asyncio.run(run(cache, KVFactory(), ROLLOUT[:1]))[0].output == "a=1"
        with RemoteCache(server.url) as anonymous, pytest.raises(tvcache.TVCacheError, match="401"):
            asyncio.run(run(anonymous, KVFactory(), ROLLOUT[:1]))
    service.close()


def test_rendezvous_moves_about_one_nth_of_tasks_when_a_shard_is_added() -> None:
    tasks = [f"task-{index}" for index in range(20_000)]
    four = [f"http://10.0.0.{index}:8000" for index in range(4)]
    five = [*four, "http://10.0.0.9:8000"]
    before = {task: rendezvous(task, four) for task in tasks}
    after = {task: rendezvous(task, five) for task in tasks}
    moved = [task for task in tasks if before[task] != after[task]]
    assert 0.17 < len(moved) / len(tasks) < 0.23  # about 1/5
    assert all(after[task] == five[-1] for task in moved)  # only to the new shard
    counts = {shard: list(before.values()).count(shard) for shard in four}
    assert min(counts.values()) > 0.2 * len(tasks)  # balanced
    random.shuffle(four)
    assert all(rendezvous(task, four) == before[task] for task in tasks[:1000])  # order does not matter
    with pytest.raises(ValueError, match="at least one"):
        rendezvous("t", [])


def test_sharded_cache_routes_each_task_to_one_server() -> None:
    services = [CacheService(), CacheService()]
    with ServerThread(services[0]) as one, ServerThread(services[1]) as two:
        with ShardedCache([one.url, two.url]) as cache:
            tasks = [f"task-{index}" for index in range(8)]
            factory = KVFactory()
            for task in tasks:
                asyncio.run(run(cache, factory, ROLLOUT[:2], task=task))
                assert asyncio.run(run(cache, factory, ROLLOUT[:2], task=task))[1].hit is True
            owners = {task: cache.shard(task).url for task in tasks}
            assert set(owners.values()) == {one.url, two.url}
            for service, url in zip(services, (one.url, two.url), strict=True):
                assert sorted(service.cache.tasks()) == sorted(t for t in tasks if owners[t] == url)
            assert set(cache.server_stats()) == {one.url, two.url}
        with pytest.raises(ValueError, match="twice"):
            ShardedCache([one.url, one.url + "/"])
    for service in services:
        service.close()
