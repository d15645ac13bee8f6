"""Snapshots every node can fork: content-addressed publication to a shared store, with a node-local cache.

``PublishedSnapshots(factory, store)`` wraps any snapshotting ``SandboxFactory`` (SQLite, folder: backends whose
snapshot is one file or one directory tree). After its sandbox freezes a snapshot, the data is packed (a file as
is, a directory as a tar archive), addressed by its BLAKE2b-256 digest and published to ``store``; the snapshot
record the shards keep carries the digest. A fork on the node that made the snapshot uses the local copy; a fork
anywhere else fetches the data, checks its digest on arrival (a mismatch is refused, never forked) and unpacks it
into a node-local cache that later forks on that node reuse.

Shell sandboxes (``ShellSandbox.factory``) snapshot a stack of overlay layers; each layer is published as its own
blob (``layers``: the archive format and the cache of this process's layers by digest), so a snapshot publishes
only the layers its parent snapshots' publications have not, and a fork elsewhere fetches only the layers its
process does not hold yet, adopts them into its own layer store and mounts the stack from there.

Stores: ``RayObjectStore`` keeps blobs in Ray's object store, put (and so owned) by a named actor, so any node of
the cluster can pull them (lost with the actor's node, or if the actor restarts: a fork that cannot fetch starts
fresh and replays, which costs time, never correctness). ``DirectoryStore`` keeps them under a directory
every node mounts (a shared filesystem), which survives node loss.

Eviction respects leases everywhere: a blob is released only when the shards evict its snapshot record, which
they never do while any client on any node leases it; every publication holds one reference on each of its
blobs (one per layer for a shell stack), so a blob shared by two records outlives the first eviction. The
node-local cache is bounded by bytes and evicts the least recently used entries, skipping any entry a fork on
that node is reading (a shared ``flock``); fetched shell layers are bounded the same way, per process.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import io
import os
import secrets
import shutil
import tarfile
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import ray
from ray.exceptions import RayError

from ...calls import ToolSpec
from ...errors import SandboxError
from ...protocol import Sandbox, SandboxFactory, SandboxWrapper, Snapshot
from ...sandboxes.layers import Layer
from ...sandboxes.shell import ShellSandboxFactory
from .layers import LayerCache, LayerRef, pack_layer, require_gnu_tar

__all__ = [
    "PUBLISHED",
    "BlobStore",
    "DirectoryStore",
    "NodeCache",
    "PublishedSnapshots",
    "RayObjectStore",
    "blob_digest",
    "current_node_id",
    "fetch_verified",
]

PUBLISHED = "tvcache.published"
"""The snapshot meta key holding a publication: ``{"digest", "format", "node", "publication", "store"}``, plus
``"layers"`` (``[{"digest", "squashed"}]``, newest first) and ``"base"`` for a shell stack (format ``layers``)."""
LAYERS = "layers"  # a shell snapshot's meta key for its stack, and the format of its publication
T = TypeVar("T")


def blob_digest(data: bytes) -> str:
    """The content address of a blob: BLAKE2b-256, hex."""
    return hashlib.blake2b(data, digest_size=32).hexdigest()


def current_node_id() -> str:
    """This node's identity: the Ray node id inside Ray, else the host name."""
    if ray.is_initialized():
        return str(ray.get_runtime_context().get_node_id())
    return os.uname().nodename


# ---------------------------------------------------------------------------------------------- stores


class BlobStore(Protocol):
    """A store of immutable blobs by digest, reachable from every node. Each ``put`` adds one reference
    (``publication``); ``release`` drops it, and the blob is deleted with its last reference."""

    @property
    def name(self) -> str: ...

    def put(self, digest: str, data: bytes, publication: str) -> None: ...

    def retain(self, digests: Sequence[str], publication: str) -> list[str]:
        """Add ``publication``'s reference to each of ``digests`` the store holds, without sending the data;
        returns the digests it does not hold (to be ``put``)."""
        ...

    def get(self, digest: str) -> bytes | None:
        """The blob, or None when the store no longer has it (released, or lost)."""
        ...

    def release(self, digest: str, publication: str) -> None: ...


