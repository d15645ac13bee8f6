"""The sandbox of a Docker container (``ContainerSandbox``), and what it needs from the factory that launched it
(``ContainerHost``, which ``docker.DockerSandboxFactory`` is).

The one-shot ``docker.DockerSandbox`` and the persistent ``docker_shell.PersistentDockerSandbox`` are both built
on it; it knows neither of them, nor the factory class, so the factory can launch both without a cycle.

Limits: once per container (``watch_limits``, at its start or fork) the sandbox finds its cgroups' counters on
this machine (``docker_cgroups``), and reads them before and after every call, a few microseconds. A call during
which a counter grew ends with the limit's note (``SandboxLimits.describe``), as an error and non-deterministic;
the container is killed and the sandbox is never trusted again: later calls and snapshots raise, naming the limit
(so does the next call after a hit that came between calls, from a background process).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from ..calls import ToolCall, ToolSpec
from ..errors import SandboxError, SnapshotDeclined
from ..protocol import Outcome, Snapshot, require_new_destination
from .commands import ShellResult, command_timeout, render_shell, validated
from .docker_cgroups import ContainerCounters, container_counters
from .docker_engine import SNAPSHOT_REPOSITORY, DockerCommands, engine_down, no_bash, run_cli_async, run_merged
from .shell.cgroups import MEMORY
from .shell.limits import SandboxLimits

__all__ = ["ContainerHost", "ContainerSandbox"]


class ContainerHost(Protocol):
    """What a container sandbox reads off its factory, at each use (a factory's ``commands`` may be replaced
    while its sandboxes run)."""

    commands: DockerCommands
    kind: str  # of the snapshots it makes
    checkpoint_declined: str | None  # why the engine cannot checkpoint; a sandbox sets it once found out

    @property
    def tools(self) -> Mapping[str, ToolSpec]: ...

    @property
    def timeout(self) -> float: ...

    @property
    def max_output_bytes(self) -> int: ...

    @property
    def checkpoint(self) -> bool: ...

    def adopt_image(self, image: str, snapshot_path: str) -> None:
        """Own ``image`` (made for the snapshot at ``snapshot_path``) from now on, before it exists."""
        ...

    def release_container(self, name: str) -> None:
        """Remove the container ``name`` and give its slot back (once)."""
        ...

    def discard(self, snapshot: Snapshot) -> None: ...


class ContainerSandbox:
    """A running container, driven by ``docker exec`` (one ``bash -c`` per call), snapshotted by ``docker commit``
    (and ``docker checkpoint``). Calls are serialised; every docker call runs in a worker thread."""

    def __init__(self, factory: ContainerHost, name: str, image: str) -> None:
        self._factory = factory
        self.name = name
        self.image = image
        self._stopped = False
        self._dead: str | None = None  # why the container cannot be trusted any more
        self._lock = asyncio.Lock()
        self._counters: ContainerCounters | None = None  # its limit hits, on this machine (``watch_limits``)
        self._mark: dict[str, int] = {}  # the counts at its start: any growth is a hit
        self._hit: str | None = None  # the limit a call hit: never trusted again
        self.counters_missing: str | None = None  # why they could not be found (the fallback check runs instead)

    async def watch_limits(self, pid: int | None = None) -> None:
        """Find the counters of the container's cgroups from its main process (``pid``, else asked of the engine),
        once; without them (another machine's engine), a memory hit is still found after a SIGKILL by asking the
        container (``_check_memory``), and a pids hit is not found at all."""
        limits = self._factory.commands.limits
        if limits is None or (limits.pids is None and limits.memory_bytes is None):
            return
        if pid is None:
            found = await run_cli_async(self._factory.commands.main_pid(self.name), timeout=60)
            text = found.stdout.strip()
            if found.returncode != 0 or not text.isdigit() or int(text) <= 0:
                self.counters_missing = f"the engine gave no main process ({found.stderr.strip()[:200]})"
                return
            pid = int(text)
        counters = container_counters(pid, memory=limits.memory_bytes is not None, pids=limits.pids is not None)
        if isinstance(counters, str):
            self.counters_missing = counters
            return
        try:
            self._mark = counters.counts()
        except OSError as error:
            self.counters_missing = f"its cgroup counters cannot be read: {error.strerror}"
            return
        self._counters = counters

    def _limits(self) -> SandboxLimits:
        return self._factory.commands.limits or SandboxLimits()

    def _limit_hit(self) -> str | None:
        """The note of the limit hit since the container started (``SandboxLimits.describe``), or None (also when
        its cgroups are gone: the container stopped, and the engine's state says why, ``_confirm_alive``)."""
        if self._counters is None:
            return None
        try:
            kind = self._counters.hit_since(self._mark)
        except OSError:
            return None
        return self._limits().describe(kind) if kind is not None else None

    async def _untrust_at_hit(self, hit: str) -> None:
        """After a limit hit: never trusted again, and the container killed (a fork bomb goes on forking in the
        background, a hog's partners half-done); ``stop`` removes it."""
        self._hit = hit
        self._dead = f"it is no longer trusted: an earlier call ended because {hit}"
        with contextlib.suppress(SandboxError):
            await run_cli_async(self._factory.commands.kill(self.name), timeout=30)

    async def _require_within_limits(self, what: str, error: type[SandboxError] = SandboxError) -> None:
        """Before a call or a snapshot: a limit hit since the last call (a background process) untrusts the
        sandbox, and this raises naming it; a snapshot after any hit is declined (the cache replays instead)."""
        if self._hit is not None and error is SnapshotDeclined:
            raise SnapshotDeclined(f"{self._where(what)}: {self._dead}; not snapshotting this state")
        hit = self._limit_hit()
        if hit is not None:
            await self._untrust_at_hit(hit)
            raise error(f"{self._where(what)}: {hit} (after the last call returned); start or fork a new sandbox")

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
        commands = self._factory.commands
        state = await run_cli_async(commands.running(self.name), timeout=30)
        running, _, oom_killed = state.stdout.strip().partition(" ")
        if state.returncode == 0 and oom_killed == "true":  # its main process, at the memory limit
            limits = commands.limits
            self._dead = limits.describe(MEMORY) if limits is not None else "the OOM killer ended a process"
            raise SandboxError(f"{self._where(what)}: {self._dead}")
        if state.returncode == 0 and running == "true":
            return
        if engine_down(state.stderr) or engine_down(stderr):
            self._dead = "the Docker engine does not answer (stopped or died)"
        else:
            self._dead = "its container is not running any more (killed or removed from outside)"
        raise SandboxError(f"{self._where(what)}: {self._dead}: {stderr.strip()[:300]}")

    async def _check_memory(self, what: str) -> None:
        """The fallback where the counters could not be found on this machine (``watch_limits``): after a SIGKILL
        (137: the call's timeout, or the OOM killer at the memory limit), a second ``docker exec`` asks the
        container; if the OOM killer ended a process, the call raises and the sandbox is never trusted again (its
        state is not one an unlimited run would have left)."""
        commands = self._factory.commands
        counts = await run_cli_async(commands.oom_kills(self.name), timeout=30)
        kills = [line.split()[1] for line in counts.stdout.splitlines() if line.startswith("oom_kill ")]
        if any(count.isdigit() and int(count) > 0 for count in kills):
            limits = commands.limits
            self._dead = limits.describe(MEMORY) if limits is not None else "the OOM killer ended a process"
            raise SandboxError(f"{self._where(what)}: {self._dead}")

    async def execute(self, call: ToolCall) -> Outcome:
        _, arguments = validated(call, self._factory.tools)
        timeout = command_timeout(arguments, self._factory.timeout)
        what = f"call {call.name}({arguments['cmd'][:80]!r})"
        async with self._lock:
            self._require_usable(what)
            await self._require_within_limits(what)
            argv = self._factory.commands.exec(self.name, arguments["cmd"], timeout)
            try:
                # One pipe for both streams, as the shell backends give: the output interleaves as it was written.
                result = await asyncio.to_thread(run_merged, argv, timeout + 30)
            except SandboxError as error:
                hit = self._limit_hit()
                if hit is not None:  # a fork bomb kept docker exec attached past the timeout
                    await self._untrust_at_hit(hit)
                    raise SandboxError(f"{self._where(what)}: {hit}") from error
                self._dead = f"docker exec did not return ({error})"
                raise SandboxError(f"{self._where(what)}: {self._dead}") from error
            hit = self._limit_hit()
            if hit is not None:
                await self._untrust_at_hit(hit)
                return self._render_exec(result, timeout, hit)
            text = result.stdout.decode("utf-8", errors="replace")
            # 137 is also the timeout's kill; docker's own failures (not running, no engine) exit 1 or 125-127
            # with its message: only the container's state tells them from the command's own.
            if result.returncode == 137 and self._counters is None:
                await self._check_memory(what)
            if result.returncode == 137 or (
                result.returncode in (1, 125, 126, 127) and ("Error response from daemon" in text or engine_down(text))
            ):
                await self._confirm_alive(what, text)
            if result.returncode in (126, 127) and no_bash(text):
                self._dead = "the image has no bash (or no coreutils timeout); docker sandboxes need both"
                raise SandboxError(f"{self._where(what)}: {self._dead}: {text.strip()[:300]}")
        return self._render_exec(result, timeout, None)

    def _render_exec(self, result: subprocess.CompletedProcess[bytes], timeout: float, hit: str | None) -> Outcome:
        limit = self._factory.max_output_bytes
        shell = ShellResult(
            output=result.stdout[:limit],
            total_bytes=len(result.stdout),
            returncode=result.returncode if result.returncode != 137 else 0,
            timed_out=result.returncode == 137,  # killed by the timeout inside the container
            escaped=False,
            limit=hit,
        )
        return render_shell(shell, limit, timeout)

    async def snapshot(self, dest: Path) -> Snapshot:
        factory, commands = self._factory, self._factory.commands
        image = f"{SNAPSHOT_REPOSITORY}:{uuid.uuid4().hex[:16]}"
        dest = require_new_destination(dest)
        async with self._lock:
            await self._require_within_limits("snapshot", SnapshotDeclined)
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
            factory.adopt_image(image, str(dest))  # before it exists: an exit meanwhile still removes it
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
        result = await run_cli_async(factory.commands.checkpoint(self.name, "snap", checkpoint_dir))
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
        result = await run_cli_async(argv)
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
                await asyncio.shield(asyncio.to_thread(self._factory.release_container, self.name))
