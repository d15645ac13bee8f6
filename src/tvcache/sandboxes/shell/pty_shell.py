"""One long-lived, confined, interactive bash driven over a pty with a sentinel protocol.

Why a pty: the harnesses whose rollouts we serve (Terminus/tmux, SWE-ReX, OpenHands) type into an interactive
bash on a terminal, with job control; a timeout sends SIGINT to the terminal's foreground job, and the shell
lives on. The pty is in raw mode (no echo, no line editing, no output translation), so bytes pass unchanged and
a line of any length reaches bash; the driver resets the mode before every command, whatever ``stty`` did.

Protocol. bash starts with ``--norc --noediting -i`` and a ``PROMPT_COMMAND`` that sources a *boot script* from
the environment once (defining the two protocol functions, a trap, and, for a fork, the restored state), then
prints a ready marker. Each command is then typed as ONE line::

    eval $'<command, ANSI-C quoted>' </dev/null; { __tvcache_end <sentinel> $LINENO $? "$_"; } 2>/dev/null

* ``eval`` of a quoted string: unterminated quotes, heredocs and syntax errors stay inside the command (bash
  reports them and the line goes on), and the command's stdin is ``/dev/null`` (reads get end of file);
* the sentinel is 128 random bits, new per command and never stored in a variable, so output cannot fake it;
  ``__tvcache_end`` prints ``\\n<sentinel> <lineno> <status>\\n`` and returns the status, so ``$?``,
  ``$_`` and ``PIPESTATUS`` seen by the next command are what a terminal would show (``$_`` being the
  command's text, as ``eval``'s last argument); its xtrace output goes to /dev/null;
* the shell's state can be read without typing a line (which would move ``$LINENO``): SIGRTMAX runs
  ``__tvcache_capture`` by a trap, between commands only (see ``shell_state``); the trap leaves ``$?``, ``$_``
  and ``PIPESTATUS`` as they were. ERR traps are listed at the trap's top level (functions do not see them);
  DEBUG and RETURN traps only by the epilogue, a traced function, which reports them with every status.

A *warm* shell (``PtyShell.warm``) is started ahead of a fork, before its tree exists: its boot script stops after
the protocol functions and the first step of every restore (``RESET_VARIABLES``) and waits, reading the rest of its
boot (a snapshot's state) from a pipe on descriptor 3; ``resume`` has the zygote attach the tree, sends the state
with the namespace's last PID (written through descriptor 4), and the boot closes both descriptors, restarts
``$SECONDS`` (as every boot does) and goes on exactly as a cold shell's boot does. Nothing in between reads the
terminal or starts a process, so the shell a fork gets cannot tell it waited (but for its process start time, as
``ps`` shows it).

bash is PID 1 of its own PID namespace, as a container's shell is: when it ends, everything it started dies,
and ``kill -9 $$`` from inside is ignored (the kernel protects a namespace's init from its own processes).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import select
import signal
import string
import struct
import termios
import threading
import time
import tty
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import SandboxError
from .process import ShellResult
from .zygote import Spawned, Zygote

__all__ = ["CAPTURE_SIGNAL", "OutputCollector", "PtyResult", "PtyShell", "ShellGone", "Terminal", "ansi_c_quote"]

CAPTURE_SIGNAL = signal.SIGRTMAX
READY = b"\n@@tvcache-ready@@\n"
WAITING = b"\n@@tvcache-waiting@@\n"
STATE_BEGIN = b"\n@@tvcache-state-begin@@\n"
STATE_END = b"\n@@tvcache-state-end@@\n"
WINDOW = (24, 80)  # rows, columns: fixed, so that `ls`, `COLUMNS` and wrapping are the same in every shell
START_SECONDS = 10.0
GRACE_SECONDS = 2.0  # after SIGINT, then after SIGKILL of the foreground job, before the shell is given up
CAPTURE_SECONDS = 5.0
MAX_STATE_BYTES = 4 << 20
_CHUNK = 1 << 16
_STATUS = re.compile(rb"(\d+) (\d+)\r?\n(.*?)@@\r?\n", re.DOTALL)

# The functions every shell defines at boot. Builtins are called through ``builtin`` so that user functions or
# aliases named printf or declare cannot change what the protocol prints; every step that may fail ends in
# `|| :` because the shell may run under `set -e`. Sections are marked by lines no builtin's output starts with.
PROTOCOL = r"""__tvcache_end() {
builtin printf '\n%s %s %s\n' "$1" "$2" "$3"; builtin trap -p DEBUG RETURN; builtin printf '@@\n'; return "$3"
}
builtin declare -ft __tvcache_end
__tvcache_capture() {
builtin local __tvcache_v=
builtin printf '\n@@tvcache-state-begin@@\n@@tvcache:status@@\n%s\n' "$1"
builtin printf '@@tvcache:underscore@@\n'; builtin printf '%q\n' "${@: -1}"
builtin printf '@@tvcache:args@@\n'; builtin printf '%q\n' "$2" "${@:3:$2}"
builtin printf '@@tvcache:cwd@@\n'; builtin printf '%q\n' "$PWD"; builtin pwd -P || :
builtin printf '@@tvcache:vars@@\n'; builtin declare -p || :
builtin printf '@@tvcache:functions@@\n'; builtin declare -f || :
builtin printf '@@tvcache:function-attributes@@\n'; builtin declare -F || :
builtin printf '@@tvcache:aliases@@\n'; builtin alias -p || :
builtin printf '@@tvcache:shopt@@\n'; builtin shopt -p || :
builtin printf '@@tvcache:set@@\n'; builtin set +o || :
builtin printf '@@tvcache:umask@@\n'; builtin umask || :
builtin printf '@@tvcache:traps@@\n'; builtin trap -p || :
builtin printf '@@tvcache:dirs@@\n'; builtin dirs -l -p || :
builtin printf '@@tvcache:hash@@\n'; builtin hash -l 2>/dev/null || :
builtin printf '@@tvcache:jobs@@\n'; builtin jobs -p || :
builtin printf '@@tvcache:last-background@@\n%s\n' "${!-}"
builtin read -r __tvcache_v </proc/sys/kernel/ns_last_pid || :
builtin printf '@@tvcache:last-pid@@\n%s\n@@tvcache:top-traps@@\n' "$__tvcache_v"
builtin declare -g __tvcache_u="${@: -1}"
}
__tvcache_tail() { builtin unset -v __tvcache_u; builtin printf '@@tvcache-state-end@@\n'; }
trap '__tvcache_capture "$?" "$#" "$@" "$_"; builtin trap -p ERR; __tvcache_tail "$__tvcache_u"' SIGRTMAX
"""
# ``SECONDS=0``: every shell's $SECONDS counts from its boot, a warm shell's from its resume (WARM_HEAD) - and the
# assignment leaves the same trace in ``declare -p`` (a value, no -i) in each, before the state could set -a.
BOOT_HEAD = "unset -v __TVCACHE_BOOT PROMPT_COMMAND; PS1=; PS2=; set +o history; SECONDS=0\n"
BOOT_TAIL = "builtin printf '\\n%s\\n' '@@tvcache-ready@@'\n"
# bash's dynamic and read-only variables: never unset (they would lose their meaning), never restored, not
# compared. COLUMNS/LINES are ordinary here: bash sets them after a command, so they are state like the rest.
DYNAMIC = frozenset(
    """BASH BASHOPTS BASHPID BASH_ALIASES BASH_ARGC BASH_ARGV BASH_ARGV0 BASH_CMDS BASH_COMMAND
    BASH_EXECUTION_STRING BASH_LINENO BASH_SOURCE BASH_SUBSHELL BASH_VERSINFO BASH_VERSION COMP_WORDBREAKS
    DIRSTACK EPOCHREALTIME EPOCHSECONDS EUID FUNCNAME GROUPS HISTCMD LINENO PIPESTATUS PPID RANDOM SECONDS
    SHELLOPTS SRANDOM UID _""".split()
)
# The first line of a restored shell's boot (``ShellState.boot_script``): unset every variable but the dynamic
# ones, so that the snapshot's declarations alone define the rest. It is most of the boot's time (53 scans of
# the variables); a warm shell runs it before it waits, where its variables are the ones it would unset after
# (nothing in between sets one), and ``resume`` sends the rest of the boot only.
RESET_VARIABLES = (
    "for __tvcache_n in "
    + " ".join(f"${{!{letter}@}}" for letter in string.ascii_letters + "_")
    + f"; do case $__tvcache_n in {'|'.join(sorted(DYNAMIC))}) ;; "
    + '*) builtin unset -v "$__tvcache_n" ;; esac; done; builtin unset -v __tvcache_n\n'
)
# A warm shell's boot stops here until its state arrives (descriptors: see zygote_process.WARM_BOOT_FD).
WARM_WAIT = RESET_VARIABLES + "builtin printf '\\n%s\\n' '@@tvcache-waiting@@'\n" "builtin source /dev/fd/3\n"
# The head of what ``resume`` sends: the namespace's last PID, then both descriptors closed (plain ``exec``: behind
# ``builtin`` the redirections would be undone; no user function or alias exists yet to shadow it). ``source``
# read the whole pipe before running any of it.
# A shell that cannot set its last PID (the capability to write ns_last_pid was dropped) ends before it is ready:
# the fork then gets a cold shell, whose PID is set before its exec.
WARM_HEAD = "builtin printf %s {last_pid} >&4 || builtin exit 97\nexec 3<&- 4>&-\nSECONDS=0\n"
_PIPE_BYTES = 1 << 18  # the boot pipe holds a whole boot script (MAX_BOOT_BYTES), so writing it never blocks
_F_SETPIPE_SZ = 1031
# Sourced (not evaluated): `source` keeps the line counter, so $LINENO of the first command is 1 in every shell.
BOOT_COMMAND = 'source /dev/stdin <<< "$__TVCACHE_BOOT"'


def ansi_c_quote(text: str) -> str:
    """``$'...'`` quoting of any text without NUL: printable ASCII as is, every other byte as ``\\xHH``."""
    out = []
    for byte in os.fsencode(text):
        if byte in (0x27, 0x5C):
            out.append(f"\\x{byte:02x}")
        elif 0x20 <= byte < 0x7F:
            out.append(chr(byte))
        else:
            out.append(f"\\x{byte:02x}")
    return "$'" + "".join(out) + "'"


@dataclass(frozen=True, kw_only=True, slots=True)
class PtyResult:
    """One command's run. ``status`` is None when the command never finished (timeout or death)."""

    output: bytes
    total_bytes: int
    status: int | None
    timed_out: bool
    died: bool

    def as_shell_result(self, *, limit: str | None = None) -> ShellResult:
        """This run as the one-shot shells' result, to be rendered the same way (a command that never finished
        reads as status 0: its timeout or death is said by the renderer or the caller)."""
        return ShellResult(
            output=self.output,
            total_bytes=self.total_bytes,
            returncode=self.status or 0,
            timed_out=self.timed_out,
            escaped=False,
            limit=limit,
        )


