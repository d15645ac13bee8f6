"""Storage nobody else can read or exec (issue 24, findings 1 and 2): another host user (uid 65534) can neither
read what a sandbox wrote (layers, uppers, snapshots, CRIU images, the journal) nor run a setuid binary a sandbox
made with privileges, whatever the umask; inside, the tree is mounted nosuid; older, wider directories are
tightened on open."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tvcache import AlwaysSnapshot, Cache, ToolCall
from tvcache.sandboxes import ShellSandbox, ShellSandboxFactory
from tvcache.sandboxes.shell.criu import find_criu
from tvcache.sandboxes.shell.layers import LayerStore
from tvcache.sandboxes.shell.linux import overlay_supported

pytestmark = pytest.mark.skipif(
    not overlay_supported() or shutil.which("setpriv") is None,
    reason="needs root, overlay mounts (Linux >= 6.8) and setpriv(1) inside the sandbox",
)


def sh(cmd: str) -> ToolCall:
    return ToolCall("sh", {"cmd": cmd})


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every user can traverse (pytest's own is 0700, which would hide everything anyway), with a
    umask of 0 meanwhile: nothing may rely on the umask to stay private."""
    path = Path(tempfile.mkdtemp(prefix="tvcache-storage-test-"))
    os.chmod(path, 0o755)
    umask = os.umask(0)
    try:
        yield path
    finally:
        os.umask(umask)
        shutil.rmtree(path, ignore_errors=True)


def as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as uid 65534 with no capability left (``setpriv --reuid`` would keep root's until its exec,
    which then still traverses 0700 directories)."""
    shell = ["/bin/sh", "-c", '"$0" "$@"', *argv]  # an exec refused is the shell's error, on stderr
    return subprocess.run(shell, user=65534, group=65534, extra_groups=[], capture_output=True, text=True, timeout=30)


def assert_nobody_cannot_read(path: Path) -> None:
    reader = ["ls", str(path)] if path.is_dir() else ["head", "-c1", str(path)]
    done = as_nobody(*reader)
    assert done.returncode != 0, (path, done)
    assert "Permission denied" in done.stderr, (path, done)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_another_user_can_neither_read_nor_run_what_a_sandbox_wrote(shared: Path) -> None:
    base = shared / "base"
    base.mkdir(mode=0o755)
    (base / "a.txt").write_text("base\n")
    factory = ShellSandbox.factory(base, fallback=False, persistent=True)  # the default store under /dev/shm
    assert isinstance(factory, ShellSandboxFactory)
    store = factory.store
    criu = find_criu(warn=False)

    async def main() -> tuple[str, str]:
        sandbox = await factory.start()
        try:
            made = await sandbox.execute(sh("cp /usr/bin/id idsuid; chmod 4755 idsuid; ls -l idsuid"))
            assert made.output.startswith("-rwsr-xr-x"), made.output
            inside = await sandbox.execute(sh(f"setpriv --reuid=65534 ./idsuid -u; grep ' {base} ' /proc/mounts"))
            upper = next(store.directory.glob("uppers/*/upper/idsuid"))
            assert as_nobody(str(upper), "-u").stdout != "0\n"  # the finding: 0, root's
            assert_nobody_cannot_read(upper)
            await sandbox.execute(sh("SECRET=hunter2; sleep 60 &"))  # a job: CRIU's route, where there is one
            await sandbox.snapshot(shared / "direct" / "snap")
            layer = next(store.directory.glob("layers/*/idsuid"))
            assert_nobody_cannot_read(layer)
            assert as_nobody(str(layer), "-u").returncode != 0
            return inside.output, upper.as_posix()
        finally:
            await sandbox.stop()

    try:
        inside, _ = asyncio.run(main())
        assert inside.startswith("65534\n")  # no privilege from a setuid file inside either
        assert "nosuid" in inside.split("\n")[1].split()[3].split(",")  # the tree itself is mounted nosuid
        for directory in (store.root, store.directory, store.directory / "layers", store.directory / "uppers"):
            assert mode(directory) == 0o700, directory
            assert_nobody_cannot_read(directory)
        if criu is not None:
            images = shared / "direct" / "snap.criu"
            pages = sorted(images.glob("pages-*.img"))
            assert pages, "the snapshot took no CRIU image"
            assert mode(images) == 0o700
            assert {mode(path) for path in images.iterdir()} == {0o600}
            assert_nobody_cannot_read(images)
            for path in pages:
                assert as_nobody("cat", str(path)).returncode != 0
    finally:
        factory.close()


def test_a_durable_cache_is_its_users_alone(shared: Path) -> None:
    base = shared / "base"
    base.mkdir(mode=0o755)
    factory = ShellSandbox.factory(base, fallback=False, store_root=shared / "layers")
    cache = Cache(shared / "cache", snapshot_policy=AlwaysSnapshot())

    async def rollout() -> None:
        async with cache.session("task", sandbox=factory) as session:
            await session.call("sh", {"cmd": "echo token=hunter2 > notes.txt"})

    try:
        asyncio.run(rollout())
        root = shared / "cache"
        journal = root / "journal.log"
        assert "hunter2" in journal.read_text()
        snapshots = sorted(path for path in root.rglob("*") if path.parent.parent.name == "snapshots")
        assert snapshots, "no snapshot was taken"
        for directory in (root, root / "snapshots", snapshots[0].parent):
            assert mode(directory) == 0o700, directory
        assert mode(journal) == mode(root / "lock") == 0o600
        for path in (root, journal, snapshots[0]):
            assert_nobody_cannot_read(path)
    finally:
        cache.close()
        factory.close()


def test_directories_older_versions_left_open_are_tightened(shared: Path) -> None:
    old = shared / "cache"
    (old / "snapshots").mkdir(parents=True, mode=0o755)
    os.chmod(old, 0o755)
    (old / "journal.log").touch(mode=0o644)
    (old / "lock").touch(mode=0o644)
    layers = shared / "layers"
    layers.mkdir(mode=0o755)
    with contextlib.closing(Cache(old)):
        assert [mode(path) for path in (old, old / "snapshots")] == [0o700, 0o700]
        assert [mode(old / name) for name in ("journal.log", "lock")] == [0o600, 0o600]
    store = LayerStore(layers)
    try:
        assert mode(layers) == 0o700
    finally:
        store.close()


def test_a_layer_store_root_of_another_user_is_refused(shared: Path) -> None:
    foreign = shared / "layers"
    foreign.mkdir(mode=0o777)
    os.chown(foreign, 65534, 65534)  # planted by another user where every user may create directories
    with pytest.raises(OSError, match="owned by uid 65534"):
        LayerStore(foreign)
