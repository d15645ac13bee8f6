"""Whose storage an evicted snapshot is, and how it is freed.

A process frees only storage it made: an evicted snapshot one of its sessions took is freed by the factory that
made it, from the record that factory returned. Any other record (reloaded from the journal, handed back by a
server any client writes to) is only a claim about where storage is, so by default only a path that really lies
in the store's snapshot directory is freed, and the rest is forgotten (``SnapshotOwners.free``). ``discard``
replaces that default for such records (a server: they go back to the clients that own them).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from pathlib import Path

from ..protocol import DiscardsForeign, SandboxFactory, Snapshot, discard_snapshot_files, snapshot_inside
from ..snapshots.publication import PUBLISHED

__all__ = ["SnapshotOwners"]

Discard = Callable[[Snapshot], None]


class SnapshotOwners:
    """The snapshots this process made, and the backends it knows. Thread-safe."""

    def __init__(self, *, discard: Discard | None = None) -> None:
        self._lock = threading.Lock()
        # Snapshots this process's sessions made: path -> (the record their factory returned, its discard).
        self._owned: dict[str, tuple[Snapshot, Discard]] = {}
        self._discarders: dict[str, Discard] = {}  # kind -> ``factory.discard``
        # Backends that can release what a record they did not make holds in their own storage (a published
        # snapshot's references in their store): kind -> ``factory.discard_foreign``.
        self._foreign_discarders: dict[str, Discard] = {}
        self._forgotten = 0  # evicted records naming storage this process does not own, left alone
        self._discard_default = discard

    def register(self, factory: SandboxFactory) -> None:
        with self._lock:
            self._discarders.setdefault(factory.kind, factory.discard)
            if isinstance(factory, DiscardsForeign):
                self._foreign_discarders.setdefault(factory.kind, factory.discard_foreign)

    def own(self, snapshot: Snapshot, factory: SandboxFactory) -> None:
        """Evicting ``snapshot`` frees it through the factory that made it (two factories of one backend kind
        keep separate storage), from this record: the one evicted may have come back over the wire."""
        with self._lock:
            self._owned[snapshot.path] = (snapshot, factory.discard)

    def free(self, snapshot: Snapshot, *, snapshot_root: Path, durable: bool) -> None:
        """Free an evicted snapshot's storage if this process made it; hand any other record to ``discard``
        (by default ``_release_foreign``)."""
        with self._lock:
            owned = self._owned.pop(snapshot.path, None)
        if owned is not None:
            record, discard = owned
            discard(record)
        elif self._discard_default is not None:
            self._discard_default(snapshot)
        else:
            self._release_foreign(snapshot, snapshot_root=snapshot_root, durable=durable)

    def free_all(self) -> None:
        """Free every snapshot this process made (an in-memory store closing)."""
        with self._lock:
            owned, self._owned = list(self._owned.values()), {}
        for record, discard in owned:
            try:
                discard(record)
            except Exception as error:  # one backend's failure must not keep the others' storage
                warnings.warn(f"freeing snapshot {record.path} at close failed: {error}", RuntimeWarning, stacklevel=1)

    def _release_foreign(self, snapshot: Snapshot, *, snapshot_root: Path, durable: bool) -> None:
        """An evicted record no session of this process made: a reopened cache's journal, or a server's answer
        (any of its clients may have written it, naming any path). Never delete what it names unless it lies in
        the snapshot directory, symlinks resolved:

        - a durable store's own directory: what its journal records there, an earlier process of this store
          made, so its backend frees it as if made here;
        - anywhere else in the snapshot directory (clients on one machine sharing a ``snapshot_dir``): only the
          verified path is removed, since the record's ``meta`` (layers, images) is not this process's to trust;
        - a backend with ``discard_foreign`` releases what it can verify in its own storage (a published
          snapshot's references in its store);
        - nothing else is touched: the record is forgotten (with a warning the first time, unless its data is
          published: that lives in a store, not on this machine).
        """
        inside = snapshot_inside(snapshot, snapshot_root)
        with self._lock:
            discard = self._discarders.get(snapshot.kind)
            foreign = self._foreign_discarders.get(snapshot.kind)
        if inside is not None and durable:
            (discard or discard_snapshot_files)(snapshot)
            return
        if foreign is not None:
            foreign(snapshot)
        if inside is not None:
            discard_snapshot_files(snapshot, root=snapshot_root)
        elif PUBLISHED not in snapshot.meta:  # a published one's data is in a store, released above
            with self._lock:
                self._forgotten += 1
                first = self._forgotten == 1
            if first:
                warnings.warn(
                    f"not deleting {snapshot.path!r}, an evicted {snapshot.kind!r} snapshot this process did not "
                    f"make and that is not in its snapshot directory {str(snapshot_root)!r}: a snapshot record "
                    "names storage, it does not prove whose it is. Such records are forgotten (this warning is "
                    "given once); point the processes of one machine at one snapshot directory so that whichever "
                    "evicts a snapshot frees it",
                    RuntimeWarning,
                    stacklevel=4,
                )
