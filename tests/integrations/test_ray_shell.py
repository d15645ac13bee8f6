"""Shell sandbox snapshots across nodes: each overlay layer published as its own content-addressed blob, fetched,
verified and adopted into another process's layer store, and forked there without replaying.

First without Ray (two factories with their own layer stores stand in for two processes, a ``DirectoryStore`` for
the shared store), then on a real two-node ``ray.cluster_utils.Cluster`` with rollouts pinned to each node, as in
``test_ray.py``. Sandboxes are real overlay mounts: these tests need root on Linux >= 6.8."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
pytest.importorskip("ray", reason="the 'ray' extra is not installed: pip install 'tvcache[ray]'")

import ray  # noqa: E402
import ray.cloudpickle  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from tvcache import AlwaysSnapshot, SandboxError, ToolCall  # noqa: E402
from tvcache.integrations.ray import (  # noqa: E402
    DirectoryStore,
    PublishedSnapshots,
    RayCache,
    RayObjectStore,
    start_shards,
)
from tvcache.protocol import Sandbox, Snapshot  # noqa: E402
from tvcache.sandboxes import ShellSandbox, ShellSandboxFactory  # noqa: E402
from tvcache.sandboxes.shell.layer_archive import LayerRef, pack_layer, unpack_layer  # noqa: E402
from tvcache.sandboxes.shell.linux import overlay_supported  # noqa: E402
from tvcache.snapshots import PUBLISHED  # noqa: E402


def lookup(cache: RayCache, task_id: str, history: list[dict[str, Any]]) -> dict[str, Any]:
    """``POST /v1/lookup`` of ``history`` on the shard that holds ``task_id``, through the shard's transport."""
    transport = cache.transports[cache.shard_name(task_id)]
    with httpx.Client(base_url="http://shard", transport=transport) as client:
        reply: dict[str, Any] = client.post("/v1/lookup", json={"task_id": task_id, "history": history}).json()
    return reply


pytestmark = pytest.mark.skipif(not overlay_supported(), reason="overlay mounts need root on Linux >= 6.8")

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

MiB = 1024 * 1024
Calls = list[tuple[str, dict[str, Any]]]

# A rollout's state-changing steps over the base tree of ``make_base``: a whiteout (a deleted base file), an opaque
# directory (a base directory deleted and made again), symlinks (relative and absolute), a setuid mode, an owner,
# empty directories; then whiteouts in a higher layer of a directory and of an entry below. (No hard links: a
# sandbox declines to snapshot hard links it made; the base tree's own reach a layer through a squash.)
STEPS: Calls = [
    (
        "sh",
        {
            "cmd": "rm doomed.txt && rm -rf olddir && mkdir olddir && echo fresh > olddir/new.txt"
            " && ln -s notes.txt link && chown 1234:99 script.sh && chmod 4750 script.sh"
            " && mkdir -p empty/nested && echo one >> notes.txt"
        },
    ),
    ("sh", {"cmd": "echo two >> notes.txt && mkdir built && echo obj > built/a.o && ln -s /usr/bin/env abs-link"}),
    ("sh", {"cmd": "rm -rf built && rmdir empty/nested && echo three >> notes.txt"}),
    ("sh", {"cmd": "echo four >> notes.txt"}),
]
# Read-only: everything a lost whiteout, opaque flag, link, mode or owner would change (no times: an uncached
# run makes its files later; no directory sizes: they depend on the filesystem under the upper layer).
INSPECT: Calls = [
    (
        "sh",
        {
            "cmd": "ls -A; cat notes.txt link; ls -A olddir empty; cat olddir/new.txt; readlink link abs-link;"
            " stat -c '%n %A %u:%g' . olddir empty; stat -c %n doomed.txt built empty/nested olddir/old.txt 2>&1;"
            " ls -lan --time-style=+ script.sh hard keep.txt link notes.txt olddir/new.txt"
        },
    )
]


