"""Snapshots any process can fork: content-addressed publication to a shared store, with local copies.

``PublishedSnapshots(factory, store)`` wraps any snapshotting ``SandboxFactory`` whose snapshot is one file, one
directory tree (SQLite, folder) or a stack of overlay layers (shell). After its sandbox freezes a snapshot, the
data is published to ``store`` (``tvcache.snapshots``), addressed by its BLAKE2b-256 digest, and the snapshot
record the cache keeps carries the publication. So the record is usable by every process that reads it::

    store = DirectoryStore("/dev/shm/tvcache-snapshots")          # any directory the processes share
    factory = PublishedSnapshots(ShellSandbox.factory("repo"), store)
    with Cache("cache-dir") as cache: ...                            # a restarted process forks what the last made
    with RemoteCache(url) as cache: ...                              # workers of one server fork each other's

A fork where the data is local (the node that made a file or tree snapshot; the process that made a shell
stack) uses it as is. Anywhere else the blobs are fetched, checked against their digest on arrival (a mismatch
or a missing blob is refused: the session starts fresh and replays) and kept for later forks: file and tree data
in the node's ``NodeCache``, shell layers in this process's layer store (``LayerCache``, bounded by bytes).

A shell stack publishes each layer as its own blob (``tvcache.sandboxes.shell.layer_archive``), so a snapshot uploads
only the layers its parent snapshots' publications have not, and a fork fetches only the layers its process
does not hold yet, adopts them into its own layer store and mounts the stack from there.

Eviction respects leases everywhere: a blob is released only when the cache evicts its snapshot record (never
while a session anywhere leases it), through ``discard``; every publication holds one reference on each of its
blobs, so a blob shared by two records outlives the first eviction. When another process evicts a shell snapshot
made here, the store's references go at once, and this process drops its own layers of it when it next
publishes (``sweep``). Every process must use one store, named by the same path: a record naming another store
is never released into this one (a warning says so).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..calls import ToolSpec
from ..errors import SandboxError
from ..protocol import Sandbox, SandboxFactory, SandboxWrapper, Snapshot, cost_hints
from ..snapshots.node_cache import NodeCache, check_format, pack
from ..snapshots.publication import LAYERS, PUBLISHED, LayerRef, Publication, default_node_id, stack_digest
from ..snapshots.stores import BlobStore, blob_digest, fetch_verified, new_publication_id
from .shell.layer_archive import LayerCache, pack_layer, require_gnu_tar
from .shell.layers import Layer
from .shell.sandbox import ShellSandboxFactory
from .threads import finish_in_thread

__all__ = ["PublishedSnapshots"]


class PublishedSnapshots:
    """A ``SandboxFactory`` whose snapshots any process reading the cache's records can fork (module docstring).

    ``node_id``: this node's identity (default: the host name; ``tvcache.integrations.ray`` uses the Ray node
    id). ``cache``: the node-local cache of fetched file and tree data. ``max_layer_bytes``: for shell sandboxes,
    the bytes of fetched layers this process keeps for later forks (``layer_cache``; layers in use are never
    evicted).
    """

    def __init__(
        self,
        factory: SandboxFactory,
        store: BlobStore,
        *,
        cache: NodeCache | None = None,
        node_id: str | None = None,
        max_layer_bytes: int = 1024**3,
    ) -> None:
        self.inner = factory
        self.kind = factory.kind
        self.store = store
        self.cache = cache or NodeCache()
        self.node_id = node_id or self.default_node_id()
        self.cost_hints: Mapping[str, float] = cost_hints(factory)
        self.published = 0
        self.swept = 0
        self._layers: _LayerPublisher | None = None
        self._lock = threading.Lock()
        self._warned_store = False
        self._made: dict[str, Snapshot] = {}  # shell stacks published here whose layers this process holds
        if isinstance(factory, ShellSandboxFactory):
            require_gnu_tar()  # now rather than at the first snapshot
            self._layers = _LayerPublisher(factory, store, LayerCache(factory.store, max_bytes=max_layer_bytes))

    @staticmethod
    def default_node_id() -> str:
        """This node's identity when no ``node_id`` is given: the host name. A subclass names its own (Ray's
        node id), so it need not restate the constructor."""
        return default_node_id()

    @property
    def tools(self) -> Mapping[str, ToolSpec]:
        return self.inner.tools

    @property
    def layer_cache(self) -> LayerCache | None:
        """The shell layers this process published or fetched, by digest (None for other backends)."""
        return self._layers.cache if self._layers is not None else None

    async def start(self) -> Sandbox:
        return _PublishingSandbox(await self.inner.start(), self)

    async def fork(self, snapshot: Snapshot) -> Sandbox:
        publication = Publication.of(snapshot)  # a malformed record raises: the session replays instead
        if publication is None:  # made by an unwrapped factory: only usable where its files are
            return _PublishingSandbox(await self.inner.fork(snapshot), self)
        self._same_store(publication)
        if publication.format == LAYERS:
            return await self._fork_layers(snapshot, publication)
        check_format(publication.format)
        with self.cache.pinned(publication.digest):
            local = self._local_copy(snapshot, publication)
            if local is None:
                # Cancelled: the entry stays pinned until the fetching thread is done with it.
                local = await finish_in_thread(
                    lambda: self.cache.fetch(publication.digest, publication.format, self.store)
                )
            plain = Snapshot(kind=snapshot.kind, path=str(local), bytes=snapshot.bytes, meta=_inner_meta(snapshot))
            return _PublishingSandbox(await self.inner.fork(plain), self)

    async def _fork_layers(self, snapshot: Snapshot, publication: Publication) -> Sandbox:
        """Mount the stack from this process's layers, fetching the ones it does not hold; the layers stay
        pinned (referenced) from the moment they are found until the sandbox holds its own references."""
        layers = self._layers
        if layers is None:
            raise SandboxError(f"a shell layer stack cannot be forked by {self.inner!r}; use a shell sandbox factory")
        shell = layers.shell
        # Cancelled: the pinning still finishes, and its references are given back.
        pinned = await finish_in_thread(lambda: layers.pin(snapshot, publication), undo=shell.store.release)
        try:
            stack = Snapshot(
                kind=snapshot.kind,
                path=snapshot.path,
                bytes=snapshot.bytes,
                meta={**_inner_meta(snapshot), LAYERS: [str(layer.path) for layer in pinned]},
            )
            return _PublishingSandbox(await shell.fork(stack), self)
        finally:
            shell.store.release(pinned)

    def fork_is_local(self, snapshot: Snapshot) -> bool:
        """Whether forking ``snapshot`` needs nothing fetched from the store. Sessions keep the measured costs of
        local and fetching forks apart, so one slow fetch does not make every later fork look slow. A record that
        cannot be forked at all counts as local: its fork fails at once, and the session drops it."""
        try:
            publication = Publication.of(snapshot)
            if publication is not None and publication.format != LAYERS:
                check_format(publication.format)
        except SandboxError:
            return True
        if publication is None:
            return True
        if publication.format == LAYERS:
            return self._layers is None or self._layers.holds(snapshot, publication)
        return self._local_copy(snapshot, publication) is not None

    def _local_copy(self, snapshot: Snapshot, publication: Publication) -> Path | None:
        """The snapshot's data on this node without fetching: its own path where it was made, or a cached copy."""
        if publication.node == self.node_id and Path(snapshot.path).exists():
            return Path(snapshot.path)
        cached = self.cache.path(publication.digest)
        return cached if cached.exists() else None

    def discard(self, snapshot: Snapshot) -> None:
        """The cache evicted the snapshot (never while leased): drop this publication's references in the store
        and this node's copy if no fork is reading it (a shell stack's layers stay with their other users). A
        record naming another store releases nothing (see ``_same_store``); a malformed one touches nothing."""
        publication = self._release(snapshot, made_here=True)
        if publication is None or publication.format != LAYERS:
            return
        with self._lock:
            made = self._made.pop(publication.publication, None)
        if made is not None:  # the snapshot's own layer references, and its marker file, as this process made them
            self.inner.discard(_without_publication(made))
        else:  # made by another process (or swept already): its layer paths are not ours to release
            Path(snapshot.path).unlink(missing_ok=True)

    def discard_foreign(self, snapshot: Snapshot) -> None:
        """The cache evicted a record this process did not make (another worker's, handed back by a server): any
        client may have written it, so nothing it names as a path is touched. Release its references in this
        factory's own store and drop this node's cached copy of its data, both found by the publication's
        checked addresses; the maker's files (its layers, its snapshot path) stay with it (see ``sweep``)."""
        self._release(snapshot, made_here=False)

    def _release(self, snapshot: Snapshot, *, made_here: bool) -> Publication | None:
        """What ``discard`` and ``discard_foreign`` both do with an evicted record: read its publication (a
        malformed one: warn and touch nothing), release its references in this store and drop this node's copy
        of file or tree data. An unwrapped record goes to the inner factory only if ``made_here`` (a foreign one's
        paths are not ours). Returns the publication, or None when nothing is left to do."""
        try:
            publication = Publication.of(snapshot)
        except SandboxError as error:
            # stacklevel 3: the warning names whoever evicted, as when discard itself warned.
            warnings.warn(f"not releasing an evicted snapshot: {error}", RuntimeWarning, stacklevel=3)
            return None
        if publication is None:
            if made_here:
                self.inner.discard(snapshot)
            return None
        if self._same_store(publication, stacklevel=4):
            for digest in publication.blobs():
                self.store.release(digest, publication.publication)
        if publication.format != LAYERS:
            self.cache.drop(publication.digest)
        return publication

    def _same_store(self, publication: Publication, *, stacklevel: int = 3) -> bool:
        """Whether the record was published to this factory's store; if not, warn (once per factory): its
        references cannot be released here, and its data is fetched from this store, which may lack it.
        ``stacklevel`` names the frame the warning points at (by default the caller's caller)."""
        if publication.store == self.store.name:
            return True
        with self._lock:
            warned, self._warned_store = self._warned_store, True
        if not warned:
            warnings.warn(
                f"a snapshot record names the store {publication.store}, but this PublishedSnapshots uses "
                f"{self.store.name}: every process that forks or evicts the cache's snapshots must use one store, "
                "named by the same path everywhere. Records of the other store are not released here (their blobs "
                "stay there) and forks fetch from this one (a missing blob: the state is rebuilt by replay)",
                RuntimeWarning,
                stacklevel=stacklevel,
            )
        return False

    def sweep(self) -> int:
        """Release this process's layers of shell snapshots it published that the store no longer holds: another
        process evicted them (its ``discard`` released their blobs, but only this process can release the layers
        it made). Runs before every publication; call it when idle to free them sooner. Returns how many."""
        with self._lock:
            made = [(publication, Publication.of(snapshot)) for publication, snapshot in self._made.items()]
        checks = [(p, record.blobs()[0]) for p, record in made if record is not None and record.blobs()]
        if not checks:
            return 0
        held = self.store.holds([(digest, publication) for publication, digest in checks])
        gone = []
        with self._lock:
            for (publication, _), still in zip(checks, held, strict=True):
                snapshot = None if still else self._made.pop(publication, None)
                if snapshot is not None:
                    gone.append(snapshot)
            self.swept += len(gone)
        for snapshot in gone:
            self.inner.discard(_without_publication(snapshot))
        return len(gone)

    async def publish(self, snapshot: Snapshot) -> Snapshot:
        """Publish a snapshot just made here; returns its record (file and tree data move into the node cache)."""
        layers = self._layers
        if layers is not None and LAYERS in snapshot.meta:
            if self._made:
                try:
                    await finish_in_thread(self.sweep)
                except Exception as error:  # freeing layers early is a courtesy, never a reason to lose a snapshot
                    warnings.warn(
                        f"could not check the store for snapshots evicted by other processes: {error!r}",
                        RuntimeWarning,
                        stacklevel=2,
                    )
            # Cancelled: the publication still finishes, and is undone (its references released, its data gone).
            return await finish_in_thread(lambda: self._publish_layers(layers, snapshot), undo=self.discard)
        return await finish_in_thread(lambda: self._publish_data(snapshot), undo=self.discard)

    def _publish_data(self, snapshot: Snapshot) -> Snapshot:
        """Publish a file or tree snapshot and move its data into the node cache. If anything fails, the store's
        reference and the snapshot's files go: an unpublished snapshot is never recorded, so nothing else would
        remove them."""
        source = Path(snapshot.path)
        stored: Publication | None = None
        try:
            data, fmt = pack(source)
            digest = blob_digest(data)
            publication = Publication(
                digest=digest, format=fmt, node=self.node_id, publication=new_publication_id(), store=self.store.name
            )
            self.store.put(digest, data, publication.publication)
            stored = publication
            with self.cache.pinned(digest):
                local = self.cache.adopt(digest, source, fmt=fmt, data=data)
        except BaseException:
            if stored is not None:
                with contextlib.suppress(Exception):  # the store may be what failed; the first error is the news
                    self.store.release(stored.digest, stored.publication)
            with contextlib.suppress(Exception):
                self.inner.discard(snapshot)
            raise
        with self._lock:
            self.published += 1
        return Snapshot(
            kind=snapshot.kind,
            path=str(local),
            bytes=snapshot.bytes,
            meta={**snapshot.meta, PUBLISHED: publication.to_json()},
        )

    def _publish_layers(self, layers: _LayerPublisher, snapshot: Snapshot) -> Snapshot:
        publication_id = new_publication_id()
        try:
            refs = layers.publish(snapshot, publication_id)
        except BaseException:
            self.inner.discard(snapshot)  # unpublished: nothing would ever release its layers
            raise
        publication = Publication(
            digest=stack_digest(refs),
            format=LAYERS,
            node=self.node_id,
            publication=publication_id,
            store=self.store.name,
            layers=refs,
            base=str(layers.shell.base),
        )
        published = Snapshot(
            kind=snapshot.kind,
            path=snapshot.path,
            bytes=snapshot.bytes,
            meta={**snapshot.meta, PUBLISHED: publication.to_json()},
        )
        with self._lock:
            self._made[publication_id] = published
            self.published += 1
        return published

    def __repr__(self) -> str:
        return f"PublishedSnapshots({self.inner!r}, {self.store!r})"


