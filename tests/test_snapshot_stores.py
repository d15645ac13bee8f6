"""The parts of published snapshots below the sandboxes: the tree archive, ``DirectoryStore`` and ``NodeCache``.

Real files, real GNU tar, real processes (a publisher killed mid-write), a real full filesystem (a small tmpfs,
root only). What ``PublishedSnapshots`` makes of them is in ``tests/test_published_snapshots.py``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
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
    tmp_path: Path,
) -> None:
    """The snapshot is made in ``tmp_path`` and adopted by a node cache in ``/dev/shm`` (another filesystem, so
    copied, not renamed): the publisher is killed as soon as anything but a lock appears there."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the temp directory")
    template = tmp_path / "template"
    for i in range(100):
        (template / f"d{i:03}").mkdir(parents=True)
        for j in range(100):
            (template / f"d{i:03}" / f"f{j}").write_text(f"{i} {j}\n")
    node_cache = Path(tempfile.mkdtemp(dir=shm, prefix="tvcache-test-"))
    arguments = [str(template), str(tmp_path / "store"), str(node_cache), str(tmp_path / "snapshot")]
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, *arguments],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "TMPDIR": str(tmp_path)},  # the killed factory's sandbox folders stay in tmp_path
        )
        try:
            wait_until(lambda: any(not path.name.endswith(".lock") for path in node_cache.iterdir()), timeout=60)
        finally:
            child.send_signal(signal.SIGKILL)
            assert child.stdout is not None
            published = child.stdout.read()
            child.wait()
        assert published == ""  # killed before it finished, mid-copy
        entries = [path.name for path in node_cache.iterdir()]
        assert not [name for name in entries if re.fullmatch("[0-9a-f]{64}", name)], entries  # nothing a fork takes
        assert [name for name in entries if name.endswith(".partial")]
    finally:
        shutil.rmtree(node_cache)