def make_base(root: Path) -> Path:
    base = root / "base"
    (base / "olddir").mkdir(parents=True)
    (base / "notes.txt").write_text("first\n")
    (base / "doomed.txt").write_text("to be deleted\n")
    (base / "olddir" / "old.txt").write_text("hidden by the opaque directory\n")
    (base / "script.sh").write_text("#!/bin/sh\necho hi\n")
    (base / "script.sh").chmod(0o755)
    os.setxattr(base / "script.sh", "user.tvcache-test", b"\xffbinary\x00")  # copied up into a layer by chown
    (base / "keep.txt").write_text("linked\n")
    os.link(base / "keep.txt", base / "hard")  # never written: both names stay in the base layer
    return base


def shell_factory(base: Path, store_root: Path | None = None, **options: Any) -> ShellSandboxFactory:
    factory = ShellSandbox.factory(base, fallback=False, store_root=store_root, **options)
    assert isinstance(factory, ShellSandboxFactory)
    return factory


async def run_calls(sandbox: Sandbox, calls: Calls) -> list[str]:
    return [(await sandbox.execute(ToolCall(name, arguments))).output for name, arguments in calls]


async def run_uncached(base: Path, calls: Calls) -> list[str]:
    """The outputs of ``calls`` in a fresh sandbox, no snapshot and no cache anywhere."""
    factory = shell_factory(base)
    sandbox = await factory.start()
    try:
        return await run_calls(sandbox, calls)
    finally:
        await sandbox.stop()
        factory.close()


def uncached(base: Path, calls: Calls) -> list[str]:
    return asyncio.run(run_uncached(base, calls))


def tree(root: Path) -> dict[str, tuple[Any, ...]]:
    """What a layer holds, by relative path: type and mode, owner, size, mtime, device, link target, hard-link
    group, and the extended attributes a layer publication keeps."""
    entries: dict[str, tuple[Any, ...]] = {}
    inodes: dict[int, str] = {}
    for directory, dirs, files in os.walk(root):
        for name in [".", *dirs, *files] if directory == str(root) else [*dirs, *files]:
            path = os.path.normpath(os.path.join(directory, name))
            info = os.lstat(path)
            relative = os.path.relpath(path, root)
            group = inodes.setdefault(info.st_ino, relative) if info.st_nlink > 1 else None
            xattrs = {
                key: os.getxattr(path, key, follow_symlinks=False)
                for key in os.listxattr(path, follow_symlinks=False)
                if key.split(".")[-1] not in ("origin", "uuid", "impure")
            }
            target = os.readlink(path) if os.path.islink(path) else None
            fields = (info.st_mode, info.st_uid, info.st_gid, info.st_mtime_ns, info.st_rdev, target, group, xattrs)
            entries[relative] = (*fields, info.st_size if not os.path.isdir(path) else None)
    return entries


# ------------------------------------------------------------------ without Ray


def test_a_layer_archive_is_canonical_and_keeps_what_overlay_needs(tmp_path: Path) -> None:
    base = make_base(tmp_path)
    factory = shell_factory(base, tmp_path / "layers")

    async def main() -> Snapshot:
        sandbox = await factory.start()
        await run_calls(sandbox, [STEPS[0], ("sh", {"cmd": "mkfifo pipe && echo h > h1"})])
        snapshot = await sandbox.snapshot(tmp_path / "snap")
        await sandbox.stop()
        return snapshot

    (frozen,) = (Path(path) for path in asyncio.run(main()).meta["layers"])
    layer_path = tmp_path / "layer"  # the frozen layer plus a hard link, as a squash of a base tree's can hold
    subprocess.run(["cp", "-a", str(frozen), str(layer_path)], check=True)
    os.link(layer_path / "h1", layer_path / "h2")
    original = tree(layer_path)
    assert original["doomed.txt"][0] & 0o170000 == 0o020000  # a whiteout: a character device ...
    assert original["doomed.txt"][4] == 0  # ... 0/0
    assert original["olddir"][7] == {"trusted.overlay.opaque": b"y"}  # this setup: trusted.*, not userxattr
    assert original["script.sh"][7] == {"user.tvcache-test": b"\xffbinary\x00"}
    assert "trusted.overlay.origin" in os.listxattr(frozen / "script.sh")  # node-local: not published

    data = pack_layer(layer_path)
    assert pack_layer(layer_path) == data  # the same bytes every time ...
    subprocess.run(["cp", "-a", str(layer_path), str(tmp_path / "copy")], check=True)
    assert pack_layer(tmp_path / "copy") == data  # ... and for the same content elsewhere (other inodes, ctimes)

    unpack_layer(data, tmp_path / "unpacked")
    assert tree(tmp_path / "unpacked") == original
    assert "trusted.overlay.origin" not in os.listxattr(tmp_path / "unpacked" / "script.sh")
    assert pack_layer(tmp_path / "unpacked") == data
    factory.close()