class _LayerPublisher:
    """The shell half of ``PublishedSnapshots``: a stack is published and fetched layer by layer."""

    def __init__(self, shell: ShellSandboxFactory, store: BlobStore, cache: LayerCache) -> None:
        self.shell = shell
        self.store = store
        self.cache = cache

    def publish(self, snapshot: Snapshot, publication: str) -> tuple[LayerRef, ...]:
        """Take one store reference per layer of the snapshot's stack for ``publication``, uploading only the
        layers the store does not hold yet; returns the stack's layer addresses, newest first."""
        layers = self.shell.store.lookup(list(snapshot.meta[LAYERS]), acquire=True)  # held while packing
        if layers is None:
            raise SandboxError(f"snapshot {snapshot.path} lost its layers before it was published; it is dropped")
        try:
            refs, packed = self._address(layers)
            try:
                self._upload(refs, packed, layers, publication)
            except BaseException:
                for digest in dict.fromkeys(ref.digest for ref in refs):
                    with contextlib.suppress(Exception):  # the store may be what failed; the first error is the news
                        self.store.release(digest, publication)
                raise
            return refs
        finally:
            self.shell.store.release(layers)

    def _address(self, layers: list[Layer]) -> tuple[tuple[LayerRef, ...], dict[str, bytes]]:
        """Each layer's address, packing only the layers this process has not packed before (the new top layer,
        or a squash): returns the addresses and the archives packed now."""
        refs: list[LayerRef] = []
        packed: dict[str, bytes] = {}
        for layer in layers:
            digest = self.cache.digest_of(layer)
            if digest is None:
                data = pack_layer(layer.path)
                digest = blob_digest(data)
                self.cache.remember(layer, digest)
                packed[digest] = data
            refs.append(LayerRef(digest=digest, squashed=layer.squashed))
        return tuple(refs), packed

    def _upload(
        self, refs: tuple[LayerRef, ...], packed: dict[str, bytes], layers: list[Layer], publication: str
    ) -> None:
        """Reference the layers the store holds already (one call), upload the others."""
        paths = {ref.digest: layer.path for ref, layer in zip(refs, layers, strict=True)}
        known = [digest for digest in paths if digest not in packed]
        lost = self.store.retain(known, publication) if known else []
        for digest in lost:  # released by every publication since, or lost with a node: upload it again
            data = pack_layer(paths[digest])
            if blob_digest(data) != digest:
                raise SandboxError(f"layer {paths[digest]} changed after it was published")
            packed[digest] = data
        for digest, data in packed.items():
            self.store.put(digest, data, publication)
        self.cache.shared += len(known) - len(lost)
        self.cache.uploaded += len(packed)

    def holds(self, snapshot: Snapshot, publication: Publication) -> bool:
        """Whether every layer of the stack is in this process already (its own, or fetched before)."""
        if self.shell.store.lookup(list(snapshot.meta.get(LAYERS, []))) is not None:
            return True
        return all(self.cache.holds(ref) for ref in publication.layers)

    def pin(self, snapshot: Snapshot, publication: Publication) -> list[Layer]:
        """The snapshot's stack as layers of this process, each with a reference for the caller: its own layers
        where it was made, else layers found in the cache or fetched, verified and unpacked now."""
        if publication.base != str(self.shell.base):
            raise SandboxError(
                f"the snapshot's layers lie over {publication.base}, this factory's base is {self.shell.base}; "
                "the state will be rebuilt by replay"
            )
        local = self.shell.store.lookup(list(snapshot.meta.get(LAYERS, [])), acquire=True)
        if local is not None:
            return local
        pinned: list[Layer] = []
        try:
            for ref in publication.layers:
                layer = self.cache.acquire(ref)
                if layer is None:
                    layer = self.cache.add(ref, fetch_verified(self.store, ref.digest))
                pinned.append(layer)
        except BaseException:
            self.shell.store.release(pinned)
            raise
        return pinned


def _inner_meta(snapshot: Snapshot) -> dict[str, Any]:
    return {key: value for key, value in snapshot.meta.items() if key != PUBLISHED}


def _without_publication(snapshot: Snapshot) -> Snapshot:
    return Snapshot(kind=snapshot.kind, path=snapshot.path, bytes=snapshot.bytes, meta=_inner_meta(snapshot))


class _PublishingSandbox(SandboxWrapper):
    """A sandbox of the wrapped backend whose snapshots are published as they are made."""

    def __init__(self, sandbox: Sandbox, factory: PublishedSnapshots) -> None:
        super().__init__(sandbox)
        self._factory = factory

    async def snapshot(self, dest: Path) -> Snapshot:
        return await self._factory.publish(await self.inner.snapshot(dest))
