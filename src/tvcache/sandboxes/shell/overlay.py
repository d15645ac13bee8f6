"""The overlay under a shell sandbox, one-shot or persistent: a writable upper over a stack of read-only layers
over the base tree, held as a detached mount (see ``sandbox`` for the whole picture).

``OverlaySandbox`` mounts it, freezes the upper into a layer for a snapshot (squashing deep stacks), digests
the files and tears it all down. ``sandbox.ShellSandbox`` (a process per command) and
``persistent.PersistentShellSandbox`` (one long-lived shell) build on it, and ``sandbox.ShellSandboxFactory``
builds either; both take the factory as a ``ShellHost``: what a sandbox reads of it, so that neither module
imports the factory's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import stat
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from ...calls import ToolSpec
from ...children import run as run_tied
from ...errors import SandboxError, SnapshotDeclined
from ..threads import finish_in_thread
from . import linux
from .criu import Keepers
from .layers import Layer, LayerStore, upper_digest
from .limits import SandboxLimits
from .warm import WarmShells
from .zygote import Confinement, Spawned, Zygote

__all__ = ["OverlaySandbox", "ShellHost"]


class ShellHost(Protocol):
    """What a shell sandbox reads of the factory that built it (``sandbox.ShellSandboxFactory``)."""

    base: Path
    rootfs: bool
    store: LayerStore
    zygote: Zygote
    bash: str
    environment: dict[str, str]
    command_prefix: tuple[str, ...]
    confinement: Confinement
    limits: SandboxLimits | None
    cgroups: Any
    timeout: float
    max_output_bytes: int
    max_layers: int
    prove_read_only: bool
    warm_shells: int
    snapshot_routes: tuple[Any, ...]

    @property
    def tools(self) -> Mapping[str, ToolSpec]: ...

    def warm_pool(self) -> WarmShells | None: ...

    def criu_keepers(self) -> Keepers | None: ...

    def count_route(self, route: object) -> None: ...


class OverlaySandbox:
    """What both shell sandbox kinds are: a detached overlay mount over a stack of layers, frozen by snapshots.
    Calls are serialised (``_lock``); blocking work runs in worker threads."""

    def __init__(self, factory: ShellHost, layers: list[Layer]) -> None:
        self._factory = factory
        self._store = factory.store
        self._lock = asyncio.Lock()
        self._live: set[Spawned] = set()
        self._stack = list(layers)  # newest first, above the base; their references are ours now
        self._upper, self._work = self._store.new_upper()
        self._mount_fd: int | None = None
        self._stopped = False
        self._last_digest: str | None = None
        self._limit_hit: str | None = None  # the limit a call hit: the sandbox is no longer trusted
        try:
            _copy_root_attributes(self._top(), self._upper)
            self._mount()
        except BaseException:
            self._teardown()
            raise
        with contextlib.suppress(OSError):  # boots while the caller gets to its first command (which retries)
            factory.zygote.start()

    # ----------------------------------------------------------- mounts

    def _top(self) -> Path:
        """The tree right below the upper layer: the newest layer, or the base."""
        return self._stack[0].path if self._stack else self._factory.base

    def _lowers(self) -> list[str]:
        lowers = [str(layer.path) for layer in self._stack]
        squashed = bool(self._stack) and self._stack[-1].squashed
        return lowers if squashed else [*lowers, str(self._factory.base)]

    def _mount(self) -> None:
        self._mount_fd = linux.mount_overlay(self._lowers(), str(self._upper), str(self._work))

    def _unmount(self) -> None:
        fd, self._mount_fd = self._mount_fd, None
        if fd is not None:
            os.close(fd)  # the last reference to a detached mount: the kernel unmounts it

    def _require_open(self) -> int:
        if self._mount_fd is None:
            raise SandboxError("this shell sandbox was stopped; start or fork a new one from the factory")
        return self._mount_fd

    def _require_within_limits(self, error: type[SandboxError] = SandboxError) -> None:
        """After a call hit a limit, what is left of the sandbox (half-written files, a killed process's
        partners) depends on timing: nothing more runs in it, and the cache rebuilds the state by replay."""
        if self._limit_hit is not None:
            raise error(
                f"this shell sandbox is no longer trusted: an earlier call ended because {self._limit_hit}; "
                "start or fork a new one (the cache replays its calls there)"
            )

    # --------------------------------------------------------- snapshots

    def _freeze(self) -> tuple[list[Layer], int]:
        """Freeze the upper into a layer (if it holds changes) and go on above it; squash deep stacks."""
        with os.scandir(self._upper) as entries:
            changed = any(True for _ in entries)
        if not changed and self._stack:
            return list(self._stack), 0
        self._refuse_hard_links()
        self._unmount()
        layer = self._store.freeze(self._upper)
        self._store.acquire([layer])
        self._stack.insert(0, layer)
        self._upper, self._work = self._store.new_upper()
        # Before a squash too: its copy takes the root's owner and mode from the merged tree, whose root is the
        # upper's (a fresh upper is 0700 until it takes the tree's).
        _copy_root_attributes(self._top(), self._upper)
        if len(self._stack) > self._factory.max_layers:
            self._squash()
            _copy_root_attributes(self._top(), self._upper)
        self._mount()
        self._last_digest = None
        return list(self._stack), layer.bytes

    def _refuse_hard_links(self) -> None:
        """SnapshotDeclined when the upper holds hard links. overlayfs copies a lower file up on its first change,
        which splits it from its other names; in this live sandbox the names share one upper inode. A fork would
        let them diverge where this does not."""
        linked = _hard_linked(self._upper)
        if linked is not None:
            raise SnapshotDeclined(
                f"{linked} has hard links made in this sandbox, which overlayfs would split in a fork; "
                "not snapshotting this state"
            )

    def _squash(self) -> None:
        """Replace the whole stack (and the base) by one layer holding the merged tree: a full copy, paid
        once every ``max_layers`` snapshots so that lookups and mounts stay fast. ``cp -a`` keeps owners, modes,
        hard links, special files and extended attributes. If the copy fails, the deep stack stays as it is."""
        merged = linux.mount_overlay(self._lowers(), str(self._upper), str(self._work))
        target = self._store.new_layer_path(squashed=True)
        try:
            # The detached mount's root is reachable through its descriptor (from a child too, via our pid):
            # nothing is ever attached.
            source = f"/proc/{os.getpid()}/fd/{merged}/."
            # Tied: a cp outliving a killed process would go on filling its layer store.
            result = run_tied(["cp", "-a", source, str(target)], capture_output=True, text=True, check=False)
        finally:
            os.close(merged)
        if result.returncode != 0:
            shutil.rmtree(target, ignore_errors=True)
            warnings.warn(
                f"squashing {len(self._stack)} layers failed ({result.stderr.strip()[:200]}); keeping the deep stack",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        squashed = self._store.adopt(target)
        self._store.acquire([squashed])
        self._store.release(self._stack)
        self._stack = [squashed]

    async def state_digest(self) -> str:
        async with self._lock:
            self._require_open()
            # Cancelled, the digest still ends before the lock goes: it sets the next call's "before" digest.
            return await finish_in_thread(self._state_digest)

    def _state_digest(self) -> str:
        """Digests of the layers, oldest first, then of the upper if it holds changes. Freezing renames the
        upper into a layer without touching its entries, so a state digests the same before and after a
        snapshot, and in every fork of it."""
        self._last_digest = upper_digest(self._upper)
        parts = [layer.digest() for layer in reversed(self._stack)]
        with os.scandir(self._upper) as entries:
            if any(True for _ in entries):
                parts.append(self._last_digest)
        return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()

    # -------------------------------------------------------------- stop

    async def stop(self) -> None:
        async with self._lock:
            if not self._stopped:
                # Cancelled, the teardown still ends before the lock goes: a call let in meanwhile would find the
                # mount descriptor open, then closed (or reused) under it.
                await finish_in_thread(self._teardown)

    def _teardown(self) -> None:
        self._stopped = True
        self._unmount()
        self._store.discard_upper(self._upper)
        self._store.release(self._stack)
        self._stack = []

    @property
    def layers(self) -> list[str]:
        """The paths of this sandbox's layers, newest first (for inspection and tests)."""
        return [str(layer.path) for layer in self._stack]


def _hard_linked(upper: Path) -> str | None:
    """A non-directory of ``upper`` with more than one name (files, FIFOs, symlinks...), relative to it, or None.
    Whiteouts (character devices 0/0) are skipped: overlay makes every whiteout a link of one shared inode."""
    pending = [str(upper)]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                info = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(info.st_mode):
                    pending.append(entry.path)
                elif info.st_nlink > 1 and not (stat.S_ISCHR(info.st_mode) and info.st_rdev == 0):
                    return os.path.relpath(entry.path, upper)
    return None


def _copy_root_attributes(source: Path, upper: Path) -> None:
    """overlayfs shows the sandbox root with the upper root's owner, mode, times and user xattrs; a fresh upper
    must carry those of the tree below it, or every snapshot and fork would reset them (``find -newer``)."""
    info = os.lstat(source)
    os.chown(upper, info.st_uid, info.st_gid)
    os.chmod(upper, stat.S_IMODE(info.st_mode))
    for name in os.listxattr(source, follow_symlinks=False):
        if name.startswith("user."):
            os.setxattr(upper, name, os.getxattr(source, name, follow_symlinks=False))
    os.utime(upper, ns=(info.st_atime_ns, info.st_mtime_ns))
