"""Published snapshots without Ray: shell, SQLite and folder snapshots forked by another process through a
``DirectoryStore`` — after a durable cache restarts, or by another worker process of one ``tvcache serve``.

Every process is a real one: rollouts run in worker subprocesses (this file run as a script: a JSON spec as its
argument, one plan per line on stdin, one JSON report per line on stdout), shell sandboxes are real overlay
mounts (root on Linux >= 6.8), the server is a real ``tvcache serve``. A fork is told from a replay by the
sessions' own counters (sandboxes forked / started, calls replayed), as in ``tests/integrations/test_ray_shell.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tvcache import AlwaysSnapshot, Budget, Cache, DirectoryStore, PublishedSnapshots, RemoteCache
from tvcache.calls import ToolCall
from tvcache.errors import SandboxError
from tvcache.protocol import SandboxFactory, Snapshot
from tvcache.sandboxes import FolderSandbox, ShellSandbox, SQLiteSandbox
from tvcache.sandboxes.shell.linux import overlay_supported
from tvcache.snapshots import PUBLISHED, NodeCache, Publication, publication_available

from server_support import free_port, wait_until

Call = list[Any]  # [name, arguments]: JSON-friendly, as the workers read them
Plan = list[list[Any]]  # [[task_id, [call, ...]], ...]

needs_overlay = pytest.mark.skipif(not overlay_supported(), reason="overlay mounts need root on Linux >= 6.8")

# State-changing shell steps (a sleep makes replaying them cost more than forking: the sessions fork only then),
# and a read-only look at everything they changed: appended lines, a whiteout, an opaque directory, new files.
STEPS: list[Call] = [
    ["sh", {"cmd": "sleep 0.2 && echo one >> notes.txt && mkdir -p built && echo obj > built/a.o"}],
    ["sh", {"cmd": "sleep 0.2 && rm doomed.txt && echo two >> notes.txt"}],
    ["sh", {"cmd": "sleep 0.2 && rm -rf olddir && mkdir olddir && echo fresh > olddir/new.txt"}],
]
OTHER: list[Call] = [["sh", {"cmd": "sleep 0.2 && echo other >> notes.txt && rm -r built"}]]
INSPECT: list[Call] = [
    ["sh", {"cmd": "ls -A . olddir; cat notes.txt olddir/*; stat -c %n doomed.txt built/a.o 2>&1; echo done"}]
]


def make_base(root: Path) -> Path:
    base = root / "base"
    (base / "olddir").mkdir(parents=True)
    (base / "notes.txt").write_text("first\n")
    (base / "doomed.txt").write_text("to be deleted\n")
    (base / "olddir" / "old.txt").write_text("hidden by the opaque directory\n")
    return base


# ------------------------------------------------------------------ the worker process


def make_factory(spec: dict[str, Any]) -> tuple[PublishedSnapshots, SandboxFactory]:
    kind, source = spec["kind"], spec["source"]
    inner: SandboxFactory
    if kind == "shell":
        inner = ShellSandbox.factory(source, fallback=False, store_root=spec["layers"])
    elif kind == "sqlite":
        inner = SQLiteSandbox.factory(source, delay_seconds=0.05)
    else:
        inner = FolderSandbox.factory(source)
    store = DirectoryStore(spec["store"])
    return PublishedSnapshots(inner, store, cache=NodeCache(spec["node_cache"])), inner


def open_cache(spec: dict[str, Any]) -> Cache:
    if "url" in spec:
        return RemoteCache(spec["url"], snapshot_policy=AlwaysSnapshot(), claim_ttl=60)
    return Cache(spec["cache"], snapshot_policy=AlwaysSnapshot(), budget=Budget(max_snapshots_per_task=spec["budget"]))


def run_plan(cache: Cache, factory: PublishedSnapshots, plan: Plan) -> dict[str, Any]:
    rollouts = []
    for task_id, calls in plan:
        began = time.perf_counter()
        with cache.session_sync(task_id, sandbox=factory) as session:
            results = [session.call(name, arguments) for name, arguments in calls]
            stats = session.stats
        rollouts.append(
            {
                "outputs": [result.output for result in results],
                "hits": [result.hit for result in results],
                "started": stats.sandboxes_started,
                "forked": stats.sandboxes_forked,
                "replayed": stats.calls_replayed,
                "seconds": time.perf_counter() - began,
            }
        )
    report: dict[str, Any] = {
        "rollouts": rollouts,
        "published": factory.published,
        "swept": factory.swept,
        "node_fetched": factory.cache.fetched,
    }
    layers = factory.layer_cache
    if layers is not None:
        layers.check_invariants()
        live = layers.layers.live_layers()
        report |= {
            "fetched": layers.fetched,
            "reused": layers.reused,
            "uploaded": layers.uploaded,
            "shared": layers.shared,
            "live_layers": {str(layer.path): layers.digest_of(layer) for layer in live},
        }
    return report


def worker_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    factory, inner = make_factory(spec)
    cache = open_cache(spec)
    try:
        for line in sys.stdin:
            print(json.dumps(run_plan(cache, factory, json.loads(line))), flush=True)
    finally:
        cache.close()
        close = getattr(inner, "close", None)
        if close is not None:
            close()


class Worker:
    """A worker subprocess: ``run(plan)`` sends it a plan and returns its report (bounded wait)."""

    def __init__(self, spec: dict[str, Any], log: Path) -> None:
        self.log = log
        self._stderr = log.open("w")
        self.process = subprocess.Popen(
            [sys.executable, __file__, json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )

    def run(self, plan: Plan, *, timeout: float = 120.0) -> dict[str, Any]:
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.write(json.dumps(plan) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.process.kill()
            raise AssertionError(f"worker gave no report within {timeout} s: {self.log.read_text()[-3000:]}")
        report: dict[str, Any] = json.loads(line)
        return report

    def close(self) -> int:
        """End the worker (it exits when its stdin closes); returns its exit status."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            return self.process.wait(60)
        finally:
            self._stderr.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is not None:  # the test failed: its error is the news, not the worker's exit status
            self.process.kill()
            self.close()
            return
        code = self.close()
        assert code == 0, f"worker exited with {code}: {self.log.read_text()[-3000:]}"


