"""Blob stores: immutable snapshot data by content address, reference counted per publication.

A ``BlobStore`` is what every process that may fork a published snapshot can reach. ``DirectoryStore`` keeps the
blobs as files under a directory: ``/dev/shm/...`` for the worker processes of one machine (it outlives them,
not a reboot), a local disk directory for a durable cache that restarts, a shared filesystem for a cluster.
``tvcache.integrations.ray.RayObjectStore`` keeps them in Ray's object store.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

from ..errors import SandboxError

__all__ = ["BlobStore", "DirectoryStore", "blob_digest", "fetch_verified", "open_store"]

Reference = tuple[str, str]
"""One publication's reference on one blob: ``(digest, publication)``."""


def blob_digest(data: bytes) -> str:
    """The content address of a blob: BLAKE2b-256, hex."""
    return hashlib.blake2b(data, digest_size=32).hexdigest()


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
    ``flock``, so any number of processes (on any number of nodes, over a shared filesystem) use one store."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()  # absolute: the name is how a reopened cache finds the store again
        for sub in ("blobs", "refs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._lock_path = self.root / "lock"

    @property
    def name(self) -> str:
        return f"dir:{self.root}"

    def _blob(self, digest: str) -> Path:
        return self.root / "blobs" / digest[:2] / digest

    def _ref(self, digest: str, publication: str) -> Path:
        return self.root / "refs" / digest / publication

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def put(self, digest: str, data: bytes, publication: str) -> None:
        with self._locked():
            ref = self._ref(digest, publication)
            ref.parent.mkdir(parents=True, exist_ok=True)
            ref.touch()
            blob = self._blob(digest)
            if blob.exists():
                return
            blob.parent.mkdir(parents=True, exist_ok=True)
            partial = blob.with_name(f"{digest}.{secrets.token_hex(4)}.partial")
            partial.write_bytes(data)
            os.replace(partial, blob)

    def retain(self, digests: Sequence[str], publication: str) -> list[str]:
        missing = []
        with self._locked():
            for digest in digests:
                if not self._blob(digest).exists():
                    missing.append(digest)
                    continue
                ref = self._ref(digest, publication)
                ref.parent.mkdir(parents=True, exist_ok=True)
                ref.touch()
        return missing

    def holds(self, references: Sequence[Reference]) -> list[bool]:
        # No lock: a reference file is created before and removed before its blob, so both existing means held.
        return [self._ref(digest, pub).exists() and self._blob(digest).exists() for digest, pub in references]

    def get(self, digest: str) -> bytes | None:
        try:
            return self._blob(digest).read_bytes()
        except FileNotFoundError:
            return None

    def release(self, digest: str, publication: str) -> None:
        refs = self.root / "refs" / digest
        with self._locked():
            (refs / publication).unlink(missing_ok=True)
            if refs.is_dir() and not any(refs.iterdir()):
                refs.rmdir()
                self._blob(digest).unlink(missing_ok=True)

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
        raise SandboxError(
            f"snapshot blob {digest[:16]} is not in {store.name} (released, or lost with a node); "
            "the state will be rebuilt by replay"
        )
    actual = blob_digest(data)
    if actual != digest:
        raise SandboxError(
            f"snapshot blob from {store.name} does not match its address ({actual[:16]} != {digest[:16]}); "
            "refusing to fork corrupted data"
        )
    return data
