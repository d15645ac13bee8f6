"""File and directory snapshots as blobs (SQLite databases, folder trees), and this node's copies of them.

``pack`` turns a snapshot's data into one blob (a file as is, a directory as a tar archive that keeps modes),
``unpack`` writes it back. ``NodeCache`` holds the data of snapshots made or fetched on this node by digest,
shared by every process of the node, bounded by bytes, least recently used first, never evicting an entry a
fork is reading.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import secrets
import shutil
import tarfile
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from ..errors import SandboxError
from .stores import BlobStore, fetch_verified

__all__ = ["NodeCache", "pack", "unpack"]


def pack(path: Path) -> tuple[bytes, str]:
    """A snapshot's data as one blob and its format: ``file`` (the bytes) or ``tar`` (a directory tree)."""
    if path.is_file():
        return path.read_bytes(), "file"
    if not path.is_dir():
        raise SandboxError(f"snapshot {path} is neither a file nor a directory; it cannot be published")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        archive.add(path, arcname=".", recursive=False)
        for directory, dirs, files in os.walk(path):
            dirs.sort()
            for name in sorted(dirs + files):
                full = os.path.join(directory, name)
                archive.add(full, arcname=os.path.relpath(full, path), recursive=False)
    return buffer.getvalue(), "tar"


def unpack(data: bytes, fmt: str, dest: Path) -> None:
    """Write a blob to ``dest`` (which must not exist) as a file or a directory tree."""
    if fmt == "file":
        dest.write_bytes(data)
        return
    if fmt != "tar":
        raise SandboxError(f"unknown published snapshot format {fmt!r}; is this tvcache older than the publisher?")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as archive:
        archive.extractall(dest, filter=_safe_paths_exact_modes)


def _safe_paths_exact_modes(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    """The ``tar`` filter's refusals (absolute paths, members or links leaving ``dest``) without its mode changes:
    it clears setuid/setgid/sticky and group/other write bits, and a fork must show the modes the snapshot had."""
    return tarfile.tar_filter(member, dest).replace(mode=member.mode, deep=False)


class NodeCache:
    """Fetched (and locally published) snapshot data on this node, by digest, bounded by ``max_bytes``."""

    def __init__(self, root: str | os.PathLike[str] | None = None, *, max_bytes: int = 2 * 1024**3) -> None:
        self.root = Path(root) if root is not None else Path(tempfile.gettempdir()) / "tvcache-node-cache"
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.fetched = 0
        self.reused = 0
        self._lock = threading.Lock()

    def path(self, digest: str) -> Path:
        return self.root / digest

    @contextlib.contextmanager
    def pinned(self, digest: str) -> Iterator[None]:
        """Hold ``digest``'s entry against eviction (any process on this node) while a fork reads it."""
        fd = os.open(self.root / f"{digest}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)

    def adopt(self, digest: str, source: Path) -> Path:
        """Move a locally made snapshot's data in as ``digest``'s entry (the caller pins it)."""
        dest = self.path(digest)
        if dest.exists():
            _remove(source)
        else:
            try:
                os.replace(source, dest)
            except OSError:  # another filesystem
                shutil.move(source, dest)
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
        partial = self.root / f"{digest}.{secrets.token_hex(4)}.partial"
        try:
            if fmt == "tar":
                partial.mkdir()
            unpack(data, fmt, partial)
            try:
                os.rename(partial, dest)
            except OSError:  # a concurrent fetch on this node won: use its copy
                _remove(partial)
        finally:
            _remove(partial)
        self.fetched += 1
        self._evict()
        return dest

    def drop(self, digest: str) -> None:
        """Remove ``digest``'s entry unless a fork is reading it."""
        self._try_remove(digest)

    def _evict(self) -> None:
        with self._lock:
            entries = []
            for entry in self.root.iterdir():
                if entry.name.endswith((".lock", ".partial")):
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
        fd = os.open(self.root / f"{digest}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # pinned by a fork in progress
            _remove(self.path(digest))
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