def spec_for(tmp_path: Path, name: str, *, kind: str = "shell", source: Path, **where: Any) -> dict[str, Any]:
    """A worker's spec: its own layer store and node cache (as a separate process or machine has), the shared
    store, and where the cache is (``cache``: a durable directory, or ``url``: a server)."""
    return {
        "kind": kind,
        "source": str(source),
        "store": str(tmp_path / "store"),
        "layers": str(tmp_path / f"layers-{name}"),
        "node_cache": str(tmp_path / f"node-cache-{name}"),
        "budget": 64,
        **where,
    }


def uncached(factory: SandboxFactory, calls: list[Call]) -> list[str]:
    """The outputs of ``calls`` in a fresh sandbox: no cache, no snapshot."""

    async def main() -> list[str]:
        sandbox = await factory.start()
        try:
            return [(await sandbox.execute(ToolCall(name, arguments))).output for name, arguments in calls]
        finally:
            await sandbox.stop()

    try:
        return asyncio.run(main())
    finally:
        close = getattr(factory, "close", None)
        if close is not None:
            close()


def shell_uncached(base: Path, calls: list[Call], layers: Path) -> list[str]:
    return uncached(ShellSandbox.factory(base, fallback=False, store_root=layers), calls)


def live_publications(cache_dir: Path, **options: Any) -> dict[str, Publication]:
    """The publications of the snapshot records a durable cache (or a server's data directory) holds."""
    found = {}
    with Cache(cache_dir, **options) as cache:
        for task_id in cache.tasks():
            for node in cache.graph(task_id).snapshot_nodes.values():
                assert node.snapshot is not None
                publication = Publication.of(node.snapshot)
                assert publication is not None
                found[publication.publication] = publication
    return found


def assert_no_leak(store: DirectoryStore, live: dict[str, Publication]) -> None:
    """The store holds exactly the blobs of the live records, each referenced by exactly their publications."""
    store.check_invariants()
    assert store.publications() == set(live)
    blobs = {digest for publication in live.values() for digest in publication.blobs()}
    references = sum(len(publication.blobs()) for publication in live.values())
    assert store.stats() == {"blobs": len(blobs), "references": references}


# ------------------------------------------------------------------ a durable cache restarted


