"""Shell sandboxes on overlayfs: a base tree seen through stacks of copy-on-write layers.

Each sandbox is a writable upper directory over read-only layers over the base tree (a project checkout, or a
whole root filesystem with ``rootfs=True``). A *snapshot* freezes the upper into a new layer by a rename, and
the sandbox goes on with a fresh upper above it; a *fork* mounts a fresh upper over a snapshot's stack. Both
cost about a millisecond whatever the size of the tree, because nothing is copied. Layers live on tmpfs (no
sync on freeze), are shared and reference counted, and are squashed into one when a stack grows deep.

The overlay is a *detached* mount held by a file descriptor, never attached in the host's mount namespace.
Each command gets its own mount, PID, network, IPC and UTS namespaces: there it sees of the host only the
system directories, an allowlist of ``/etc`` and the paths the factory declares ``visible``, read-only, in a
root of its own (``host_view``; ``factory.host_view()`` prints it); the sandbox's merged tree is attached at
the base tree's own path (so every sandbox, and every uncached run, sees the same paths), ``/tmp``,
``/var/tmp``, ``/dev/shm`` and ``/run`` are private and empty, ``/proc`` shows only the command's own
processes, the network is a loopback of its own, and the capabilities that could undo any of this are dropped.
bash is PID 1 of its PID namespace: when it ends or times out, everything it started dies with it. Commands
are started by a small helper process per factory (``zygote``), so the caller's large Python process is never
forked per command.

With ``persistent=True`` each sandbox keeps one long-lived bash instead (``persistent``): the working
directory, variables, functions and jobs carry over between calls, and snapshots carry the shell's state too.
Both kinds are an ``overlay.OverlaySandbox`` (the mount, its layers, freezing and digests) and take their
factory as an ``overlay.ShellHost``; ``ShellSandboxFactory`` here builds either. What it needs besides the
classes (the snapshots' kind and routes, deleting their process state) is in ``routes``.

Needs root (or overlay mounts in general); otherwise ``ShellSandbox.factory`` falls back to copying the tree
(``FolderSandbox``), with a warning.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypedDict, Unpack

from ...calls import ToolCall, ToolSpec
from ...errors import SandboxError, SnapshotDeclined, SnapshotUnusable
from ...protocol import Outcome, Snapshot, require_new_destination
from ..commands import (
    FIXED_PATH,
    ShellResult,
    command_timeout,
    fixed_environment,
    render_shell,
    sh_tools,
    validated,
)
from ..folder import FolderSandbox, FolderSandboxFactory
from ..threads import finish_in_thread, run_in_worker
from . import linux
from .criu import Keepers
from .host_view import HostView, build_confinement, describe
from .layers import Layer, LayerStore, upper_digest
from .limits import DEFAULT_LIMITS, SandboxLimits, cgroup_spec
from .overlay import OverlaySandbox
from .persistent import PersistentShellSandbox
from .process import run_confined
from .pty_shell import PtyShell
from .routes import PERSISTENT_KIND, ROUTES, discard_process_state
from .warm import WarmShells
from .zygote import Confinement, Zygote

__all__ = ["AnyShellSandbox", "ShellFactoryOptions", "ShellSandbox", "ShellSandboxFactory"]

KIND = "shell"
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run")
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


# What a FolderSandbox fallback keeps of them (the rest have no meaning for a copied tree).
_FOLDER_OPTIONS = ("timeout", "max_output_bytes")


class ShellFactoryOptions(TypedDict, total=False):
    """``ShellSandboxFactory``'s keyword options (defaults and meaning there), for what builds one
    (``ShellSandbox.factory``)."""

    rootfs: bool
    timeout: float
    max_output_bytes: int
    prove_read_only: bool
    max_layers: int
    store_root: str | os.PathLike[str] | None
    environment: Mapping[str, str] | None
    persistent: bool
    visible: Sequence[str]
    limits: SandboxLimits | None


@dataclass(frozen=True, kw_only=True, slots=True)
class _Ran:
    result: ShellResult
    before: str | None  # digests of the upper layer around the command, when proving read-only calls
    after: str | None


class ShellSandboxFactory:
    """Starts shell sandboxes over ``base_dir`` and forks them from snapshots. See the module docstring."""

    kind: str = KIND

    def __init__(
        self,
        base_dir: str | os.PathLike[str],
        *,
        rootfs: bool = False,
        timeout: float = 60.0,
        max_output_bytes: int = 1_000_000,
        prove_read_only: bool = True,
        max_layers: int = 128,
        store_root: str | os.PathLike[str] | None = None,
        environment: Mapping[str, str] | None = None,
        persistent: bool = False,
        visible: Sequence[str] = (),
        limits: SandboxLimits | None = DEFAULT_LIMITS,
    ) -> None:
        base = Path(base_dir).resolve()
        if not base.is_dir():
            raise SandboxError(f"shell sandbox base {base} does not exist or is not a directory")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if not 2 <= max_layers <= 400:
            raise ValueError(f"max_layers must be between 2 and 400 (the kernel stacks at most 500), got {max_layers}")
        bash = "/bin/bash" if rootfs else shutil.which("bash", path=FIXED_PATH)
        if bash is None or (rootfs and not (base / "bin" / "bash").exists()):
            where = base if rootfs else FIXED_PATH
            raise SandboxError(f"bash was not found in {where}; shell sandboxes run commands with bash")
        self.base = base
        self.rootfs = rootfs
        self.timeout = float(timeout)
        self.max_output_bytes = max_output_bytes
        self.prove_read_only = prove_read_only
        self.max_layers = max_layers
        self.bash = bash
        self.command_prefix: tuple[str, ...] = ()  # run before bash: an image's WORKDIR and USER (sandboxes.image)
        self.persistent = persistent
        self.snapshot_routes: tuple[Any, ...] = ()
        if persistent:
            self.kind = PERSISTENT_KIND  # its snapshots carry a shell: never forked by a one-shot factory
            self.snapshot_routes = ROUTES  # tried in order per snapshot (persistent); narrow it to opt out
        self.environment = (
            dict(environment) if environment is not None else fixed_environment("/root" if rootfs else str(base))
        )
        if persistent and environment is None:
            # A terminal: programs that would page or colour their output for a person must not wait for one.
            self.environment.update({"TERM": "dumb", "PAGER": "cat", "GIT_PAGER": "cat"})
        # Warm shells kept for forks of persistent snapshots (``warm``); 0 turns them off. Not with rootfs: bash
        # comes from the sandbox's own tree there, which a warm shell cannot have before its fork.
        self.warm_shells = 2 if persistent and not rootfs else 0
        self._warm: WarmShells | None = None
        self._keepers: Keepers | None = None
        self._routes: Counter[str] = Counter()
        self._routes_lock = threading.Lock()
        self.store = LayerStore(Path(store_root) if store_root is not None else None)
        self._visible = tuple(os.fspath(path) for path in visible)
        self.confinement = _confinement(base, rootfs=rootfs, visible=self._visible)
        # Per sandbox (``limits``): pids, memory and CPU by a cgroup per confined tree (``cgroups``; None where
        # the host has none, said once), the private tmpfs sizes by their mounts. None: no limits at all.
        self.limits = limits
        self.cgroups = cgroup_spec(limits)
        if limits is not None and limits.tmpfs_bytes is not None:
            self.confinement = replace(self.confinement, tmpfs_size=str(limits.tmpfs_bytes))
        # Started with the first sandbox; ends with close() or the process.
        self.zygote = Zygote(self.confinement, cgroups=self.cgroups)
        self._tools = sh_tools(persistent=persistent)
        self.cost_hints: dict[str, float] = {"start": 0.001, "fork": 0.001, "snapshot": 0.001}

    @property
    def tools(self) -> Mapping[str, ToolSpec]:
        return self._tools

    async def start(self) -> AnyShellSandbox:
        return await self._build([], None)

    async def fork(self, snapshot: Snapshot) -> AnyShellSandbox:
        layers = self._layers_of(snapshot)  # referenced now: an eviction meanwhile cannot delete them
        image = snapshot.meta.get("shell") if self.persistent else None
        return await self._build(layers, dict(image) if image is not None else None)

    def _make(self, layers: list[Layer], image: dict[str, object] | None) -> AnyShellSandbox:
        if not self.persistent:
            return ShellSandbox(self, layers)
        return PersistentShellSandbox(self, layers, image)  # on failure, it released the layers itself

    def host_view(self) -> HostView:
        """What this factory's commands see of the host, path by path, and why (``print`` it to audit)."""
        return describe(self.confinement, visible=self._visible)

    def count_route(self, route: object) -> None:
        """Count one snapshot of a persistent shell by the route it took (``shell_state.SnapshotRoute``)."""
        with self._routes_lock:
            self._routes[str(getattr(route, "value", route))] += 1

    def warm_pool(self) -> WarmShells | None:
        """The factory's pool of warm persistent shells (``warm.WarmShells``), made on first use; None when off."""
        if self.warm_shells <= 0 or self.rootfs or not self.persistent:
            return None
        with self._routes_lock:
            if self._warm is None:

                def make() -> PtyShell:
                    return PtyShell.warm(self.zygote, bash=self.bash, env=self.environment)

                def key() -> object:
                    return self.bash, tuple(sorted(self.environment.items()))

                self._warm = WarmShells(make, key, size=self.warm_shells)
            return self._warm

    def criu_keepers(self) -> Keepers | None:
        """The keeper processes started ahead for CRIU restores of this factory's shells (``criu.Keepers``), made
        on first use; None for a factory whose shells are not persistent."""
        if not self.persistent:
            return None
        with self._routes_lock:
            if self._keepers is None:
                self._keepers = Keepers()
            return self._keepers

    def route_counts(self) -> dict[str, int]:
        """Snapshots of this factory's persistent shells by route ("shell-state", "declined", ...)."""
        with self._routes_lock:
            return dict(self._routes)

    async def _build(self, layers: list[Layer], image: dict[str, object] | None) -> AnyShellSandbox:
        """The sandbox takes over one reference on each layer, already acquired here. If the caller is cancelled
        (once or again and again) meanwhile, the build is still waited for and the sandbox it made torn down
        before the cancellation goes on: nothing leaks, and the caller may release the snapshot once this
        returns. A build that fails released its layers itself."""
        return await finish_in_thread(lambda: self._make(layers, image), undo=lambda sandbox: sandbox._teardown())

    def discard(self, snapshot: Snapshot) -> None:
        layers = self.store.lookup(list(snapshot.meta.get("layers", [])))
        if layers is not None:
            self.store.release(layers)
        Path(snapshot.path).unlink(missing_ok=True)
        if self.persistent:
            discard_process_state(snapshot.meta)  # a CRIU image, for that route

    def _layers_of(self, snapshot: Snapshot) -> list[Layer]:
        if snapshot.kind != self.kind:
            raise SandboxError(f"cannot fork a shell sandbox from a {snapshot.kind!r} snapshot; use its own backend")
        paths = list(snapshot.meta.get("layers", []))
        layers = self.store.lookup(paths, acquire=True)
        if layers is None:
            if self.store.storage_gone(paths):  # for every process: the cache drops the snapshot
                raise SnapshotUnusable(
                    f"snapshot {snapshot.path} is missing its layers (discarded, or their process ended); "
                    "rebuild the state by replaying its calls"
                )
            raise SandboxError(
                f"snapshot {snapshot.path} stacks layers of another process's store, which only it can fork; "
                "rebuild the state by replaying its calls"
            )
        return layers

    def close(self) -> None:
        """Delete the factory's layer store and end its warm shells and zygote; its sandboxes and snapshots stop
        working."""
        with self._routes_lock:
            warm, self._warm = self._warm, None
            keepers, self._keepers = self._keepers, None
            self.warm_shells = 0
        if warm is not None:
            warm.close()
        if keepers is not None:
            keepers.close()
        self.zygote.close()
        self.store.close()

    def __repr__(self) -> str:
        return f"ShellSandboxFactory({str(self.base)!r}, rootfs={self.rootfs}, persistent={self.persistent})"


