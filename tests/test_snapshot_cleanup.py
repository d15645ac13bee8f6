"""Leftovers (issue 24, finding 5): a snapshot whose storage is gone is unusable everywhere (``SnapshotUnusable``)
and dropped, with its files and CRIU image, when a durable cache opens (``Cache.recovery.dropped``); restore
scratch directories of a process killed mid-restore are removed by the next process."""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tvcache import AlwaysSnapshot, Cache, SnapshotUnusable, ToolCall
from tvcache.sandboxes import ShellSandbox, ShellSandboxFactory
from tvcache.sandboxes.shell.criu import SCRATCH_PREFIX, find_criu, remove_dead_scratch
from tvcache.sandboxes.shell.layers import process_tag
from tvcache.sandboxes.shell.linux import overlay_supported

pytestmark = pytest.mark.skipif(
    not overlay_supported(), reason="overlay mounts need root on Linux >= 6.8 (the shell backend falls back to copies)"
)
needs_criu = pytest.mark.skipif(
    not overlay_supported() or find_criu(warn=False) is None, reason="no working CRIU (make criu)"
)


def sh(cmd: str) -> ToolCall:
    return ToolCall("sh", {"cmd": cmd})


def factory_for(tmp_path: Path, **options: object) -> ShellSandboxFactory:
    base = tmp_path / "base"
    base.mkdir(exist_ok=True)
    factory = ShellSandbox.factory(base, fallback=False, store_root=tmp_path / "layers", **options)
    assert isinstance(factory, ShellSandboxFactory)
    return factory


def test_a_snapshot_whose_layers_are_gone_is_unusable_everywhere(tmp_path: Path) -> None:
    first = factory_for(tmp_path)

    async def take() -> object:
        sandbox = await first.start()
        await sandbox.execute(sh("echo 1 > f"))
        snapshot = await sandbox.snapshot(tmp_path / "snap")
        await sandbox.stop()
        return snapshot

    snapshot = asyncio.run(take())
    first.close()  # its layer store, and so the snapshot's layers, are gone
    second = factory_for(tmp_path)
    try:
        with pytest.raises(SnapshotUnusable, match="missing its layers"):
            asyncio.run(second.fork(snapshot))  # type: ignore[arg-type]
    finally:
        second.close()


@pytest.mark.parametrize("persistent", [False, True], ids=["one-shot", "persistent"])
def test_a_reopened_durable_cache_drops_snapshots_whose_storage_is_gone(tmp_path: Path, persistent: bool) -> None:
    if persistent and find_criu(warn=False) is None:
        pytest.skip("no working CRIU (make criu)")
    commands = ["X=1; echo 1 > f", "sleep 60 & Y=2" if persistent else "echo 2 >> f", "cat f"]

    def rollout(factory: ShellSandboxFactory, cache: Cache) -> list[str]:
        async def main() -> list[str]:
            async with cache.session("task", sandbox=factory) as session:
                return [(await session.call("sh", {"cmd": command})).output for command in commands]

        return asyncio.run(main())

    factory = factory_for(tmp_path, persistent=persistent)
    cache = Cache(tmp_path / "cache", snapshot_policy=AlwaysSnapshot())
    first = rollout(factory, cache)
    taken = cache.stats().snapshots
    cache.close()
    factory.close()  # a clean exit: the layers go with the process's store
    snapshot_files = sorted((tmp_path / "cache" / "snapshots").rglob("*"))
    assert taken >= 2
    assert snapshot_files
    if persistent:
        assert list((tmp_path / "cache").rglob("*.criu")), "no CRIU image was taken"

    reopened = Cache(tmp_path / "cache", snapshot_policy=AlwaysSnapshot())
    try:
        recovery = reopened.recovery
        assert recovery is not None
        assert len(recovery.dropped) == taken
        assert not recovery.lost_records
        assert not recovery.removed
        assert "whose storage is gone were dropped" in recovery.describe()
        assert reopened.stats().snapshots == 0
        assert [path for path in (tmp_path / "cache" / "snapshots").rglob("*") if not path.is_dir()] == []
        factory = factory_for(tmp_path, persistent=persistent)
        try:
            assert rollout(factory, reopened) == first  # all served from the journal
        finally:
            factory.close()
    finally:
        reopened.close()
    again = Cache(tmp_path / "cache")
    try:
        assert again.recovery is not None
        assert again.recovery.dropped == ()
    finally:
        again.close()


CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from tvcache import ToolCall
    from tvcache.sandboxes import ShellSandbox

    tmp = Path(sys.argv[1])
    factory = ShellSandbox.factory(tmp / "base", fallback=False, store_root=tmp / "layers", persistent=True)

    async def main():
        sandbox = await factory.start()
        await sandbox.execute(ToolCall("sh", {"cmd": "sleep 60 &"}))
        snapshot = await sandbox.snapshot(tmp / "snap")
        while True:  # restore after restore, until killed
            fork = await factory.fork(snapshot)
            await fork.stop()

    asyncio.run(main())
    """
)


@needs_criu
def test_scratch_of_a_process_killed_mid_restore_is_removed_by_the_next(tmp_path: Path) -> None:
    (tmp_path / "base").mkdir()
    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    environment = {**os.environ, "TMPDIR": str(scratch_root)}
    left: list[str] = []
    for _ in range(3):  # the kill may land between two restores; then try again
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], env=environment)
        pattern = str(scratch_root / f"{SCRATCH_PREFIX}{child.pid}-*")
        deadline = time.monotonic() + 120
        try:
            while not glob.glob(pattern) and child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.001)
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.kill()
            child.wait()
        left = glob.glob(pattern)
        if left:
            break
    assert left, "the child was never killed while a restore's scratch directory existed"
    tag = process_tag(os.getpid())
    live = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{tag}-", dir=scratch_root)  # a live process's: kept
    removed = remove_dead_scratch(str(scratch_root))
    assert set(left) <= set(removed)
    assert glob.glob(str(scratch_root / f"{SCRATCH_PREFIX}*")) == [live]
