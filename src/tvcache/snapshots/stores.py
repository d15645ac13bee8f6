"""Blob stores: immutable snapshot data by content address, reference counted per publication.

A ``BlobStore`` is what every process that may fork a published snapshot can reach. ``DirectoryStore`` keeps the
blobs as files under a directory: ``/dev/shm/...`` for the worker processes of one machine (it outlives them,
not a reboot), a local disk directory for a durable cache that restarts, a shared filesystem for a cluster.
``tvcache.integrations.ray.RayObjectStore`` keeps them in Ray's object store.

Digests and publication ids come from snapshot records (a journal, a server's reply): ``check_reference``
refuses any that is not one, so a record can never name a path outside a store.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

from ..errors import SandboxError, SnapshotUnusable

__all__ = [
    "BlobStore",
    "DirectoryStore",
    "blob_digest",
    "check_digest",
    "check_reference",
    "fetch_verified",
    "is_digest",
    "new_publication_id",
    "open_store",
]

Reference = tuple[str, str]
"""One publication's reference on one blob: ``(digest, publication)``."""

_DIGEST = re.compile(r"[0-9a-f]{64}")  # blob_digest: BLAKE2b-256, hex
_PUBLICATION_ID = re.compile(r"[0-9a-f]{16}")  # new_publication_id: 8 random bytes, hex


def blob_digest(data: bytes) -> str:
    """The content address of a blob: BLAKE2b-256, hex."""
    return hashlib.blake2b(data, digest_size=32).hexdigest()


def new_publication_id() -> str:
    """A new publication's id: the name of its references on the blobs it holds."""
    return secrets.token_hex(8)


def is_digest(value: object) -> bool:
    """Whether ``value`` is a blob address: 64 lowercase hex digits."""
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None


def check_digest(digest: object) -> str:
    """``digest`` if it is a blob address (64 lowercase hex digits); SandboxError otherwise. A digest from a
    record names a file of a store or a node cache: anything else (``../x``) must never reach a path."""
    if not isinstance(digest, str) or not is_digest(digest):
        raise SnapshotUnusable(
            f"{digest!r} is not a snapshot blob address (64 hex digits): the record is corrupt or forged, so its "
            "snapshot is not used (the state will be rebuilt by replay)"
        )
    return digest


def check_reference(digest: object, publication: object) -> Reference:
    """``(digest, publication)`` if both are well formed (``check_digest``; a publication id is 16 lowercase hex
    digits, ``new_publication_id``); SandboxError otherwise."""
    if not isinstance(publication, str) or not _PUBLICATION_ID.fullmatch(publication):
        raise SnapshotUnusable(
            f"{publication!r} is not a publication id (16 hex digits): the record is corrupt or forged, so its "
            "snapshot is not used (the state will be rebuilt by replay)"
        )
    return check_digest(digest), publication


class BlobStore(Protocol):
    """A store of immutable blobs by digest, reachable from every process that forks. Each ``put`` adds one
    reference (``publication``); ``release`` drops it, and the blob is deleted with its last reference.

    ``name`` identifies the store in the snapshot records (``"dir:<path>"`` lets a reopened durable cache
    check that a record's data is still there; see ``open_store``)."""

    @property
    def name(self) -> str: ...

    def put(self, digest: str, data: bytes, publication: str) -> None: ...

    def retain(self, digests: Sequence[str], publication: str) -> list[str]:
        """Add ``publication``'s reference to each of ``digests`` the store holds, without sending the data;
        returns the digests it does not hold (to be ``put``)."""
        ...

    def holds(self, references: Sequence[Reference]) -> list[bool]:
        """For each ``(digest, publication)``: whether the store holds the blob with that reference on it
        (False once the publication released it, whoever released it)."""
        ...

    def get(self, digest: str) -> bytes | None:
        """The blob, or None when the store no longer has it (released, or lost)."""
        ...

    def release(self, digest: str, publication: str) -> None: ...


