"""The Docker engine as tvcache drives it: the CLI's argument vectors (``DockerCommands``, pure functions tested
without an engine), running them, the labels that mark what tvcache made, and the removal of what dead owners left.

Nothing here is a sandbox or a factory: ``docker_container`` (the sandbox), ``docker_shell`` (its persistent
shell) and ``docker`` (the factory) are built on this layer, and this layer on none of them.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SandboxError
from ..journal import Journal
from .ownership import owner_is_gone, process_tag
from .shell.limits import DEFAULT_LIMITS, SandboxLimits
from .shell.linux import CAP_CHECKPOINT_RESTORE, KEPT_CAPABILITIES
from .shell.pty_shell import shell_argv

__all__ = [
    "CONTAINER_CAPABILITIES",
    "KIND",
    "OWNER",
    "OWNER_LABEL",
    "PERSISTENT_KIND",
    "SANDBOX_LABEL",
    "SHELL_ARGV",
    "SNAPSHOT_LABEL",
    "SNAPSHOT_REPOSITORY",
    "DockerCommands",
    "docker_available",
    "engine_down",
    "kept_by_durable_cache",
    "no_bash",
    "remove_orphans",
    "run_cli",
    "run_cli_async",
    "run_merged",
]

KIND = "docker"
PERSISTENT_KIND = "docker-persistent"  # a persistent sandbox's snapshot: files and (checkpointed) shell
SNAPSHOT_REPOSITORY = "tvcache-snapshot"  # every snapshot image is a tag of it; ``discard`` removes no other
SANDBOX_LABEL = "tvcache.sandbox"
OWNER_LABEL = "tvcache.owner"
SNAPSHOT_LABEL = "tvcache.snapshot"  # on a snapshot image: the snapshot's file, which a durable cache keeps
# The main process of a persistent sandbox's container: an interactive shell on the container's terminal.
SHELL_ARGV = tuple(shell_argv("bash"))  # the persistent shell, as the overlay flavour starts it
OWNER = process_tag(os.getpid()) or f"{os.getpid()}-0"  # this process, as the owner label names it
# A container keeps the capabilities a shell sandbox keeps (``linux.KEPT_CAPABILITIES``) and no other, less
# CHECKPOINT_RESTORE: its shell's next PID is set from the host (``docker_shell``), and a checkpoint is taken by the
# engine's CRIU, outside the container.
CONTAINER_CAPABILITIES = tuple(
    name.removeprefix("CAP_") for name, number in KEPT_CAPABILITIES.items() if number != CAP_CHECKPOINT_RESTORE
)


@dataclass(frozen=True, kw_only=True)
class DockerCommands:
    """The argument vectors tvcache runs; no shell is ever involved."""

    docker: str = "docker"
    network: str = "none"
    workdir: str | None = None  # None: the image's own WORKDIR
    environment: Mapping[str, str] = field(default_factory=lambda: {"LANG": "C.UTF-8", "TZ": "UTC"})
    ulimits: tuple[str, ...] = ()
    owner: str = OWNER
    # The shell factory's limits, per container: processes, memory (swap included: --memory-swap equals it) and
    # CPUs; ``tmpfs_bytes`` does not apply (a container's /tmp is part of its files, committed with them).
    limits: SandboxLimits | None = DEFAULT_LIMITS

    def __post_init__(self) -> None:
        memory = self.limits.memory_bytes if self.limits is not None else None
        if memory is not None and memory < 6 * 1024**2:
            raise ValueError(
                f"memory_bytes must be at least 6 MiB for a container (the engine's minimum), got {memory}"
            )

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
        options += self.confinement()
        for limit in self.ulimits:
            options += ["--ulimit", limit]
        for key, value in sorted(self.environment.items()):
            options += ["--env", f"{key}={value}"]
        return options

    def confinement(self) -> list[str]:
        """The options that confine a container: only ``CONTAINER_CAPABILITIES``, no privilege gained by exec
        (setuid files, file capabilities), and the limits. Never ``--privileged``, and no mount of the host: the
        container sees its image alone."""
        options = ["--cap-drop", "ALL"]
        for capability in CONTAINER_CAPABILITIES:
            options += ["--cap-add", capability]
        options += ["--security-opt", "no-new-privileges"]
        limits = self.limits or SandboxLimits(pids=None, memory_bytes=None, cpus=None, tmpfs_bytes=None)
        if limits.pids is not None:
            options += ["--pids-limit", str(limits.pids)]
        if limits.memory_bytes is not None:  # swap equal to memory: no swap beyond it
            options += ["--memory", f"{limits.memory_bytes}b", "--memory-swap", f"{limits.memory_bytes}b"]
        if limits.cpus is not None:
            options += ["--cpus", f"{limits.cpus:g}"]
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

    def oom_kills(self, name: str) -> list[str]:
        """The container's count of processes the OOM killer ended (``oom_kill`` of its memory cgroup, v1 or v2,
        as seen inside it): the engine's ``State.OOMKilled`` covers only its main process, not an exec's."""
        files = "/sys/fs/cgroup/memory/memory.oom_control /sys/fs/cgroup/memory.events"
        return [self.docker, "exec", name, "sh", "-c", f"cat {files} 2>/dev/null; true"]

    def main_pid(self, name: str) -> list[str]:
        """The container's main process, in this machine's PID numbers (0 when it is not running)."""
        return [self.docker, "container", "inspect", "--format", "{{.State.Pid}}", name]

    def kill(self, name: str) -> list[str]:
        return [self.docker, "kill", name]

    def running(self, name: str) -> list[str]:
        """``<running> <oom killed>``: whether the container runs, and whether the kernel's OOM killer has ended a
        process of it (since it started) at its memory limit."""
        return [self.docker, "container", "inspect", "--format", "{{.State.Running}} {{.State.OOMKilled}}", name]

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


def run_cli(argv: list[str], *, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SandboxError(f"{' '.join(argv[:3])} failed: {error}") from error


async def run_cli_async(argv: list[str], *, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(run_cli, argv, timeout=timeout)


def engine_down(stderr: str) -> bool:
    return "Cannot connect to the Docker daemon" in stderr or "Is the docker daemon running" in stderr


def _owner_alive(owner: str) -> bool:
    """The owner label's process still runs (``owner_is_gone``: one test for every leftover sweep); a label that
    is not a process tag counts as gone, since tvcache wrote every label it reads here."""
    pid, _, start = owner.partition("-")
    return pid.isdigit() and start.isdigit() and not owner_is_gone(owner)


def remove_orphans(commands: DockerCommands | None = None) -> tuple[int, int]:
    """Remove the containers, and the snapshot images no durable cache records any more, that tvcache processes
    which are gone left in the engine (they crashed, or were killed before cleaning up). A live owner's are left
    alone, and so is an image whose snapshot file still exists (a durable cache's: it frees it on eviction).
    Returns (containers, images) removed."""
    commands = commands or DockerCommands()
    listing = run_cli(commands.list_containers())
    dead = [line.split()[0] for line in listing.stdout.splitlines() if line.strip() and not _alive_line(line)]
    if dead:
        run_cli(commands.remove_container(*dead))
    images = run_cli(commands.list_images()).stdout.split()
    orphans: list[str] = []
    if images:
        for line in run_cli(commands.image_labels(*sorted(set(images)))).stdout.splitlines():
            image_id, _, labels_json = line.partition(" ")
            labels = json.loads(labels_json or "null") or {}
            kept = kept_by_durable_cache(labels.get(SNAPSHOT_LABEL) or "")
            if not _owner_alive(labels.get(OWNER_LABEL, "")) and not kept:
                orphans.append(image_id)
    if orphans:
        run_cli(commands.remove_image(*orphans))
    return len(dead), len(orphans)


def kept_by_durable_cache(snapshot_path: str) -> bool:
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


def no_bash(stderr: str) -> bool:
    return "executable file not found" in stderr or "failed to run command 'bash'" in stderr


def run_merged(argv: list[str], timeout: float) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SandboxError(f"{' '.join(argv[:3])} failed: {error}") from error
