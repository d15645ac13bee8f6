"""File and directory snapshots as blobs (SQLite databases, folder trees), and this node's copies of them.

``pack`` turns a snapshot's data into one blob (a file as is, a directory as the canonical GNU tar archive of
``tvcache.snapshots.archive``: nanosecond times, extended attributes, owners, modes, hard links), ``unpack``
writes it back. ``NodeCache`` holds the data of snapshots made or fetched on this node by digest, shared by
every process of the node, bounded by bytes, least recently used first, never evicting an entry a fork is
reading.

An entry appears under its digest only complete: it is written as ``<digest>.<token>.partial`` and renamed, so a
process killed while writing one leaves a ``.partial`` that no fork ever reads. A writer pins its digest while
it writes, and the tar it may run dies with it, so a ``.partial`` no one pins is abandoned: the next tidying pass
on the node removes it, and one still pinned is never touched. Forks trust the entries (they
are not verified again), so the cache's directory must be this user's alone: the default is per user
(``tvcache-node-cache-<uid>`` in the temp directory, mode 0700), and a root owned by another user or writable by
group or others is refused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from ..errors import SandboxError, SnapshotUnusable
from .archive import pack_tree, unpack_tree
from .publication import FILE, LEGACY_TAR, TREE
from .stores import BlobStore, check_digest, fetch_verified, is_digest

__all__ = ["NodeCache", "check_format", "default_node_cache_root", "pack", "unpack"]


def pack(path: Path) -> tuple[bytes, str]:
    """A snapshot's data as one blob and its format: ``file`` (the bytes) or ``tree`` (a directory tree)."""
    if path.is_file():
        return path.read_bytes(), FILE
    if not path.is_dir():
        raise SandboxError(f"snapshot {path} is neither a file nor a directory; it cannot be published")
    return pack_tree(path), TREE


def unpack(data: bytes, fmt: str, dest: Path) -> None:
    """Write a blob to ``dest`` (which must not exist) as a file or a directory tree."""
    check_format(fmt)
    if fmt == FILE:
        dest.write_bytes(data)
    else:
        unpack_tree(data, dest)


def check_format(fmt: str) -> None:
    """SandboxError unless ``unpack`` can write blobs of format ``fmt`` (say why, and that the state replays)."""
    if fmt == LEGACY_TAR:
        raise SnapshotUnusable(
            "this folder snapshot was published by an older tvcache as a Python tar archive, which keeps times to "
            "the microsecond and no extended attributes (two different trees could share its address); it is not "
            "forked, and the state will be rebuilt by replay"
        )
    if fmt not in (FILE, TREE):
        raise SandboxError(f"unknown published snapshot format {fmt!r}; is this tvcache older than the publisher?")


def default_node_cache_root() -> Path:
    """This user's node cache directory: ``tvcache-node-cache-<uid>`` in the temp directory."""
    return Path(tempfile.gettempdir()) / f"tvcache-node-cache-{os.geteuid()}"


