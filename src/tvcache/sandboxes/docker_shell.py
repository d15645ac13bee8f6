"""Persistent shells inside containers (``DockerSandbox.factory(image, persistent=True)``): one long-lived,
interactive bash per container, typed into over a terminal as Terminus/tmux, SWE-ReX and OpenHands do.

The shell is the container's own main process (PID 1), started by ``docker run -it`` with the docker CLI on a
pty of ours, and driven by the overlay persistent shell's sentinel protocol (``shell.pty_shell.PtyShell``: one typed
line per command, stdin at end of file, bounded output, a timeout interrupts the foreground job). Why PID 1 and
not a ``docker exec -it`` session: a ``docker checkpoint`` restores a container's console but cannot re-attach an
exec session, so only a shell on the console can be forked with its state; and as PID 1 the shell is what it is
in the overlay flavour (``kill -9 $$`` from inside is ignored, its end ends every process it started).

The driver reaches the container's side of the terminal from this machine (``/proc/<pid>/fd/0`` of the shell,
the engine must run here): to put it back in raw mode before each command (whatever ``stty`` did), and to find
the foreground job (``/proc/<pid>/stat``) that a timeout interrupts. Measured here: about 0.2-0.4 ms per command,
against ~75 ms for a ``docker exec``.

Snapshots: ``docker commit`` keeps files only, so a persistent sandbox is snapshotted only with
``checkpoint=True`` (CRIU, through ``docker checkpoint``: the shell, its variables, cwd, functions, jobs and
background processes, exactly); otherwise, or when the checkpoint fails, the snapshot is declined
(``SnapshotDeclined``) and later states replay — never a fork with another shell state.

Limits are found as in the one-shot flavour (``docker_container``: the container's cgroup counters, read on this
machine around each call); a shell the OOM killer ended took its cgroups with it, and the engine's state
(``OOMKilled``) says so instead. After a hit the container is killed and the sandbox is never used again.

When the shell ends (``exit``, ``exec false``, the container killed), the call returns what it printed and a
note, as an error and non-deterministic; the sandbox is no longer trusted (nothing it does is cached, it is
never snapshotted), and the next call starts the container again (``docker start``) with a new shell in the same
files, its output beginning with a note saying so — as a harness restarting its session would.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import secrets
import select
import signal
import subprocess
import termios
import time
import tty
from typing import TYPE_CHECKING

from ..calls import ToolCall
from ..errors import SandboxError, SnapshotDeclined
from ..protocol import Outcome, Snapshot
from .commands import OutputCollector, render_shell
from .docker_container import ContainerHost, ContainerSandbox
from .docker_engine import PERSISTENT_KIND, no_bash, run_cli_async
from .shell.cgroups import MEMORY
from .shell.pty_shell import (
    BOOT_HEAD,
    BOOT_LINE,
    BOOT_TAIL,
    GRACE_SECONDS,
    PROTOCOL,
    READY,
    PtyResult,
    PtyShell,
    ShellGone,
    Terminal,
    boot_escapes,
)
from .shell.session import NEW_SHELL_NOTE, PersistentShellCalls, persistent_command
from .threads import run_in_worker

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["NEW_SHELL_NOTE", "PERSISTENT_KIND", "DockerShell", "PersistentDockerSandbox", "shell_environment"]

START_SECONDS = 60.0  # a container start under load; the shell itself is ready in ~0.3 s
# Raw mode on the container's side too, set by the shell itself before it says it is ready (the host cannot
# reach its terminal before that); an image without stty gets it from the host right after.
# Fresh shells go on from this PID: a container's start takes a varying number of PIDs (8 or 9 here), and
# `cmd &` prints its job's PID, which must be the same in every run of one history (and in forks: the last PID
# is carried by the snapshot, as the overlay shell's is).
FIRST_PID = 100
LAST_PID = "/proc/sys/kernel/ns_last_pid"  # of the reader's PID namespace
BOOT = "command stty raw -echo <&2 2>/dev/null || :\n"


def shell_environment() -> dict[str, str]:
    """What the container's shell is started with, beside the factory's environment: TERM=dumb (no colours or
    cursor movement in outputs) and the protocol's boot, sourced once before the first prompt."""
    return {"TERM": "dumb", "__TVCACHE_BOOT": BOOT_HEAD + PROTOCOL + BOOT + BOOT_TAIL}