@needs_overlay
def test_a_restarted_cache_forks_the_shell_snapshots_its_last_process_published(tmp_path: Path) -> None:
    base = make_base(tmp_path)
    spec = spec_for(tmp_path, "first", source=base, cache=str(tmp_path / "cache"))
    with Worker(spec, tmp_path / "first.log") as first:
        made = first.run([["task", STEPS]])
    assert made["published"] == 3
    assert (made["uploaded"], made["shared"]) == (3, 3)  # one new layer per snapshot, the lower ones referenced

    # The first process is gone, and its layers with it; the records stay, because the store holds their data.
    with Cache(tmp_path / "cache") as reopened:
        nodes = list(reopened.graph("task").snapshot_nodes.values())
        assert len(nodes) == 3
        assert not any(node.snapshot is not None and node.snapshot.exists() for node in nodes)

    second_spec = spec_for(tmp_path, "second", source=base, cache=str(tmp_path / "cache"))
    with Worker(second_spec, tmp_path / "second.log") as second:
        seen = second.run([["task", STEPS + INSPECT], ["task", STEPS[:1] + OTHER + INSPECT]])
    deep, shallow = seen["rollouts"]
    assert deep["hits"] == [True, True, True, False]
    assert shallow["hits"] == [True, False, False]
    for rollout in (deep, shallow):
        assert (rollout["forked"], rollout["started"], rollout["replayed"]) == (1, 0, 0)
    assert (seen["fetched"], seen["reused"]) == (3, 1)  # the shallow fork reuses the layer the deep one fetched
    assert deep["outputs"] == shell_uncached(base, STEPS + INSPECT, tmp_path / "layers-uncached")
    assert shallow["outputs"] == shell_uncached(base, STEPS[:1] + OTHER + INSPECT, tmp_path / "layers-uncached")
    assert "doomed.txt': No such file" in deep["outputs"][3]  # a whiteout came through the store
    assert "old.txt" not in deep["outputs"][3]  # so did an opaque directory


@needs_overlay
def test_a_reopened_cache_drops_the_records_whose_published_data_is_gone(tmp_path: Path) -> None:
    base = make_base(tmp_path)
    spec = spec_for(tmp_path, "first", source=base, cache=str(tmp_path / "cache"))
    with Worker(spec, tmp_path / "first.log") as first:
        first.run([["task", [["sh", {"cmd": "echo 1 > a"}], ["sh", {"cmd": "echo 2 > b"}]]]])
    publications = sorted(live_publications(tmp_path / "cache").values(), key=lambda p: len(p.layers))
    assert [len(publication.layers) for publication in publications] == [1, 2]
    store = DirectoryStore(tmp_path / "store")

    top = publications[1].layers[0].digest  # the deeper snapshot's own layer: only its publication has it
    (store.root / "blobs" / top[:2] / top).unlink()
    live = live_publications(tmp_path / "cache")
    assert set(live) == {publications[0].publication}
    assert_no_leak(store, live)  # the dropped record's references on the lower layer went with it

    shutil.rmtree(store.root)
    assert live_publications(tmp_path / "cache") == {}


@pytest.mark.parametrize("kind", ["sqlite", "folder"])
def test_sqlite_and_folder_snapshots_are_forked_from_the_store_after_a_restart(kind: str, tmp_path: Path) -> None:
    if kind == "sqlite":
        source = tmp_path / "app.db"
        with sqlite3.connect(source) as db:
            db.execute("CREATE TABLE t (x INTEGER)")
            db.execute("INSERT INTO t VALUES (1), (2)")
        db.close()
        steps: list[Call] = [
            ["sql", {"query": "INSERT INTO t VALUES (3)"}],
            ["sql", {"query": "UPDATE t SET x = x * 10"}],
        ]
        look: list[Call] = [["sql", {"query": "SELECT x FROM t ORDER BY x"}]]
        reference: SandboxFactory = SQLiteSandbox.factory(source)
    else:
        source = tmp_path / "template"
        source.mkdir()
        (source / "notes.txt").write_text("first\n")
        steps = [
            ["sh", {"cmd": "sleep 0.2 && echo one >> notes.txt"}],
            ["sh", {"cmd": "sleep 0.2 && chmod 4750 notes.txt"}],
        ]
        look = [["sh", {"cmd": "cat notes.txt; stat -c %A notes.txt"}]]
        reference = FolderSandbox.factory(source)

    spec = spec_for(tmp_path, "first", kind=kind, source=source, cache=str(tmp_path / "cache"))
    with Worker(spec, tmp_path / "first.log") as first:
        assert first.run([["task", steps]])["published"] == 2
    shutil.rmtree(tmp_path / "node-cache-first")  # as a reboot clearing /tmp would: only the store has the data

    second_spec = spec_for(tmp_path, "second", kind=kind, source=source, cache=str(tmp_path / "cache"))
    with Worker(second_spec, tmp_path / "second.log") as second:
        seen = second.run([["task", steps + look]])
    (rollout,) = seen["rollouts"]
    assert rollout["hits"] == [True, True, False]
    assert (rollout["forked"], rollout["started"], rollout["replayed"]) == (1, 0, 0)
    assert seen["node_fetched"] == 1
    assert rollout["outputs"] == uncached(reference, steps + look)