def test_an_archive_cannot_write_outside_its_layer(tmp_path: Path) -> None:
    import io
    import tarfile

    def archive(*members: tarfile.TarInfo) -> bytes:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for member in members:
                tar.addfile(member)
        return buffer.getvalue()

    link = tarfile.TarInfo("escape")
    link.type, link.linkname = tarfile.SYMTYPE, str(tmp_path / "outside")
    below = tarfile.TarInfo("escape/file")
    dotdot = tarfile.TarInfo("../file")
    for n, members in enumerate([(link, below), (dotdot,)]):
        with pytest.raises(SandboxError, match="cannot unpack a published layer"):
            unpack_layer(archive(*members), tmp_path / f"dest-{n}")
        assert not (tmp_path / f"dest-{n}").exists()
    assert not (tmp_path / "outside").exists()
    assert not (tmp_path / "file").exists()


@dataclass
class TwoProcesses:
    base: Path
    store: DirectoryStore
    a: PublishedSnapshots
    b: PublishedSnapshots

    @property
    def shell_a(self) -> ShellSandboxFactory:
        assert isinstance(self.a.inner, ShellSandboxFactory)
        return self.a.inner

    @property
    def shell_b(self) -> ShellSandboxFactory:
        assert isinstance(self.b.inner, ShellSandboxFactory)
        return self.b.inner


@pytest.fixture
def two(tmp_path: Path) -> Iterator[TwoProcesses]:
    base = make_base(tmp_path)
    store = DirectoryStore(tmp_path / "blobs")
    a = PublishedSnapshots(shell_factory(base, tmp_path / "layers-a", max_layers=3), store, node_id="a")
    b = PublishedSnapshots(shell_factory(base, tmp_path / "layers-b"), store, node_id="b", max_layer_bytes=0)
    processes = TwoProcesses(base=base, store=store, a=a, b=b)
    yield processes
    processes.shell_a.close()
    processes.shell_b.close()


async def snapshots_along(factory: PublishedSnapshots, calls: Calls, where: Path) -> list[Snapshot]:
    sandbox = await factory.start()
    snapshots = []
    for n, call in enumerate(calls):
        await run_calls(sandbox, [call])
        snapshots.append(await sandbox.snapshot(where / f"snap-{n}"))
    await sandbox.stop()
    return snapshots


def blobs_in(store: DirectoryStore) -> set[str]:
    return {path.name for path in (store.root / "blobs").rglob("*") if path.is_file()}