class NodeCache:
    """Fetched (and locally published) snapshot data on this node, by digest, bounded by ``max_bytes``.

    ``root`` (default ``default_node_cache_root()``) is created with mode 0700; an existing one must belong to
    this user and not be writable by group or others (forks trust what it holds): SandboxError otherwise."""

    def __init__(self, root: str | os.PathLike[str] | None = None, *, max_bytes: int = 2 * 1024**3) -> None:
        self.root = Path(root) if root is not None else default_node_cache_root()
        self._check_root()
        self.max_bytes = max_bytes
        self.fetched = 0
        self.reused = 0
        self._lock = threading.Lock()

    def _check_root(self) -> None:
        with self._failures("create the node cache"):
            self.root.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                self.root.mkdir()
                os.chmod(self.root, 0o700)  # not the umask's
            link, info = os.lstat(self.root), os.stat(self.root)
        if stat.S_ISLNK(link.st_mode) and link.st_uid != os.geteuid():
            raise SandboxError(
                f"node cache {self.root} is a symbolic link of uid {link.st_uid}, who could point it elsewhere; "
                "pass NodeCache(root=...) a directory of yours"
            )
        if not stat.S_ISDIR(info.st_mode):
            raise SandboxError(f"node cache {self.root} is not a directory; pass NodeCache(root=...) a directory")
        if info.st_uid != os.geteuid():
            raise SandboxError(
                f"node cache {self.root} belongs to uid {info.st_uid}, not to this process's uid {os.geteuid()}; "
                "forks trust its entries, so each user needs its own: pass NodeCache(root=...) a directory of yours"
            )
        if info.st_mode & 0o022:
            raise SandboxError(
                f"node cache {self.root} is writable by group or others (mode {oct(stat.S_IMODE(info.st_mode))}); "
                f"forks trust its entries, so make it private (chmod 700 {self.root}) or pass another root"
            )

    def path(self, digest: str) -> Path:
        """Where ``digest``'s entry is (SandboxError if ``digest`` is not a blob address)."""
        return self.root / check_digest(digest)

    @contextlib.contextmanager
    def pinned(self, digest: str) -> Iterator[None]:
        """Hold ``digest``'s entry against eviction (any process on this node) while a fork reads it."""
        lock = self.path(digest).with_name(f"{digest}.lock")
        with self._failures("lock an entry"):
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)

    def adopt(self, digest: str, source: Path, *, fmt: str, data: bytes) -> Path:
        """Move a locally made snapshot's data (``data``, packed in ``fmt``) in as ``digest``'s entry (the caller
        pins it). Within one filesystem the data is renamed in; across filesystems the blob is unpacked as a
        fetch would, into a ``.partial`` renamed when complete. ``source`` is gone afterwards."""
        dest = self.path(digest)
        with self._failures(f"adopt {source}"):
            if dest.exists():
                _remove(source)
            else:
                try:
                    os.rename(source, dest)
                except OSError as error:
                    if error.errno != errno.EXDEV:
                        if not dest.exists():  # not a concurrent adopt of the same data
                            raise
                    else:
                        self._install(digest, fmt, data)
                    _remove(source)
        self._evict()
        return dest

    def fetch(self, digest: str, fmt: str, store: BlobStore) -> Path:
        """``digest``'s entry, fetched from ``store`` and verified if this node does not hold it yet (the caller
        pins it)."""
        dest = self.path(digest)
        if dest.exists():
            os.utime(dest)  # recently used
            self.reused += 1
            return dest
        data = fetch_verified(store, digest)
        self._install(digest, fmt, data)
        self.fetched += 1
        self._evict()
        return dest

    def _install(self, digest: str, fmt: str, data: bytes) -> None:
        """Unpack ``data`` as ``digest``'s entry: into a ``.partial``, renamed only when complete.

        The writer pins the digest itself while it writes (whether or not its caller does), so no process takes
        the ``.partial`` for abandoned while it is being written. GNU tar, which writes a tree, dies with this
        process (``tvcache.children``), so once the pin goes with a killed writer nothing writes there any more.
        """
        dest = self.path(digest)
        partial = self.root / f"{digest}.{secrets.token_hex(4)}.partial"
        try:
            with self._failures(f"write entry {digest[:16]}"), self.pinned(digest):
                unpack(data, fmt, partial)
                try:
                    os.rename(partial, dest)
                except OSError:
                    if not dest.exists():
                        raise
                    # a concurrent fetch on this node won: use its copy
        finally:
            _remove(partial)

    @contextlib.contextmanager
    def _failures(self, action: str) -> Iterator[None]:
        """Turn an OSError of the cache's directory into a SandboxError saying which and what to do."""
        try:
            yield
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                advice = "its filesystem is full; free space or pass NodeCache(root=..., max_bytes=...) elsewhere"
            else:
                advice = "check that it exists and is writable by this process"
            raise SandboxError(f"node cache {self.root}: cannot {action}: {error}; {advice}") from error

    def drop(self, digest: str) -> None:
        """Remove ``digest``'s entry unless a fork is reading it."""
        self._try_remove(digest)

    def _evict(self) -> None:
        with self._lock:
            entries = []
            for entry in self.root.iterdir():
                if entry.name.endswith(".partial"):
                    self._remove_if_abandoned(entry)
                    continue
                if not is_digest(entry.name):  # locks, files that are not ours
                    continue
                with contextlib.suppress(OSError):
                    entries.append((entry.stat().st_mtime, entry, _size(entry)))
            total = sum(size for _, _, size in entries)
            for _, entry, size in sorted(entries, key=lambda item: item[0]):
                if total <= self.max_bytes:
                    break
                if self._try_remove(entry.name):
                    total -= size

    def _try_remove(self, digest: str) -> bool:
        return self._unless_pinned(digest, self.path(digest))

    def _remove_if_abandoned(self, partial: Path) -> None:
        """Remove a ``<digest>.<random>.partial`` a killed fetch left behind. Fetches write one only while they
        pin the digest, so one that no one pins is no longer being written."""
        digest = partial.name.split(".", 1)[0]
        if is_digest(digest):
            with contextlib.suppress(OSError):
                self._unless_pinned(digest, partial)

    def _unless_pinned(self, digest: str, path: Path) -> bool:
        """Remove ``path`` if no process pins ``digest`` (a fork reading it, or a fetch writing it)."""
        fd = os.open(self.path(digest).with_name(f"{digest}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # pinned
            _remove(path)
            return True
        finally:
            os.close(fd)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(
        os.lstat(os.path.join(directory, name)).st_size for directory, _, files in os.walk(path) for name in files
    )


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