class OutputCollector:
    """The first ``limit`` bytes of a command's output, and a count of all of them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kept = bytearray()
        self.total = 0

    def add(self, data: bytes | bytearray) -> None:
        room = self.limit - len(self.kept)
        if room > 0:
            self.kept += data[:room]
        self.total += len(data)


class ShellGone(Exception):
    """The shell's end of the pty closed: bash (PID 1, and with it its namespace) is gone."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Terminal:
    """A fresh pty pair in raw mode with the fixed window size: the master stays with the driver, the slave goes
    to the shell (started by the zygote, or handed to a CRIU restore) and is then closed here."""

    master: int
    slave: int
    mode: list[Any]  # the slave's termios settings, restored before every command
    device: int  # the slave's device number, to tell the terminal from other descriptors

    @classmethod
    def open(cls) -> Terminal:
        master, slave = os.openpty()
        try:
            tty.setraw(slave)
            fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", *WINDOW, 0, 0))
            return cls(master=master, slave=slave, mode=termios.tcgetattr(slave), device=os.fstat(slave).st_rdev)
        except BaseException:
            os.close(master)
            os.close(slave)
            raise


class PtyShell:
    """The main process's side of one persistent shell. Not thread-safe: one caller at a time (the sandbox's
    lock); ``kill`` alone may be called from any thread. ``PtyShell(zygote, ...)`` starts a new shell;
    ``PtyShell.adopt`` takes over one already running on a terminal (a CRIU-restored copy)."""

    spawned: Spawned | None

    def __init__(
        self,
        zygote: Zygote,
        *,
        bash: str,
        env: Mapping[str, str],
        mount_fd: int,
        boot: str = "",
        last_pid: int | None = None,
    ) -> None:
        self._launch(
            zygote, bash, env, boot=BOOT_HEAD + PROTOCOL + boot + BOOT_TAIL, mount_fd=mount_fd, last_pid=last_pid
        )

    @classmethod
    def warm(cls, zygote: Zygote, *, bash: str, env: Mapping[str, str]) -> PtyShell:
        """A shell started before its sandbox: confined, at the point of its boot where it waits for ``resume``."""
        shell = cls.__new__(cls)
        shell._launch(zygote, bash, env, boot=BOOT_HEAD + PROTOCOL + WARM_WAIT + BOOT_TAIL, mount_fd=None)
        return shell

    def _launch(
        self,
        zygote: Zygote,
        bash: str,
        env: Mapping[str, str],
        *,
        boot: str,
        mount_fd: int | None,
        last_pid: int | None = None,
    ) -> None:
        """Start bash on a new terminal, until it prints the ready marker (with ``mount_fd`` None: a warm
        shell, until it waits for its state)."""
        terminal = Terminal.open()
        self._setup(terminal)
        slave = terminal.slave
        boot_read = -1
        try:
            environment = {**env, "__TVCACHE_BOOT": boot}
            environment["PROMPT_COMMAND"] = BOOT_COMMAND
            argv = [bash, "--norc", "--noprofile", "--noediting", "-i"]
            if mount_fd is None:
                boot_read, self._boot_pipe = os.pipe2(os.O_CLOEXEC)
                fcntl.fcntl(self._boot_pipe, _F_SETPIPE_SZ, _PIPE_BYTES)
            self.spawned = zygote.spawn(
                argv,
                env=environment,
                mount_fd=-1 if mount_fd is None else mount_fd,
                output_fd=slave,
                terminal=True,
                last_pid=last_pid,
                warm_boot_fd=boot_read if mount_fd is None else None,
            )
            os.close(slave)
            slave = -1
            self.spawned.wait_started()
            if self.spawned.pid is None:
                raise SandboxError(f"the persistent shell did not start: {'; '.join(self.spawned.errors)}")
            self.pid = self.spawned.pid
            collected = OutputCollector(4096)
            if not self._read_until(
                READY if mount_fd is not None else WAITING, time.monotonic() + START_SECONDS, collected
            ):
                raise SandboxError("the persistent shell did not become ready within 10 s")
        except ShellGone:
            errors = "; ".join(self.spawned.errors) if self.spawned is not None else ""
            self.close()
            raise SandboxError(f"the persistent shell ended while starting: {errors or 'no error reported'}") from None
        except BaseException:
            if slave >= 0:
                os.close(slave)
            self.close()
            raise
        finally:
            if boot_read >= 0:
                os.close(boot_read)

    def resume(self, mount_fd: int, boot: str, last_pid: int | None) -> None:
        """Bring a warm shell onto its sandbox: attach the tree ``mount_fd``, send the rest of its boot (as a cold
        shell's ``boot`` and ``last_pid``), and wait until it is ready. SandboxError (the shell closed) if not."""
        pipe = self._boot_pipe
        if pipe < 0 or self.spawned is None:
            raise SandboxError("this shell is not a warm shell waiting for its state")
        self._boot_pipe = -1
        deadline = time.monotonic() + START_SECONDS
        try:
            try:
                if not boot.startswith(RESET_VARIABLES):
                    raise SandboxError("a warm shell takes a restored shell's boot only (it unset its variables)")
                boot = boot[len(RESET_VARIABLES) :]
                self.spawned.attach(mount_fd, START_SECONDS)
                head = WARM_HEAD.format(last_pid=int(last_pid) if last_pid is not None and last_pid > 1 else 1)
                data = (head + boot).encode("utf-8", errors="surrogateescape")
                if len(data) > _PIPE_BYTES:
                    raise SandboxError(f"a boot script of {len(data)} bytes does not fit the boot pipe")
                view = memoryview(data)
                while view:
                    view = view[os.write(pipe, view) :]
            finally:
                os.close(pipe)
            if not self._read_until(READY, deadline, OutputCollector(4096)):
                raise SandboxError("the warm shell did not become ready within 10 s")
        except ShellGone:
            self.close()
            raise SandboxError("the warm shell ended while taking its state") from None
        except OSError as error:
            self.close()
            raise SandboxError(f"the warm shell could not take its state: {error}") from error
        except BaseException:
            self.close()
            raise

    def _setup(self, terminal: Terminal) -> None:
        self._master = terminal.master
        self._mode = terminal.mode
        self._slave_device = terminal.device
        self._buffer = bytearray()
        self._closed = False
        self._lock = threading.Lock()
        self.status = 0  # the last command's $?, its line number, and its text ($_ of the next command)
        self.lineno = 0
        self.last_command: str | None = None
        self.firing_traps = False  # a DEBUG or RETURN trap is set (reported by every epilogue)
        self.spawned = None
        self.pid = 0
        self._boot_pipe = -1  # a warm shell's, until resume

    @classmethod
    def adopt(
        cls, terminal: Terminal, spawned: Spawned, pid: int, *, lineno: int, status: int, last_command: str | None
    ) -> PtyShell:
        """Drive a shell that already runs the protocol on ``terminal`` (whose slave the caller closes), held by
        ``spawned``; ``lineno``, ``status`` and ``last_command`` are what its last command left."""
        shell = cls.__new__(cls)
        shell._setup(terminal)
        shell.spawned, shell.pid = spawned, pid
        shell.lineno, shell.status, shell.last_command = lineno, status, last_command
        return shell

    # ------------------------------------------------------------------ reading

    def _read_until(
        self, token: bytes, deadline: float, into: OutputCollector, abandon: threading.Event | None = None
    ) -> bool:
        """Move bytes before ``token`` into ``into`` and drop the token; False at the deadline (the bytes read so
        far are in ``into``, except a tail that may be the start of the token). Raises ShellGone at end of file."""
        keep = len(token) - 1
        while True:
            index = self._buffer.find(token)
            if index >= 0:
                into.add(self._buffer[:index])
                del self._buffer[: index + len(token)]
                return True
            if len(self._buffer) > keep:
                into.add(self._buffer[: len(self._buffer) - keep])
                del self._buffer[: len(self._buffer) - keep]
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (abandon is not None and abandon.is_set()):
                return False
            try:
                self._read_some(remaining)
            except ShellGone:
                # No token can come any more: the held-back tail is output too (``printf abc; exit 3``
                # prints ``abc`` before the shell ends, as the harness's terminal shows it).
                into.add(self._buffer)
                self._buffer.clear()
                raise

    def _read_some(self, timeout: float) -> None:
        ready, _, _ = select.select([self._master], [], [], timeout)
        if not ready:
            return
        try:
            chunk = os.read(self._master, _CHUNK)
        except OSError as error:
            if error.errno == errno.EIO:  # the last descriptor of the slave closed
                raise ShellGone from None
            raise
        if not chunk:
            raise ShellGone
        self._buffer += chunk

    def _status_line(self, deadline: float) -> tuple[int, int] | None:
        while True:
            match = _STATUS.match(self._buffer)
            if match:
                numbers = int(match.group(1)), int(match.group(2))  # before the buffer under the match changes
                # Visible only to a traced function such as the epilogue: the capture would fire them.
                self.firing_traps = bool(match.group(3).strip())
                del self._buffer[: match.end()]
                return numbers
            if len(self._buffer) > 1 << 20 or time.monotonic() >= deadline:
                return None
            self._read_some(deadline - time.monotonic())

    def _write(self, data: bytes, deadline: float) -> bool:
        view = memoryview(data)
        while view:
            _, ready, _ = select.select([], [self._master], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return False
            try:
                written = os.write(self._master, view)
            except OSError as error:
                if error.errno == errno.EIO:
                    raise ShellGone from None
                raise
            view = view[written:]
        return True

    def _reset_terminal(self) -> None:
        """Raw mode again, whatever a command did with ``stty -F /dev/tty``: the protocol needs no echo and no
        output translation (termios calls on the master act on the slave's settings)."""
        with contextlib.suppress(termios.error):
            if termios.tcgetattr(self._master) != self._mode:
                termios.tcsetattr(self._master, termios.TCSANOW, self._mode)

    def _translating(self) -> bool:
        """Whether a command turned output translation back on (``stty -F /dev/tty sane``): then a terminal
        shows its output with CR LF line ends, and so do we, until the next command resets the mode."""
        with contextlib.suppress(termios.error):
            return bool(termios.tcgetattr(self._master)[1] & termios.OPOST)
        return False

    # ------------------------------------------------------------------ commands

    def run(self, command: str, *, timeout: float, limit: int, abandon: threading.Event | None = None) -> PtyResult:
        """Type one command and wait for its sentinel. A timeout interrupts the foreground job (SIGINT, then
        SIGKILL) and resynchronises; the shell lives on unless even that fails, when it is killed."""
        collected = OutputCollector(limit)
        sentinel = secrets.token_hex(16)
        line = f'eval {ansi_c_quote(command)} </dev/null; {{ __tvcache_end {sentinel} $LINENO $? "$_"; }} 2>/dev/null\n'
        data = line.encode()
        deadline = time.monotonic() + timeout
        try:
            self._reset_terminal()
            if self._write(data, deadline) and self._read_until(
                f"\n{sentinel} ".encode(), deadline, collected, abandon
            ):
                numbers = self._status_line(time.monotonic() + GRACE_SECONDS)
                if numbers is not None:
                    self.lineno, self.status = numbers
                    self.last_command = command
                    if collected.kept.endswith(b"\r") and self._translating():
                        collected.kept[-1:] = b""  # the epilogue's own newline went out as CR LF
                        collected.total -= 1
                    return self._result(collected, data, self.status, timed_out=False)
            self._recover(collected)
            return self._result(collected, data, None, timed_out=True)
        except ShellGone:
            self.close()
            return self._result(collected, data, None, timed_out=False, died=True)

    def _result(
        self, collected: OutputCollector, line: bytes, status: int | None, *, timed_out: bool, died: bool = False
    ) -> PtyResult:
        kept, total = bytes(collected.kept), collected.total
        if kept.startswith(line):  # `set -v` echoes each line bash reads, our protocol line included
            kept, total = kept[len(line) :], total - len(line)
        return PtyResult(output=kept, total_bytes=total, status=status, timed_out=timed_out, died=died)

    def _recover(self, collected: OutputCollector) -> None:
        """After a timeout: SIGINT to the terminal's foreground job, then SIGKILL to it, each followed by a
        resynchronising line; when the shell itself still does not answer, kill it (raises ShellGone)."""
        sentinel = secrets.token_hex(16)
        line = f'{{ __tvcache_end {sentinel} $LINENO $? "$_"; }} 2>/dev/null\n'.encode()
        token = f"\n{sentinel} ".encode()
        for signum in (signal.SIGINT, signal.SIGKILL):
            group = self._foreground_group()
            if group is not None and (signum == signal.SIGINT or group != self.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(group, signum)
            elif signum == signal.SIGINT and self.spawned is not None:
                self.spawned.send_signal(signal.SIGINT)  # bash itself is busy (a loop in the shell)
            self._reset_terminal()
            deadline = time.monotonic() + GRACE_SECONDS
            ignored = OutputCollector(0)
            if self._write(line, deadline) and self._read_until(token, deadline, ignored):
                numbers = self._status_line(time.monotonic() + GRACE_SECONDS)
                if numbers is not None:
                    self.lineno, self.status = numbers
                    self.last_command = None
                    return
        self.kill()
        while True:  # until the pty reports the end, bounded by the kernel killing the namespace
            self._read_some(GRACE_SECONDS)

    def _foreground_group(self) -> int | None:
        try:
            return os.tcgetpgrp(self._master)
        except OSError:
            return None

    def synchronise(self, line: str, sentinel: str, deadline: float) -> tuple[int, int] | None:
        """Type ``line`` (which ends with the epilogue for ``sentinel``), drop its output, return its line number
        and status; None when it does not answer by ``deadline``."""
        ignored = OutputCollector(0)
        try:
            self._reset_terminal()
            if self._write(line.encode(), deadline) and self._read_until(f"\n{sentinel} ".encode(), deadline, ignored):
                return self._status_line(deadline + GRACE_SECONDS)
        except ShellGone:
            self.close()
        return None

    # ------------------------------------------------------------------ state

    def capture(self) -> bytes | None:
        """The shell's state as printed by ``__tvcache_capture`` (between commands only), or None when the
        shell does not answer (its trap was removed or replaced). A capture that was signalled but did not
        finish kills the shell: the rest of it could come later, inside a command's output."""
        if self.spawned is None or not self.wait_idle() or not _catches(self.pid, CAPTURE_SIGNAL):
            return None  # busy, or the default action of SIGRTMAX: it would terminate the shell
        self._reset_terminal()
        before = OutputCollector(MAX_STATE_BYTES)
        deadline = time.monotonic() + CAPTURE_SECONDS
        try:
            if not self.spawned.send_signal(CAPTURE_SIGNAL):
                return None
            state = OutputCollector(MAX_STATE_BYTES)
            if (
                not self._read_until(STATE_BEGIN, deadline, before)
                or not self._read_until(STATE_END, deadline, state)
                or state.total > MAX_STATE_BYTES
            ):
                self.close()
                return None
        except ShellGone:
            self.close()
            return None
        # Anything printed before the marker (a prompt after the last command) belongs to the next command.
        self._buffer[:0] = before.kept
        return bytes(state.kept)

    def wait_idle(self, timeout: float = GRACE_SECONDS) -> bool:
        """Wait until bash blocks reading its terminal (``read`` on descriptor 0): the sentinel is printed a
        moment before bash undoes the epilogue's redirection and returns to its input, and a probe or a capture
        in that moment would see the redirection, or run inside the epilogue."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with open(f"/proc/{self.pid}/syscall") as handle:
                    fields = handle.read().split()
            except OSError:
                return False
            if fields[:2] == ["0", "0x0"]:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.00005)

    def children(self) -> list[int]:
        """Processes whose parent is the shell; as PID 1 of its namespace it inherits every orphan, so this is
        empty exactly when the shell is the only process in its namespace."""
        found: list[int] = []
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{self.pid}/task"):
                with open(f"/proc/{self.pid}/task/{task}/children") as handle:
                    found += [int(pid) for pid in handle.read().split()]
        return found

    def foreign_descriptors(self) -> list[str]:
        """The shell's open descriptors other than its terminal on 0, 1, 2 and 255 (bash's own copy)."""
        foreign = []
        directory = f"/proc/{self.pid}/fd"
        with contextlib.suppress(OSError):
            for name in sorted(os.listdir(directory), key=int):
                try:
                    info = os.stat(f"{directory}/{name}")
                    target = os.readlink(f"{directory}/{name}")
                except OSError:
                    continue
                if name in ("0", "1", "2", "255") and info.st_rdev == self._slave_device:
                    continue
                foreign.append(f"{name} -> {target}")
        return foreign

    # ------------------------------------------------------------------ end

    @property
    def alive(self) -> bool:
        return not self._closed and self.spawned is not None and not self.spawned.exited

    def kill(self) -> None:
        """SIGKILL the shell, and with it its namespace. Safe from any thread."""
        spawned = self.spawned
        if spawned is not None:
            spawned.kill()

    def close(self) -> None:
        """Kill the shell if it still runs and release everything; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        spawned = self.spawned
        if spawned is not None:
            spawned.kill()
            spawned.wait(None)
            spawned.close()
        if self._boot_pipe >= 0:
            os.close(self._boot_pipe)
            self._boot_pipe = -1
        os.close(self._master)


def _catches(pid: int, signum: int) -> bool:
    """Whether ``pid`` has a handler for ``signum`` (its SigCgt mask in /proc)."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except OSError:
        pass
    return False
