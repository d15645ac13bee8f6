"""Docker sandboxes, for users who already run Docker (or podman): a container per sandbox, driven by the CLI.

``execute`` runs ``bash -c`` through ``docker exec`` (with a kill-timeout inside the container); ``snapshot``
commits the container's filesystem to an image (``docker commit``) — or, with ``checkpoint=True`` on an
engine with CRIU enabled, also checkpoints its processes (``docker checkpoint create --leave-running``);
``fork`` starts a new container from that image (and checkpoint). Containers get no network by default.
With ``persistent=True`` the container's main process is one long-lived interactive shell instead, typed into
over a terminal (``docker_shell``); its snapshots need ``checkpoint=True`` and are declined otherwise.

Ownership, like overlay layers: a snapshot image belongs to the factory that made it and is removed when the
cache evicts it (``discard``), when the factory closes or its process exits (unless a durable cache still
records the snapshot: its file is still there), or, after a crash, by the next factory that starts on the
engine. Every container and image carries the labels ``tvcache.sandbox=1`` and ``tvcache.owner=<pid>-<start
time>``, which tell a live owner's from an orphan's. Checkpoints live beside their snapshot's file.

Faults: an engine that does not answer, an image that does not exist (never pulled: ``--pull never``), a
container killed from outside, an image without bash — each is a ``SandboxError`` naming the sandbox and the
call; a container that was found dead is never used again. Without ``checkpoint=True``, a state with processes
still running in the container is declined (``SnapshotDeclined``): a commit would silently drop them.

Layers: ``docker_engine`` (the CLI's command lines, ``DockerCommands``: pure functions tested without an engine;
labels, orphan removal), ``docker_container`` (the sandbox, ``ContainerSandbox``, and what it reads off its
factory), ``docker_shell`` (the persistent one); this module holds the factory, which launches both.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import os
import shutil
import threading
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..calls import ToolSpec
from ..errors import SandboxError
from ..protocol import Snapshot
from .commands import sh_tools
from .docker_container import ContainerSandbox
from .docker_engine import (
    KIND,
    OWNER,
    OWNER_LABEL,
    PERSISTENT_KIND,
    SANDBOX_LABEL,
    SNAPSHOT_REPOSITORY,
    DockerCommands,
    docker_available,
    engine_down,
    kept_by_durable_cache,
    remove_orphans,
    run_cli,
    run_cli_async,
)
from .docker_shell import DockerShell, PersistentDockerSandbox, shell_environment
from .shell.limits import DEFAULT_LIMITS, SandboxLimits

# The engine layer's names that users of this module import from here stay importable from here.
__all__ = [
    "OWNER_LABEL",
    "SANDBOX_LABEL",
    "DockerCommands",
    "DockerSandbox",
    "DockerSandboxFactory",
    "docker_available",
    "remove_orphans",
]

# Measured here (2 cores, 23 GB): 100 containers start in 21 s six at a time and all answer; the engine's
# latency, not memory, is what grows. A factory keeps at most this many containers at once by default; more
# sandboxes wait for a slot instead of piling onto the engine.
DEFAULT_MAX_CONTAINERS = 128
# podman's runs fail on rlimits they cannot raise here unless told what to use (research/sandboxes.md).
PODMAN_ULIMITS = ("nofile=20000:20000", "nproc=32768:32768")
_factory_ids = itertools.count()
_swept: set[str] = set()  # engines whose orphans this process removed already
_swept_lock = threading.Lock()


class _Slots:
    """A bound on live containers shared by every event loop and thread that uses one factory: waiting for a
    slot suspends the coroutine (never a worker thread, which the docker calls themselves need)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._used = 0
        self._lock = threading.Lock()
        self._waiters: collections.deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = collections.deque()

    async def acquire(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._used < self.limit and not self._waiters:
                self._used += 1
                return
            waiter = (loop, loop.create_future())
            self._waiters.append(waiter)
        try:
            await waiter[1]
        except asyncio.CancelledError:
            with self._lock:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
            raise  # a slot granted meanwhile is handed on by ``_grant``, which finds the future cancelled

    def release(self) -> None:
        with self._lock:
            while self._waiters:
                loop, future = self._waiters.popleft()
                with contextlib.suppress(RuntimeError):  # that loop is closed: try the next waiter
                    loop.call_soon_threadsafe(self._grant, future)
                    return
            self._used -= 1

    def _grant(self, future: asyncio.Future[None]) -> None:
        if future.done():  # cancelled after the slot was handed to it: pass it on
            self.release()
        else:
            future.set_result(None)


@dataclass(eq=False)
class _Owned:
    """What a factory made and has not released; shared with its exit finalizer (which must not hold the
    factory itself)."""

    commands: DockerCommands
    containers: set[str] = field(default_factory=set)
    images: dict[str, str] = field(default_factory=dict)  # image -> its snapshot's file
    lock: threading.Lock = field(default_factory=threading.Lock)

    def release(self) -> None:
        """Remove every container, and every image whose snapshot no durable cache records."""
        with self.lock:
            containers, self.containers = sorted(self.containers), set()
            doomed = [image for image, path in self.images.items() if not kept_by_durable_cache(path)]
            for image in doomed:
                del self.images[image]
        with contextlib.suppress(SandboxError):
            if containers:
                run_cli(self.commands.remove_container(*containers))
            if doomed:
                run_cli(self.commands.remove_image(*doomed))


class DockerSandboxFactory:
    kind: str = KIND

    def __init__(
        self,
        image: str,
        *,
        timeout: float = 60.0,
        checkpoint: bool = False,
        commands: DockerCommands | None = None,
        max_containers: int = DEFAULT_MAX_CONTAINERS,
        max_output_bytes: int = 1_000_000,
        persistent: bool = False,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if max_containers < 1:
            raise ValueError(f"max_containers must be >= 1, got {max_containers}")
        self.image = image
        self.timeout = timeout
        self.checkpoint = checkpoint
        self.persistent = persistent
        if persistent:
            self.kind = PERSISTENT_KIND  # its snapshots hold a shell: a one-shot factory never forks them
        self.commands = commands or DockerCommands()
        self.max_output_bytes = max_output_bytes
        self.name_prefix = f"tvcache-{OWNER}-{next(_factory_ids)}"
        self._data_root: str | None = None  # the engine's, where a restored container's checkpoint must lie
        self.checkpoint_declined: str | None = None  # why this engine cannot checkpoint, once found out
        self._slots = _Slots(max_containers)
        self._owned = _Owned(self.commands)
        self._release = weakref.finalize(self, self._owned.release)
        self._tools = sh_tools(persistent=persistent)
        self.cost_hints: dict[str, float] = {"start": 0.5, "fork": 0.5, "snapshot": 1.0}

    @property
    def tools(self) -> Mapping[str, ToolSpec]:
        return self._tools

    @property
    def max_containers(self) -> int:
        return self._slots.limit

    async def start(self) -> ContainerSandbox:
        return await self._launch(self.image, None)

    async def fork(self, snapshot: Snapshot) -> ContainerSandbox:
        if snapshot.kind != self.kind:
            raise SandboxError(f"cannot fork a docker sandbox from a {snapshot.kind!r} snapshot")
        if not Path(snapshot.path).exists():
            raise SandboxError(
                f"docker snapshot {snapshot.path} is missing (discarded, or its cache is gone); "
                "rebuild the state by replaying its calls"
            )
        checkpoint_dir = snapshot.meta.get("checkpoint_dir")
        last_pid = snapshot.meta.get("last_pid")
        escapes = snapshot.meta.get("prompt_escapes")
        return await self._launch(
            str(snapshot.meta["image"]),
            str(checkpoint_dir) if checkpoint_dir else None,
            int(last_pid) if last_pid is not None else None,
            json.loads(escapes) if isinstance(escapes, str) else None,
        )

    async def _launch(
        self,
        image: str,
        checkpoint_dir: str | None,
        last_pid: int | None = None,
        escapes: dict[str, str] | None = None,
    ) -> ContainerSandbox:
        await self._sweep_once()
        await self._slots.acquire()
        name = f"{self.name_prefix}-{uuid.uuid4().hex[:8]}"
        with self._owned.lock:
            self._owned.containers.add(name)  # before it exists: an exit meanwhile still removes it
        try:
            if self.persistent:
                return await self._launch_shell(image, name, checkpoint_dir, last_pid, escapes)
            if checkpoint_dir is not None:
                container = await self._check(self.commands.run(image, name, create_only=True), "docker create", image)
                await asyncio.to_thread(self._place_checkpoint, checkpoint_dir, container)
                await self._check(self.commands.start_from_checkpoint(name, "snap"), "docker start --checkpoint", image)
            else:
                await self._check(self.commands.run(image, name), "docker run", image)
            sandbox = DockerSandbox(self, name, image)
            await sandbox.watch_limits()
        except BaseException:
            await asyncio.shield(asyncio.to_thread(self.release_container, name))
            raise
        return sandbox

    async def _launch_shell(
        self,
        image: str,
        name: str,
        checkpoint_dir: str | None,
        last_pid: int | None,
        escapes: dict[str, str] | None = None,
    ) -> ContainerSandbox:
        environment = {**self.commands.environment, **shell_environment()}
        docker = self.commands.docker
        if checkpoint_dir is None:
            argv = self.commands.run_shell(image, name, environment)
            try:
                shell = await asyncio.to_thread(DockerShell, argv, name=name, docker=docker)
            except SandboxError as error:
                raise SandboxError(f"docker sandbox from {image}: docker run -it failed: {error}") from error
        else:
            create = self.commands.run_shell(image, name, environment, create_only=True)
            container = await self._check(create, "docker create", image)
            await asyncio.to_thread(self._place_checkpoint, checkpoint_dir, container)
            argv = self.commands.start_shell(name, "snap")
            shell = await asyncio.to_thread(DockerShell, argv, name=name, docker=docker, restored=True)
            shell.escapes = dict(escapes or {})  # what the original's boot said its prompt decodes to
            if last_pid is not None and not await asyncio.to_thread(shell.set_last_pid, last_pid):
                await asyncio.to_thread(shell.close)
                raise SandboxError(f"docker sandbox {name}: cannot set the restored container's last PID (nsenter)")
        sandbox = PersistentDockerSandbox(self, name, image, shell)
        try:
            await sandbox.watch_limits(shell.pid)  # the shell is the container's main process
        except BaseException:
            await asyncio.to_thread(shell.close)
            raise
        return sandbox

    async def _check(self, argv: list[str], what: str, image: str) -> str:
        result = await run_cli_async(argv)
        if result.returncode != 0:
            stderr = result.stderr.strip()
            if engine_down(stderr):
                raise SandboxError(f"docker sandbox from {image}: {what} failed: the engine does not answer ({stderr})")
            raise SandboxError(f"docker sandbox from {image}: {what} failed: {stderr[:500]}")
        return result.stdout.strip()

    def _place_checkpoint(self, checkpoint_dir: str, container: str) -> None:
        if self._data_root is None:
            self._data_root = run_cli(self.commands.data_root()).stdout.strip() or "/var/lib/docker"
        target = Path(self._data_root) / "containers" / container / "checkpoints" / "snap"
        try:
            shutil.copytree(Path(checkpoint_dir) / "snap", target)
        except OSError as error:
            raise SandboxError(
                f"docker sandbox from checkpoint {checkpoint_dir}: cannot place it in the engine's container "
                f"directory {target.parent} (the engine must run on this machine): {error}"
            ) from error

    async def _sweep_once(self) -> None:
        """Orphans of crashed processes are removed once per process and engine, before its first container."""
        key = self.commands.docker
        with _swept_lock:
            if key in _swept:
                return
            _swept.add(key)
        with contextlib.suppress(SandboxError, ValueError):
            await asyncio.to_thread(remove_orphans, self.commands)

    def release_container(self, name: str) -> None:
        """Remove a container and give its slot back (once: only a container still owned)."""
        with self._owned.lock:
            owned = name in self._owned.containers
            self._owned.containers.discard(name)
        if owned:
            try:
                run_cli(self.commands.remove_container(name))
            finally:
                self._slots.release()

    def adopt_image(self, image: str, snapshot_path: str) -> None:
        """Own ``image``, made for the snapshot at ``snapshot_path`` (before it exists: an exit still removes it)."""
        with self._owned.lock:
            self._owned.images[image] = snapshot_path

    def discard(self, snapshot: Snapshot) -> None:
        # The record's meta names an image and a directory: remove only what ``snapshot`` itself makes (an image
        # of our repository, the checkpoint beside the snapshot's file), never another image or any directory.
        image = snapshot.meta.get("image")
        if isinstance(image, str) and image.startswith(SNAPSHOT_REPOSITORY + ":"):
            with self._owned.lock:
                self._owned.images.pop(image, None)
            with contextlib.suppress(SandboxError):
                run_cli(self.commands.remove_image(image))
        checkpoint_dir = snapshot.meta.get("checkpoint_dir")
        if checkpoint_dir and str(checkpoint_dir) == str(Path(snapshot.path).with_suffix(".checkpoint")):
            shutil.rmtree(checkpoint_dir, ignore_errors=True)
        Path(snapshot.path).unlink(missing_ok=True)

    def owned(self) -> tuple[list[str], list[str]]:
        """The containers and snapshot images this factory holds now (for inspection and tests)."""
        with self._owned.lock:
            return sorted(self._owned.containers), sorted(self._owned.images)

    def close(self) -> None:
        """Remove this factory's containers, and its snapshot images no durable cache records. Idempotent."""
        self._owned.release()

    def __repr__(self) -> str:
        return f"DockerSandboxFactory({self.image!r}, engine={self.commands.docker!r})"


class DockerSandbox(ContainerSandbox):
    """A container per sandbox, one ``docker exec`` per call (``ContainerSandbox``); ``DockerSandbox.factory``
    makes the factory, of these or of persistent shells (``docker_shell``)."""

    @classmethod
    def factory(
        cls,
        image: str,
        *,
        timeout: float = 60.0,
        checkpoint: bool = False,
        network: str = "none",
        engine: str = "docker",
        max_containers: int = DEFAULT_MAX_CONTAINERS,
        persistent: bool = False,
        limits: SandboxLimits | None = DEFAULT_LIMITS,
    ) -> DockerSandboxFactory:
        """Sandboxes started from ``image`` (which needs ``bash`` and coreutils' ``timeout``), by ``engine``
        ("docker", or "podman" through the same CLI), at most ``max_containers`` at once. With
        ``persistent=True``, one long-lived shell per container (``docker_shell``); its snapshots need
        ``checkpoint=True``.

        Each container is confined (``DockerCommands.confinement``): only ``CONTAINER_CAPABILITIES``, no
        privilege gained by exec, and ``limits`` (the shell factory's ``SandboxLimits``: ``pids``, ``memory_bytes``
        with swap included, ``cpus``; None: none). A call during which the container hit its memory or process
        limit ends with a note saying so ("[the sandbox hit its process limit of 1024]"), as an error and
        non-deterministic, and the sandbox is not used again: later calls raise SandboxError naming the limit
        (``docker_container``: the engine's cgroup counters, read on this machine)."""
        podman = os.path.basename(engine).startswith("podman")
        commands = DockerCommands(
            docker=engine,
            network=network,
            ulimits=PODMAN_ULIMITS if podman else (),
            limits=limits,
        )
        return DockerSandboxFactory(
            image,
            timeout=timeout,
            checkpoint=checkpoint,
            commands=commands,
            max_containers=max_containers,
            persistent=persistent,
        )