def test_a_stack_forks_in_another_process_from_fetched_layers(two: TwoProcesses, tmp_path: Path) -> None:
    async def main() -> None:
        snapshots = await snapshots_along(two.a, STEPS[:3], tmp_path)
        published = [snapshot.meta[PUBLISHED] for snapshot in snapshots]
        assert [len(p["layers"]) for p in published] == [1, 2, 3]
        # Each publication uploads only its new top layer and references the lower ones already stored.
        assert published[2]["layers"][1:] == published[1]["layers"]
        assert published[1]["layers"][1:] == published[0]["layers"]
        cache_a = two.a.layer_cache
        assert cache_a is not None
        assert (cache_a.uploaded, cache_a.shared) == (3, 0 + 1 + 2)
        assert len(blobs_in(two.store)) == 3

        cache_b = two.b.layer_cache
        assert cache_b is not None
        deep = await two.b.fork(snapshots[2])
        assert (cache_b.fetched, cache_b.reused) == (3, 0)
        assert all(path.startswith(str(two.shell_b.store.directory)) for path in deep.layers)
        shallow = await two.b.fork(snapshots[0])  # its layer was fetched for the deep fork: nothing to fetch
        assert (cache_b.fetched, cache_b.reused) == (3, 1)
        assert await run_calls(deep, INSPECT) == (await run_uncached(two.base, STEPS[:3] + INSPECT))[3:]
        assert await run_calls(shallow, INSPECT) == (await run_uncached(two.base, STEPS[:1] + INSPECT))[1:]
        cache_b.check_invariants()

        # A fork's own snapshot publishes again from the other process: only its new layer is uploaded.
        await run_calls(shallow, [STEPS[1]])
        mine = await shallow.snapshot(tmp_path / "snap-b")
        assert (cache_b.uploaded, cache_b.shared) == (1, 1)
        assert mine.meta[PUBLISHED]["layers"][1] == published[0]["layers"][0]
        for sandbox in (deep, shallow):
            await sandbox.stop()

        for snapshot in [*snapshots, mine]:
            two.a.discard(snapshot)
        assert blobs_in(two.store) == set()  # every publication's references released: every blob deleted
        assert not list((two.store.root / "refs").iterdir())

    asyncio.run(main())


def test_fetched_layers_in_use_are_never_evicted(two: TwoProcesses, tmp_path: Path) -> None:
    async def main() -> None:
        snapshots = await snapshots_along(two.a, STEPS[:2], tmp_path)
        cache_b = two.b.layer_cache  # max_layer_bytes=0: every idle layer is evicted at the next fetch
        assert cache_b is not None
        first = await two.b.fork(snapshots[0])
        second = await two.b.fork(snapshots[1])  # evicts nothing: the first layer is in use by both sandboxes
        assert cache_b.fetched == 2
        assert all(Path(path).is_dir() for path in first.layers + second.layers)
        await first.stop()
        await second.stop()
        cache_b.check_invariants()
        assert cache_b.held_bytes() > 0  # idle now, held until the next fetch evicts them
        other = await snapshots_along(two.a, [("sh", {"cmd": "echo x > x"})], tmp_path / "other")
        third = await two.b.fork(other[0])
        assert [Path(path).is_dir() for path in third.layers] == [True]
        assert len(two.shell_b.store.live_layers()) == 1  # the idle layers were freed
        cache_b.check_invariants()
        await third.stop()

    asyncio.run(main())


def test_a_tampered_or_lost_layer_is_refused(two: TwoProcesses, tmp_path: Path) -> None:
    async def main() -> None:
        snapshots = await snapshots_along(two.a, STEPS[:2], tmp_path)
        await (await two.b.fork(snapshots[0])).stop()  # the lower layer is fetched, verified and cached
        top = snapshots[1].meta[PUBLISHED]["layers"][0]["digest"]
        blob = next(path for path in (two.store.root / "blobs").rglob(top))
        blob.write_bytes(blob.read_bytes() + b"corrupt")
        with pytest.raises(SandboxError, match="does not match its address"):
            await two.b.fork(snapshots[1])
        blob.unlink()
        with pytest.raises(SandboxError, match="is not in"):
            await two.b.fork(snapshots[1])
        # Nothing refused reached the layer store; the verified lower layer stays, held by the cache alone.
        assert [layer.refs for layer in two.shell_b.store.live_layers()] == [1]
        cache_b = two.b.layer_cache
        assert cache_b is not None
        assert cache_b.fetched == 1
        cache_b.check_invariants()

    asyncio.run(main())