class DirectoryStore:
    """Blobs as files under ``root`` (a directory every node mounts): ``blobs/<d[:2]>/<d>``, one reference
    file per publication under ``refs/<d>/``; writes are atomic renames, bookkeeping runs under a ``flock``."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        for sub in ("blobs", "refs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._lock_path = self.root / "lock"

    @property
    def name(self) -> str:
        return f"dir:{self.root}"

    def _blob(self, digest: str) -> Path:
        return self.root / "blobs" / digest[:2] / digest

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def put(self, digest: str, data: bytes, publication: str) -> None:
        refs = self.root / "refs" / digest
        with self._locked():
            refs.mkdir(parents=True, exist_ok=True)
            (refs / publication).touch()
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
                refs = self.root / "refs" / digest
                refs.mkdir(parents=True, exist_ok=True)
                (refs / publication).touch()
        return missing

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

    def __repr__(self) -> str:
        return f"DirectoryStore({str(self.root)!r})"


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


# ---------------------------------------------------------------------------------------------- packing


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


# ---------------------------------------------------------------------------------------------- node cache


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


# ---------------------------------------------------------------------------------------------- factory


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


class PublishedSnapshots:
    """A ``SandboxFactory`` whose snapshots any node can fork (see the module docstring)::

        factory = PublishedSnapshots(SQLiteSandbox.factory("app.db"), RayObjectStore())
        async with RayCache().session("task-1", sandbox=factory) as s: ...

    ``node_id``: this node's identity (default: the Ray node id). ``cache``: the node-local cache of fetched data.
    ``max_layer_bytes``: for shell sandboxes, the bytes of fetched layers this process keeps for later forks
    (``layer_cache``; layers in use are never evicted).
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
        self.node_id = node_id or current_node_id()
        self.cost_hints: Mapping[str, float] = getattr(factory, "cost_hints", {})
        self.published = 0
        self._layers: _LayerPublisher | None = None
        if isinstance(factory, ShellSandboxFactory):
            require_gnu_tar()  # now rather than at the first snapshot
            self._layers = _LayerPublisher(factory, store, LayerCache(factory.store, max_bytes=max_layer_bytes))

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
        publication = Publication.of(snapshot)
        if publication is None:  # made by an unwrapped factory: only usable where its files are
            return _PublishingSandbox(await self.inner.fork(snapshot), self)
        if publication.format == LAYERS:
            return await self._fork_layers(snapshot, publication)
        with self.cache.pinned(publication.digest):
            local = self._local_copy(snapshot, publication)
            if local is None:
                local = await asyncio.to_thread(self.cache.fetch, publication.digest, publication.format, self.store)
            plain = Snapshot(kind=snapshot.kind, path=str(local), bytes=snapshot.bytes, meta=_inner_meta(snapshot))
            return _PublishingSandbox(await self.inner.fork(plain), self)

    async def _fork_layers(self, snapshot: Snapshot, publication: Publication) -> Sandbox:
        """Mount the stack from this process's layers, fetching the ones it does not hold; the layers stay
        pinned (referenced) from the moment they are found until the sandbox holds its own references."""
        layers = self._layers
        if layers is None:
            raise SandboxError(f"a shell layer stack cannot be forked by {self.inner!r}; use a shell sandbox factory")
        shell = layers.shell
        pinned = await _undone_if_cancelled(lambda: layers.pin(snapshot, publication), shell.store.release)
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

    def _local_copy(self, snapshot: Snapshot, publication: Publication) -> Path | None:
        """The snapshot's data on this node without fetching: its own path where it was made, or a cached copy."""
        if publication.node == self.node_id and Path(snapshot.path).exists():
            return Path(snapshot.path)
        cached = self.cache.path(publication.digest)
        return cached if cached.exists() else None

    def discard(self, snapshot: Snapshot) -> None:
        """The shards evicted the snapshot (never while leased): drop this publication's references in the store
        and this node's copy if no fork is reading it (a shell stack's layers stay with their other users)."""
        publication = Publication.of(snapshot)
        if publication is None:
            self.inner.discard(snapshot)
            return
        for digest in publication.blobs():
            self.store.release(digest, publication.publication)
        if publication.format == LAYERS:
            # The snapshot's own layer references, where it was made (elsewhere its layer paths are unknown).
            self.inner.discard(_without_publication(snapshot))
        else:
            self.cache.drop(publication.digest)

    async def publish(self, snapshot: Snapshot) -> Snapshot:
        """Publish a snapshot just made on this node; returns its record (the data moves into the node cache)."""
        layers = self._layers
        if layers is not None and LAYERS in snapshot.meta:
            return await _undone_if_cancelled(lambda: self._publish_layers(layers, snapshot), self.discard)
        source = Path(snapshot.path)
        data, fmt = await asyncio.to_thread(pack, source)
        digest = blob_digest(data)
        publication = Publication(
            digest=digest, format=fmt, node=self.node_id, publication=secrets.token_hex(8), store=self.store.name
        )
        await asyncio.to_thread(self.store.put, digest, data, publication.publication)
        with self.cache.pinned(digest):
            local = await asyncio.to_thread(self.cache.adopt, digest, source)
        self.published += 1
        return Snapshot(
            kind=snapshot.kind,
            path=str(local),
            bytes=snapshot.bytes,
            meta={**snapshot.meta, PUBLISHED: publication.to_json()},
        )

    def _publish_layers(self, layers: _LayerPublisher, snapshot: Snapshot) -> Snapshot:
        publication_id = secrets.token_hex(8)
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
        self.published += 1
        return Snapshot(
            kind=snapshot.kind,
            path=snapshot.path,
            bytes=snapshot.bytes,
            meta={**snapshot.meta, PUBLISHED: publication.to_json()},
        )

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


async def _undone_if_cancelled(work: Callable[[], T], undo: Callable[[T], object]) -> T:
    """Run blocking ``work`` in a thread. If the caller is cancelled meanwhile, the work still finishes and its
    result is undone, so that the references it took (layers, store blobs) are not left behind."""
    running = asyncio.ensure_future(asyncio.to_thread(work))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            undo(await running)
        raise


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
