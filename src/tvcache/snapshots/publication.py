"""The record of a published snapshot: where its data went, kept in the snapshot's meta so that every process
reading the cache's records (a restarted one, another worker of the same server, another node) can fork it."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..protocol import Snapshot
from .stores import blob_digest, open_store

__all__ = ["LAYERS", "PUBLISHED", "LayerRef", "Publication", "default_node_id", "publication_available"]

PUBLISHED = "tvcache.published"
"""The snapshot meta key holding a publication: ``{"digest", "format", "node", "publication", "store"}``, plus
``"layers"`` (``[{"digest", "squashed"}]``, newest first) and ``"base"`` for a shell stack (format ``layers``)."""
LAYERS = "layers"  # a shell snapshot's meta key for its stack, and the format of its publication


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
        return cls(digest=str(data["digest"]), squashed=bool(data.get("squashed", False)))


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
        data = snapshot.meta.get(PUBLISHED)
        if not isinstance(data, Mapping):
            return None
        base = data.get("base")
        return cls(
            digest=str(data["digest"]),
            format=str(data["format"]),
            node=str(data["node"]),
            publication=str(data["publication"]),
            store=str(data["store"]),
            layers=tuple(LayerRef.from_json(layer) for layer in data.get("layers", ())),
            base=None if base is None else str(base),
        )

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

    False for a snapshot that was not published, or whose ``DirectoryStore`` no longer holds every blob with
    this publication's reference. True when it does, and for a store this process cannot open by name (Ray's
    object store): the fork then verifies each blob, and a missing one is refused and the state replayed."""
    publication = Publication.of(snapshot)
    if publication is None:
        return False
    if not publication.store.startswith("dir:"):
        return True
    store = open_store(publication.store)
    if store is None:
        return False
    return all(store.holds([(digest, publication.publication) for digest in publication.blobs()]))