def test_the_session_weighs_local_and_fetching_forks_apart(tmp_path: Path) -> None:
    """After a slow fetch, a snapshot whose data this process already holds is still forked, not replayed."""
    source = tmp_path / "app.db"
    with sqlite3.connect(source) as db:
        db.execute("CREATE TABLE t (x INTEGER)")
    db.close()
    store = DirectoryStore(tmp_path / "store")
    maker = PublishedSnapshots(SQLiteSandbox.factory(source), store, cache=NodeCache(tmp_path / "maker"), node_id="a")
    other = PublishedSnapshots(SQLiteSandbox.factory(source), store, cache=NodeCache(tmp_path / "other"), node_id="b")
    cache = Cache(snapshot_policy=AlwaysSnapshot())
    step = ["sql", {"query": "INSERT INTO t VALUES (1)"}]
    looks = iter(range(3))

    async def rollout(factory: PublishedSnapshots) -> tuple[int, int]:
        async with cache.session("task", sandbox=factory) as session:
            await session.call(*step)
            await session.call("sql", {"query": f"SELECT count(*) + {next(looks)} FROM t"})  # a miss each time
            return session.stats.sandboxes_forked, session.stats.sandboxes_started

    async def main() -> list[tuple[int, int]]:
        await rollout(maker)  # publishes the snapshot after the insert
        costs = cache.costs(other)
        costs.observe("start", 0.01)
        costs.observe("fork", 0.001)
        costs.observe("fetching_fork", 60.0)  # say fetching is slow: replaying (from a start) is cheaper
        first = await rollout(other)  # the data is not on "b": start and replay
        snapshot = cache.graph("task").match([ToolCall(*step)]).node.snapshot
        assert snapshot is not None
        await asyncio.to_thread(other.cache.fetch, Publication.of(snapshot).digest, "file", store)  # type: ignore[union-attr]
        second = await rollout(other)  # now it is: fork
        return [first, second]

    assert asyncio.run(main()) == [(0, 1), (1, 0)]
    cache.close()


@needs_overlay
def test_evicted_snapshots_release_their_blobs_in_every_process(tmp_path: Path) -> None:
    """A budget of two snapshots per task: the first process evicts its own snapshots, the second (after a
    restart) evicts the first's, and the store ends up holding exactly the live records' blobs."""
    base = make_base(tmp_path)
    branch = [
        [["sh", {"cmd": f"sleep 0.05 && echo {n} > f{n}"}], ["sh", {"cmd": f"echo {n} >> notes.txt"}]] for n in range(4)
    ]
    spec = spec_for(tmp_path, "first", source=base, cache=str(tmp_path / "cache"), budget=2)
    with Worker(spec, tmp_path / "first.log") as first:
        made = first.run([["task", calls] for calls in branch[:3]])
    assert made["published"] == 6
    store = DirectoryStore(tmp_path / "store")
    live = live_publications(tmp_path / "cache")
    assert len(live) == 2
    assert_no_leak(store, live)
    # The maker held the layers of its two live snapshots and no others: evicting released them in place.
    assert set(made["live_layers"].values()) == {digest for p in live.values() for digest in p.blobs()}
    before = set(store.publications())

    second_spec = spec_for(tmp_path, "second", source=base, cache=str(tmp_path / "cache"), budget=2)
    with Worker(second_spec, tmp_path / "second.log") as second:
        seen = second.run([["task", calls] for calls in branch[2:]] + [["task", branch[0][:1] + INSPECT]])
    assert seen["published"] >= 2
    live = live_publications(tmp_path / "cache")
    assert len(live) == 2
    assert before - set(live)  # the first process's records were evicted by the second, and released
    assert_no_leak(store, live)


# ------------------------------------------------------------------ two workers of one server


