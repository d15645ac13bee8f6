"""Docker sandboxes, for users who already run Docker: a container per sandbox, driven by the docker CLI.

``execute`` runs ``bash -c`` through ``docker exec`` (with a kill-timeout inside the container); ``snapshot``
commits the container's filesystem to an image (``docker commit``) — or, with ``checkpoint=True`` on an
engine with CRIU enabled, also checkpoints its processes (``docker checkpoint create --leave-running``);
``fork`` starts a new container from that image (and checkpoint). Containers get no network by default.

The docker command lines are built by ``DockerCommands`` (pure functions, tested without an engine); the
tests that need a running engine are skipped, with the reason shown, where none is available.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from ..calls import ToolCall, ToolSpec
from ..errors import SandboxError
from ..protocol import Outcome, Snapshot
from ._process import command_timeout, validated
from .folder import SH_TOOL

__all__ = ["DockerCommands", "DockerSandbox", "DockerSandboxFactory", "docker_available"]

KIND = "docker"
_LABEL = "tvcache.sandbox=1"


@dataclass(frozen=True, kw_only=True)
class DockerCommands:
    """The argument vectors tvcache runs; no shell is ever involved."""

    docker: str = "docker"
    network: str = "none"
    workdir: str = "/"
    environment: Mapping[str, str] = field(default_factory=lambda: {"LANG": "C.UTF-8", "TZ": "UTC"})

    def run(
        self, image: str, name: str, *, checkpoint: str | None = None, checkpoint_dir: str | None = None
    ) -> list[str]:
        if checkpoint is not None:  # restore processes too: create, then start from the checkpoint
            return [self.docker, "create", *self._run_options(name), image, "sleep", "infinity"]
        return [self.docker, "run", "--detach", *self._run_options(name), image, "sleep", "infinity"]

    def start_from_checkpoint(self, name: str, checkpoint: str, checkpoint_dir: str) -> list[str]:
        return [self.docker, "start", "--checkpoint", checkpoint, "--checkpoint-dir", checkpoint_dir, name]

    def _run_options(self, name: str) -> list[str]:
        options = ["--name", name, "--label", _LABEL, "--network", self.network, "--workdir", self.workdir]
        for key, value in sorted(self.environment.items()):
            options += ["--env", f"{key}={value}"]
        return options

    def exec(self, name: str, command: str, timeout: float) -> list[str]:
        seconds = f"{timeout:g}"
        return [
            self.docker,
            "exec",
            "--workdir",
            self.workdir,
            name,
            "timeout",
            "-s",
            "KILL",
            seconds,
            "bash",
            "-c",
            command,
        ]

    def commit(self, name: str, image: str) -> list[str]:
        return [self.docker, "commit", "--pause=true", name, image]

    def checkpoint(self, name: str, checkpoint: str, checkpoint_dir: str) -> list[str]:
        create = [self.docker, "checkpoint", "create", "--leave-running"]
        return [*create, "--checkpoint-dir", checkpoint_dir, name, checkpoint]

    def image_size(self, image: str) -> list[str]:
        return [self.docker, "image", "inspect", "--format", "{{.Size}}", image]

    def remove_container(self, name: str) -> list[str]:
        return [self.docker, "rm", "--force", "--volumes", name]

    def remove_image(self, image: str) -> list[str]:
        return [self.docker, "image", "rm", "--force", image]


def docker_available(docker: str = "docker") -> tuple[bool, str]:
    """Whether a Docker engine answers, and if not, why (for skip reasons and error messages)."""
    if shutil.which(docker) is None:
        return False, f"the {docker!r} command is not installed"
    try:
        result = subprocess.run(
            [docker, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return False, f"docker info failed: {error}"
    if result.returncode != 0:
        return False, f"no Docker engine answers: {result.stderr.strip()[:200]}"
    return True, f"Docker engine {result.stdout.strip()}"


async def _run(argv: list[str], *, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    try:
        return await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SandboxError(f"{' '.join(argv[:3])} failed: {error}") from error


async def _check(argv: list[str], what: str) -> str:
    result = await _run(argv)
    if result.returncode != 0:
        raise SandboxError(f"{what} failed ({' '.join(argv[:3])} ...): {result.stderr.strip()[:500]}")
    return result.stdout.strip()


class DockerSandboxFactory:
    kind: str = KIND

    def __init__(
        self, image: str, *, timeout: float = 60.0, checkpoint: bool = False, commands: DockerCommands | None = None
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.image = image
        self.timeout = timeout
        self.checkpoint = checkpoint
        self.commands = commands or DockerCommands()
        self._tools: Mapping[str, ToolSpec] = MappingProxyType({SH_TOOL.name: SH_TOOL})
        self.cost_hints: dict[str, float] = {"start": 0.5, "fork": 0.5, "snapshot": 1.0}

    @property
    def tools(self) -> Mapping[str, ToolSpec]:
        return self._tools

    async def start(self) -> DockerSandbox:
        return await self._launch(self.image, None)

    async def fork(self, snapshot: Snapshot) -> DockerSandbox:
        if snapshot.kind != KIND:
            raise SandboxError(f"cannot fork a docker sandbox from a {snapshot.kind!r} snapshot")
        return await self._launch(str(snapshot.meta["image"]), snapshot.meta.get("checkpoint_dir"))

    async def _launch(self, image: str, checkpoint_dir: str | None) -> DockerSandbox:
        name = f"tvcache-{uuid.uuid4().hex[:12]}"
        if checkpoint_dir is not None:
            await _check(
                self.commands.run(image, name, checkpoint="snap", checkpoint_dir=checkpoint_dir), "docker create"
            )
            await _check(self.commands.start_from_checkpoint(name, "snap", checkpoint_dir), "docker start --checkpoint")
        else:
            await _check(self.commands.run(image, name), "docker run")
        return DockerSandbox(self, name)

    def discard(self, snapshot: Snapshot) -> None:
        subprocess.run(self.commands.remove_image(str(snapshot.meta["image"])), capture_output=True, timeout=120)
        checkpoint_dir = snapshot.meta.get("checkpoint_dir")
        if checkpoint_dir:
            shutil.rmtree(checkpoint_dir, ignore_errors=True)
        Path(snapshot.path).unlink(missing_ok=True)


class DockerSandbox:
    def __init__(self, factory: DockerSandboxFactory, name: str) -> None:
        self._factory = factory
        self.name = name
        self._stopped = False
        self._lock = asyncio.Lock()

    @classmethod
    def factory(
        cls, image: str, *, timeout: float = 60.0, checkpoint: bool = False, network: str = "none"
    ) -> DockerSandboxFactory:
        """Sandboxes started from ``image`` (which needs ``bash`` and coreutils' ``timeout``)."""
        return DockerSandboxFactory(
            image, timeout=timeout, checkpoint=checkpoint, commands=DockerCommands(network=network)
        )

    async def execute(self, call: ToolCall) -> Outcome:
        _, arguments = validated(call, self._factory.tools)
        timeout = command_timeout(arguments, self._factory.timeout)
        async with self._lock:
            if self._stopped:
                raise SandboxError("this docker sandbox was stopped; start or fork a new one")
            argv = self._factory.commands.exec(self.name, arguments["cmd"], timeout)
            result = await _run(argv, timeout=timeout + 30)
        output = result.stdout + result.stderr
        if result.returncode == 137:  # killed by the timeout inside the container
            return Outcome(output=output + f"[timed out after {timeout:g}s]", is_error=True, deterministic=False)
        if result.returncode != 0:
            return Outcome(output=output + f"[exit code {result.returncode}]", is_error=True)
        return Outcome(output=output)

    async def snapshot(self, dest: Path) -> Snapshot:
        commands = self._factory.commands
        image = f"tvcache-snapshot:{uuid.uuid4().hex[:16]}"
        async with self._lock:
            meta: dict[str, str] = {"image": image}
            if self._factory.checkpoint:
                checkpoint_dir = str(Path(dest).with_suffix(".checkpoint"))
                await _check(commands.checkpoint(self.name, "snap", checkpoint_dir), "docker checkpoint create")
                meta["checkpoint_dir"] = checkpoint_dir
            await _check(commands.commit(self.name, image), "docker commit")
        size = int(await _check(commands.image_size(image), "docker image inspect") or 0)
        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        Path(dest).write_text(json.dumps({"kind": KIND, **meta}))
        return Snapshot(kind=KIND, path=str(dest), bytes=size, meta=meta)

    async def stop(self) -> None:
        async with self._lock:
            if self._stopped:
                return
            self._stopped = True
            await _run(self._factory.commands.remove_container(self.name))