def test_squashed_stacks_cross_processes(two: TwoProcesses, tmp_path: Path) -> None:
    async def main() -> None:
        snapshots = await snapshots_along(two.a, STEPS, tmp_path)  # max_layers=3: the fourth snapshot squashes
        layers = snapshots[-1].meta[PUBLISHED]["layers"]
        assert [LayerRef.from_json(layer).squashed for layer in layers] == [True]
        fork = await two.b.fork(snapshots[-1])
        assert fork.layers[0].endswith("-squashed")
        assert await run_calls(fork, INSPECT) == (await run_uncached(two.base, STEPS + INSPECT))[4:]
        await fork.stop()

    asyncio.run(main())


def test_a_stack_over_another_base_is_refused(two: TwoProcesses, tmp_path: Path) -> None:
    other = make_base(tmp_path / "elsewhere")
    b = PublishedSnapshots(shell_factory(other, tmp_path / "layers-c"), two.store, node_id="c")

    async def main() -> None:
        (snapshot,) = await snapshots_along(two.a, STEPS[:1], tmp_path)
        with pytest.raises(SandboxError, match="this factory's base"):
            await b.fork(snapshot)

    asyncio.run(main())
    assert isinstance(b.inner, ShellSandboxFactory)
    b.inner.close()


# ------------------------------------------------------------------ on a two-node Ray cluster


@dataclass(frozen=True)
class Deployment:
    namespace: str
    work: Path
    base: Path
    node_a: str
    node_b: str


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    if not overlay_supported():
        pytest.skip("overlay mounts need root on Linux >= 6.8")
    work = tmp_path_factory.mktemp("ray-shell")
    node_args = {"num_cpus": 1, "object_store_memory": 80 * MiB}
    try:
        cluster = Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False})
        worker = cluster.add_node(**node_args)
        cluster.wait_for_nodes()
    except Exception as error:  # this machine cannot run Ray (no /dev/shm, sandboxed sockets, ...)
        pytest.skip(f"Ray cannot start a local cluster here: {error!r}")
    namespace = f"tvcache-shell-{uuid.uuid4().hex[:8]}"
    try:
        ray.init(address=cluster.address, namespace=namespace, log_to_driver=False)
        start_shards(1, data_dir=work / "shards", namespace=namespace, detached=False)
        yield Deployment(
            namespace=namespace,
            work=work,
            base=make_base(work),
            node_a=cluster.head_node.node_id,
            node_b=worker.node_id,
        )
    finally:
        ray.shutdown()
        cluster.shutdown()


Plan = list[tuple[str, Calls]]


def _run_shell_rollouts(namespace: str, base: str, store: str, plan: Plan, max_layers: int) -> dict[str, Any]:
    """Run ``plan`` through a RayCache on this node, snapshotting after every state change."""
    blob_store = RayObjectStore(namespace=namespace) if store == "ray" else DirectoryStore(store)
    shell = shell_factory(Path(base), max_layers=max_layers)
    factory = PublishedSnapshots(shell, blob_store)
    rollouts = []
    try:
        with RayCache(namespace=namespace, snapshot_policy=AlwaysSnapshot()) as cache:
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
                        "replayed": stats.calls_replayed,
                    }
                )
        layers = factory.layer_cache
        assert layers is not None
        layers.check_invariants()
        return {
            "node": ray.get_runtime_context().get_node_id(),
            "rollouts": rollouts,
            "published": factory.published,
            "uploaded": layers.uploaded,
            "shared": layers.shared,
            "fetched": layers.fetched,
            "reused": layers.reused,
        }
    finally:
        shell.close()


def run_on(node_id: str, *args: Any) -> dict[str, Any]:
    remote = ray.remote(_run_shell_rollouts).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    )
    result: dict[str, Any] = ray.get(remote.remote(*args), timeout=120)
    assert result["node"] == node_id
    return result


def published_stack(namespace: str, task_id: str, calls: Calls) -> list[dict[str, Any]]:
    """The layers of the snapshot the shards hold after ``calls``."""
    history = [{"name": name, "arguments": arguments} for name, arguments in calls]
    with RayCache(namespace=namespace) as cache:
        match = lookup(cache, task_id, history)
    layers: list[dict[str, Any]] = match["node"]["snapshot"]["meta"][PUBLISHED]["layers"]
    return layers


