"""A small helper process (a *zygote*) that starts the confined commands of one shell sandbox factory.

Why: forking the trainer's large Python process for every command costs milliseconds (copying its page tables,
then copy-on-write faults while Python runs the pre-exec code), ``unshare(1)`` added an exec and a fork, and
building fresh namespaces and mounts costs a few more, all while the caller waits. The zygote is a fresh
``python -I -S`` interpreter that loads only ``zygote_process`` (light standard-library modules and
``linux``). It keeps a few *spares* ready: children forked into a new PID namespace (each is PID 1 there) that
have already entered fresh mount, network, IPC and UTS namespaces, built their mounts and dropped the
capabilities bash must not get, and wait. A command goes to a spare, which attaches the sandbox's tree and
execs bash. A spare serves exactly one command, so nothing is shared between commands or sandboxes. When bash
(PID 1) ends, the kernel kills everything left in its namespace; killing bash (by its pidfd) kills it all.

Protocol, over ``SOCK_SEQPACKET`` socket pairs (one message per packet):

* main -> zygote, on the control socket: a request (``encode_request``) with three descriptors: the reply
  socket of this command, the write end of its output pipe, and the sandbox's detached overlay mount;
* zygote -> main, on the reply socket: ``{"pid": N}`` with the command's pidfd (and ``"cgroup": name``), then
  ``{"exited": code}`` (``code`` as in ``Popen.returncode``; with ``"limit": kind`` when its tree hit a limit of
  its cgroup and was killed for it, see ``cgroups``). When its confinement or exec fails, the command sends
  ``{"error": text}`` first and exits with 127; when the zygote cannot start it, only ``{"error": text}`` comes.
* a *warm* shell (``spawn(..., warm_boot_fd=...)``) is started before its sandbox exists: confined as usual but
  with no tree attached, it waits in its boot script for its state on a pipe. ``Spawned.attach`` sends the
  tree later, main -> zygote on the reply socket (``{"attach": true}`` with the overlay mount); the zygote enters
  the shell's mount namespace, attaches the tree where a cold command gets it, and answers ``{"attached": true}``
  (or ``{"error": text}``).

The zygote ends when the control socket closes (``close``, garbage collection, or the main process dying); its
children then die with it (parent-death signal), and with them every command they run.
"""

from __future__ import annotations

import errno
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from .zygote_process import MAX_REPLY, encode_request, receive, send

__all__ = ["Confinement", "SpawnError", "Spawned", "Zygote"]


class SpawnError(OSError):
    """A confined command could not be started, or the zygote died under it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Confinement:
    """Where and how a factory's commands are confined; computed once, in the main process."""

    base: str  # the sandbox tree is attached here (rootfs: it becomes the root)
    rootfs: bool
    private_dirs: tuple[str, ...]  # each gets a fresh tmpfs (rootfs: where the image has the directory)
    devices: tuple[str, ...]  # names under /dev bound into the minimal /dev
    hostname: str = "sandbox"
    # The host paths in the sandbox's new root (``host_view``), each bound read-only, nosuid, nodev at its own
    # place: the system directories and allowed /etc entries, then the ones the factory declared visible (files
    # or directories, parents first); and host symlinks recreated as they are, (path, target). Not with rootfs.
    system: tuple[str, ...] = ()
    visible: tuple[str, ...] = ()
    links: tuple[tuple[str, str], ...] = ()
    # A tmpfs ``size=`` value ("1g") for each private tmpfs (/tmp, /var/tmp, /run, /dev/shm); None: the kernel's
    # default (half the memory, each).
    tmpfs_size: str | None = None


