"""One long-lived, confined, interactive bash driven over a pty, whose commands' ends and statuses are read from
outside the shell.

Why a pty: the harnesses whose rollouts we serve (Terminus/tmux, SWE-ReX, OpenHands) type into an interactive
bash on a terminal, with job control; a timeout sends SIGINT to the terminal's foreground job, and the shell
lives on. The pty is in raw mode (no echo, no line editing, no output translation), so bytes pass unchanged and
a line of any length reaches bash; the driver resets the mode before every command, whatever ``stty`` did.

Protocol. bash starts with ``--norc --noediting -i``; its first line sources a *boot script* from the environment
(``BOOT_LINE``: the capture trap and, for a fork, the restored state), which prints a ready marker. From
then on nothing of ours runs between commands. A command is typed as a group, as a user would type it::

    { <command, line by line>
    } </dev/null

* the group gives the command's stdin as end of file, and leaves everything else as a plain bash has it:
  ``$?``, ``$_``, ``PIPESTATUS``, ``$BASH_COMMAND``, the command's own redirections (``exec >log``), its options
  and traps; nothing is printed or run after it;
* the end of a command and its status are not printed by the shell at all: ``bash_observer`` reads them from
  the kernel and bash's memory (the top-level reader blocked on the terminal, ``last_command_exit_value``).
  A command therefore cannot forge its status or its end, or push bytes into another call's output: what the
  terminal received between the first typed line and the moment bash waits again is this call's output;
* each line goes only once bash waits inside the group for the next (the parser's line count says so): a
  syntax error ends the group at once, with bash's own message and ``$?`` 2, and no later line runs outside it;
  a command that leaves the group open (an unterminated quote or here-document) gets SIGINT, as a Ctrl-C at the
  PS2 prompt, and the call says it was incomplete; what bash prints while the group is open is its PS2 prompt or
  ``set -v`` echo, and is dropped;
* prompts: PS1/PS2 are empty at boot and ``PROMPT_COMMAND`` unset; when a command sets PS0 or PS1 (a virtualenv's
  ``activate``) to plain text, the driver removes it from the output (see the README for what stays);
* bytes that arrive while no call runs, or while a background process of the shell lives, make the call not
  deterministic (``PtyResult.background``): their place in the output depends on timing;
* the state of a shell is read without typing a line: SIGRTMAX runs the capture trap, between commands only
  (see ``shell_state``).

What the guarantee rests on, and what breaks it: the kernel's view of the process and bash's globals. A process
that writes bash's memory (``/proc/1/mem`` is hidden from the sandbox; see ``zygote_process``) or replaces bash
by ``exec`` (then the call says the shell ended, and the sandbox is no longer trusted) is what is left.

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
import math
import os
import re
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
from ..commands import OutputCollector, ShellResult
from ..threads import Steps, blocking, drive
from .bash_observer import BashObserver, Idle, ShellGone, ShellReplaced, UnknownBash
from .capture import CAPTURE_PROTOCOL, CaptureRefused, prepare_capture, take_capture
from .zygote import Spawned, Zygote

__all__ = [
    "CAPTURE_SIGNAL",
    "OutputCollector",
    "PtyResult",
    "PtyShell",
    "ShellGone",
    "Terminal",
    "ansi_c_quote",
    "boot_escapes",
    "decode_prompt",
    "shell_argv",
]

CAPTURE_SIGNAL = signal.SIGRTMAX
READY = b"\n@@tvcache-ready@@\n"
WAITING = b"\n@@tvcache-waiting@@\n"
WINDOW = (24, 80)  # rows, columns: fixed, so that `ls`, `COLUMNS` and wrapping are the same in every shell
START_SECONDS = 10.0
GRACE_SECONDS = 2.0  # after SIGINT, then after SIGKILL of the foreground job, before the shell is given up
_CHUNK = 1 << 16
_CLOSE_GROUP = "} </dev/null"
_PROMPT_ROOM = 4096  # what a step keeps beyond the output limit: the prompts it may hold are removed after
EDITING_NOTE = "\n[line editing (set -o emacs or vi) is not supported in a persistent shell: the shell was ended]\n"
_FIRST_PAUSE = 0.00002  # between the first looks at a running command's shell; doubled up to _LAST_PAUSE
_LAST_PAUSE = 0.002

# What every shell runs at boot for the state capture: the SIGRTMAX trap (``capture``, whose docstring says what
# it guarantees). Nothing else of the protocol lives in the shell.
PROTOCOL = CAPTURE_PROTOCOL
# ``SECONDS=0``: every shell's $SECONDS counts from its boot, a warm shell's from its resume (WARM_HEAD) - and the
# assignment leaves the same trace in ``declare -p`` (a value, no -i) in each, before the state could set -a.
BOOT_HEAD = "builtin unset -v __TVCACHE_BOOT; builtin history -c; set +o history; SECONDS=0\n"
# Before the ready marker, the boot prints what the prompt escapes that never change in a shell decode to, so
# that the driver can remove a PS1 built of them (plain bash's default, a virtualenv's prefix) from outputs.
STATIC_ESCAPES = ("s", "v", "V", "$", "u", "h", "H")
BOOT_TAIL = (
    "__tvcache_p='" + "\x1f".join("\\" + letter for letter in STATIC_ESCAPES) + "'\n"
    "builtin printf '\\n@@tvcache-escapes@@%s\\n' \"${__tvcache_p@P}\"; builtin unset -v __tvcache_p\n"
    "builtin printf '\\n%s\\n' '@@tvcache-ready@@'\n"
)
ESCAPES_MARK = b"\n@@tvcache-escapes@@"
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
# How the boot reaches bash: typed as its first line, once it started (not PROMPT_COMMAND from the environment:
# bash 5.2 then never sets PIPESTATUS again; not an rcfile: Debian's bash then sources /etc/bash.bashrc first).
# ``source`` of a here-string read whole before it runs; ``"$_"`` as its last argument leaves ``$_`` as it was.
BOOT_LINE = b'. /dev/stdin "$_" <<<"$__TVCACHE_BOOT"\n'
FRESH_LINENO = 1  # the $LINENO of a booted shell's first command (the boot line is taken back: set_lineno)


def shell_argv(bash: str) -> list[str]:
    """The command line that starts a protocol shell from ``bash`` (its boot in ``__TVCACHE_BOOT``, typed by
    ``BOOT_LINE``)."""
    return [bash, "--norc", "--noprofile", "--noediting", "-i"]


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
    background: bool = False  # output may have come from a process other than the command (see the docstring)
    replaced: str | None = None  # the shell replaced its bash image: why the call's shell is gone

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
    escapes: dict[str, str]  # what the prompt escapes that never change decode to (the boot says)

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
            argv = shell_argv(bash)
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
            self._write(BOOT_LINE, time.monotonic() + START_SECONDS)
            self.spawned.wait_started()
            if self.spawned.pid is None:
                raise SandboxError(f"the persistent shell did not start: {'; '.join(self.spawned.errors)}")
            self.pid = self.spawned.pid
            collected = OutputCollector(4096)
            if not self._read_until(
                READY if mount_fd is not None else WAITING, time.monotonic() + START_SECONDS, collected
            ):
                raise SandboxError("the persistent shell did not become ready within 10 s")
            if mount_fd is None:
                # A warm shell: the readers of its memory are made now, while it waits, not on a fork's path.
                with contextlib.suppress(ShellReplaced, UnknownBash, CaptureRefused, OSError):
                    _ = self.observer
                    prepare_capture(self)
            else:
                self.escapes = boot_escapes(collected.kept)
            if mount_fd is not None and self.settle(time.monotonic() + START_SECONDS, booted=True) is None:
                raise SandboxError("the persistent shell did not wait for its first command within 10 s")
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
        self._prompts_current = False  # the state it takes sets them
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
            booted = OutputCollector(4096)
            if not self._read_until(READY, deadline, booted):
                raise SandboxError("the warm shell did not become ready within 10 s")
            self.escapes = boot_escapes(booted.kept)
            if self.settle(deadline, booted=True) is None:
                raise SandboxError("the warm shell did not wait for its first command within 10 s")
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
        self._setup_state()

    def _setup_state(self) -> None:
        """What the driver knows of a shell it has not talked to yet (a subclass with its own terminal calls this)."""
        self._buffer = bytearray()
        self._closed = False
        self._lock = threading.Lock()
        self.status = 0  # the last command's $?, its line number, and its text ($_ of the next command)
        self.lineno = 0
        self.last_command: str | None = None
        self._observer: BashObserver | None = None
        self._idle: Idle | None = None  # the state bash waited in after the last command
        self.escapes = {}
        # The last prompts read (raw, and the escapes then) and what they decoded to.
        self._prompts_seen: tuple[tuple[Any, Any], tuple[bytes | None, bytes | None, bytes | None]] = (
            ((), None),
            (None, None, None),
        )
        self._prompts_current = False  # read since the last line was typed
        self._others_after: dict[int, tuple[int, bool]] = {}  # the processes besides bash after the last call
        self._jobs_after: tuple[int, int] | None = None  # bash's job table then (None: no call yet)
        self.spawned = None
        self.pid = 0
        self._boot_pipe = -1  # a warm shell's, until resume

    @classmethod
    def adopt(
        cls,
        terminal: Terminal,
        spawned: Spawned,
        pid: int,
        *,
        lineno: int,
        status: int,
        last_command: str | None,
        escapes: Mapping[str, str] | None = None,
    ) -> PtyShell:
        """Drive a shell that already runs the protocol on ``terminal`` (whose slave the caller closes), held by
        ``spawned``; ``lineno``, ``status`` and ``last_command`` are what its last command left, ``escapes``
        what its boot said its prompt escapes decode to."""
        shell = cls.__new__(cls)
        shell._setup(terminal)
        shell.spawned, shell.pid = spawned, pid
        shell.lineno, shell.status, shell.last_command = lineno, status, last_command
        shell.escapes = dict(escapes or {})
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

    def _writing(self, data: bytes, deadline: float) -> Steps[bool]:
        view = memoryview(data)
        while view:
            _, ready, _ = select.select([], [self._master], [], 0)
            if not ready:  # the terminal's input queue is full: bash reads it while busy with nothing else
                yield max(0.0, deadline - time.monotonic())
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

    _write = blocking(_writing)

    def _reset_terminal(self) -> None:
        """Raw mode again, whatever a command did with ``stty -F /dev/tty``: the protocol needs no echo and no
        output translation (termios calls on the master act on the slave's settings)."""
        with contextlib.suppress(termios.error):
            if termios.tcgetattr(self._master) != self._mode:
                termios.tcsetattr(self._master, termios.TCSANOW, self._mode)

    # ------------------------------------------------------------------ observing

    @property
    def observer(self) -> BashObserver:
        """The reader of this shell's state from outside (``bash_observer``), made on first use."""
        if self._observer is None or self._observer.pid != self.pid:
            if self._observer is not None:
                self._observer.close()
            self._observer = BashObserver(self.pid, self._slave_device)
        return self._observer

    @property
    def firing_traps(self) -> bool:
        """A DEBUG or RETURN trap is set (read from the shell's memory)."""
        try:
            return self.observer.firing_traps()
        except (ShellReplaced, OSError):
            return True

    def _typing(self, line: bytes, deadline: float) -> Steps[int | None]:
        """Write ``line`` to the terminal; the shell's read count it must reach once it took the line, or None
        when the terminal does not take it by ``deadline``."""
        target = self.observer.bytes_read() + len(line)
        self._prompts_current = False  # the line may set them
        return target if (yield from self._writing(line, deadline)) else None

    _type = blocking(_typing)

    def _waiting(
        self,
        deadline: float,
        into: OutputCollector,
        abandon: threading.Event | None = None,
        *,
        taken: int = 0,
        longest: float = _LAST_PAUSE,
    ) -> Steps[Idle | None]:
        """Collect output until bash's top-level reader waits for a line, having read ``taken`` bytes in all,
        then every byte written before that (``select`` on the master pushes the terminal's pending input to
        it); None at the deadline. Checks start tight and back off, so a quick command is seen at once and a
        long one costs little."""
        observer = self.observer
        pause = _FIRST_PAUSE
        while True:
            state = observer.idle() if observer.bytes_read() >= taken else None
            if state is not None:
                self._drain(into)
                return state
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (abandon is not None and abandon.is_set()):
                return None
            # Output (a prompt, printed just before bash waits) wakes us; otherwise back off.
            yield min(pause, remaining)
            pause = _FIRST_PAUSE if self._read_some(min(pause, remaining), into) else min(pause * 2, longest)

    _wait_for_prompt = blocking(_waiting)

    def _wait_outside_command(self, deadline: float) -> Idle | None:
        """After a SIGINT: wait until bash waits for a line with no command half read (what it prints is dropped)."""
        while True:
            state = self._wait_for_prompt(deadline, OutputCollector(0))
            if state is None or not state.continuation:
                return state
            self._read_some(min(0.0005, max(0.0, deadline - time.monotonic())))

    def _drain(self, into: OutputCollector) -> None:
        into.add(self._buffer)
        self._buffer.clear()
        while select.select([self._master], [], [], 0)[0]:
            self._read_some(0, into)

    def _read_some(self, timeout: float, into: OutputCollector | None = None) -> bool:
        """Read what the terminal has within ``timeout`` (into ``into``, else the buffer); whether it had any."""
        ready, _, _ = select.select([self._master], [], [], timeout)
        if not ready:
            return False
        try:
            chunk = os.read(self._master, _CHUNK)
        except OSError as error:
            if error.errno == errno.EIO:  # the last descriptor of the slave closed
                raise ShellGone from None
            raise
        if not chunk:
            raise ShellGone
        if into is None:
            self._buffer += chunk
        else:
            into.add(chunk)
        return True

    # ------------------------------------------------------------------ commands

    def run(self, command: str, *, timeout: float, limit: int, abandon: threading.Event | None = None) -> PtyResult:
        return drive(self.steps(command, timeout=timeout, limit=limit, abandon=abandon))

    def steps(
        self, command: str, *, timeout: float, limit: int, abandon: threading.Event | None = None
    ) -> Steps[PtyResult]:
        """``run`` as ``Steps``: it yields before each wait, so that a caller may take the first ones on its
        event loop and hand the rest to a thread (``session``); ``math.inf`` before a wait of the slow paths
        (a timeout's recovery, an incomplete command, a shell that ended).

        Type one command as a group, ``{ <command>`` then ``} </dev/null`` (see the module docstring), and
        wait until bash's top-level reader waits again; its ``$?`` then is the status. A timeout interrupts the
        foreground job (SIGINT, then SIGKILL); the shell lives on unless even that fails, when it is killed."""
        collected = OutputCollector(limit)
        deadline = time.monotonic() + timeout
        before = self._idle
        step = OutputCollector(limit + _PROMPT_ROOM)
        at_once = b""  # the PS2 that opens the output of a one-line command typed with its closing line
        try:
            self._reset_terminal()
            late = self._pending_output(collected)
            processes = self._others()
            last_job, *table = self.observer.jobs()
            jobs = (table[0], table[1])
            if self._jobs_after is None:  # the first call of this shell (new, or restored): nothing to compare yet
                self._jobs_after, self._others_after = jobs, processes
            # Something wrote between calls, a job ended since the last call returned, or a process that holds
            # the terminal wrote meanwhile.
            background = late or jobs != self._jobs_after or self._wrote(self._others_after, processes)
            if not command.strip():  # an empty group is a syntax error; an empty line is nothing to bash
                return self._result(collected, self.status, background=background)
            lines = [f"{{ {line}" if index == 0 else line for index, line in enumerate(command.split("\n"))]
            state: Idle | None = None
            verbose = before is not None and before.verbose
            prompts = self._fixed_prompts()
            if len(lines) == 1 and not processes and not jobs[1] and before is not None and not verbose and prompts:
                # One line, nothing else in the namespace and no ended job in bash's table (whose notice would come
                # before the PS2): both lines at once, one wait instead of two; what bash printed for the
                # terminal's user is told apart afterwards.
                line = _CLOSE_GROUP
                typed = f"{lines[0]}\n{_CLOSE_GROUP}\n".encode("utf-8", errors="surrogateescape")
                at_once = prompts[2]
                taken = yield from self._typing(typed, deadline)
                state = None if taken is None else (yield from self._waiting(deadline, step, abandon, taken=taken))
                if state is not None and not state.continuation:
                    ps0, _, ps2 = prompts
                    ps1 = (self._fixed_prompts() or prompts)[1]  # the command may have set it
                    if ps1 and step.total > len(step.kept):  # cut before its end: the prompt is in the count only
                        step.total -= len(ps1)
                    collected.absorb(step, _typed_at_once(bytes(step.kept), state.status, ps0, ps1, ps2))
                lines = []
            for line in [*lines, _CLOSE_GROUP] if lines else []:
                step = OutputCollector(limit + _PROMPT_ROOM)
                typed = line.encode("utf-8", errors="surrogateescape") + b"\n"
                taken = yield from self._typing(typed, deadline)
                if taken is None:
                    break
                state = yield from self._waiting(deadline, step, abandon, taken=taken)
                if state is None:
                    break
                if not state.continuation:  # the group ran (closed by us, or by the command), or bash refused it
                    collected.absorb(
                        step, self._without_prompts(step, before, command if line is _CLOSE_GROUP else None)
                    )
                    break
                # Still inside the group: nothing ran. What bash printed is its `set -v` echo of our line and its
                # PS2 prompt, dropped, after the notices of jobs that ended meanwhile, kept.
                collected.absorb(step, self._without_continuation_prompt(step, typed if verbose else b""))
                verbose = state.verbose
            if state is None:
                collected.absorb(step, _without_prefix(bytes(step.kept), at_once))
                yield math.inf
                self._recover()
                return self._result(collected, None, background=True, timed_out=True)
            if state.continuation:
                yield math.inf
                return self._incomplete(collected, command, before, deadline, processes)
            if state.editing:  # readline now echoes and edits what is typed: not a terminal we can drive exactly
                yield math.inf
                collected.add(EDITING_NOTE.encode())
                self.kill()
                self.close()
                return self._result(collected, None, background=True, died=True, replaced=EDITING_NOTE.strip())
            if line is _CLOSE_GROUP:  # one line more than the user typed: the count a terminal would have
                # (from the call's first line: bash renumbers after a group that ran a subshell)
                counted = before.lineno + command.count("\n") + 1 if before is not None else state.lineno - 1
                state = self._take_back_lines(state, state.lineno - counted)
            self._idle = state
            self.lineno, self.status, self.last_command = state.lineno, state.status, command
            after = self._others_after = self._others()
            # A process that was there before the call is gone: bash's SIGCHLD handler may have reaped it and not
            # yet noted it in its job table; once bash waits for a line again, it has.
            settled = processes.keys() <= after.keys() or self.wait_idle()
            last_job_after, held, ended = self.observer.jobs()
            jobs_after = self._jobs_after = (held, ended)
            # A job of the shell ended during the call (more ended, or fewer left), or one it started ended already,
            # or one is ending (`kill %1` returns before its job dies: its notice may come now or with the next call).
            job_moved = jobs_after[1] != jobs[1] or jobs_after[0] < jobs[0] or self._job_ended(last_job, last_job_after)
            moving = not settled or job_moved or self._wrote(processes, after) or any(map(_ending, after))
            return self._result(collected, state.status, background=background or moving)
        except ShellReplaced as replaced:
            yield math.inf
            ended = not os.path.exists(f"/proc/{self.pid}/exe") or not self.alive  # it exited, not exec'd
            # What it printed last may still be on its way (its memory went first): with the rest of the step,
            # so that the PS2 of a one-line command typed at once is told apart from it.
            self._drain_ended(step)
            collected.absorb(step, _without_prefix(bytes(step.kept), at_once))
            self.kill()
            self.close()
            return self._result(collected, None, background=True, died=True, replaced=None if ended else str(replaced))
        except ShellGone:
            yield math.inf
            # What the command printed before it ended the shell.
            collected.absorb(step, _without_prefix(bytes(step.kept), at_once))
            self.close()
            return self._result(collected, None, background=True, died=True)

    def _decoded_prompts(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """PS0, PS1 and PS2 as bash prints them (``decode_prompt``: None for one that is not fixed), with ``\\s``
        from bash's current ``$0``. What was read stays current until a line is typed (between calls nothing else runs
        in the shell but the capture, which sets no prompt); the last decoding is kept: most calls set none."""
        read, decoded = self._prompts_seen
        if self._prompts_current and self.escapes is read[1]:
            return decoded
        raw = self.observer.prompts()
        self._prompts_current = True
        if raw != read[0] or self.escapes is not read[1]:
            escapes = {**self.escapes, "s": os.path.basename(raw[3].decode("utf-8", "surrogateescape"))}
            decoded = tuple(decode_prompt(prompt, escapes if self.escapes else {}) for prompt in raw[:3])  # type: ignore[assignment]
            self._prompts_seen = (raw, self.escapes), decoded
        return decoded

    def _fixed_prompts(self) -> tuple[bytes, bytes, bytes] | None:
        """PS0, PS1 and PS2 as bash prints them, when all three are fixed (``decode_prompt``), else None."""
        try:
            ps0, ps1, ps2 = self._decoded_prompts()
        except (ShellReplaced, OSError):
            return None
        if ps0 is None or ps1 is None or ps2 is None:
            return None
        return ps0, ps1, ps2

    def _drain_ended(self, collected: OutputCollector) -> None:
        """What a shell that just ended printed last (``printf abc; exit 3``), read until its terminal closes."""
        with contextlib.suppress(ShellGone, OSError):
            deadline = time.monotonic() + GRACE_SECONDS
            while time.monotonic() < deadline and self._read_some(0.05, collected):
                pass

    def _without_continuation_prompt(self, step: OutputCollector, echo: bytes) -> bytes:
        kept = bytes(step.kept)
        if echo and kept.startswith(echo):
            kept = kept[len(echo) :]
        with contextlib.suppress(ShellReplaced, OSError):
            ps2 = self._decoded_prompts()[2]
            if ps2 and kept.endswith(ps2):
                kept = kept[: len(kept) - len(ps2)]
        return kept

    def _pending_output(self, into: OutputCollector) -> bool:
        """Bytes on the terminal from before this call (a background process wrote after the last one ended):
        they open this call's output, as a terminal shows them."""
        pending = OutputCollector(into.limit)
        self._drain(pending)
        into.add(pending.kept)
        return pending.total > 0

    def _without_prompts(self, step: OutputCollector, before: Idle | None, command: str | None) -> bytes:
        """The output of the step that ran the group (``command``: closed by our line), without what bash
        printed for the terminal's user only: under ``set -v`` its echo of our closing line becomes the echo of
        the command's lines that a plain bash prints (before the output, not between lines: see the README);
        PS0 before the command and PS1 after it, when they are plain text (a prompt with escapes or expansions
        stays: see the README)."""
        kept = bytes(step.kept)
        if command is not None and before is not None and before.verbose:
            echo = _CLOSE_GROUP.encode() + b"\n"
            if kept.startswith(echo):
                kept = command.encode("utf-8", errors="surrogateescape") + b"\n" + kept[len(echo) :]
        with contextlib.suppress(ShellReplaced, OSError):
            ps0, ps1, _ = self._decoded_prompts()
            if ps0 and kept.startswith(ps0):
                kept = kept[len(ps0) :]
            if ps1 and kept.endswith(ps1):
                kept = kept[: len(kept) - len(ps1)]
            elif ps1 and step.total > len(step.kept):  # cut before its end: the prompt is in the count only
                step.total -= len(ps1)
        return kept

    def _incomplete(
        self,
        collected: OutputCollector,
        command: str,
        before: Idle | None,
        deadline: float,
        processes: dict[int, tuple[int, bool]],
    ) -> PtyResult:
        """The command left bash inside an unfinished construct (a quote, a here-document, a compound command):
        nothing of it ran. SIGINT makes bash drop the partial input (a Ctrl-C at its PS2 prompt), and the
        command is evaluated as a string instead: bash's own messages, a here-document ended by the end of the
        command, as ``bash -c`` would (see the README)."""
        self._signal(signal.SIGINT)
        state = self._wait_outside_command(min(deadline, time.monotonic() + GRACE_SECONDS))
        if state is None:
            self._recover()
            return self._result(collected, None, background=True, timed_out=True)
        start = before.lineno if before is not None else state.lineno
        self._take_back_lines(state, state.lineno - start)  # the eval's lines count from the command's first
        step = OutputCollector(collected.limit)
        line = f"eval {ansi_c_quote(command)} </dev/null\n".encode()
        taken = self._type(line, deadline)
        result = self._wait_for_prompt(deadline, step, taken=taken) if taken is not None else None
        if result is None or result.continuation:
            collected.absorb(step, bytes(step.kept))
            self._recover()
            return self._result(collected, None, background=True, timed_out=True)
        # bash 5.2 leaves the parser's last token at the end of the evaluated string: the next line's first word
        # would not be a reserved word (`{`). An empty line resets it (and is taken back with the others).
        settled = self._type(b"\n", deadline)
        after = self._wait_for_prompt(deadline, OutputCollector(0), taken=settled) if settled is not None else None
        if after is None:
            collected.absorb(step, bytes(step.kept))
            self._recover()
            return self._result(collected, None, background=True, timed_out=True)
        result = Idle(status=result.status, lineno=after.lineno, continuation=False, verbose=result.verbose)
        kept = self._without_prompts(step, None, None)
        if state.verbose and kept.startswith(line):
            kept = command.encode("utf-8", errors="surrogateescape") + b"\n" + kept[len(line) :]
        collected.absorb(step, kept)
        result = self._take_back_lines(result, result.lineno - start - command.count("\n") - 1)
        self._idle = result
        self.lineno, self.status, self.last_command = result.lineno, result.status, command
        self._others_after = self._others()
        return self._result(collected, result.status, background=self._wrote(processes, self._others_after))

    def _result(
        self,
        collected: OutputCollector,
        status: int | None,
        *,
        background: bool,
        timed_out: bool = False,
        died: bool = False,
        replaced: str | None = None,
    ) -> PtyResult:
        return PtyResult(
            output=bytes(collected.kept),
            total_bytes=collected.total,
            status=status,
            timed_out=timed_out,
            died=died,
            background=background,
            replaced=replaced,
        )

    def _recover(self) -> None:
        """After a timeout: SIGINT to the terminal's foreground job (or to bash, busy itself), then SIGKILL to
        the job, each followed by a wait for bash's reader; when bash still does not wait for a line, kill it
        (raises ShellGone). What is printed meanwhile is dropped."""
        for signum in (signal.SIGINT, signal.SIGKILL):
            group = self._foreground_group()
            if group is not None and (signum == signal.SIGINT or group != self.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(group, signum)
            elif signum == signal.SIGINT:
                self._signal(signal.SIGINT)  # bash itself is busy (a loop in the shell)
            self._reset_terminal()
            state = self._wait_for_prompt(time.monotonic() + GRACE_SECONDS, OutputCollector(0))
            if state is not None and state.continuation:
                self._signal(signal.SIGINT)  # the group's closing line never came: drop it
                state = self._wait_outside_command(time.monotonic() + GRACE_SECONDS)
            if state is not None and not state.continuation:
                self._idle = state
                self.lineno, self.status, self.last_command = state.lineno, state.status, None
                return
        self.kill()
        while True:  # until the pty reports the end, bounded by the kernel killing the namespace
            self._read_some(GRACE_SECONDS)

    def _signal(self, signum: int) -> None:
        """Send ``signum`` to bash itself (PID 1 of its namespace: through the zygote that holds it)."""
        if self.spawned is not None:
            self.spawned.send_signal(signum)

    def _foreground_group(self) -> int | None:
        try:
            return os.tcgetpgrp(self._master)
        except OSError:
            return None

    def synchronise(self, line: str, deadline: float) -> Idle | None:
        """Type ``line`` (lines of the restore, no user command), drop what it prints, and return the state
        bash then waits in; None when it does not wait for a line by ``deadline``."""
        try:
            self._reset_terminal()
            taken = self._type(line.encode("utf-8", errors="surrogateescape"), deadline)
            if taken is not None:
                state = self._wait_for_prompt(deadline, OutputCollector(0), taken=taken, longest=_FIRST_PAUSE * 4)
                if state is not None and not state.continuation:
                    self._idle = state
                    self.lineno, self.status = state.lineno, state.status
                    return state
        except (ShellGone, ShellReplaced):
            self.close()
        return None

    def _take_back_lines(self, state: Idle, count: int) -> Idle:
        """``state`` with its line number ``count`` lower, in bash too (``BashObserver.set_lineno``)."""
        lineno = state.lineno - count
        self.observer.set_lineno(lineno)
        return Idle(status=state.status, lineno=lineno, continuation=state.continuation, verbose=state.verbose)

    def settle(self, deadline: float, *, booted: bool = False) -> Idle | None:
        """Wait until bash waits for a line (after its boot, ``booted``: whose line is taken back, or after a
        restore) and note its state."""
        try:
            # Our own boot or restore, a few milliseconds at most, and its prompt may be read already: look often.
            state = self._wait_for_prompt(deadline, OutputCollector(0), longest=_FIRST_PAUSE * 4)
            if state is not None and booted:
                state = self._take_back_lines(state, 1)
        except (ShellGone, ShellReplaced):
            self.close()
            return None
        if state is not None:
            self._idle = state
            self.lineno, self.status = state.lineno, state.status
        return state

    # ------------------------------------------------------------------ state

    def capture(self) -> bytes | None:
        """The shell's state (``capture.take_capture``: between commands only), or None when it cannot be taken
        or trusted; ``capture_state`` says why."""
        try:
            return self.capture_state()
        except CaptureRefused:
            return None

    def capture_state(self, *, checked: bool = True) -> bytes:
        """The shell's state as ``capture.encode_state`` bytes, or CaptureRefused saying why not (the shell goes on
        as it was, unless it did not finish the trap in time: then it was ended). ``checked=False``: a shell that
        ran nothing but its boot (a restore being verified), where no code of a user's can be in the way."""
        return take_capture(self, checked=checked)

    def wait_idle(self, timeout: float = GRACE_SECONDS) -> bool:
        """Wait until bash's top-level reader waits for a line outside any command (``bash_observer``); what
        arrives meanwhile is kept for the next command. False when it does not by ``timeout`` or is gone."""
        deadline = time.monotonic() + timeout
        try:
            observer = self.observer
            while True:
                state = observer.idle()
                if state is not None and not state.continuation:
                    return True
                if time.monotonic() >= deadline:
                    return False
                self._read_some(min(0.0005, max(0.0, deadline - time.monotonic())))
        except (ShellGone, ShellReplaced, OSError):
            return False

    def _others(self) -> dict[int, tuple[int, bool]]:
        """Every process in the shell's namespace but bash: its write count (``wchar``) and whether it holds
        the terminal (on descriptor 1 or 2)."""
        found: dict[int, tuple[int, bool]] = {}
        pending = self.children()
        while pending:
            pid = pending.pop()
            try:
                with open(f"/proc/{pid}/io", "rb") as handle:
                    written = int(handle.read().split(b"\n")[1].split()[1])
                terminal = any(_device(f"/proc/{pid}/fd/{fd}") == self._slave_device for fd in (1, 2))
                with open(f"/proc/{pid}/task/{pid}/children") as handle:
                    pending += [int(child) for child in handle.read().split()]
            except (OSError, IndexError, ValueError):
                continue  # it just ended
            found[pid] = (written, terminal)
        return found

    @staticmethod
    def _wrote(before: dict[int, tuple[int, bool]], after: dict[int, tuple[int, bool]]) -> bool:
        """Whether a process other than bash that holds the terminal wrote between ``before`` and ``after`` (or
        started meanwhile and wrote): its bytes may be in the output, at a place that depends on timing."""
        return any(terminal and written != before.get(pid, (0, True))[0] for pid, (written, terminal) in after.items())

    def _job_ended(self, last_job: int, last_job_after: int) -> bool:
        """Whether the call started a background job that has already ended: whether bash noted it ("Done")
        before it waited for the next line depends on timing. (``$!`` is a PID of the shell's namespace, which
        the host cannot map back; a job that ended leaves fewer processes than it would.)"""
        if last_job_after == last_job:
            return False
        namespace_pids = set()
        for pid in self._others_after:
            with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/status") as handle:
                for line in handle:
                    if line.startswith("NSpid:"):
                        namespace_pids.add(int(line.split()[-1]))
        return last_job_after not in namespace_pids

    def children(self) -> list[int]:
        """Processes whose parent is the shell; as PID 1 of its namespace it inherits every orphan, so this is
        empty exactly when the shell is the only process in its namespace."""
        try:
            return self.observer.children()
        except (ShellReplaced, OSError, UnknownBash):
            return []

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
        if self._observer is not None:
            self._observer.close()
        os.close(self._master)


_EXPANDING = {bytes([char]) for char in b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_0123456789{(@*#?$!-'\""}
_FIXED_ESCAPES = {"a": b"\a", "e": b"\x1b", "n": b"\n", "r": b"\r", "\\": b"\\", "[": b"", "]": b""}


def _typed_at_once(output: bytes, status: int, ps0: bytes, ps1: bytes, ps2: bytes) -> bytes:
    """The output of a one-line command typed together with the group's closing line, without what bash printed
    for the terminal's user: PS2 (it asked for the second line), PS0 and PS1 around the command's own output, or,
    when the first line was a syntax error, the closing line's own error and the prompts between."""
    if ps2 and output.startswith(ps2):
        output = output[len(ps2) :]
    elif status == 2:  # a syntax error: bash never asked for the closing line, and then refused it too
        refused = re.search(
            re.escape(ps1) + rb"[^\n]*: syntax error near unexpected token `}'\n" + re.escape(ps1) + rb"\Z", output
        )
        if refused is not None:
            return output[: refused.start()]
    if ps0 and output.startswith(ps0):
        output = output[len(ps0) :]
    if ps1 and output.endswith(ps1):
        output = output[: len(output) - len(ps1)]
    return output


_PF_EXITING = 0x4  # linux/sched.h: the task is in do_exit


def _ending(pid: int) -> bool:
    """Whether the process is ending or has ended (a zombie its parent has not reaped, exiting, or with a signal
    pending, as a fatal one is from the moment it is sent until the process exits): its end, and what it brings (a
    job notice, a port or a file let go), come at a moment the call does not control. ``/proc/PID/stat``'s 31st
    field is the thread's private pending set, where the kernel puts the SIGKILL that a fatal signal becomes."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rpartition(b")")[2].split()
        return fields[0] in (b"Z", b"X", b"x") or bool(int(fields[6]) & _PF_EXITING) or fields[28] != b"0"
    except (OSError, IndexError, ValueError):
        return True  # it just went: its parent may not have reaped it yet


def _without_prefix(output: bytes, prefix: bytes) -> bytes:
    return output[len(prefix) :] if prefix and output.startswith(prefix) else output


def _device(path: str) -> int:
    try:
        return os.stat(path).st_rdev
    except OSError:
        return -1


def decode_prompt(raw: bytes, escapes: Mapping[str, str]) -> bytes | None:
    """What bash prints for the prompt string ``raw``, when that does not depend on the moment: escapes of
    ``_FIXED_ESCAPES``, octal ones and those the boot decoded (``escapes``); None for anything else (the time,
    the directory, the command number, ``$`` or backquote expansions, ``!``)."""
    if not raw:
        return b""
    out = bytearray()
    index = 0
    while index < len(raw):
        byte = raw[index : index + 1]
        index += 1
        if byte == b"$" and raw[index : index + 1] not in _EXPANDING:
            out += byte  # a `$` that starts no expansion (`$ ` at the end of a prompt) is printed as it is
            continue
        if byte in (b"$", b"`", b"!"):
            return None
        if byte != b"\\":
            out += byte
            continue
        letter = raw[index : index + 1].decode("latin-1")
        index += 1
        if letter in _FIXED_ESCAPES:
            out += _FIXED_ESCAPES[letter]
        elif letter in escapes:
            out += escapes[letter].encode("utf-8", errors="surrogateescape")
        elif letter.isdigit() and letter < "8":
            digits = raw[index - 1 : index + 2]
            if len(digits) < 3 or not all(48 <= char < 56 for char in digits):
                return None
            out.append(int(digits, 8) & 0xFF)
            index += 2
        else:
            return None
    return bytes(out)


def boot_escapes(booted: bytes | bytearray) -> dict[str, str]:
    """The boot's decoding of ``STATIC_ESCAPES`` (empty when it is not there)."""
    start = booted.rfind(ESCAPES_MARK)
    if start < 0:
        return {}
    line = bytes(booted[start + len(ESCAPES_MARK) :]).split(b"\n", 1)[0].rstrip(b"\r")
    values = line.decode("utf-8", errors="surrogateescape").split("\x1f")
    return dict(zip(STATIC_ESCAPES, values, strict=False)) if len(values) == len(STATIC_ESCAPES) else {}
