"""What a tvcache client trusts from the server: node ids only within one server instance (a restarted server
reuses them for other states), and snapshot records never as a licence to delete (any client can attach any path).
Real servers on 127.0.0.1 (restarted on the same port), real SQLite sandboxes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import warnings
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tvcache import AlwaysSnapshot, Budget, Cache, NeverSnapshot, RemoteCache
from tvcache.journal import Journal
from tvcache.sandboxes import SQLiteSandbox
from tvcache.server import CacheService, ServerThread

from kvstore import KVFactory

UPDATE_100 = "UPDATE settings SET v = 100"
UPDATE_7 = "UPDATE settings SET v = 7"
SELECT = "SELECT v FROM settings"


@pytest.fixture
def database(tmp_path: Path) -> Path:
    path = tmp_path / "base.sqlite"
    connection = sqlite3.connect(path)
    connection.execute("CREATE TABLE settings (v INTEGER)")
    connection.execute("INSERT INTO settings (v) VALUES (1)")
    connection.commit()
    connection.close()
    return path


async def rollout(cache: Cache, factory: object, queries: list[str], task: str = "t") -> list:
    async with cache.session(task, sandbox=factory) as session:  # type: ignore[arg-type]
        return [await session.call("sql", {"query": query}) for query in queries]


@contextlib.contextmanager
def recorded() -> Iterator[list[str]]:
    """The warnings given inside (any thread), as text: checked after the outcome, so that a failure shows the
    wrong answer rather than a missing warning."""
    messages: list[str] = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield messages
    messages.extend(str(warning.message) for warning in seen)


def warned(messages: list[str], text: str) -> bool:
    return any(text in message for message in messages)


class Restartable:
    """An in-memory ``tvcache serve`` on one port that the test restarts (everything in memory is lost)."""

    def __init__(self, service: CacheService | None = None) -> None:
        self.service = service or CacheService()
        self.thread = ServerThread(self.service).start()
        self.port = self.thread.port
        self.url = self.thread.url

    def restart(self, service: CacheService | None = None) -> CacheService:
        self.thread.stop()
        self.service.close()
        self.service = service or CacheService()
        self.thread = ServerThread(self.service, port=self.port).start()
        return self.service

    def close(self) -> None:
        self.thread.stop()
        self.service.close()


@pytest.fixture
def server() -> Iterator[Restartable]:
    running = Restartable()
    yield running
    running.close()


# ------------------------------------------------------------------ item 5: node ids across a restart


def test_a_replica_never_answers_with_a_node_of_the_server_before_its_restart(
    server: Restartable, database: Path
) -> None:
    """The issue's repro: UPDATE v=100, SELECT; restart; UPDATE v=7 reports the same "OK (1 row changed)", and
    the server assigns it the id the replica knows as UPDATE v=100. The SELECT must answer 7, executed."""
    factory = SQLiteSandbox.factory(database)
    with RemoteCache(server.url, snapshot_policy=NeverSnapshot()) as cache:
        before = asyncio.run(rollout(cache, factory, [UPDATE_100, SELECT]))
        assert [r.output for r in before] == ["OK (1 row changed)", "v\n100"]
        server.restart()
        with recorded() as messages:
            after = asyncio.run(rollout(cache, factory, [UPDATE_7, SELECT]))
        assert [r.output for r in after] == ["OK (1 row changed)", "v\n7"]
        assert [r.hit for r in after] == [False, False]
        assert warned(messages, "restarted")
        # The restarted server holds the new rollout, and the replica now mirrors it: a repeat hits.
        again = asyncio.run(rollout(cache, factory, [UPDATE_7, SELECT]))
        assert [(r.output, r.hit) for r in again] == [("OK (1 row changed)", True), ("v\n7", True)]
        cache.check_invariants()
    assert len(server.service.cache.graph("t")) == 3  # the root, UPDATE v=7, SELECT: nothing of before


def test_a_rollout_running_across_the_restart_finishes_exactly_and_writes_nothing_stale(
    server: Restartable, database: Path
) -> None:
    """A session in flight when the server restarts holds states whose ids now mean something else on the
    server: it finishes on its own copy (hits from it stay exact), and never sends those ids to the new server."""
    factory = SQLiteSandbox.factory(database)
    with (
        recorded() as messages,  # the first request to meet the new server sees it restarted (any thread)
        RemoteCache(server.url, snapshot_policy=NeverSnapshot()) as cache,
        RemoteCache(server.url) as other,
    ):
        asyncio.run(rollout(cache, factory, [UPDATE_100, SELECT]))

        async def across() -> list:
            async with cache.session("t", sandbox=factory) as session:
                first = await session.call("sql", {"query": UPDATE_100})  # a replica hit: state = node 1
                server.restart()
                # Another client fills the new server: its node 1 is UPDATE v=7.
                await asyncio.to_thread(lambda: asyncio.run(rollout(other, factory, [UPDATE_7])))
                second = await session.call("sql", {"query": SELECT})  # answered from the replica's own copy
                third = await session.call("sql", {"query": "UPDATE settings SET v = v + 1"})
                fourth = await session.call("sql", {"query": SELECT})
                return [first, second, third, fourth]

        results = asyncio.run(across())
        assert [r.output for r in results] == ["OK (1 row changed)", "v\n100", "OK (1 row changed)", "v\n101"]
    graph = server.service.cache.graph("t")
    calls = sorted(node.call.arguments["query"] for node in graph.nodes() if node.call is not None)
    assert calls == [UPDATE_7]  # the stale session inserted nothing under the new server's node 1
    assert warned(messages, "restarted")


def test_a_server_that_kept_its_instance_but_lost_records_is_caught_by_the_node_identity(
    server: Restartable, database: Path
) -> None:
    """Even when the instance id does not change (a durable server that lost journal records), a node id the
    replica knows for another call is not adopted: the digest and parent are compared, the replica dropped."""
    factory = SQLiteSandbox.factory(database)
    with RemoteCache(server.url, snapshot_policy=NeverSnapshot()) as cache:
        asyncio.run(rollout(cache, factory, [UPDATE_100, SELECT]))
        lost = CacheService()
        lost.instance = getattr(server.service, "instance", "")
        server.restart(lost)
        with recorded() as messages:
            after = asyncio.run(rollout(cache, factory, [UPDATE_7, SELECT]))
        assert [(r.output, r.hit) for r in after] == [("OK (1 row changed)", False), ("v\n7", False)]
        assert warned(messages, "does not match")


# ------------------------------------------------------------------ item 6: snapshot records are not licences


def attach_hostile_records(url: str, victim: Path, *, count: int = 64, task: str = "t") -> None:
    """What any client of the server can send: nodes with snapshot records naming someone else's directories
    (``victim``'s, each record another one: the server takes one record per path)."""
    with httpx.Client(base_url=url) as raw:
        for index in range(count):
            call = {"name": "sql", "arguments": {"query": f"SELECT {index}"}}
            body = {"task_id": task, "parent": 0, "call": call, "output": "x", "seconds": 0.0}
            node = raw.post("/v1/insert", json=body).json()["node"]
            target = victim / f"dir-{index}"
            target.mkdir(exist_ok=True)
            (target / "precious.txt").write_text("not the cache's")
            snapshot = {"kind": "sqlite", "path": str(target), "bytes": 1}
            reply = raw.post(
                "/v1/snapshots/attach", json={"task_id": task, "node_id": node["id"], "snapshot": snapshot}
            )
            assert reply.status_code == 200, reply.text


def victim_directory(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("not the cache's")
    return victim


def test_an_honest_client_never_deletes_a_directory_another_client_attached(
    server: Restartable, database: Path, tmp_path: Path
) -> None:
    """The issue's repro: with the default budget, 64 hostile records fill the task; an honest AlwaysSnapshot
    rollout's snapshot evicts one, handed back to the honest client, which must not delete it."""
    victim = victim_directory(tmp_path)
    attach_hostile_records(server.url, victim)
    factory = SQLiteSandbox.factory(database)
    with RemoteCache(server.url, snapshot_policy=AlwaysSnapshot()) as cache, recorded() as messages:
        results = asyncio.run(rollout(cache, factory, [UPDATE_100, SELECT]))
        assert results[-1].output == "v\n100"
        assert server.service.counters["snapshots_evicted"] >= 1
    assert (victim / "precious.txt").read_text() == "not the cache's"
    assert len(list(victim.glob("dir-*/precious.txt"))) == 64
    assert warned(messages, "not deleting")


def test_a_symlink_planted_in_a_shared_snapshot_dir_does_not_lead_outside_it(
    server: Restartable, database: Path, tmp_path: Path
) -> None:
    """Clients sharing a snapshot directory free each other's snapshots in it, but only what really lies in it:
    a path through a directory link planted there (it resolves elsewhere) is not freed."""
    victim = victim_directory(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "planted").symlink_to(tmp_path, target_is_directory=True)
    attach_hostile_records(server.url, shared / "planted" / victim.name)
    with (
        RemoteCache(server.url, snapshot_policy=AlwaysSnapshot(), snapshot_dir=shared) as cache,
        recorded() as messages,
    ):
        asyncio.run(rollout(cache, SQLiteSandbox.factory(database), [UPDATE_100]))
    assert (victim / "precious.txt").exists()
    assert len(list(victim.glob("dir-*/precious.txt"))) == 64
    assert warned(messages, "not deleting")


def test_snapshots_of_a_shared_dir_are_still_freed_by_whichever_client_evicts_them(
    server: Restartable, tmp_path: Path
) -> None:
    """The other side of the rule: a snapshot one client made in the shared directory, evicted by another
    client's attach, is freed by that client (it lies in a directory it was told it owns)."""
    shared = tmp_path / "shared"
    server.restart(CacheService(budget=Budget(max_snapshots_per_task=1)))
    factory = KVFactory()
    with (
        RemoteCache(server.url, snapshot_policy=AlwaysSnapshot(), snapshot_dir=shared) as first,
        RemoteCache(server.url, snapshot_policy=AlwaysSnapshot(), snapshot_dir=shared) as second,
    ):
        asyncio.run(run_kv(first, factory, [("set", {"key": "a", "value": 1})]))
        made = [path for path in shared.rglob("*") if path.is_file()]
        assert len(made) == 1
        asyncio.run(run_kv(second, factory, [("set", {"key": "b", "value": 2})]))
        assert not made[0].exists()
        assert len([path for path in shared.rglob("*") if path.is_file()]) == 1


def test_a_record_naming_another_nodes_snapshot_is_refused_so_its_eviction_frees_nothing(
    server: Restartable, tmp_path: Path
) -> None:
    """Inside a shared snapshot directory every client frees what it is handed back, so the server must never
    hold two records of one path: a forged record naming client A's live snapshot, once evicted, would have
    another honest client delete A's data while A's node still holds it."""
    shared = tmp_path / "shared"
    factory = KVFactory()
    with RemoteCache(server.url, snapshot_policy=AlwaysSnapshot(), snapshot_dir=shared) as first:
        asyncio.run(run_kv(first, factory, [("set", {"key": "a", "value": 1})]))
        (made,) = [path for path in shared.rglob("*") if path.is_file()]
        with httpx.Client(base_url=server.url) as raw:
            call = {"name": "set", "arguments": {"key": "z", "value": 0}}
            node = raw.post(
                "/v1/insert", json={"task_id": "u", "parent": 0, "call": call, "output": "z=0", "seconds": 0.0}
            )
            for path in (str(made), f"{made.parent}/./{made.name}", f"{made.parent}/../{made.parent.name}/{made.name}"):
                snapshot = {"kind": "kv", "path": path, "bytes": 1}
                reply = raw.post(
                    "/v1/snapshots/attach",
                    json={"task_id": "u", "node_id": node.json()["node"]["id"], "snapshot": snapshot},
                )
                assert reply.status_code == 400, reply.text
                assert "attached to another node" in reply.json()["error"]["message"]
        assert server.service.cache.graph("u").snapshot_nodes == {}  # nothing attached, so nothing to evict
        assert made.exists()


async def run_kv(cache: Cache, factory: KVFactory, calls: list[tuple[str, dict]]) -> list:
    async with cache.session("t", sandbox=factory) as session:
        return [await session.call(name, arguments) for name, arguments in calls]


def test_a_durable_cache_frees_its_own_reloaded_snapshots_but_not_paths_its_journal_names_elsewhere(
    database: Path, tmp_path: Path
) -> None:
    """A journal is written by whoever had the directory before: records of snapshots in the cache's own
    snapshot directory are its own (freed on eviction after a reopen), a record naming any other path is not."""
    victim = victim_directory(tmp_path)
    root = tmp_path / "cache"
    factory = SQLiteSandbox.factory(database)
    with Cache(root, snapshot_policy=AlwaysSnapshot()) as cache:
        asyncio.run(rollout(cache, factory, [UPDATE_100]))
        own = [Path(node.snapshot.path) for node in cache.graph("t").nodes() if node.snapshot is not None]
    assert len(own) == 1
    assert own[0].exists()
    journal = Journal(root)
    for _ in journal.load():  # a journal takes appends once read to its end
        pass
    journal.append({"t": "n", "task": "t", "id": 2, "p": 0, "name": "sql", "a": '{"query":"SELECT 1"}',
                    "o": "x", "e": False, "s": 0.0, "r": False})  # fmt: skip
    journal.append({"t": "s", "task": "t", "id": 2, "snap": {"kind": "sqlite", "path": str(victim), "bytes": 1}})
    journal.close()
    with Cache(root, snapshot_policy=AlwaysSnapshot(), budget=Budget(max_snapshots_per_task=1)) as cache:
        assert len(cache.graph("t").snapshot_nodes) == 2
        with recorded() as messages:
            asyncio.run(rollout(cache, factory, [UPDATE_7]))
        assert len(cache.graph("t").snapshot_nodes) == 1
    assert (victim / "precious.txt").exists()
    assert not own[0].exists()  # its own snapshot, reloaded from its journal, was freed
    assert warned(messages, "not deleting")


def test_discard_snapshot_files_refuses_a_path_outside_the_root_it_is_given(tmp_path: Path) -> None:
    from tvcache.protocol import Snapshot, discard_snapshot_files

    victim = victim_directory(tmp_path)
    root = tmp_path / "snapshots"
    (root / "task").mkdir(parents=True)
    inside = root / "task" / "1-00000000"
    inside.mkdir()
    assert discard_snapshot_files(Snapshot(kind="x", path=str(victim), bytes=0), root=root) is False
    assert discard_snapshot_files(Snapshot(kind="x", path=str(root), bytes=0), root=root) is False
    escape = root / "task" / ".." / ".." / "victim"
    assert discard_snapshot_files(Snapshot(kind="x", path=str(escape), bytes=0), root=root) is False
    assert victim.exists()
    assert root.exists()
    assert discard_snapshot_files(Snapshot(kind="x", path=str(inside), bytes=0), root=root) is True
    assert not inside.exists()
    assert os.path.isdir(root / "task")
