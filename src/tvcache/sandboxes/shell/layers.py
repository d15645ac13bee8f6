"""Read-only overlay layers on disk, reference counted across every sandbox and snapshot that stacks them.

A *layer* is a frozen upper directory: the changes one sandbox made since its previous snapshot. A sandbox's
state is its stack of layers (newest first) over the base tree, plus its own writable upper. Layers are
deleted when the last sandbox or snapshot using them lets go, and a store left behind by a crashed process
is removed by the next process that opens the same root.

Everything here is private to the store's user (``tvcache.private_storage``): the root, each store and its
``layers``/``uppers`` directories are 0700, so no other host user can read a sandbox's files, or run a setuid
binary a sandbox made in its upper (the overlay is mounted ``nosuid`` too: see ``linux.mount_overlay``).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import stat
import tempfile
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from ...private_storage import DIRECTORY_MODE, private_directory
from ..ownership import owner_is_gone, process_tag, tree_bytes

# owner_is_gone and process_tag (``ownership``) stay importable from here.
__all__ = ["Layer", "LayerStore", "default_store_root", "owner_is_gone", "process_tag", "upper_digest"]

_counter = itertools.count()
SQUASHED = "-squashed"  # the name suffix of a layer that holds a whole merged stack, base included


def default_store_root() -> Path:
    """tmpfs when available: freezing an upper needs no sync there, so snapshots cost the same at any size. One
    root per user (root's keeps the historical name): each must own its own, private one."""
    name = "tvcache-layers" if os.geteuid() == 0 else f"tvcache-layers-{os.geteuid()}"
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / name
    return Path(tempfile.gettempdir()) / name


def upper_digest(upper: Path) -> str:
    """Digest of everything a command could have changed: the upper layer's entries and their metadata.

    ctime moves on every write, chmod, xattr or rename, so metadata alone detects any change without reading
    file contents; a call that leaves the digest unchanged is proved read-only. Entries are visited depth first
    in name order (``scandir``: about twice as fast as ``os.walk`` plus ``lstat``; this runs around every call).
    """
    hasher = hashlib.blake2b(digest_size=16)
    update = hasher.update
    root = os.fspath(upper)
    prefix = len(root) + 1
    pending = [root]
    while pending:
        with os.scandir(pending.pop()) as listing:
            entries = sorted(listing, key=lambda entry: entry.name)
        below = []
        for entry in entries:
            info = entry.stat(follow_symlinks=False)
            relative = os.fsencode(entry.path[prefix:])
            update(
                b"%s\0%o %d %d %d %d %d\n"
                % (relative, info.st_mode, info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, info.st_rdev)
            )
            if stat.S_ISDIR(info.st_mode):
                below.append(entry.path)
        pending.extend(reversed(below))  # the first subdirectory is visited next
    return hasher.hexdigest()


@dataclass(eq=False, kw_only=True)
class Layer:
    path: Path
    bytes: int
    refs: int = field(default=0)
    _digest: str | None = field(default=None, repr=False)

    @property
    def squashed(self) -> bool:
        """A squash of a whole stack and its base: it replaces the base instead of lying above it."""
        return self.path.name.endswith(SQUASHED)

    def digest(self) -> str:
        """The layer's content digest (computed once: layers never change)."""
        if self._digest is None:
            self._digest = upper_digest(self.path)
        return self._digest


class LayerStore:
    """The layers, uppers and work directories of one factory, under ``root/<pid>-<start>-<n>``."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_store_root()
        private_directory(self.root, owned=True)  # tightened, if an older version made it 0755
        self._remove_orphans()
        tag = process_tag(os.getpid())
        self.directory = self.root / f"{tag}-{next(_counter)}"
        private_directory(self.directory, parents=False)
        for sub in ("layers", "uppers"):
            private_directory(self.directory / sub, parents=False)
        self._lock = threading.Lock()
        self._layers: dict[str, Layer] = {}
        self._ids = itertools.count()
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.directory, True)

    def _remove_orphans(self) -> None:
        """Delete stores whose owning process is gone (it crashed, or was killed before cleaning up)."""
        for entry in self.root.iterdir():
            if owner_is_gone(entry.name):
                shutil.rmtree(entry, ignore_errors=True)

    def new_upper(self) -> tuple[Path, Path]:
        """A fresh (upper, work) directory pair on the store's filesystem."""
        base = self.directory / "uppers" / str(next(self._ids))
        upper, work = base / "upper", base / "work"
        base.mkdir(DIRECTORY_MODE)
        upper.mkdir(DIRECTORY_MODE)  # the sandbox's root: it gets the base tree's mode and owner when mounted
        work.mkdir(DIRECTORY_MODE)
        return upper, work

    def discard_upper(self, upper: Path) -> None:
        shutil.rmtree(upper.parent, ignore_errors=True)

    def freeze(self, upper: Path) -> Layer:
        """Turn an unmounted upper into a read-only layer (a rename: O(1) whatever the size of the changes)."""
        path = self.directory / "layers" / str(next(self._ids))
        os.rename(upper, path)
        shutil.rmtree(upper.parent, ignore_errors=True)  # the work directory
        layer = Layer(path=path, bytes=tree_bytes(path))
        with self._lock:
            self._layers[str(path)] = layer
        return layer

    def adopt(self, path: Path) -> Layer:
        """Register a directory built in place (a squashed stack, a layer fetched from another node) as a layer,
        with no reference taken yet."""
        layer = Layer(path=path, bytes=tree_bytes(path))
        with self._lock:
            self._layers[str(path)] = layer
        return layer

    def new_layer_path(self, *, squashed: bool = False) -> Path:
        """A path for a layer to be built in place and then ``adopt``-ed."""
        return self.directory / "layers" / f"{next(self._ids)}{SQUASHED if squashed else ''}"

    def lookup(self, paths: list[str], *, acquire: bool = False) -> list[Layer] | None:
        """The live layers at ``paths`` (None if any is unknown to this store or already deleted), with a
        reference taken on each when ``acquire`` — atomically, so a concurrent release cannot delete them."""
        with self._lock:
            found = [self._layers.get(path) for path in paths]
            layers = [layer for layer in found if layer is not None]
            if len(layers) != len(found):
                return None
            if acquire:
                for layer in layers:
                    layer.refs += 1
            return layers

    def acquire(self, layers: list[Layer]) -> None:
        with self._lock:
            for layer in layers:
                layer.refs += 1

    def release(self, layers: list[Layer]) -> None:
        doomed = []
        with self._lock:
            for layer in layers:
                layer.refs -= 1
                if layer.refs < 0:
                    warnings.warn(f"layer {layer.path} released more often than acquired", RuntimeWarning, stacklevel=2)
                if layer.refs <= 0:
                    self._layers.pop(str(layer.path), None)
                    doomed.append(layer)
        for layer in doomed:
            shutil.rmtree(layer.path, ignore_errors=True)

    def storage_gone(self, paths: list[str]) -> bool:
        """Whether the layers at ``paths`` (which this store does not hold) are gone for every process: one is no
        longer on disk, or lies in a store whose process has ended (its next opener deletes it). Layers that are
        still there and still owned, by another process's live store, may yet be forked there."""
        for path in paths:
            layer = Path(path)
            if not layer.exists() or owner_is_gone(layer.parent.parent.name):
                return True
            if layer.parent.parent == self.directory and self.lookup([path]) is None:
                return True  # released by this store: being deleted
        return False

    def live_layers(self) -> list[Layer]:
        with self._lock:
            return list(self._layers.values())

    def close(self) -> None:
        self._cleanup()
