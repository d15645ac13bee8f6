"""The record of a published snapshot: where its data went, kept in the snapshot's meta so that every process
reading the cache's records (a restarted one, another worker of the same server, another node) can fork it."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import SandboxError, SnapshotUnusable
from ..protocol import Snapshot
from .stores import blob_digest, check_digest, check_reference, open_store

__all__ = [
    "FILE",
    "LAYERS",
    "LEGACY_TAR",
    "PUBLISHED",
    "TREE",
    "LayerRef",
    "Publication",
    "default_node_id",
    "publication_available",
    "release_dropped",
]

PUBLISHED = "tvcache.published"
"""The snapshot meta key holding a publication: ``{"digest", "format", "node", "publication", "store"}``, plus
``"layers"`` (``[{"digest", "squashed"}]``, newest first) and ``"base"`` for a shell stack (format ``layers``)."""
FILE = "file"  # one file as is (SQLite)
TREE = "tree"  # a directory tree as a canonical GNU tar archive (tvcache.snapshots.archive)
LAYERS = "layers"  # a shell snapshot's meta key for its stack, and the format of its publication
LEGACY_TAR = "tar"
"""Trees published by tvcache before ``tree``: Python ``tarfile`` archives, which keep modification times to the
microsecond and no extended attributes, so two different trees could share one address. Never forked: the state
is rebuilt by replay (and a reopened cache drops the record)."""
FORKABLE = frozenset({FILE, TREE, LAYERS})


def default_node_id() -> str:
    """This machine's identity: its host name. A fork on the node that made a snapshot uses the local copy;
    Ray's integration uses the Ray node id instead (several Ray nodes may share one host)."""
    return os.uname().nodename


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerRef:
    """One layer of a published stack: its content address, and whether it is a squash of a whole stack (it
    then replaces the base tree instead of lying above it)."""

    digest: str
    squashed: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"digest": self.digest, "squashed": self.squashed}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LayerRef:
        """The layer a record names; SandboxError if its digest is not a blob address."""
        if not isinstance(data, Mapping):
            raise SnapshotUnusable(f"a published layer must be an object, not {data!r}: the record is corrupt")
        return cls(digest=check_digest(data.get("digest")), squashed=bool(data.get("squashed", False)))


@dataclass(frozen=True, kw_only=True, slots=True)
class Publication:
    """Where a snapshot's data was published. ``digest`` addresses the blob (formats ``file``, ``tar``) or, for a
    shell stack (format ``layers``), the list of its layers, each its own blob; ``layers`` and ``base`` (the
    tree the stack lies over) are set only then."""

    digest: str
    format: str
    node: str
    publication: str
    store: str
    layers: tuple[LayerRef, ...] = ()
    base: str | None = None

    @classmethod
    def of(cls, snapshot: Snapshot) -> Publication | None:
        """The publication a snapshot record carries; None if it was not published. A malformed one (a digest
        or publication id that is not one: they name files in stores and node caches) raises SandboxError, so
        its snapshot is never forked (the state is rebuilt by replay) and nothing it names is touched."""
        data = snapshot.meta.get(PUBLISHED)
        if data is None:
            return None
        try:
            if not isinstance(data, Mapping):
                raise TypeError(f"a publication is an object, not {type(data).__name__}")
            digest, publication = check_reference(data.get("digest"), data.get("publication"))
            layers = data.get("layers", ())
            if not isinstance(layers, list | tuple):
                raise TypeError(f"layers is a list, not {type(layers).__name__}")
            base = data.get("base")
            return cls(
                digest=digest,
                format=str(data["format"]),
                node=str(data["node"]),
                publication=publication,
                store=str(data["store"]),
                layers=tuple(LayerRef.from_json(layer) for layer in layers),
                base=None if base is None else str(base),
            )
        except (KeyError, TypeError) as error:
            raise SnapshotUnusable(
                f"snapshot {snapshot.path}: its publication record is malformed ({error!r}); the snapshot is not "
                "used (the state will be rebuilt by replay)"
            ) from error

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "digest": self.digest,
            "format": self.format,
            "node": self.node,
            "publication": self.publication,
            "store": self.store,
        }
        if self.format == LAYERS:
            data["layers"] = [layer.to_json() for layer in self.layers]
            data["base"] = self.base
        return data

    def blobs(self) -> list[str]:
        """The digests of the blobs this publication holds a reference on."""
        if self.format == LAYERS:
            return list(dict.fromkeys(layer.digest for layer in self.layers))
        return [self.digest]


def stack_digest(layers: Sequence[LayerRef]) -> str:
    """The address of a shell stack: its layers' addresses, newest first."""
    return blob_digest("".join(f"{layer.digest} {int(layer.squashed)}\n" for layer in layers).encode())


def publication_available(snapshot: Snapshot) -> bool:
    """Whether a snapshot's data can still be fetched from where it was published, when its local files are
    gone (a durable cache reopened by a new process, whose shell layers died with the old one).

    False for a snapshot that was not published, whose record is malformed or in a format this process does not
    fork (``LEGACY_TAR``), or whose ``DirectoryStore`` no longer holds every blob with this publication's
    reference. True when it does, and for a store this process cannot open by name (Ray's object store): the
    fork then verifies each blob, and a missing one is refused and the state replayed."""
    try:
        publication = Publication.of(snapshot)
    except SandboxError:
        return False
    if publication is None or publication.format not in FORKABLE:
        return False
    if not publication.store.startswith("dir:"):
        return True
    store = open_store(publication.store)
    if store is None:
        return False
    return all(store.holds([(digest, publication.publication) for digest in publication.blobs()]))


def release_dropped(snapshot: Snapshot) -> None:
    """Release the references a published record holds, when a reopened cache drops it because its data is no
    longer all there (``publication_available`` is False): no process will ever evict the record, so nothing
    else would release its references on the blobs that are left. Only the store the record names is touched;
    a malformed record or a store this process cannot open releases nothing. SandboxError if the store fails."""
    try:
        publication = Publication.of(snapshot)
    except SandboxError:
        return  # what a malformed record names is never touched
    store = None if publication is None else open_store(publication.store)
    if publication is None or store is None:
        return
    for digest in publication.blobs():
        store.release(digest, publication.publication)