class Server:
    """A real ``tvcache serve`` on a free port with a durable data directory."""

    def __init__(self, data_dir: Path, *options: str) -> None:
        self.data_dir = data_dir
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = data_dir.with_suffix(".log")
        command = [sys.executable, "-m", "tvcache.cli", "serve", "--port", str(port), "--data-dir", str(data_dir)]
        with self.log.open("w") as log:  # a file, not a pipe: nobody reads it while the server runs
            self.process = subprocess.Popen([*command, *options], stdout=log, stderr=subprocess.STDOUT)

        def healthy() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"server exited: {self.log.read_text()[-3000:]}")
            try:
                return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, timeout=20, interval=0.02)

    def snapshot_at(self, task_id: str, calls: list[Call]) -> Publication | None:
        """The publication of the snapshot the server holds at the end of ``calls`` (None: no snapshot)."""
        history = [{"name": name, "arguments": arguments} for name, arguments in calls]
        reply = httpx.post(f"{self.url}/v1/lookup", json={"task_id": task_id, "history": history}, timeout=10)
        node = reply.json()["node"]
        assert reply.json()["hit"]
        return None if node["snapshot"] is None else Publication.of(Snapshot.from_json(node["snapshot"]))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(20)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[list[Server]]:
    servers: list[Server] = []
    yield servers
    for server in servers:
        server.stop()


@needs_overlay
def test_two_workers_of_one_server_fork_each_others_shell_snapshots(tmp_path: Path, serve: list[Server]) -> None:
    base = make_base(tmp_path)
    server = Server(tmp_path / "server")
    serve.append(server)
    with (
        Worker(spec_for(tmp_path, "a", source=base, url=server.url), tmp_path / "a.log") as a,
        Worker(spec_for(tmp_path, "b", source=base, url=server.url), tmp_path / "b.log") as b,
    ):
        made = a.run([["task", STEPS]])
        assert made["published"] == 3

        # B forks A's three-layer stack (A still running), fetching its layers from the store.
        seen = b.run([["task", STEPS + INSPECT]])
        (deep,) = seen["rollouts"]
        assert deep["hits"] == [True, True, True, False]
        assert (deep["forked"], deep["started"], deep["replayed"]) == (1, 0, 0)
        assert (seen["fetched"], seen["reused"]) == (3, 0)

        # B's own snapshot over A's lower layers, then A forks that: it fetches only B's new layer.
        seen = b.run([["task", STEPS[:2] + OTHER]])
        (branch,) = seen["rollouts"]
        assert (branch["forked"], branch["started"], branch["replayed"]) == (1, 0, 0)
        assert (seen["published"], seen["uploaded"]) == (1, 1)
        back = a.run([["task", STEPS[:2] + OTHER + INSPECT]])
        (mine,) = back["rollouts"]
        assert mine["hits"] == [True, True, True, False]
        assert (mine["forked"], mine["started"], mine["replayed"]) == (1, 0, 0)
        assert (back["fetched"], back["reused"]) == (1, 2)  # A's own two layers, found by their digests

    uncached_layers = tmp_path / "layers-uncached"
    assert deep["outputs"] == shell_uncached(base, STEPS + INSPECT, uncached_layers)
    assert branch["outputs"] == shell_uncached(base, STEPS[:2] + OTHER, uncached_layers)
    assert mine["outputs"] == shell_uncached(base, STEPS[:2] + OTHER + INSPECT, uncached_layers)


