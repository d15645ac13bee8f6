"""Snapshot data shared across processes, restarts and nodes (standard library only).

- ``BlobStore``: immutable blobs by content address, one reference per publication; ``DirectoryStore`` keeps
  them in a directory the processes share (``/dev/shm/...`` on one machine, a shared filesystem for a cluster).
- ``Publication``: what a published snapshot's record carries (``meta["tvcache.published"]``), so that any process
  reading the record can fetch the data; ``publication_available`` tells a reopened cache whether it still can.
- ``NodeCache``: the file and tree snapshots (SQLite, folder) made or fetched on this node, by digest, in a
  directory private to its user.
- ``pack``/``unpack``: a snapshot's data as one blob; a tree as the canonical GNU tar archive of
  ``tvcache.snapshots.archive``, which shell layers use too.

The factory wrapper that publishes snapshots as sandboxes make them is
``tvcache.sandboxes.published.PublishedSnapshots`` (also ``tvcache.PublishedSnapshots``)::

    from tvcache import Cache, DirectoryStore, PublishedSnapshots
    from tvcache.sandboxes import ShellSandbox

    factory = PublishedSnapshots(ShellSandbox.factory("repo"), DirectoryStore("/dev/shm/tvcache-snapshots"))
"""

from .node_cache import NodeCache, pack, unpack
from .publication import PUBLISHED, LayerRef, Publication, default_node_id, publication_available
from .stores import BlobStore, DirectoryStore, blob_digest, fetch_verified, open_store

__all__ = [
    "PUBLISHED",
    "BlobStore",
    "DirectoryStore",
    "LayerRef",
    "NodeCache",
    "Publication",
    "blob_digest",
    "default_node_id",
    "fetch_verified",
    "open_store",
    "pack",
    "publication_available",
    "unpack",
]
