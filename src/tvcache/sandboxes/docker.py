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

The docker command lines are built by ``DockerCommands`` (pure functions, tested without an engine).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import threading
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from ..calls import ToolCall, ToolSpec
from ..errors import SandboxError, SnapshotDeclined
from ..journal import Journal
from ..protocol import Outcome, Snapshot
from ._process import ShellResult, command_timeout, render_shell, validated
from .folder import SH_TOOL
from .layers import _process_tag

__all__ = ["DockerCommands", "DockerSandbox", "DockerSandboxFactory", "docker_available", "remove_orphans"]

KIND = "docker"
PERSISTENT_KIND = "docker-persistent"  # a persistent sandbox's snapshot: files and (checkpointed) shell
SNAPSHOT_REPOSITORY = "tvcache-snapshot"  # every snapshot image is a tag of it; ``discard`` removes no other
SANDBOX_LABEL = "tvcache.sandbox"
OWNER_LABEL = "tvcache.owner"
SNAPSHOT_LABEL = "tvcache.snapshot"  # on a snapshot image: the snapshot's file, which a durable cache keeps
# Measured here (2 cores, 23 GB): 100 containers start in 21 s six at a time and all answer; the engine's
# latency, not memory, is what grows. A factory keeps at most this many containers at once by default; more
# sandboxes wait for a slot instead of piling onto the engine.
DEFAULT_MAX_CONTAINERS = 128
# podman's runs fail on rlimits they cannot raise here unless told what to use (research/sandboxes.md).
PODMAN_ULIMITS = ("nofile=20000:20000", "nproc=32768:32768")
# The main process of a persistent sandbox's container: an interactive shell on the container's terminal.
SHELL_ARGV = ("bash", "--norc", "--noprofile", "--noediting", "-i")
_OWNER = _process_tag(os.getpid()) or f"{os.getpid()}-0"
_factory_ids = itertools.count()
_swept: set[str] = set()  # engines whose orphans this process removed already
_swept_lock = threading.Lock()


@dataclass(frozen=True, kw_only=True)
class DockerCommands:
    """The argument vectors tvcache runs; no shell is ever involved."""

    docker: str = "docker"
    network: str = "none"
    workdir: str | None = None  # None: the image's own WORKDIR
    environment: Mapping[str, str] = field(default_factory=lambda: {"LANG": "C.UTF-8", "TZ": "UTC"})
    ulimits: tuple[str, ...] = ()
    owner: str = _OWNER

    def run(self, image: str, name: str, *, create_only: bool = False) -> list[str]:
        if create_only:  # to restore processes: create, put the checkpoint in place, start from it
            return [self.docker, "create", *self._run_options(name), image, "sleep", "infinity"]
        return [self.docker, "run", "--detach", *self._run_options(name), image, "sleep", "infinity"]

    def run_shell(
        self, image: str, name: str, environment: Mapping[str, str], *, create_only: bool = False
    ) -> list[str]:
        """A container whose main process is an interactive bash on a terminal (persistent sandboxes): ``docker
        run -it``, attached to the caller's terminal; or ``docker create -it``, to restore a checkpoint into."""
        verb = "create" if create_only else "run"
        extra = [option for key, value in sorted(environment.items()) for option in ("--env", f"{key}={value}")]
        return [self.docker, verb, "--interactive", "--tty", *self._run_options(name), *extra, image, *SHELL_ARGV]

    def start_shell(self, name: str, checkpoint: str | None = None) -> list[str]:
        """Start a persistent sandbox's container again (or from a checkpoint), attached to the caller's terminal."""
        restore = ["--checkpoint", checkpoint] if checkpoint is not None else []
        return [self.docker, "start", "--attach", "--interactive", *restore, name]

    def start_from_checkpoint(self, name: str, checkpoint: str) -> list[str]:
        # The engine (20.10) refuses a custom --checkpoint-dir here: the checkpoint is copied into the container's
        # own directory first (``DockerSandboxFactory._launch``).
        return [self.docker, "start", "--checkpoint", checkpoint, name]

    def data_root(self) -> list[str]:
        return [self.docker, "info", "--format", "{{.DockerRootDir}}"]

    def _run_options(self, name: str) -> list[str]:
        options = ["--pull", "never", "--name", name, "--network", self.network, *self._workdir()]
        options += ["--label", f"{SANDBOX_LABEL}=1", "--label", f"{OWNER_LABEL}={self.owner}"]
        for limit in self.ulimits:
            options += ["--ulimit", limit]
        for key, value in sorted(self.environment.items()):
            options += ["--env", f"{key}={value}"]
        return options

    def _workdir(self) -> list[str]:
        return ["--workdir", self.workdir] if self.workdir is not None else []

    def exec(self, name: str, command: str, timeout: float) -> list[str]:
        seconds = f"{timeout:g}"
        return [
            self.docker,
            "exec",
            *self._workdir(),
            name,
            "timeout",
            "-s",
            "KILL",
            seconds,
            "bash",
            "-c",
            command,
        ]

    def commit(self, name: str, image: str, *, snapshot: str = "") -> list[str]:
        change = ["--change", f"LABEL {SNAPSHOT_LABEL}={json.dumps(snapshot)}"] if snapshot else []
        return [self.docker, "commit", "--pause=true", *change, name, image]

    def checkpoint(self, name: str, checkpoint: str, checkpoint_dir: str) -> list[str]:
        create = [self.docker, "checkpoint", "create", "--leave-running"]
        return [*create, "--checkpoint-dir", checkpoint_dir, name, checkpoint]

    def processes(self, name: str) -> list[str]:
        """The processes in the container (``docker top``: a header line, then one line per process)."""
        return [self.docker, "top", name]

    def running(self, name: str) -> list[str]:
        return [self.docker, "container", "inspect", "--format", "{{.State.Running}}", name]

    def image_size(self, *images: str) -> list[str]:
        return [self.docker, "image", "inspect", "--format", "{{.Size}}", *images]

    def remove_container(self, *names: str) -> list[str]:
        return [self.docker, "rm", "--force", "--volumes", *names]

    def remove_image(self, *images: str) -> list[str]:
        return [self.docker, "image", "rm", "--force", *images]

    def list_containers(self) -> list[str]:
        label = f"{{{{.ID}}}} {{{{.Label {json.dumps(OWNER_LABEL)}}}}}"
        return [self.docker, "ps", "--all", "--filter", f"label={SANDBOX_LABEL}=1", "--format", label]

    def list_images(self) -> list[str]:
        return [self.docker, "images", "--quiet", "--no-trunc", "--filter", f"label={SANDBOX_LABEL}=1"]

    def image_labels(self, *images: str) -> list[str]:
        return [self.docker, "image", "inspect", "--format", "{{.Id}} {{json .Config.Labels}}", *images]