@needs_overlay
def test_a_maker_frees_its_layers_of_a_snapshot_another_worker_evicted(tmp_path: Path, serve: list[Server]) -> None:
    """The server evicts A's snapshot while B attaches one (budget: two per task); B releases the store's blobs,
    and A, which alone holds the snapshot's overlay layers, frees them when it next publishes."""
    base = make_base(tmp_path)
    server = Server(tmp_path / "server", "--max-snapshots-per-task", "2")
    serve.append(server)
    x = [["sh", {"cmd": "sleep 0.1 && echo x > x"}]]
    y = [["sh", {"cmd": "sleep 0.1 && echo y > y"}]]
    x2 = [["sh", {"cmd": "echo x2 >> x"}]]
    z = [["sh", {"cmd": "echo z > z"}]]
    store = DirectoryStore(tmp_path / "store")
    with (
        Worker(spec_for(tmp_path, "a", source=base, url=server.url), tmp_path / "a.log") as a,
        Worker(spec_for(tmp_path, "b", source=base, url=server.url), tmp_path / "b.log") as b,
    ):
        made = a.run([["task", x], ["task", y]])
        layers_of = {digest: path for path, digest in made["live_layers"].items()}
        assert len(layers_of) == 2
        publications = [server.snapshot_at("task", x), server.snapshot_at("task", y)]

        seen = b.run([["task", x + x2]])  # forks A's x snapshot; attaching its own evicts one of A's
        assert seen["rollouts"][0]["forked"] == 1
        evicted = [p for p, calls in zip(publications, (x, y), strict=True) if not server.snapshot_at("task", calls)]
        assert len(evicted) == 1
        (gone,) = evicted
        assert gone is not None
        assert store.holds([(gone.layers[0].digest, gone.publication)]) == [False]  # B released the blobs ...
        orphan = Path(layers_of[gone.layers[0].digest])
        assert orphan.is_dir()  # ... but only A can release its layer

        again = a.run([["task", z]])  # publishing sweeps first
        assert again["swept"] == 1
        assert not orphan.exists()
        assert str(orphan) not in again["live_layers"]
        assert_no_leak(store, {p.publication: p for p in _live_on(server, [x, y, x + x2, z]) if p is not None})
    server.stop()
    assert_no_leak(store, live_publications(server.data_dir, verify_snapshots=False))


@needs_overlay
def test_a_worker_releases_the_blobs_of_a_snapshot_whose_maker_has_exited(tmp_path: Path, serve: list[Server]) -> None:
    base = make_base(tmp_path)
    server = Server(tmp_path / "server", "--max-snapshots-per-task", "1")
    serve.append(server)
    x = [["sh", {"cmd": "sleep 0.1 && echo x > x"}]]
    y = [["sh", {"cmd": "echo y > y"}]]
    store = DirectoryStore(tmp_path / "store")
    with Worker(spec_for(tmp_path, "a", source=base, url=server.url), tmp_path / "a.log") as a:
        a.run([["task", x]])
    made = server.snapshot_at("task", x)
    assert made is not None
    with Worker(spec_for(tmp_path, "b", source=base, url=server.url), tmp_path / "b.log") as b:
        b.run([["task", y]])  # its snapshot evicts A's (budget one per task); A's layers are long gone
    assert server.snapshot_at("task", x) is None
    assert store.holds([(made.layers[0].digest, made.publication)]) == [False]
    assert_no_leak(store, {p.publication: p for p in _live_on(server, [x, y]) if p is not None})


@needs_overlay
def test_the_published_benchmark_runs_and_reports_each_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tvcache.cli import main

    report = tmp_path / "bench.json"
    assert main(["bench", "published", "--layers", "5x0", "--publish-repeats", "1", "--json", str(report)]) == 0
    (row,) = json.loads(report.read_text()).values()
    assert set(row) == {
        f"{name}_ms_p50" for name in ("publish", "step", "fork (fetch)", "fork (held)", "start + replay")
    }
    assert "replay/fetch" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="FILESxMIB"):
        main(["bench", "published", "--layers", "many"])


def _live_on(server: Server, paths: list[list[Call]]) -> list[Publication | None]:
    return [server.snapshot_at("task", calls) for calls in paths]


if __name__ == "__main__":
    worker_main(sys.argv[1])


# ------------------------------------------------------------------ exactness, failures, forged records


def folder_factories(tmp_path: Path, store: DirectoryStore) -> tuple[PublishedSnapshots, PublishedSnapshots]:
    """Two nodes' factories over one template and one store: ``here`` makes snapshots, ``there`` fetches them."""
    template = tmp_path / "template"
    template.mkdir(exist_ok=True)
    here = PublishedSnapshots(FolderSandbox.factory(template), store, cache=NodeCache(tmp_path / "nc-a"), node_id="a")
    there = PublishedSnapshots(FolderSandbox.factory(template), store, cache=NodeCache(tmp_path / "nc-b"), node_id="b")
    return here, there


async def run_sh(sandbox: Any, command: str) -> str:
    return str((await sandbox.execute(ToolCall("sh", {"cmd": command}))).output)


