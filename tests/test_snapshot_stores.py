"""The parts of published snapshots below the sandboxes: the tree archive, ``DirectoryStore`` and ``NodeCache``.

Real files, real GNU tar, real processes (a publisher killed mid-write), a real full filesystem (a small tmpfs,
root only). What ``PublishedSnapshots`` makes of them is in ``tests/test_published_snapshots.py``.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tvcache.errors import SandboxError
from tvcache.snapshots import DirectoryStore, NodeCache, blob_digest, pack, unpack

from server_support import wait_until

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving files to other users and mounting take root")


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def listing(root: Path) -> dict[str, tuple[Any, ...]]:
    """Everything a sandbox can see of a tree but access and change times and inode numbers."""
    entries = {}
    for directory, dirs, files in os.walk(root):
        for name in [".", *dirs, *files] if directory == str(root) else [*dirs, *files]:
            path = os.path.normpath(os.path.join(directory, name))
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode):
                content: bytes | str = Path(path).read_bytes()
            elif stat.S_ISLNK(info.st_mode):
                content = os.readlink(path)
            else:
                content = b""
            xattrs = {} if stat.S_ISLNK(info.st_mode) else {k: os.getxattr(path, k) for k in os.listxattr(path)}
            entries[os.path.relpath(path, root)] = (
                info.st_mode,
                info.st_uid,
                info.st_gid,
                info.st_nlink,
                info.st_mtime_ns,
                content,
                xattrs,
            )
    return entries


def make_tree(root: Path) -> Path:
    """A tree using what a folder sandbox can: nanosecond times, an xattr, a hard link, setuid, a symlink."""
    (root / "d" / "empty").mkdir(parents=True)
    (root / "f").write_text("same bytes\n")
    os.setxattr(root / "f", "user.tag", b"one")
    (root / "d" / "tool").write_text("#!/bin/sh\n")
    os.chmod(root / "d" / "tool", 0o4755)
    os.link(root / "f", root / "d" / "f-again")
    os.symlink("../f", root / "d" / "link")
    for path, stamp in [("f", 1_577_836_800_123_456_789), ("d", 1_609_459_200_987_654_321), ("d/empty", 5)]:
        os.utime(root / path, ns=(stamp, stamp))
    return root


# ------------------------------------------------------------------ the tree archive


def test_trees_that_differ_only_in_nanoseconds_or_xattrs_or_owners_pack_to_different_blobs(tmp_path: Path) -> None:
    base = make_tree(tmp_path / "base")
    variants = {"base": base}
    for name in ("nanoseconds", "xattr", "owner"):
        variants[name] = tmp_path / name
        subprocess.run(["cp", "-a", str(base), str(variants[name])], check=True)
    stamp = os.lstat(base / "f").st_mtime_ns - 39  # the same microsecond
    os.utime(variants["nanoseconds"] / "f", ns=(stamp, stamp))
    os.setxattr(variants["xattr"] / "f", "user.tag", b"two")
    if os.geteuid() == 0:
        os.chown(variants["owner"] / "d" / "tool", 4242, 4242)
        os.chmod(variants["owner"] / "d" / "tool", 0o4755)  # chown cleared setuid
    else:
        del variants["owner"]

    blobs = {name: pack(path) for name, path in variants.items()}
    digests = {name: blob_digest(data) for name, (data, _) in blobs.items()}
    assert len(set(digests.values())) == len(variants), digests  # no two share an address
    assert {fmt for _, fmt in blobs.values()} == {"tree"}
    subprocess.run(["cp", "-a", str(base), str(tmp_path / "copy")], check=True)
    assert pack(tmp_path / "copy") == blobs["base"]  # equal trees, equal bytes (other inodes and change times)


def test_an_unpacked_tree_shows_exactly_what_was_packed(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "tree")
    if os.geteuid() == 0:
        os.lchown(tree / "d" / "link", 4243, 4243)
        os.chown(tree / "f", 4242, 4242)
        os.setxattr(tree / "f", "trusted.kept", b"too")
    data, fmt = pack(tree)
    unpack(data, fmt, tmp_path / "copy")
    assert listing(tmp_path / "copy") == listing(tree)


def test_an_archive_cannot_write_outside_its_tree_and_old_python_archives_are_not_forked(tmp_path: Path) -> None:
    import io
    import tarfile

    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w", format=tarfile.PAX_FORMAT) as archive:
        archive.addfile(tarfile.TarInfo("../escaped"), io.BytesIO(b""))
    with pytest.raises(SandboxError, match="cannot unpack a published tree"):
        unpack(evil.getvalue(), "tree", tmp_path / "evil")
    assert not (tmp_path / "escaped").exists()
    assert not (tmp_path / "evil").exists()

    with pytest.raises(SandboxError, match="older tvcache as a Python tar archive"):
        unpack(evil.getvalue(), "tar", tmp_path / "legacy")
    assert not (tmp_path / "legacy").exists()


# ------------------------------------------------------------------ DirectoryStore

DATA = b"blob data\n"
DIGEST = blob_digest(DATA)
PUBLICATION = "0123456789abcdef"


def modes(root: Path) -> dict[str, int]:
    return {str(path.relative_to(root)): stat.S_IMODE(path.lstat().st_mode) for path in [root, *root.rglob("*")]}


def test_a_store_is_private_to_its_user_unless_created_shared(tmp_path: Path) -> None:
    with umask(0o022):
        private = DirectoryStore(tmp_path / "private")
        private.put(DIGEST, DATA, PUBLICATION)
    found = modes(private.root)
    assert {found[name] for name in [".", "blobs", "refs", f"blobs/{DIGEST[:2]}", f"refs/{DIGEST}"]} == {0o700}
    assert {found[name] for name in ["lock", f"blobs/{DIGEST[:2]}/{DIGEST}", f"refs/{DIGEST}/{PUBLICATION}"]} == {0o600}

    with umask(0o077):  # the opt-in wins over a strict umask
        shared = DirectoryStore(tmp_path / "shared", mode=0o660)
        shared.put(DIGEST, DATA, PUBLICATION)
    found = modes(shared.root)
    assert {found[name] for name in [".", "blobs", "refs", f"blobs/{DIGEST[:2]}", f"refs/{DIGEST}"]} == {0o770}
    assert {found[name] for name in ["lock", f"blobs/{DIGEST[:2]}/{DIGEST}", f"refs/{DIGEST}/{PUBLICATION}"]} == {0o660}
    with pytest.raises(ValueError, match="mode"):
        DirectoryStore(tmp_path / "bad", mode=0o755)


def test_a_deleted_store_fails_with_its_path_and_what_to_do(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "store")
    store.put(DIGEST, DATA, PUBLICATION)
    shutil.rmtree(store.root)
    for attempt in (
        lambda: store.put(DIGEST, DATA, "fedcba9876543210"),
        lambda: store.retain([DIGEST], "fedcba9876543210"),
        lambda: store.release(DIGEST, PUBLICATION),
    ):
        with pytest.raises(SandboxError, match=f"snapshot store {store.root}: .*deleted or moved; recreate it"):
            attempt()
    assert store.get(DIGEST) is None  # gone is not an error: the fork replays
    assert not store.root.exists()  # and nothing recreated it behind the user's back


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs takes root")
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], check=False).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_leaves_no_partial_blob_and_no_reference(small_filesystem: Path) -> None:
    store = DirectoryStore(small_filesystem / "store")
    store.put(DIGEST, DATA, PUBLICATION)
    big = os.urandom(200_000)
    with pytest.raises(SandboxError, match=f"snapshot store {store.root}: .*filesystem is full"):
        store.put(blob_digest(big), big, "fedcba9876543210")
    files = sorted(str(path.relative_to(store.root)) for path in store.root.rglob("*") if path.is_file())
    assert files == sorted(["lock", f"blobs/{DIGEST[:2]}/{DIGEST}", f"refs/{DIGEST}/{PUBLICATION}"])
    assert [path.name for path in (store.root / "refs").iterdir()] == [DIGEST]
    store.check_invariants()
    assert store.stats() == {"blobs": 1, "references": 1}


@pytest.mark.parametrize("digest", ["../victim", "00", DIGEST.upper(), DIGEST + "/..", ""])
def test_digests_and_publication_ids_that_are_not_addresses_never_reach_a_path(digest: str, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    store = DirectoryStore(tmp_path / "store")
    (store.root / "refs" / "00").mkdir()  # a release of "00" by a forged record would remove what it names
    calls = [
        lambda: store.put(digest, DATA, PUBLICATION),
        lambda: store.retain([digest], PUBLICATION),
        lambda: store.holds([(digest, PUBLICATION)]),
        lambda: store.get(digest),
        lambda: store.release(digest, PUBLICATION),
        lambda: store.release("00", "../../../victim"),
        lambda: store.put(DIGEST, DATA, "../../victim"),
    ]
    cache = NodeCache(tmp_path / "node-cache")
    calls += [lambda: cache.path(digest), lambda: cache.drop(digest)]
    for call in calls:
        with pytest.raises(SandboxError, match="record is corrupt or forged"):
            call()
    assert victim.is_dir()
    assert store.stats() == {"blobs": 0, "references": 0}


# ------------------------------------------------------------------ NodeCache


def test_partial_entries_of_killed_fetches_are_cleared_unless_a_fetch_still_writes_them(tmp_path: Path) -> None:
    cache = NodeCache(tmp_path / "node-cache")
    abandoned, ours = "a" * 64, "b" * 64
    for digest in (abandoned, ours):
        (cache.root / f"{digest}.0123abcd.partial").mkdir()
        (cache.root / f"{digest}.0123abcd.partial" / "half-written").write_bytes(b"x")
    store = DirectoryStore(tmp_path / "store")
    store.put(DIGEST, DATA, PUBLICATION)
    with cache.pinned(ours):  # a fetch of ``ours`` is writing its partial entry right now
        cache.fetch(DIGEST, "file", store)  # any fetch tidies up
    left = sorted(path.name for path in cache.root.iterdir() if path.name.endswith(".partial"))
    assert left == [f"{ours}.0123abcd.partial"]


def test_the_default_node_cache_is_private_to_its_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with umask(0o022):
        cache = NodeCache()
    assert cache.root == tmp_path / f"tvcache-node-cache-{os.geteuid()}"
    assert stat.S_IMODE(cache.root.stat().st_mode) == 0o700


def test_a_node_cache_refuses_a_directory_others_can_write_or_own(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with pytest.raises(SandboxError, match=r"writable by group or others .*chmod 700"):
        NodeCache(shared)
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 4242, 4242)
        with pytest.raises(SandboxError, match="belongs to uid 4242"):
            NodeCache(theirs)


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    """A directory in memory (``/dev/shm``) where there is one, for the tests that move many files around."""
    shm = Path("/dev/shm")
    root = Path(tempfile.mkdtemp(dir=shm if shm.is_dir() else None, prefix="tvcache-test-"))
    yield root
    shutil.rmtree(root)


@pytest.fixture(scope="module")
def many_files(scratch: Path) -> Path:
    """10,000 small files (made once for the module): GNU tar takes a good tenth of a second to unpack them,
    long enough to be caught mid-write."""
    root = scratch / "many-files"
    for i in range(100):
        (root / f"d{i:03}").mkdir(parents=True)
        for j in range(100):
            (root / f"d{i:03}" / f"f{j}").write_text(f"{i} {j}\n")
    return root


def descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs, that have not exited (from every process's ``/proc`` entry:
    ``/proc/<pid>/task/<tid>/children`` is not in every kernel)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):  # exited meanwhile
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
                if fields[0] != "Z":
                    parents[int(entry.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        more = [child for child, ppid in parents.items() if ppid == parent]
        found += more
        frontier += more
    return found


def unpacking_tar(parent: int) -> int | None:
    """A GNU tar extracting an archive that ``parent`` (or a descendant) started, or None."""
    for pid in descendants(parent):
        with contextlib.suppress(OSError):
            if b"--extract" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                return pid
    return None


def state_of(pid: int) -> str | None:
    """``R``, ``S``, ``T`` (stopped), ``Z`` (exited)...; None once reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return None