def docker_available(docker: str = "docker") -> tuple[bool, str]:
    """Whether a Docker engine answers, and if not, why (for skip reasons and error messages)."""
    if shutil.which(docker) is None:
        return False, f"the {docker!r} command is not installed"
    try:
        result = subprocess.run(
            [docker, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return False, f"{docker} info failed: {error}"
    if result.returncode != 0:
        return False, f"no {docker} engine answers: {result.stderr.strip()[:200]}"
    return True, f"{docker} engine {result.stdout.strip()}"


def _run_sync(argv: list[str], *, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SandboxError(f"{' '.join(argv[:3])} failed: {error}") from error


async def _run(argv: list[str], *, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(_run_sync, argv, timeout=timeout)


def _engine_down(stderr: str) -> bool:
    return "Cannot connect to the Docker daemon" in stderr or "Is the docker daemon running" in stderr


def _owner_alive(owner: str) -> bool:
    pid, _, start = owner.partition("-")
    return pid.isdigit() and _process_tag(int(pid)) == f"{pid}-{start}"


def remove_orphans(commands: DockerCommands | None = None) -> tuple[int, int]:
    """Remove the containers, and the snapshot images no durable cache records any more, that tvcache processes
    which are gone left in the engine (they crashed, or were killed before cleaning up). A live owner's are left
    alone, and so is an image whose snapshot file still exists (a durable cache's: it frees it on eviction).
    Returns (containers, images) removed."""
    commands = commands or DockerCommands()
    listing = _run_sync(commands.list_containers())
    dead = [line.split()[0] for line in listing.stdout.splitlines() if line.strip() and not _alive_line(line)]
    if dead:
        _run_sync(commands.remove_container(*dead))
    images = _run_sync(commands.list_images()).stdout.split()
    orphans: list[str] = []
    if images:
        for line in _run_sync(commands.image_labels(*sorted(set(images)))).stdout.splitlines():
            image_id, _, labels_json = line.partition(" ")
            labels = json.loads(labels_json or "null") or {}
            kept = _kept_by_durable_cache(labels.get(SNAPSHOT_LABEL) or "")
            if not _owner_alive(labels.get(OWNER_LABEL, "")) and not kept:
                orphans.append(image_id)
    if orphans:
        _run_sync(commands.remove_image(*orphans))
    return len(dead), len(orphans)


def _kept_by_durable_cache(snapshot_path: str) -> bool:
    """A durable cache still records the snapshot: its file is there, in the snapshot directory of a cache with a
    journal (``<root>/snapshots/<task>/<file>``, ``<root>/journal.log``). An in-memory cache's directory has no
    journal; a crashed process leaves it behind, but nothing will ever fork from it again."""
    path = Path(snapshot_path)
    if not snapshot_path or not path.is_file() or len(path.parents) < 3:
        return False
    return (path.parents[2] / Journal.FILE).is_file()


def _alive_line(line: str) -> bool:
    parts = line.split()
    return len(parts) > 1 and _owner_alive(parts[1])


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
            doomed = [image for image, path in self.images.items() if not _kept_by_durable_cache(path)]
            for image in doomed:
                del self.images[image]
        with contextlib.suppress(SandboxError):
            if containers:
                _run_sync(self.commands.remove_container(*containers))
            if doomed:
                _run_sync(self.commands.remove_image(*doomed))


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
        self.name_prefix = f"tvcache-{_OWNER}-{next(_factory_ids)}"
        self._data_root: str | None = None  # the engine's, where a restored container's checkpoint must lie
        self.checkpoint_declined: str | None = None  # why this engine cannot checkpoint, once found out
        self._slots = _Slots(max_containers)
        self._owned = _Owned(self.commands)
        self._release = weakref.finalize(self, self._owned.release)
        self._tools: Mapping[str, ToolSpec] = MappingProxyType({SH_TOOL.name: SH_TOOL})
        self.cost_hints: dict[str, float] = {"start": 0.5, "fork": 0.5, "snapshot": 1.0}

    @property
    def tools(self) -> Mapping[str, ToolSpec]:
        return self._tools

    @property
    def max_containers(self) -> int:
        return self._slots.limit

    async def start(self) -> DockerSandbox:
        return await self._launch(self.image, None)

    async def fork(self, snapshot: Snapshot) -> DockerSandbox:
        if snapshot.kind != self.kind:
            raise SandboxError(f"cannot fork a docker sandbox from a {snapshot.kind!r} snapshot")
        if not Path(snapshot.path).exists():
            raise SandboxError(
                f"docker snapshot {snapshot.path} is missing (discarded, or its cache is gone); "
                "rebuild the state by replaying its calls"
            )
        checkpoint_dir = snapshot.meta.get("checkpoint_dir")
        last_pid = snapshot.meta.get("last_pid")
        return await self._launch(
            str(snapshot.meta["image"]),
            str(checkpoint_dir) if checkpoint_dir else None,
            int(last_pid) if last_pid is not None else None,
        )

    async def _launch(self, image: str, checkpoint_dir: str | None, last_pid: int | None = None) -> DockerSandbox:
        await self._sweep_once()
        await self._slots.acquire()
        name = f"{self.name_prefix}-{uuid.uuid4().hex[:8]}"
        with self._owned.lock:
            self._owned.containers.add(name)  # before it exists: an exit meanwhile still removes it
        try:
            if self.persistent:
                return await self._launch_shell(image, name, checkpoint_dir, last_pid)
            if checkpoint_dir is not None:
                container = await self._check(self.commands.run(image, name, create_only=True), "docker create", image)
                await asyncio.to_thread(self._place_checkpoint, checkpoint_dir, container)
                await self._check(self.commands.start_from_checkpoint(name, "snap"), "docker start --checkpoint", image)
            else:
                await self._check(self.commands.run(image, name), "docker run", image)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(self._remove_container, name))
            raise
        return DockerSandbox(self, name, image)

    async def _launch_shell(
        self, image: str, name: str, checkpoint_dir: str | None, last_pid: int | None
    ) -> DockerSandbox:
        from .docker_shell import DockerShell, PersistentDockerSandbox, shell_environment

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
            if last_pid is not None and not await asyncio.to_thread(shell.set_last_pid, last_pid):
                await asyncio.to_thread(shell.close)
                raise SandboxError(f"docker sandbox {name}: cannot set the restored container's last PID (nsenter)")
        return PersistentDockerSandbox(self, name, image, shell)

    async def _check(self, argv: list[str], what: str, image: str) -> str:
        result = await _run(argv)
        if result.returncode != 0:
            stderr = result.stderr.strip()
            if _engine_down(stderr):
                raise SandboxError(f"docker sandbox from {image}: {what} failed: the engine does not answer ({stderr})")
            raise SandboxError(f"docker sandbox from {image}: {what} failed: {stderr[:500]}")
        return result.stdout.strip()

    def _place_checkpoint(self, checkpoint_dir: str, container: str) -> None:
        if self._data_root is None:
            self._data_root = _run_sync(self.commands.data_root()).stdout.strip() or "/var/lib/docker"
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

    def _remove_container(self, name: str) -> None:
        """Remove a container and give its slot back (once: only a container still owned)."""
        with self._owned.lock:
            owned = name in self._owned.containers
            self._owned.containers.discard(name)
        if owned:
            try:
                _run_sync(self.commands.remove_container(name))
            finally:
                self._slots.release()

    def _adopt_image(self, image: str, snapshot_path: str) -> None:
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
                _run_sync(self.commands.remove_image(image))
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


class DockerSandbox:
    def __init__(self, factory: DockerSandboxFactory, name: str, image: str) -> None:
        self._factory = factory
        self.name = name
        self.image = image
        self._stopped = False
        self._dead: str | None = None  # why the container cannot be trusted any more
        self._lock = asyncio.Lock()

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
    ) -> DockerSandboxFactory:
        """Sandboxes started from ``image`` (which needs ``bash`` and coreutils' ``timeout``), by ``engine``
        ("docker", or "podman" through the same CLI), at most ``max_containers`` at once. With
        ``persistent=True``, one long-lived shell per container (``docker_shell``); its snapshots need
        ``checkpoint=True``."""
        podman = os.path.basename(engine).startswith("podman")
        commands = DockerCommands(docker=engine, network=network, ulimits=PODMAN_ULIMITS if podman else ())
        return DockerSandboxFactory(
            image,
            timeout=timeout,
            checkpoint=checkpoint,
            commands=commands,
            max_containers=max_containers,
            persistent=persistent,
        )

    def _where(self, what: str) -> str:
        return f"docker sandbox {self.name} (image {self.image}), {what}"

    def _require_usable(self, what: str) -> None:
        if self._stopped:
            raise SandboxError(f"{self._where(what)}: this sandbox was stopped; start or fork a new one")
        if self._dead is not None:
            raise SandboxError(f"{self._where(what)}: {self._dead}; start or fork a new sandbox")

    async def _confirm_alive(self, what: str, stderr: str) -> None:
        """After a failure that may be the engine's or the container's rather than the command's: if the
        container is not running, it is dead for good (never trusted again) and the call raises."""
        state = await _run(self._factory.commands.running(self.name), timeout=30)
        if state.returncode == 0 and state.stdout.strip() == "true":
            return
        if _engine_down(state.stderr) or _engine_down(stderr):
            self._dead = "the Docker engine does not answer (stopped or died)"
        else:
            self._dead = "its container is not running any more (killed or removed from outside)"
        raise SandboxError(f"{self._where(what)}: {self._dead}: {stderr.strip()[:300]}")

    async def execute(self, call: ToolCall) -> Outcome:
        _, arguments = validated(call, self._factory.tools)
        timeout = command_timeout(arguments, self._factory.timeout)
        what = f"call {call.name}({arguments['cmd'][:80]!r})"
        async with self._lock:
            self._require_usable(what)
            argv = self._factory.commands.exec(self.name, arguments["cmd"], timeout)
            try:
                # One pipe for both streams, as the shell backends give: the output interleaves as it was written.
                result = await asyncio.to_thread(_run_merged, argv, timeout + 30)
            except SandboxError as error:
                self._dead = f"docker exec did not return ({error})"
                raise SandboxError(f"{self._where(what)}: {self._dead}") from error
            text = result.stdout.decode("utf-8", errors="replace")
            # 137 is also the timeout's kill; docker's own failures (not running, no engine) exit 1 or 125-127
            # with its message: only the container's state tells them from the command's own.
            if result.returncode == 137 or (
                result.returncode in (1, 125, 126, 127) and ("Error response from daemon" in text or _engine_down(text))
            ):
                await self._confirm_alive(what, text)
            if result.returncode in (126, 127) and _no_bash(text):
                self._dead = "the image has no bash (or no coreutils timeout); docker sandboxes need both"
                raise SandboxError(f"{self._where(what)}: {self._dead}: {text.strip()[:300]}")
        limit = self._factory.max_output_bytes
        shell = ShellResult(
            output=result.stdout[:limit],
            total_bytes=len(result.stdout),
            returncode=result.returncode if result.returncode != 137 else 0,
            timed_out=result.returncode == 137,  # killed by the timeout inside the container
            escaped=False,
        )
        return render_shell(shell, limit, timeout)

    async def snapshot(self, dest: Path) -> Snapshot:
        factory, commands = self._factory, self._factory.commands
        image = f"{SNAPSHOT_REPOSITORY}:{uuid.uuid4().hex[:16]}"
        dest = Path(dest)
        if dest.exists() or dest.is_symlink():
            raise SandboxError(f"{self._where('snapshot')}: destination {dest} already exists")
        async with self._lock:
            self._require_usable("snapshot")
            meta: dict[str, str] = {"image": image}
            if factory.checkpoint:
                meta.update(await self._process_meta())
                try:
                    meta["checkpoint_dir"] = await self._checkpoint(dest)
                finally:  # a failed dump may have moved things too
                    await self._after_checkpoint(meta)
            else:
                await self._decline_running_processes()
            factory._adopt_image(image, str(dest))  # before it exists: an exit meanwhile still removes it
            try:
                await self._checked(commands.commit(self.name, image, snapshot=str(dest)), "snapshot (docker commit)")
                # The commit's own layer: what the snapshot adds to the image the container started from.
                sizes = await self._checked(commands.image_size(image, self.image), "snapshot (docker image inspect)")
                new, parent = (int(value) for value in sizes.split())
                size = max(new - parent, 0)
                dest.parent.mkdir(parents=True, exist_ok=True)
                partial = dest.with_name(dest.name + ".partial")
                partial.write_text(json.dumps({"kind": factory.kind, **meta}))
                os.replace(partial, dest)
            except BaseException:
                snapshot = Snapshot(kind=factory.kind, path=str(dest), bytes=0, meta=meta)
                await asyncio.shield(asyncio.to_thread(factory.discard, snapshot))
                raise
        return Snapshot(kind=factory.kind, path=str(dest), bytes=size, meta=meta)

    async def _checkpoint(self, dest: Path) -> str:
        factory = self._factory
        if factory.checkpoint_declined is not None:
            raise SnapshotDeclined(f"{self._where('snapshot')}: {factory.checkpoint_declined}")
        checkpoint_dir = str(dest.with_suffix(".checkpoint"))
        result = await _run(factory.commands.checkpoint(self.name, "snap", checkpoint_dir))
        if result.returncode == 0:
            return checkpoint_dir
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
        stderr = result.stderr.strip()
        await self._confirm_alive("snapshot (docker checkpoint create)", stderr)
        if "experimental" in stderr.lower() or "criu" in stderr.lower() or "not supported" in stderr.lower():
            # The engine cannot checkpoint at all (no --experimental, no CRIU >= 4.1): say so once, then decline
            # without asking again.
            factory.checkpoint_declined = f"this engine cannot checkpoint processes: {stderr[:300]}"
            raise SnapshotDeclined(f"{self._where('snapshot')}: {factory.checkpoint_declined}")
        raise SnapshotDeclined(f"{self._where('snapshot')}: docker checkpoint create failed: {stderr[:300]}")

    async def _process_meta(self) -> dict[str, str]:
        """What a checkpoint's fork needs besides the checkpoint (nothing here; a persistent shell's last PID)."""
        return {}

    async def _after_checkpoint(self, meta: dict[str, str]) -> None:
        """What the sandbox must redo after its checkpoint (nothing here; a persistent shell's last PID)."""

    async def _decline_running_processes(self) -> None:
        """A commit keeps files, not processes: a state with a background process left running cannot be forked
        exactly without a checkpoint."""
        listing = await self._checked(self._factory.commands.processes(self.name), "snapshot (docker top)")
        # Zombies are listed too (the container's PID 1 never reaps them), but they are no state to keep.
        lines = [line for line in listing.splitlines()[1:] if not line.rstrip().endswith("<defunct>")]
        if len(lines) > 1:  # the container's own ``sleep infinity`` is always there
            raise SnapshotDeclined(
                f"{self._where('snapshot')}: {len(lines) - 1} process(es) still run in the container, which docker "
                "commit would drop; use checkpoint=True on an engine with CRIU to snapshot them"
            )

    async def _checked(self, argv: list[str], what: str) -> str:
        result = await _run(argv)
        if result.returncode != 0:
            await self._confirm_alive(what, result.stderr)
            raise SandboxError(f"{self._where(what)} failed: {result.stderr.strip()[:500]}")
        return result.stdout.strip()

    async def stop(self) -> None:
        async with self._lock:
            if self._stopped:
                return
            self._stopped = True
            with contextlib.suppress(SandboxError):
                await asyncio.shield(asyncio.to_thread(self._factory._remove_container, self.name))


def _no_bash(stderr: str) -> bool:
    return "executable file not found" in stderr or "failed to run command 'bash'" in stderr


def _run_merged(argv: list[str], timeout: float) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SandboxError(f"{' '.join(argv[:3])} failed: {error}") from error