# The same steps as tool calls that cost what real ones do: the session forks only when forking (fetching
# included) is expected to be cheaper than starting fresh and replaying the recorded calls.
SLOW_STEPS: Calls = [(name, {"cmd": "sleep 0.3 && " + arguments["cmd"]}) for name, arguments in STEPS]


def test_a_rollout_on_another_node_forks_the_fetched_layers_without_replaying(deployment: Deployment) -> None:
    d = deployment
    args = (d.namespace, str(d.base), "ray")
    made = run_on(d.node_a, *args, [("shell-task", SLOW_STEPS[:3])], 128)
    assert made["published"] == 3
    assert (made["uploaded"], made["shared"]) == (3, 3)  # one new layer each time, the lower ones referenced

    # On node B, one process: a rollout leaving after the first step forks A's one-layer stack, fetched through
    # the object store; one leaving after the third forks A's three-layer stack, fetching only the two layers
    # it does not hold yet.
    plan = [("shell-task", SLOW_STEPS[:1] + INSPECT), ("shell-task", SLOW_STEPS[:3] + INSPECT)]
    seen = run_on(d.node_b, *args, plan, 128)
    shallow, deep = seen["rollouts"]
    assert shallow["hits"] == [True, False]
    assert deep["hits"] == [True, True, True, False]
    for rollout in (shallow, deep):
        assert (rollout["forked"], rollout["started"], rollout["replayed"]) == (1, 0, 0)
    assert (seen["fetched"], seen["reused"]) == (3, 1)
    assert shallow["outputs"] == uncached(d.base, SLOW_STEPS[:1] + INSPECT)
    assert deep["outputs"] == uncached(d.base, SLOW_STEPS[:3] + INSPECT)
    listing = deep["outputs"][3]
    assert "'doomed.txt': No such file" in listing  # a whiteout
    assert "'olddir/old.txt': No such file" in listing  # an opaque directory
    assert "-rwsr-x--- 1 1234 99" in listing  # mode, owner
    assert "-rw-r--r-- 2    0  0  7  hard" in listing  # the base tree's hard link
    assert "link -> notes.txt" in listing


def test_a_tampered_layer_blob_is_refused_and_the_rollout_stays_exact(deployment: Deployment) -> None:
    d = deployment
    store = d.work / "tampered"
    args = (d.namespace, str(d.base), str(store))
    run_on(d.node_a, *args, [("tamper-task", STEPS[:2])], 128)
    for blob in (store / "blobs").rglob("*"):
        if blob.is_file():
            blob.write_bytes(blob.read_bytes() + b"corrupt")
    seen = run_on(d.node_b, *args, [("tamper-task", STEPS[:2] + INSPECT)], 128)
    (rollout,) = seen["rollouts"]
    assert (rollout["forked"], rollout["started"], rollout["replayed"]) == (0, 1, 2)  # refused: fresh + replay
    assert seen["fetched"] == 0
    assert rollout["outputs"] == uncached(d.base, STEPS[:2] + INSPECT)


def test_a_squashed_stack_crosses_nodes(deployment: Deployment) -> None:
    d = deployment
    args = (d.namespace, str(d.base), str(d.work / "squash-blobs"))
    run_on(d.node_a, *args, [("squash-task", STEPS)], 2)  # past max_layers=2: the third snapshot squashes
    stack = published_stack(d.namespace, "squash-task", STEPS)
    assert [layer["squashed"] for layer in stack] == [False, True]
    seen = run_on(d.node_b, *args, [("squash-task", STEPS + INSPECT)], 2)
    (rollout,) = seen["rollouts"]
    assert (rollout["forked"], rollout["started"], rollout["replayed"]) == (1, 0, 0)
    assert seen["fetched"] == 2
    assert rollout["outputs"] == uncached(d.base, STEPS + INSPECT)
    shutil.rmtree(d.work / "squash-blobs")