def exited(pidfd: int, within: float) -> bool:
    ready, _, _ = select.select([pidfd], [], [], within)
    return bool(ready)


def frozen_tar(parent: int, node_cache: Path) -> int:
    """Wait for the tar ``parent`` runs to unpack a tree into ``node_cache``, and stop it (SIGSTOP) mid-write; its
    pid. The ``.partial`` it writes is made just before it starts: a cheap wait first, then a look at processes."""
    wait_until(lambda: any(node_cache.glob("*.partial")), timeout=60)
    wait_until(lambda: unpacking_tar(parent) is not None, timeout=60)
    tar = unpacking_tar(parent)
    assert tar is not None
    os.kill(tar, signal.SIGSTOP)
    wait_until(lambda: state_of(tar) in ("T", "t", "Z", None), timeout=10)
    assert state_of(tar) in ("T", "t"), "tar finished before it could be stopped mid-write: unpack a bigger tree"
    return tar


def test_a_partial_entry_is_never_cleared_while_its_writer_writes_it(
    tmp_path: Path, scratch: Path, many_files: Path
) -> None:
    """A fetch whose caller does not pin the digest still claims the ``.partial`` it writes: a tidying pass of
    another process on the node (here another NodeCache on the same directory) leaves it alone."""
    tree = many_files
    data, fmt = pack(tree)
    digest = blob_digest(data)
    store = DirectoryStore(tmp_path / "store")
    store.put(digest, data, PUBLICATION)
    store.put(DIGEST, DATA, PUBLICATION)
    root = Path(tempfile.mkdtemp(dir=scratch))
    writer, other = NodeCache(root / "node-cache"), NodeCache(root / "node-cache")
    fetched: list[Path] = []
    thread = threading.Thread(target=lambda: fetched.append(writer.fetch(digest, fmt, store)))
    thread.start()
    tar = None
    try:
        tar = frozen_tar(os.getpid(), writer.root)
        other.fetch(DIGEST, "file", store)  # any fetch tidies up the node's abandoned .partial entries
        assert [path.name for path in other.root.glob(f"{digest}.*.partial")], "a live writer's entry was cleared"
    finally:
        if tar is not None:
            os.kill(tar, signal.SIGCONT)  # our own child, not reaped yet: the number cannot be another's
        thread.join(60)
    assert fetched == [writer.path(digest)]
    assert listing(fetched[0]) == listing(tree)