def test_folder_snapshots_that_differ_in_nanoseconds_or_xattrs_each_fork_as_themselves(tmp_path: Path) -> None:
    here, _ = folder_factories(tmp_path, DirectoryStore(tmp_path / "store"))
    (tmp_path / "template" / "f").write_text("same bytes\n")
    look = "stat -c '%n %y' f; python3 -c \"import os; print(os.getxattr('f', 'user.tag'))\""

    async def main() -> list[tuple[str, str]]:
        seen = []
        for stamp, tag in [("00.123456789", "one"), ("00.123456750", "two")]:
            sandbox = await here.start()
            setxattr = f"python3 -c \"import os; os.setxattr('f', 'user.tag', b'{tag}')\""
            await run_sh(sandbox, f'{setxattr}; touch -d "2020-01-01 00:00:{stamp}" f')
            snapshot = await sandbox.snapshot(tmp_path / f"snap-{tag}")
            truth = await run_sh(sandbox, look)
            fork = await here.fork(snapshot)
            seen.append((truth, await run_sh(fork, look)))
            await fork.stop()
            await sandbox.stop()
        return seen

    (one_truth, one_fork), (two_truth, two_fork) = asyncio.run(main())
    assert one_truth != two_truth
    assert (one_fork, two_fork) == (one_truth, two_truth)  # the second is not forked as the first


def test_a_folder_fork_fetched_on_another_node_shows_what_the_uncached_sandbox_showed(tmp_path: Path) -> None:
    here, there = folder_factories(tmp_path, DirectoryStore(tmp_path / "store"))
    step = 'touch -d "2020-01-01 00:00:00.123456789" f; mkdir -p d; touch -d "2021-01-01 00:00:00.987654321" d/g'
    step += "; echo x > h; ln h h2; python3 -c \"import os; os.setxattr('h', 'user.k', b'v')\""
    if os.geteuid() == 0:
        step += "; chown 4242:4243 h"
    look = "stat -c '%n %y %u:%g %h %a' . f d d/g h h2; python3 -c \"import os; print(os.getxattr('h', 'user.k'))\""

    async def main() -> tuple[str, str, str]:
        sandbox = await here.start()
        await run_sh(sandbox, step)
        snapshot = await sandbox.snapshot(tmp_path / "snap")
        assert not there.fork_is_local(snapshot)
        local, fetched = await here.fork(snapshot), await there.fork(snapshot)
        seen = (await run_sh(sandbox, look), await run_sh(local, look), await run_sh(fetched, look))
        for each in (sandbox, local, fetched):
            await each.stop()
        return seen

    uncached, local, fetched = asyncio.run(main())
    assert local == uncached
    assert fetched == uncached


def test_a_snapshot_that_cannot_be_published_leaves_no_files_and_names_the_store(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "store")
    here, _ = folder_factories(tmp_path, store)
    shutil.rmtree(store.root)  # deleted under a running process
    cache = Cache(tmp_path / "cache", snapshot_policy=AlwaysSnapshot())
    with (
        pytest.warns(RuntimeWarning, match=rf"SandboxError.*snapshot store {store.root}: .*deleted or moved"),
        cache.session_sync("task", sandbox=here) as session,
    ):
        outputs = [session.call("sh", {"cmd": command}).output for command in ["echo 1 > a", "cat a"]]
    assert outputs == ["", "1\n"]  # the rollout goes on, without snapshots
    assert cache.stats().snapshots == 0
    assert list(cache.snapshot_root.glob("*/*")) == []  # nor the inner snapshots' folders
    assert [path.name for path in (tmp_path / "nc-a").iterdir() if not path.name.endswith(".lock")] == []
    cache.close()


def test_a_reopened_cache_releases_what_a_dropped_record_still_references(tmp_path: Path) -> None:
    source = tmp_path / "app.db"
    with sqlite3.connect(source) as db:
        db.execute("CREATE TABLE t (x INTEGER)")
    db.close()
    store = DirectoryStore(tmp_path / "store")
    factory = PublishedSnapshots(SQLiteSandbox.factory(source), store, cache=NodeCache(tmp_path / "node-cache"))
    with (
        Cache(tmp_path / "cache", snapshot_policy=AlwaysSnapshot()) as cache,
        cache.session_sync("task", sandbox=factory) as session,
    ):
        session.call("sql", {"query": "INSERT INTO t VALUES (1)"})
    ((digest, publication),) = [(path.parent.name, path.name) for path in (store.root / "refs").glob("*/*")]
    shutil.rmtree(tmp_path / "node-cache")  # the node rebooted ...
    (store.root / "blobs" / digest[:2] / digest).unlink()  # ... and the store lost the blob

    with Cache(tmp_path / "cache") as reopened:
        assert reopened.stats().snapshots == 0  # dropped: its data is gone
    assert store.publications() == set()  # and its reference released: no process ever would otherwise
    store.check_invariants()