class DirectoryStore:
    """Blobs as files under ``root`` (a directory every forking process can read): ``blobs/<d[:2]>/<d>``, one
    reference file per publication under ``refs/<d>/``; writes are atomic renames, bookkeeping runs under a
    ``flock``, so any number of processes (on any number of nodes, over a shared filesystem) use one store.

    What the store creates is private to its user: files ``mode`` 0o600, directories 0o700 (the read bits of
    ``mode`` made searchable), whatever the umask. A store that several users share must say so: every one of
    them takes and releases references, so pass ``mode=0o660`` and give the users one group (a setgid ``root``).
    Every process must name the store by the same absolute path: the path is in each snapshot record, and a
    process releases a record's references only into the store the record names.

    Failures of the directory itself (deleted, unwritable, on a full filesystem) raise SandboxError naming it.
    """

    def __init__(self, root: str | os.PathLike[str], *, mode: int = 0o600) -> None:
        if mode & ~0o666 or (mode & 0o600) != 0o600:
            raise ValueError(f"mode must give its owner read and write and no execute bits, got {oct(mode)}")
        self.root = Path(root).absolute()  # absolute: the name is how a reopened cache finds the store again
        self.mode = mode
        self._dir_mode = mode | ((mode & 0o444) >> 2)
        self._lock_path = self.root / "lock"
        with self._failures("create the store"):
            self._mkdir(self.root, parents=True)
            for sub in ("blobs", "refs"):
                self._mkdir(self.root / sub)

    @property
    def name(self) -> str:
        return f"dir:{self.root}"

    def _blob(self, digest: str) -> Path:
        return self.root / "blobs" / digest[:2] / digest

    def _ref(self, digest: str, publication: str) -> Path:
        return self.root / "refs" / digest / publication

    def _mkdir(self, path: Path, *, parents: bool = False) -> None:
        """Make ``path`` with the store's directory mode (its parents, if asked, with the umask's)."""
        if parents:
            path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir()
        except FileExistsError:
            return
        os.chmod(path, self._dir_mode)  # not the umask's

    def _create(self, path: Path) -> int:
        """Create (or open) the file ``path`` with the store's mode; returns its descriptor."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, self.mode)
        try:
            if os.fstat(fd).st_uid == os.geteuid():
                os.fchmod(fd, self.mode)  # not the umask's
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _add_reference(self, digest: str, publication: str) -> bool:
        """Create ``publication``'s reference file on ``digest``; False if it existed already."""
        ref = self._ref(digest, publication)
        self._mkdir(ref.parent)
        existed = ref.exists()
        os.close(self._create(ref))
        return not existed

    def _drop_reference(self, digest: str, publication: str) -> None:
        """Remove a reference file, and the blob with its last reference (caller holds the lock)."""
        refs = self.root / "refs" / digest
        (refs / publication).unlink(missing_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if not any(refs.iterdir()):
                refs.rmdir()
                self._blob(digest).unlink(missing_ok=True)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = self._create(self._lock_path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _failures(self, action: str) -> Iterator[None]:
        """Turn an OSError of the store's directory into a SandboxError saying which store and what to do."""
        try:
            yield
        except OSError as error:
            raise SandboxError(f"snapshot store {self.root}: cannot {action}: {error}; {_advice(error)}") from error

    def put(self, digest: str, data: bytes, publication: str) -> None:
        check_reference(digest, publication)
        with self._failures(f"store blob {digest[:16]}"), self._locked():
            added = self._add_reference(digest, publication)  # before the blob: holds() needs both
            blob = self._blob(digest)
            if blob.exists():
                return
            partial = blob.with_name(f"{digest}.{secrets.token_hex(4)}.partial")
            try:
                self._mkdir(blob.parent)
                fd = self._create(partial)
                with open(fd, "wb") as file:
                    file.write(data)
                os.replace(partial, blob)
            except BaseException:
                if added:  # a reference on a blob that never came is a loss in check_invariants
                    with contextlib.suppress(OSError):
                        self._drop_reference(digest, publication)
                raise
            finally:
                partial.unlink(missing_ok=True)

    def retain(self, digests: Sequence[str], publication: str) -> list[str]:
        for digest in digests:
            check_reference(digest, publication)
        missing = []
        with self._failures("take references"), self._locked():
            for digest in digests:
                if not self._blob(digest).exists():
                    missing.append(digest)
                    continue
                self._add_reference(digest, publication)
        return missing

    def holds(self, references: Sequence[Reference]) -> list[bool]:
        for digest, publication in references:
            check_reference(digest, publication)
        # No lock: a reference file is created before and removed before its blob, so both existing means held.
        with self._failures("check references"):
            return [self._ref(digest, pub).exists() and self._blob(digest).exists() for digest, pub in references]

    def get(self, digest: str) -> bytes | None:
        check_digest(digest)
        with self._failures(f"read blob {digest[:16]}"):
            try:
                return self._blob(digest).read_bytes()
            except FileNotFoundError:
                return None

    def release(self, digest: str, publication: str) -> None:
        check_reference(digest, publication)
        with self._failures(f"release blob {digest[:16]}"), self._locked():
            self._drop_reference(digest, publication)

    def stats(self) -> dict[str, int]:
        """How many blobs the store holds and how many references are on them."""
        with self._locked():
            blobs = sum(1 for path in (self.root / "blobs").glob("*/*") if not path.name.endswith(".partial"))
            references = sum(1 for _ in (self.root / "refs").glob("*/*"))
        return {"blobs": blobs, "references": references}

    def publications(self) -> set[str]:
        """The publications holding a reference on some blob (for tests and post-mortems)."""
        with self._locked():
            return {path.name for path in (self.root / "refs").glob("*/*")}

    def check_invariants(self) -> None:
        """Verify that every blob has a reference and every reference a blob; raise SandboxError on the first
        violation (a blob without references is a leak, a reference without its blob a loss)."""
        with self._locked():
            blobs = {path.name for path in (self.root / "blobs").glob("*/*") if not path.name.endswith(".partial")}
            referenced = {path.name for path in (self.root / "refs").iterdir() if any(path.iterdir())}
        if leaked := blobs - referenced:
            raise SandboxError(f"{self.name}: blobs without references (leaked): {sorted(leaked)[:5]}")
        if lost := referenced - blobs:
            raise SandboxError(f"{self.name}: references on blobs that are gone: {sorted(lost)[:5]}")

    def __repr__(self) -> str:
        return f"DirectoryStore({str(self.root)!r})"


def _advice(error: OSError) -> str:
    if error.errno == errno.ENOENT:
        return (
            "the store directory was deleted or moved; recreate it (every process must reach it at the same path), "
            "and until then snapshots are not published (their states are rebuilt by replay)"
        )
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "its filesystem is full; free space or move the store to a larger one"
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (
            f"this process (uid {os.geteuid()}) may not write it; fix its permissions (a store several users share "
            "needs DirectoryStore(..., mode=0o660) and one group)"
        )
    return "check that the store directory is reachable and writable from this process"


def open_store(name: str) -> BlobStore | None:
    """The store named ``name`` (a ``BlobStore.name``) if this process can open it without other context: a
    ``DirectoryStore`` whose directory exists. None otherwise (another kind of store, or the directory is gone)."""
    kind, _, where = name.partition(":")
    if kind != "dir" or not where or not (Path(where) / "blobs").is_dir():
        return None
    return DirectoryStore(where)


def fetch_verified(store: BlobStore, digest: str) -> bytes:
    """The blob ``digest`` from ``store``, checked against its address: a blob that is gone or does not match
    raises SandboxError (the fork then starts fresh and replays), never reaching a sandbox."""
    data = store.get(digest)
    if data is None:
        raise SnapshotUnusable(
            f"snapshot blob {digest[:16]} is not in {store.name} (released, or lost with a node); "
            "the state will be rebuilt by replay"
        )
    actual = blob_digest(data)
    if actual != digest:
        raise SnapshotUnusable(
            f"snapshot blob from {store.name} does not match its address ({actual[:16]} != {digest[:16]}); "
            "refusing to fork corrupted data"
        )
    return data