CHILD = """
import asyncio, sys
from pathlib import Path
from tvcache import DirectoryStore, PublishedSnapshots
from tvcache.sandboxes import FolderSandbox
from tvcache.snapshots import NodeCache

template, store, node_cache, dest = map(Path, sys.argv[1:])

async def main():
    factory = PublishedSnapshots(FolderSandbox.factory(template), DirectoryStore(store), cache=NodeCache(node_cache))
    sandbox = await factory.start()
    await sandbox.snapshot(dest)

asyncio.run(main())
print("published", flush=True)
"""


def test_a_publisher_killed_while_its_data_crosses_filesystems_leaves_no_entry_a_fork_would_use(
    tmp_path: Path, scratch: Path, many_files: Path
) -> None:
    """The snapshot is made in memory (``/dev/shm``) and adopted by a node cache in ``tmp_path`` (another
    filesystem, so unpacked there by GNU tar, not renamed): the publisher is killed while its tar writes the
    ``.partial`` entry.

    The tar is stopped (SIGSTOP) just before: on its own it would soon end anyway (the killed publisher closes its
    input), so only a tar that dies *with* its publisher gets past the bounded wait below, never one that
    happened to end in time, and the entry can no longer be written when it is checked and removed."""
    if os.stat(scratch).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the temp directory")
    work = Path(tempfile.mkdtemp(dir=scratch))
    node_cache = tmp_path / "node-cache"
    arguments = [str(many_files), str(work / "store"), str(node_cache), str(work / "snapshot")]
    watched: dict[int, int] = {}  # the publisher's descendants when it was killed, by pidfd
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, *arguments],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "TMPDIR": str(work)},  # the killed factory's sandbox folders stay in work
        )
        try:
            frozen_tar(child.pid, node_cache)
            for pid in descendants(child.pid):
                with contextlib.suppress(ProcessLookupError):
                    watched[pid] = os.pidfd_open(pid)
        finally:
            child.send_signal(signal.SIGKILL)
            assert child.stdout is not None
            published = child.stdout.read()
            child.wait()
        assert published == ""  # killed before it finished, mid-copy
        assert watched
        survivors = [pid for pid, pidfd in watched.items() if not exited(pidfd, 10)]
        assert survivors == [], "processes the publisher started outlived it and may write into the node cache"
        entries = [path.name for path in node_cache.iterdir()]
        assert not [name for name in entries if re.fullmatch("[0-9a-f]{64}", name)], entries  # nothing a fork takes
        assert [name for name in entries if name.endswith(".partial")]
        store = DirectoryStore(work / "store")
        store.put(DIGEST, DATA, PUBLICATION)
        NodeCache(node_cache).fetch(DIGEST, "file", store)  # the next fetch on the node clears what was abandoned
        assert not [path.name for path in node_cache.iterdir() if path.name.endswith(".partial")]
    finally:
        for pidfd in watched.values():  # only after a failure: kill survivors before removing what they write
            if not exited(pidfd, 0):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                exited(pidfd, 10)
            os.close(pidfd)
        if node_cache.exists():
            shutil.rmtree(node_cache)  # no ignore_errors: nothing may still write there