class ShellSandbox(OverlaySandbox):
    """One overlay sandbox running each command in a process of its own (``persistent``: one long-lived shell)."""

    @classmethod
    def factory(
        cls,
        base_dir: str | os.PathLike[str],
        *,
        fallback: bool = True,
        **options: Unpack[ShellFactoryOptions],
    ) -> ShellSandboxFactory | FolderSandboxFactory:
        """Shell sandboxes over ``base_dir`` (a tree, or a root filesystem with ``rootfs=True``); with
        ``persistent=True``, one long-lived shell per sandbox (see ``persistent``). Commands see only a minimal view
        of the host (``factory.host_view()``); ``visible``: more host paths, files or directories (under the
        private ``/tmp`` too), that they see there, read-only. ``limits``: what each sandbox may use of the machine
        (``SandboxLimits``: pids, memory, CPU, tmpfs sizes; None for no limits). ``options`` are
        ``ShellSandboxFactory``'s (``ShellFactoryOptions``; their defaults there).

        Where overlay mounts are not permitted (not root), returns a ``FolderSandbox`` factory that copies the
        tree instead, with a warning — or raises SandboxError when ``fallback`` is False.
        """
        if not linux.overlay_supported():
            if not fallback or options.get("rootfs") or options.get("persistent"):
                raise SandboxError(
                    "overlay mounts are not permitted here (run as root on Linux >= 6.8); "
                    "FolderSandbox copies trees instead"
                )
            warnings.warn(
                "overlay mounts are not permitted here; shell sandboxes fall back to copying the tree "
                "(FolderSandbox): forks cost a full copy and commands are not confined",
                RuntimeWarning,
                stacklevel=2,
            )
            copied: dict[str, Any] = {key: value for key, value in options.items() if key in _FOLDER_OPTIONS}
            return FolderSandbox.factory(base_dir, **copied)
        return ShellSandboxFactory(base_dir, **options)

    @classmethod
    def from_image(
        cls,
        image: str,
        *,
        engine: str = "docker",
        cache_dir: str | os.PathLike[str] | None = None,
        environment: Mapping[str, str] | None = None,
        **options: Any,
    ) -> ShellSandboxFactory:
        """Shell sandboxes (``rootfs=True``) over a container image's filesystem, with its ENV, WORKDIR and USER
        (extra ``environment`` entries override the image's); ``factory.image`` holds its ``ImageConfig`` (its
        digest) for task ids. ``options`` go to ``ShellSandboxFactory``. See ``tvcache.sandboxes.image``."""
        from ..image import image_setup

        setup = image_setup(
            image,
            engine=engine,
            cache_dir=cache_dir,
            environment=environment,
            persistent=bool(options.get("persistent")),
        )
        factory = ShellSandboxFactory(setup.root, rootfs=True, environment=setup.environment, **options)
        factory.command_prefix = setup.command_prefix
        factory.image = setup.config  # type: ignore[attr-defined]
        return factory

    # ---------------------------------------------------------- execute

    async def execute(self, call: ToolCall) -> Outcome:
        _, arguments = validated(call, self._factory.tools)
        timeout = command_timeout(arguments, self._factory.timeout)
        async with self._lock:
            mount_fd = self._require_open()
            self._require_within_limits()
            known, self._last_digest = self._last_digest, None
            ran = await self._run(mount_fd, arguments["cmd"], timeout, known_digest=known)
            self._last_digest = ran.after
            self._limit_hit = ran.result.limit
        outcome = render_shell(ran.result, self._factory.max_output_bytes, timeout)
        changed = None if ran.after is None else ran.before != ran.after
        return Outcome(
            output=outcome.output, is_error=outcome.is_error, changed_state=changed, deterministic=outcome.deterministic
        )

    async def _run(self, mount_fd: int, command: str, timeout: float, *, known_digest: str | None) -> _Ran:
        """The command, and the digests of the upper around it when proving read-only calls, all in one worker
        thread (each hop between threads costs more than digesting a small upper)."""
        factory = self._factory
        live, upper = self._live, self._upper
        prove = factory.prove_read_only

        def run(abandon: threading.Event) -> _Ran:
            before = (known_digest or upper_digest(upper)) if prove else None
            result = run_confined(
                factory.zygote,
                [*factory.command_prefix, factory.bash, "-c", command],
                env=factory.environment,
                mount_fd=mount_fd,
                timeout=timeout,
                limit=factory.max_output_bytes,
                live=live,
                abandon=abandon,
                limits=factory.limits,
            )
            return _Ran(result=result, before=before, after=upper_digest(upper) if prove else None)

        def kill_all() -> None:
            for spawned in list(live):
                spawned.kill()

        try:
            return await run_in_worker(run, kill_all)
        except OSError as error:
            raise SandboxError(f"cannot run a command in the shell sandbox: {error}") from error

    # --------------------------------------------------------- snapshots

    async def snapshot(self, dest: Path) -> Snapshot:
        dest = Path(dest)
        async with self._lock:
            self._require_open()
            self._require_within_limits(SnapshotDeclined)
            require_new_destination(dest)
            # A cancelled caller keeps the lock until the freeze's thread is done. A freeze that completed anyway
            # needs no undo: its layer is the sandbox's own (it goes on above it), and the snapshot's references
            # and file, taken below, are never taken.
            stack, new_bytes = await finish_in_thread(self._freeze)
            self._store.acquire(stack)  # the snapshot's own references
            layers = [str(layer.path) for layer in stack]
            dest.parent.mkdir(parents=True, exist_ok=True)
            partial = dest.with_name(dest.name + ".partial")
            partial.write_text(json.dumps({"kind": KIND, "base": str(self._factory.base), "layers": layers}))
            os.replace(partial, dest)
        return Snapshot(kind=KIND, path=str(dest), bytes=new_bytes, meta={"layers": layers})


# What a ShellSandboxFactory builds: one of the two kinds (``persistent`` picks which).
AnyShellSandbox = ShellSandbox | PersistentShellSandbox


def _confinement(base: Path, *, rootfs: bool, visible: tuple[str, ...] = ()) -> Confinement:
    """What every command of a factory is confined by; the host paths and devices are looked up once (/dev/shm
    comes with the minimal /dev, the other private dirs get a tmpfs each)."""
    devices = tuple(name for name in DEVICES if os.path.exists(f"/dev/{name}"))
    return build_confinement(base, rootfs=rootfs, devices=devices, visible=visible)