class DockerShell(PtyShell):
    """The sentinel protocol over the docker CLI's terminal: ``argv`` is a ``docker run -it`` (a new container,
    whose shell says when it is ready) or a ``docker start -ai`` (``restored``: a checkpoint's shell, idle
    already). Not thread-safe, like ``PtyShell``; ``kill`` alone may be called from any thread."""

    def __init__(self, argv: list[str], *, name: str, docker: str, restored: bool = False) -> None:
        # PtyShell's state, set here: its __init__ spawns a confined shell, this one spawns the docker CLI.
        self._setup_state()
        self.name = name
        self._docker = docker
        self._terminal = -1  # the container's side of the terminal, opened through /proc
        self._pidfd = -1
        self.pid = 0
        terminal = Terminal.open()  # the CLI's; docker passes its window size on to the container's
        self._master = terminal.master
        try:
            # A session of its own: the CLI's terminal signals never reach this process, nor ours the CLI.
            slave = terminal.slave
            self._cli = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
        except BaseException:
            os.close(terminal.slave)
            os.close(terminal.master)
            self._closed = True
            raise
        os.close(terminal.slave)
        try:
            self._start(restored)
        except BaseException:
            self.close()
            raise

    def _start(self, restored: bool) -> None:
        collected = OutputCollector(4096)
        deadline = time.monotonic() + START_SECONDS
        try:
            if not restored:
                self._write(BOOT_LINE, deadline)
            if not restored and not self._read_until(READY, deadline, collected):
                raise SandboxError(
                    f"docker sandbox {self.name}: the shell did not become ready within {START_SECONDS:g} s"
                )
            self._attach_terminal(deadline)
            if not restored:
                self.escapes = boot_escapes(collected.kept)
                self.set_last_pid(FIRST_PID)
            if self.settle(deadline, booted=not restored) is None:
                raise SandboxError(
                    f"docker sandbox {self.name}: the shell did not wait for a command within {START_SECONDS:g} s"
                )
        except ShellGone:
            with contextlib.suppress(ShellGone):
                while self._cli.poll() is None or select.select([self._master], [], [], 0)[0]:
                    self._read_some(0.1)  # what the docker CLI said before it exited (a restore never read it)
            said = bytes(collected.kept + self._buffer).decode(errors="replace").strip()
            hint = "; the image needs bash, which docker sandboxes run" if no_bash(said) else ""
            raise SandboxError(
                f"docker sandbox {self.name}: the shell ended while starting (docker exit {self._cli.wait()}): "
                f"{said[:500] or 'no message'}{hint}"
            ) from None

    def _attach_terminal(self, deadline: float) -> None:
        """Find the shell on this machine (its container's PID 1) and open its terminal through /proc. While a
        checkpoint is being restored, the engine may already report the container running, with a PID that is not
        yet the shell on its terminal: wait until it is."""
        while True:
            found = subprocess.run(
                [self._docker, "container", "inspect", "--format", "{{.State.Running}} {{.State.Pid}}", self.name],
                capture_output=True,
                text=True,
                timeout=60,
            )
            running, _, pid = found.stdout.strip().partition(" ")
            if found.returncode == 0 and running == "true" and pid.isdigit() and int(pid) > 0:
                terminal = self._open_terminal(int(pid))
                if terminal is not None:
                    break
            if self._cli.poll() is not None:
                raise ShellGone
            if time.monotonic() >= deadline:
                raise SandboxError(
                    f"docker sandbox {self.name}: the shell's terminal could not be reached within {START_SECONDS:g} s "
                    "(persistent docker shells need the engine on this machine, and the rights to its processes)"
                )
            time.sleep(0.02)
        self.pid, self._terminal = int(pid), terminal
        self._slave_device = os.fstat(terminal).st_rdev
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except OSError as error:
            raise SandboxError(f"docker sandbox {self.name}: cannot hold its shell process: {error}") from error
        mode = termios.tcgetattr(self._terminal)
        if mode[3] & (termios.ECHO | termios.ICANON):  # no stty in the image: raw mode from here
            tty.setraw(self._terminal)
            mode = termios.tcgetattr(self._terminal)
        self._mode = mode

    @staticmethod
    def _open_terminal(pid: int) -> int | None:
        """``pid``'s standard input when it is a terminal (the shell's), else None."""
        try:
            fd = os.open(f"/proc/{pid}/fd/0", os.O_RDWR | os.O_NOCTTY)
        except OSError:
            return None
        if os.isatty(fd):
            return fd
        os.close(fd)
        return None

    def _in_namespace(self, script: str) -> str | None:
        """Run a host ``sh -c script`` inside the shell's PID namespace (``nsenter``: it forks into it, so
        ``LAST_PID`` is the container's); its output, or None when it cannot be done here."""
        try:
            done = subprocess.run(
                ["nsenter", f"--target={self.pid}", "--pid", "--", "sh", "-c", script],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    def set_last_pid(self, value: int) -> bool:
        """Make ``value + 1`` the next PID in the container (what a fresh shell, or a fork, must go on from)."""
        return self._in_namespace(f"echo {int(value)} >{LAST_PID}") is not None

    def take_last_pid(self) -> int | None:
        """The container's last PID, read without moving it: the reader's own PID, given back. (Not read from
        ``LAST_PID``: through this machine's /proc it does not answer for the reader's namespace here.)"""
        found = self._in_namespace(f"n=$(($$ - 1)); echo $n >{LAST_PID}; echo $n")
        return int(found) if found is not None and found.isdigit() else None

    # The container's terminal, not ours, is the one commands can change and whose foreground job runs there.

    def _reset_terminal(self) -> None:
        with contextlib.suppress(termios.error, OSError):
            if termios.tcgetattr(self._terminal) != self._mode:
                termios.tcsetattr(self._terminal, termios.TCSANOW, self._mode)

    def _drain(self, into: OutputCollector) -> None:
        """Every byte the container's terminal got before now: the engine relays it to our terminal a moment
        later, so a barrier of ours goes after them, into the same queue (written to the container's side), and
        what arrives before it is all there was."""
        barrier = b"\x1b[tvcache-barrier:" + secrets.token_hex(8).encode() + b"]"
        try:
            os.write(self._terminal, barrier)
        except OSError:
            super()._drain(into)
            return
        if not self._read_until(barrier, time.monotonic() + GRACE_SECONDS, into):
            raise ShellGone  # the relay stopped: the container is gone or stuck

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(OSError):
            if self._pidfd >= 0:
                signal.pidfd_send_signal(self._pidfd, signum)

    def _foreground_group(self) -> int | None:
        """The terminal's foreground process group, in this machine's PID numbers (field 8 of the shell's stat;
        tcgetpgrp works only on one's own controlling terminal)."""
        try:
            with open(f"/proc/{self.pid}/stat") as handle:
                group = int(handle.read().rpartition(")")[2].split()[5])
        except (OSError, ValueError, IndexError):
            return None
        return group if group > 0 else None

    @property
    def alive(self) -> bool:
        return not self._closed and self._cli.poll() is None

    @property
    def returncode(self) -> int | None:
        """The shell's exit status once it ended (the docker CLI reports the container's)."""
        return self._cli.poll()

    def kill(self) -> None:
        """SIGKILL the shell, and with it its container's processes. Safe from any thread."""
        with contextlib.suppress(OSError):
            if self._pidfd >= 0:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                return
        with contextlib.suppress(OSError):  # not found yet: the engine stops it
            subprocess.Popen([self._docker, "kill", self.name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def close(self) -> None:
        """Release the terminal and the docker CLI; the container itself is the sandbox's to remove. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._cli.poll() is None:
            self._cli.kill()  # the CLI only: the container and its shell run on until removed
        self._cli.wait()
        for fd in (self._terminal, self._pidfd, self._master):
            if fd >= 0:
                os.close(fd)


class PersistentDockerSandbox(PersistentShellCalls, ContainerSandbox):
    """A container whose main process is one long-lived shell. Calls are serialised; blocking work in threads."""

    def __init__(self, factory: ContainerHost, name: str, image: str, shell: DockerShell) -> None:
        super().__init__(factory, name, image)
        self._shell: DockerShell | None = shell
        self._untrusted: str | None = None

    async def execute(self, call: ToolCall) -> Outcome:
        command, timeout = persistent_command(call, self._factory.tools, self._factory.timeout)
        what = f"call {call.name}({command[:80]!r})"
        async with self._lock:
            self._require_usable(what)
            await self._require_within_limits(what)
            run = functools.partial(self._run_command, command, timeout, what)
            result, restarted, code = await run_in_worker(run, self._kill_shell)
            hit = self._limit_hit() or (await self._oom_killed_shell() if result.died else None)
            if hit is not None:
                await self._untrust_at_hit(hit)
                return self._render_limit_hit(result, hit, timeout)
        return self._render(result, restarted, code, timeout)

    async def _oom_killed_shell(self) -> str | None:
        """The memory limit's note when the OOM killer ended the shell itself (the container's main process: its
        cgroups went with it, so the engine's state says it), else None."""
        with contextlib.suppress(SandboxError):
            state = await run_cli_async(self._factory.commands.running(self.name), timeout=30)
            if state.returncode == 0 and state.stdout.split()[-1:] == ["true"]:
                return self._limits().describe(MEMORY)
        return None

    def _render_limit_hit(self, result: PtyResult, hit: str, timeout: float) -> Outcome:
        plain = result.as_shell_result(limit=hit)
        outcome = render_shell(plain, self._factory.max_output_bytes, timeout)
        return Outcome(output=outcome.output, is_error=True, changed_state=True, deterministic=False)

    def _new_shell(self, what: str) -> DockerShell:
        commands = self._factory.commands
        try:
            return DockerShell(commands.start_shell(self.name), name=self.name, docker=commands.docker)
        except SandboxError as error:
            self._dead = f"its shell could not be started again ({error})"
            raise SandboxError(f"{self._where(what)}: {self._dead}") from error

    def _ended_code(self, shell: PtyShell) -> int | None:
        assert isinstance(shell, DockerShell)
        with contextlib.suppress(subprocess.TimeoutExpired):
            shell._cli.wait(timeout=10)  # its terminal closed: it is exiting
        return shell.returncode

    def _ended_note(self, code: int | None) -> str:
        how = "" if code is None else (f" with code {code}" if code < 128 else f" (killed by signal {code - 128})")
        return (
            f"[the shell ended{how}; the next call starts a new shell in the same container files, "
            "and nothing this sandbox does is cached from now on]"
        )

    async def snapshot(self, dest: Path) -> Snapshot:
        what = self._where("snapshot")
        shell = self._shell
        if self._hit is not None:
            raise SnapshotDeclined(f"{what}: {self._dead}; not snapshotting this state")
        if self._untrusted is not None or shell is None or not shell.alive:
            raise SnapshotDeclined(f"{what}: {self._untrusted or 'its shell ended'}; not snapshotting this state")
        if not self._factory.checkpoint:
            raise SnapshotDeclined(
                f"{what}: a persistent shell's state (cwd, variables, functions, jobs) lives in its process, which "
                "docker commit does not keep; use checkpoint=True on an engine with CRIU to snapshot it"
            )
        return await super().snapshot(dest)

    async def _process_meta(self) -> dict[str, str]:
        """The container's last PID, kept with the checkpoint: the fork goes on from it (``DockerShell``)."""
        shell = self._shell
        last = await asyncio.to_thread(shell.take_last_pid) if shell is not None else None
        if last is None:
            raise SnapshotDeclined(f"{self._where('snapshot')}: cannot read the container's last PID (nsenter)")
        return {"last_pid": str(last), "prompt_escapes": json.dumps(shell.escapes if shell is not None else {})}

    async def _after_checkpoint(self, meta: dict[str, str]) -> None:
        # A checkpoint moves the container's last PID (CRIU): this sandbox goes on from where its forks will.
        shell = self._shell
        if shell is None or not await asyncio.to_thread(shell.set_last_pid, int(meta["last_pid"])):
            raise SnapshotDeclined(f"{self._where('snapshot')}: cannot set the container's last PID back (nsenter)")

    async def stop(self) -> None:
        async with self._lock:
            if self._stopped:
                return
            self._stopped = True
            shell, self._shell = self._shell, None
            if shell is not None:
                await asyncio.shield(asyncio.to_thread(shell.close))
            with contextlib.suppress(SandboxError):
                await asyncio.shield(asyncio.to_thread(self._factory.release_container, self.name))