def test_a_factory_never_releases_into_a_store_the_record_does_not_name(tmp_path: Path) -> None:
    source = tmp_path / "app.db"
    with sqlite3.connect(source) as db:
        db.execute("CREATE TABLE t (x INTEGER)")
    db.close()
    store_a, store_b = DirectoryStore(tmp_path / "store-a"), DirectoryStore(tmp_path / "store-b")
    a = PublishedSnapshots(SQLiteSandbox.factory(source), store_a, cache=NodeCache(tmp_path / "nc-a"), node_id="a")
    b = PublishedSnapshots(SQLiteSandbox.factory(source), store_b, cache=NodeCache(tmp_path / "nc-b"), node_id="b")

    async def snapshots() -> list[Snapshot]:
        made = []
        for n in range(2):
            sandbox = await a.start()
            await sandbox.execute(ToolCall("sql", {"query": f"INSERT INTO t VALUES ({n})"}))
            made.append(await sandbox.snapshot(tmp_path / f"snap-{n}.db"))
            await sandbox.stop()
        return made

    first, second = asyncio.run(snapshots())
    # the same digest and publication id in store B: a release there would be the wrong store's reference
    publication = Publication.of(first)
    assert publication is not None
    store_b.put(publication.digest, store_a.get(publication.digest) or b"", publication.publication)
    with pytest.warns(RuntimeWarning, match="every process that forks or evicts the cache's snapshots must use one"):
        b.discard(first)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per factory
        b.discard(second)
    assert store_a.stats() == {"blobs": 2, "references": 2}  # not released: B cannot reach A's store
    assert store_b.stats() == {"blobs": 1, "references": 1}  # and nothing released in B's own


def test_forged_records_are_refused_and_touch_nothing(tmp_path: Path) -> None:
    source = tmp_path / "app.db"
    with sqlite3.connect(source) as db:
        db.execute("CREATE TABLE t (x INTEGER)")
    db.close()
    store = DirectoryStore(tmp_path / "store")
    factory = PublishedSnapshots(SQLiteSandbox.factory(source), store, cache=NodeCache(tmp_path / "nc"), node_id="a")
    victim = tmp_path / "victim"
    victim.mkdir()
    (store.root / "refs" / "00").mkdir()

    def record(**fields: Any) -> Snapshot:
        data = {"digest": "ab" * 32, "format": "file", "node": "b", "publication": "cd" * 8, "store": store.name}
        return Snapshot(kind="sqlite", path="/nonexistent", bytes=0, meta={PUBLISHED: data | fields})

    forged = [
        record(digest="../victim"),
        record(digest="00", publication="../../../victim"),
        record(format="layers", layers=[{"digest": "../../victim"}], base=str(source)),
        record(publication=None),
        Snapshot(kind="sqlite", path="/nonexistent", bytes=0, meta={PUBLISHED: "not a record"}),
    ]
    for snapshot in forged:
        with pytest.raises(SandboxError, match="corrupt or forged|malformed"):
            asyncio.run(factory.fork(snapshot))
        assert not publication_available(snapshot)
        with pytest.warns(RuntimeWarning, match="not releasing an evicted snapshot"):
            factory.discard(snapshot)
    assert victim.is_dir()
    assert (store.root / "refs" / "00").is_dir()


def test_folder_trees_published_by_an_older_tvcache_are_replayed_not_forked(tmp_path: Path) -> None:
    """Before format ``tree``, folders were published as Python tar archives (``tar``), whose addresses two
    different trees could share: such records are never forked, and a reopened cache drops them."""
    store = DirectoryStore(tmp_path / "store")
    here, _ = folder_factories(tmp_path, store)
    (tmp_path / "nc-a" / ("ab" * 32)).mkdir()  # the old entry, still on this node
    legacy = {"digest": "ab" * 32, "format": "tar", "node": "a", "publication": "cd" * 8, "store": store.name}
    snapshot = Snapshot(kind="folder", path=str(tmp_path / "nc-a" / ("ab" * 32)), bytes=0, meta={PUBLISHED: legacy})
    with pytest.raises(SandboxError, match="older tvcache as a Python tar archive"):
        asyncio.run(here.fork(snapshot))
    assert here.fork_is_local(snapshot)  # nothing to fetch: the fork fails at once, and the session drops it
    assert not publication_available(snapshot)
