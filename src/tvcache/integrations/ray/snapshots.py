"""Ray's parts of published snapshots: a blob store in Ray's object store, and the Ray node as node identity.

Everything else lives in the core and works without Ray (``tvcache.snapshots``: ``DirectoryStore``,
``NodeCache``, the publication record; ``tvcache.sandboxes.published``: ``PublishedSnapshots``, shell stacks
published layer by layer). The names are re-exported here so that code written against this module keeps working.

``RayObjectStore`` keeps blobs in Ray's object store, put (and so owned) by a named actor, so any node of the
cluster can pull them (lost with the actor's node, or if the actor restarts: a fork that cannot fetch starts
fresh and replays, which costs time, never correctness). ``DirectoryStore`` keeps them under a directory every
node mounts (a shared filesystem), which survives node loss.

``PublishedSnapshots`` here is the core factory with the Ray node id as its default ``node_id``: several Ray nodes
may run on one host, and a fork on another node must fetch rather than read the maker's files.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import RayError

from ...errors import SandboxError
from ...sandboxes import published
from ...snapshots import (
    PUBLISHED,
    BlobStore,
    DirectoryStore,
    NodeCache,
    Publication,
    blob_digest,
    default_node_id,
    fetch_verified,
)

__all__ = [
    "PUBLISHED",
    "BlobStore",
    "DirectoryStore",
    "NodeCache",
    "Publication",
    "PublishedSnapshots",
    "RayObjectStore",
    "blob_digest",
    "current_node_id",
    "fetch_verified",
]


def current_node_id() -> str:
    """This node's identity: the Ray node id inside Ray, else the host name."""
    if ray.is_initialized():
        return str(ray.get_runtime_context().get_node_id())
    return default_node_id()


class PublishedSnapshots(published.PublishedSnapshots):
    """``tvcache.sandboxes.published.PublishedSnapshots`` whose ``node_id`` defaults to the Ray node id, as a
    rollout worker of the cluster uses it: ``PublishedSnapshots(SQLiteSandbox.factory("app.db"), RayObjectStore())``
    as the sandbox factory of ``RayCache().session(...)``."""

    @staticmethod
    def default_node_id() -> str:
        return current_node_id()


class BlobActor:
    """The owner of the blobs of a ``RayObjectStore`` (a named Ray actor): digest -> object ref and references."""

    def __init__(self) -> None:
        self._blobs: dict[str, list[Any]] = {}
        self._refs: dict[str, set[str]] = {}

    def put(self, digest: str, publication: str, data: bytes) -> None:
        self._refs.setdefault(digest, set()).add(publication)
        if digest not in self._blobs:
            # Put by this actor, so this actor owns the object: it outlives the worker that published it.
            self._blobs[digest] = [ray.put(data)]

    def retain(self, digests: list[str], publication: str) -> list[str]:
        missing = []
        for digest in digests:
            if digest in self._blobs:
                self._refs.setdefault(digest, set()).add(publication)
            else:
                missing.append(digest)
        return missing

    def holds(self, references: list[tuple[str, str]]) -> list[bool]:
        return [
            digest in self._blobs and publication in self._refs.get(digest, ()) for digest, publication in references
        ]

    def get(self, digest: str) -> list[Any] | None:
        """The blob's object ref, in a list so that Ray hands back the reference, not the value."""
        return self._blobs.get(digest)

    def release(self, digest: str, publication: str) -> None:
        holders = self._refs.get(digest)
        if holders is None:
            return
        holders.discard(publication)
        if not holders:
            del self._refs[digest]
            self._blobs.pop(digest, None)

    def stats(self) -> dict[str, int]:
        return {"blobs": len(self._blobs), "references": sum(len(refs) for refs in self._refs.values())}


class RayObjectStore:
    """Blobs in Ray's object store, put by the named actor ``tvcache-blobs`` (created on first use) so that it owns
    them: they outlive the worker that published them, and any node can pull them."""

    ACTOR = "tvcache-blobs"

    def __init__(self, *, namespace: str = "tvcache", timeout: float = 60.0) -> None:
        if not ray.is_initialized():
            raise SandboxError("RayObjectStore needs a connected Ray process: call ray.init() first")
        self.namespace = namespace
        self.timeout = timeout
        # Any: Ray's stubs type actor methods as plain functions, without ``.remote``.
        self._actor: Any = (
            ray.remote(BlobActor)
            .options(
                name=self.ACTOR,
                namespace=namespace,
                get_if_exists=True,
                lifetime="detached",
                num_cpus=0,
                max_restarts=-1,
                max_task_retries=-1,
            )
            .remote()
        )

    @property
    def name(self) -> str:
        return f"ray:{self.namespace}/{self.ACTOR}"

    def put(self, digest: str, data: bytes, publication: str) -> None:
        ray.get(self._actor.put.remote(digest, publication, data), timeout=self.timeout)

    def retain(self, digests: Sequence[str], publication: str) -> list[str]:
        missing: list[str] = ray.get(self._actor.retain.remote(list(digests), publication), timeout=self.timeout)
        return missing

    def holds(self, references: Sequence[tuple[str, str]]) -> list[bool]:
        held: list[bool] = ray.get(self._actor.holds.remote(list(references)), timeout=self.timeout)
        return held

    def get(self, digest: str) -> bytes | None:
        try:
            refs = ray.get(self._actor.get.remote(digest), timeout=self.timeout)
            if not refs:
                return None
            data = ray.get(refs[0], timeout=self.timeout)
        except RayError:  # the node holding it is gone, or the owner restarted: the blob is lost
            return None
        return bytes(data)

    def release(self, digest: str, publication: str) -> None:
        ray.get(self._actor.release.remote(digest, publication), timeout=self.timeout)

    def stats(self) -> dict[str, int]:
        stats: dict[str, int] = ray.get(self._actor.stats.remote(), timeout=self.timeout)
        return stats

    def __repr__(self) -> str:
        return f"RayObjectStore(namespace={self.namespace!r})"
