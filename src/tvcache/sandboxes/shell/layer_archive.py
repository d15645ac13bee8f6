"""Shell sandbox layers as content-addressed blobs: a canonical archive of one overlay layer, and the layers of
this process by content address.

A shell snapshot is a stack of overlay layers (``tvcache.sandboxes.shell.layers``); ``PublishedSnapshots``
(``tvcache.sandboxes.published``) publishes each layer as its own blob, so a stack shares its lower layers with
the publications of its parent snapshots.

**The archive** is the canonical tree archive of ``tvcache.snapshots.archive`` (GNU tar: nanosecond times,
extended attributes, numeric owners, sorted) without overlay's bookkeeping about the publishing node's own
inodes: ``origin``, ``uuid``, ``impure``, ``nlink`` (file handles and caches that overlay reads only from an upper
layer, never from a lower one, which is all a layer ever is again). So whiteouts (character devices 0/0), opaque
directories (``trusted.overlay.opaque``; ``user.overlay.opaque`` on a mount with ``userxattr``), redirects,
symlinks, modes, owners, ACLs, hard links, FIFOs and empty directories come through, and equal contents give
equal bytes.

**The cache** (``LayerCache``) maps content addresses to live layers of this process's ``LayerStore``: the
layers it published (their digest is computed once) and the layers it fetched. A fetched layer is unpacked
into a new layer directory of the store and held by one cache reference, so later forks in this process reuse
it; the cache is bounded by bytes and gives up its reference on the least recently used layers that nothing
else holds. A layer is deleted only when its last reference goes, so a sandbox or a snapshot using a layer
never loses it to the cache's eviction.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

from ...errors import SandboxError
from ...snapshots.archive import pack_tree, require_gnu_tar, unpack_tree
from ...snapshots.publication import LayerRef
from .layers import Layer, LayerStore

__all__ = ["LayerCache", "LayerRef", "pack_layer", "require_gnu_tar", "unpack_layer"]

OVERLAY_NAMESPACES = ("trusted.overlay.", "user.overlay.")
LOCAL_OVERLAY_XATTRS = tuple(
    f"{namespace}{name}" for namespace in OVERLAY_NAMESPACES for name in ("origin", "uuid", "impure", "nlink")
)


# ---------------------------------------------------------------------------------------------- archive


def pack_layer(path: Path) -> bytes:
    """The layer at ``path`` as a canonical PAX tar (see the module docstring)."""
    return pack_tree(path, exclude_xattrs=LOCAL_OVERLAY_XATTRS)


def unpack_layer(data: bytes, dest: Path) -> None:
    """Unpack an archive made by ``pack_layer`` into ``dest`` (which must not exist), owners, modes, times and
    extended attributes included (which takes root, as overlay mounts do)."""
    unpack_tree(data, dest, what="a published layer")


# ---------------------------------------------------------------------------------------------- cache


class LayerCache:
    """This process's layers by content address: those it published and those it fetched (module docstring).

    ``fetched``/``reused`` count layers unpacked here and layers found here by a fork; ``uploaded``/``shared``
    count layers a publication sent to the store and layers it only referenced because the store held them.
    """

    def __init__(self, layers: LayerStore, *, max_bytes: int = 1024**3) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.layers = layers
        self.max_bytes = max_bytes
        self.fetched = 0
        self.reused = 0
        self.uploaded = 0
        self.shared = 0
        self._lock = threading.Lock()
        self._paths: dict[LayerRef, str] = {}  # content -> the path of a layer holding it (maybe deleted since)
        self._digests: dict[str, str] = {}  # layer path -> its content digest
        self._held: OrderedDict[str, Layer] = OrderedDict()  # fetched layers we hold a reference on, LRU first

    def digest_of(self, layer: Layer) -> str | None:
        """The content digest of a layer published or fetched here before (None: pack it to know)."""
        with self._lock:
            return self._digests.get(str(layer.path))

    def remember(self, layer: Layer, digest: str) -> None:
        """Record a layer of this process as holding ``digest``'s content (after packing it)."""
        path = str(layer.path)
        with self._lock:
            self._prune()
            self._digests[path] = digest
            self._paths.setdefault(LayerRef(digest=digest, squashed=layer.squashed), path)

    def acquire(self, ref: LayerRef) -> Layer | None:
        """A live layer of this process with ``ref``'s content, with a reference taken for the caller (who
        releases it through the layer store), or None when there is none."""
        with self._lock:
            path = self._paths.get(ref)
            if path is None:
                return None
            found = self.layers.lookup([path], acquire=True)  # atomic: a concurrent release cannot delete it
            if found is None:
                del self._paths[ref]
                return None
            if path in self._held:
                self._held.move_to_end(path)
            self.reused += 1
            return found[0]

    def holds(self, ref: LayerRef) -> bool:
        """Whether a live layer of this process has ``ref``'s content (a hint: it may go before it is acquired)."""
        with self._lock:
            path = self._paths.get(ref)
        return path is not None and self.layers.lookup([path]) is not None

    def add(self, ref: LayerRef, data: bytes) -> Layer:
        """Unpack a fetched, verified blob as a new layer of this process; the cache keeps one reference and the
        caller gets another."""
        path = self.layers.new_layer_path(squashed=ref.squashed)
        unpack_layer(data, path)
        layer = self.layers.adopt(path)
        self.layers.acquire([layer, layer])
        with self._lock:
            self._paths[ref] = str(path)
            self._digests[str(path)] = ref.digest
            self._held[str(path)] = layer
            self.fetched += 1
            self._evict()
        return layer

    def held_bytes(self) -> int:
        with self._lock:
            return sum(layer.bytes for layer in self._held.values())

    def check_invariants(self) -> None:
        """Verify that every held layer is live in the store with our reference on it and a known digest, and
        that every known content maps to a layer; raise SandboxError on the first violation. (The byte budget
        is enforced when a layer is added: layers released by sandboxes since may exceed it until then.)"""
        with self._lock:
            live = {str(layer.path): layer for layer in self.layers.live_layers()}
            for path, layer in self._held.items():
                if live.get(path) is not layer or layer.refs < 1:
                    raise SandboxError(f"layer cache holds {path}, which its store no longer has (refs {layer.refs})")
                if self._digests.get(path) is None:
                    raise SandboxError(f"layer cache holds {path} without knowing its digest")
            for ref, path in self._paths.items():
                if self._digests.get(path) != ref.digest:
                    raise SandboxError(f"layer cache maps {ref.digest[:16]} to {path}, which holds other content")

    def _evict(self) -> None:
        """Free least recently used layers until the held bytes fit. A layer whose only reference is ours can
        only be reached through this cache (whose lock we hold), so releasing it deletes it now; layers that
        sandboxes or snapshots hold as well are skipped: they free nothing yet."""
        total = sum(layer.bytes for layer in self._held.values())
        for path, layer in list(self._held.items()):
            if total <= self.max_bytes:
                break
            if layer.refs > 1:
                continue
            del self._held[path]
            self._forget(path)
            self.layers.release([layer])
            total -= layer.bytes

    def _prune(self) -> None:
        """Forget layers deleted since (their last user let go): keeps the maps as small as the store."""
        live = {str(layer.path) for layer in self.layers.live_layers()}
        for path in [path for path in self._digests if path not in live]:
            self._forget(path)

    def _forget(self, path: str) -> None:
        digest = self._digests.pop(path, None)
        if digest is None:
            return
        for squashed in (False, True):
            ref = LayerRef(digest=digest, squashed=squashed)
            if self._paths.get(ref) == path:
                del self._paths[ref]

    def __repr__(self) -> str:
        return f"<LayerCache layers={len(self._digests)} held={len(self._held)} fetched={self.fetched}>"