class Spawned:
    """One command started by the zygote: its pidfd, and the channel its exit status comes back on."""

    def __init__(self, channel: socket.socket) -> None:
        self._channel = channel
        self._buffer = bytearray(MAX_REPLY)
        self._lock = threading.Lock()
        self._pidfd: int | None = None
        self._done = False
        self._attached = False
        self.pid: int | None = None  # the command's process id in the caller's PID namespace
        self.returncode: int | None = None
        self.cgroup: str | None = None  # the name of its tree's cgroup (``cgroups``), when it has one
        self.limit: str | None = None  # the kind of limit its tree hit ("memory", "pids"), if any
        self.errors: list[str] = []

    def _handle_one(self, timeout: float | None) -> bool:
        """Handle one message; False when none came within ``timeout`` seconds."""
        ready, _, _ = select.select([self._channel], [], [], timeout)
        if not ready:
            return False
        try:
            data, fds = receive(self._channel, self._buffer, 1)
        except ConnectionResetError:  # it ended without reading what it was sent
            data, fds = b"", []
        if not data:  # every sender is gone: the zygote died, or gave up on this command
            for fd in fds:
                os.close(fd)
            if self.returncode is None and not self.errors:
                self.errors.append("the zygote process that starts shell commands died")
            self._done = True
            return True
        reply = json.loads(data)
        if "pid" in reply and fds:
            with self._lock:
                self._pidfd = fds[0]
                self.pid = int(reply["pid"])
                self.cgroup = reply.get("cgroup")
        if "error" in reply:
            self.errors.append(str(reply["error"]))
        if "attached" in reply:
            self._attached = True
        if "limit" in reply:
            self.limit = str(reply["limit"])
        if "exited" in reply:
            self.returncode = reply["exited"]
            self._done = True
        return True

    def wait_started(self) -> None:
        """Block until the command can be killed (its pidfd arrived), or will never run."""
        while self._pidfd is None and not self._done:
            self._handle_one(None)

    def wait(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (None: forever) for the end; True when it came."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._handle_one(remaining):
                return False
        return True

    def attach(self, mount_fd: int, timeout: float) -> None:
        """Attach the sandbox tree ``mount_fd`` in a warm shell's namespace (see the module docstring); SpawnError
        when the zygote refuses, the shell is gone, or no answer comes within ``timeout`` seconds."""
        try:
            send(self._channel, b'{"attach": true}', [mount_fd])
        except OSError as error:
            raise SpawnError(error.errno, f"cannot reach the zygote to attach the tree: {error}") from error
        deadline = time.monotonic() + timeout
        while not self._attached and not self._done:
            if not self._handle_one(max(0.0, deadline - time.monotonic())):
                raise SpawnError(0, "the zygote did not attach the tree in time")
        if not self._attached:
            raise SpawnError(0, f"the tree was not attached: {'; '.join(self.errors) or 'the shell ended'}")

    def kill(self) -> None:
        """SIGKILL the command (PID 1 of its namespace: everything in it dies). Safe from any thread."""
        self.send_signal(signal.SIGKILL)

    def send_signal(self, signum: int) -> bool:
        """Send ``signum`` to the command by its pidfd (never to a reused PID); False once it is gone."""
        with self._lock:
            if self._pidfd is None:
                return False
            try:
                signal.pidfd_send_signal(self._pidfd, signum)
            except ProcessLookupError:
                return False
            return True

    @property
    def exited(self) -> bool:
        """True once the command's exit was reported (checked without blocking)."""
        while not self._done and self._handle_one(0):
            pass
        return self._done

    def close(self) -> None:
        with self._lock:
            pidfd, self._pidfd = self._pidfd, None
        if pidfd is not None:
            os.close(pidfd)
        self._channel.close()


_BOOTSTRAP = """\
import importlib, sys, types
package = types.ModuleType("_tvcache_zygote")
package.__path__ = [sys.argv[1]]
sys.modules["_tvcache_zygote"] = package
importlib.import_module("_tvcache_zygote.zygote_process").serve(int(sys.argv[2]), *sys.argv[3:])
"""


class Zygote:
    """The main process's handle on one zygote, started by ``start`` or the first ``spawn`` (again if it died).

    Thread-safe: any number of threads may spawn and wait at once. ``close`` ends the zygote, which kills the
    commands it still runs; so does garbage collection, and the end of the main process.
    """

    def __init__(self, confinement: Confinement, *, cgroups: dict[str, object] | None = None) -> None:
        self.confinement = confinement
        self.cgroups = cgroups  # the spec of each confined tree's cgroup (``cgroups``), or None: no limits
        self._lock = threading.Lock()
        self._control: socket.socket | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._owner = 0
        self._finalizer: weakref.finalize | None = None

    def start(self) -> None:
        """Start the zygote now (it boots and readies its spares in ~50 ms) rather than on the first spawn."""
        self._ensure()

    def spawn(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        mount_fd: int,
        output_fd: int,
        terminal: bool = False,
        last_pid: int | None = None,
        warm_boot_fd: int | None = None,
    ) -> Spawned:
        """Start ``argv`` confined, its stdout and stderr on ``output_fd``; the caller keeps its descriptors.
        With ``terminal``, ``output_fd`` is a pty slave that is also stdin and the controlling terminal;
        ``last_pid`` sets the last PID used in the new PID namespace (see ``encode_request``). With
        ``warm_boot_fd`` (the read end of a pipe; ``mount_fd`` is then ignored) the command starts before its
        tree, which ``Spawned.attach`` brings later; it gets that pipe as descriptor 3 and the namespace's
        ``ns_last_pid`` as 4."""
        warm = warm_boot_fd is not None
        request = encode_request(argv, dict(env), terminal=terminal, last_pid=last_pid, warm=warm)
        third = warm_boot_fd if warm_boot_fd is not None else mount_fd
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            for attempt in (1, 2):
                control = self._ensure()
                try:
                    send(control, request, [theirs.fileno(), output_fd, third])
                    break
                except OSError as error:
                    if error.errno == errno.EMSGSIZE:
                        raise SpawnError(error.errno, f"the command is too long ({len(request)} bytes)") from error
                    self._discard(control)  # the zygote died: start another one, once
                    if attempt == 2:
                        raise SpawnError(error.errno, f"cannot reach the zygote process: {error}") from error
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        return Spawned(mine)

    def _ensure(self) -> socket.socket:
        with self._lock:
            if self._control is not None and self._owner == os.getpid():
                return self._control
            if not sys.executable:
                raise SpawnError(0, "cannot start the zygote process: sys.executable is unknown")
            control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                directory = str(Path(__file__).resolve().parent)
                boot = [sys.executable, "-I", "-S", "-B", "-c", _BOOTSTRAP, directory, str(theirs.fileno())]
                self._process = subprocess.Popen(
                    [*boot, json.dumps(asdict(self.confinement)), json.dumps(self.cgroups)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    cwd="/",
                    env={},
                    pass_fds=[theirs.fileno()],
                    start_new_session=True,
                )
            except BaseException:
                control.close()
                raise
            finally:
                theirs.close()
            self._control, self._owner = control, os.getpid()
            # Ends the zygote when this handle is garbage collected, or at interpreter exit.
            self._finalizer = weakref.finalize(self, _shutdown, control, self._process, self._owner)
            return control

    def _discard(self, control: socket.socket) -> None:
        with self._lock:
            if self._control is control:
                self._stop()

    def _stop(self) -> None:
        finalizer, self._finalizer = self._finalizer, None
        self._control = self._process = None
        if finalizer is not None:
            finalizer()

    def close(self) -> None:
        """End the zygote (idempotent); commands it still runs are killed. A later spawn starts a new one."""
        with self._lock:
            self._stop()

    @property
    def pid(self) -> int | None:
        """The zygote's process id while it runs (for tests and inspection)."""
        process = self._process
        return None if process is None else process.pid


def _shutdown(control: socket.socket, process: subprocess.Popen[bytes], owner: int) -> None:
    if os.getpid() != owner:
        return  # a forked copy of the owner: the zygote is not ours to stop
    control.close()  # the zygote sees the end of its control socket and exits
    try:
        process.wait(5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
