"""The code that runs inside the zygote process and its children (see ``_zygote`` for the why and the protocol).

This module is imported by a fresh ``python -I -S`` interpreter, so it imports only light standard-library
modules and ``linux``: each module the zygote loads is memory that every fork must copy the page tables of
(forking a 4 MiB interpreter costs half what an 8 MiB one does). Typing names are imported for type checkers
only, for the same reason.
"""

from __future__ import annotations

import array
import fcntl
import json
import os
import select
import signal
import socket
import struct
import termios

from . import linux

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import NoReturn

SPARES = 2  # confined children kept ready; more concurrent commands fork theirs on demand
MAX_REQUEST = 1 << 20  # argv strings are limited to 128 KiB each by the kernel; a packet to ~208 KiB by default
MAX_REPLY = 1 << 16
EXIT_FAILED = 127
FD_BYTES = array.array("i").itemsize
# A warm shell's two extra descriptors, closed by its boot script before any command runs: the pipe its state
# arrives on, and the namespace's ns_last_pid (opened while /proc was writable), to number its PIDs on from.
WARM_BOOT_FD = 3
WARM_LAST_PID_FD = 4
_SIOCSIFFLAGS = 0x8914
_LOOPBACK_UP = struct.pack("16sH14s", b"lo", 0x1, b"")  # IFF_UP
TMPFS_FLAGS = linux.MS_NOSUID | linux.MS_NODEV
PROC_FLAGS = linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC | linux.MS_RDONLY


# ------------------------------------------------------------------------------------------- messages


def encode_request(
    argv: Sequence[str],
    env: dict[str, str],
    *,
    terminal: bool = False,
    last_pid: int | None = None,
    warm: bool = False,
) -> bytes:
    """argv, then ``KEY=VALUE`` strings, as length-prefixed bytes (any bytes survive), after a small header.

    ``terminal``: the output descriptor is a pty's slave, which becomes the command's stdin too and its
    controlling terminal (a persistent, interactive shell). ``last_pid``: the last PID handed out in the
    command's new PID namespace, so its next child gets ``last_pid + 1`` (a restored shell numbers its jobs as
    the shell it was captured from did). ``warm``: a shell started before its tree is known (see ``warm``):
    the third descriptor is not a mount but the read end of its boot pipe, and the tree is attached later by an
    ``attach`` message on the reply socket."""
    header = {"argc": len(argv), "terminal": terminal, "last_pid": last_pid, "warm": warm}
    strings = [json.dumps(header).encode(), *(os.fsencode(item) for item in argv)]
    strings += [os.fsencode(key) + b"=" + os.fsencode(value) for key, value in env.items()]
    return b"".join(struct.pack("I", len(part)) + part for part in strings)


def decode_request(data: bytes) -> tuple[list[bytes], dict[bytes, bytes], dict[str, object]]:
    parts, offset = [], 0
    while offset < len(data):
        (size,) = struct.unpack_from("I", data, offset)
        parts.append(data[offset + 4 : offset + 4 + size])
        offset += 4 + size
    header = json.loads(parts[0])
    argc = header["argc"]
    env = dict(item.split(b"=", 1) for item in parts[1 + argc :])
    return parts[1 : 1 + argc], env, header


def request_header(data: bytes) -> dict[str, object]:
    """Only the header of a request (the zygote reads no more of it: the child decodes the rest)."""
    (size,) = struct.unpack_from("I", data, 0)
    header: dict[str, object] = json.loads(data[4 : 4 + size])
    return header


def message(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def send(channel: socket.socket, data: bytes, fds: Sequence[int] = ()) -> None:
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    channel.sendmsg([data], ancillary)


def receive(channel: socket.socket, buffer: bytearray, max_fds: int) -> tuple[bytes, list[int]]:
    """One packet (into ``buffer``: no allocation per message) and its descriptors, close-on-exec."""
    size, ancillary, _, _ = channel.recvmsg_into(
        [buffer], socket.CMSG_SPACE(max_fds * FD_BYTES), socket.MSG_CMSG_CLOEXEC
    )
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", data[: len(data) - len(data) % FD_BYTES]))
    return bytes(buffer[:size]), fds


# ------------------------------------------------------------------------------------- confinement


class Confiner:
    """The steps that confine a command, run by its own process: PID 1 of a new PID namespace.

    ``prepare`` runs before the command is known (in a spare, ahead of time); ``enter`` attaches the sandbox's
    tree once it is. Both are lists of named steps, so that ``tvcache bench shell`` can time each one.
    """

    def __init__(
        self,
        *,
        base: str,
        rootfs: bool,
        private_dirs: Sequence[str],
        devices: Sequence[str],
        hostname: str,
        visible: Sequence[str] = (),
    ) -> None:
        self.base = base
        self.rootfs = rootfs
        self.private_dirs = list(private_dirs)
        self.devices = list(devices)
        self.hostname = hostname
        self.visible = [] if rootfs else list(visible)
        self._device_trees: list[tuple[str, int]] = []
        self._visible_trees: list[tuple[str, int]] = []
        self._tree = -1

    def prepare_steps(self) -> list[tuple[str, Callable[[], None]]]:
        steps = [("unshare mount/net/ipc/uts", self.unshare), ("clone devices", self.clone_devices)]
        if not self.rootfs:
            steps += [("host read-only", self.host_read_only), ("mount proc", self.mount_proc)]
            steps += [("minimal /dev", self.minimal_dev), ("private tmpfs", self.private_tmpfs)]
        return [*steps, ("loopback up", self.loopback_up), ("hostname, capabilities", self.set_identity)]

    def enter_steps(self, mount_fd: int) -> list[tuple[str, Callable[[], None]]]:
        steps = [("clone the sandbox tree", lambda: self.clone_tree(mount_fd))]
        if self.rootfs:
            steps += [("attach tree, chroot", self.enter_rootfs), ("mount proc", self.mount_proc)]
            return [*steps, ("minimal /dev", self.minimal_dev), ("private tmpfs", self.private_tmpfs)]
        return [*steps, ("attach tree", self.attach_tree)]

    def prepare(self) -> None:
        for _, step in self.prepare_steps():
            step()

    def enter(self, mount_fd: int) -> None:
        for _, step in self.enter_steps(mount_fd):
            step()

    def unshare(self) -> None:
        linux.unshare(linux.CLONE_NEWNS | linux.CLONE_NEWNET | linux.CLONE_NEWIPC | linux.CLONE_NEWUTS)
        linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)

    def clone_devices(self) -> None:
        """Detached copies of the harmless devices, taken before the host turns read-only."""
        self._device_trees = [(name, linux.open_tree_path(f"/dev/{name}")) for name in self.devices]
        self._visible_trees = [(path, linux.open_tree_path(path)) for path in self.visible if os.path.isdir(path)]

    def host_read_only(self) -> None:
        linux.set_recursive_readonly("/")

    def mount_proc(self) -> None:
        """A proc of this PID namespace only: the host's would show host processes, and its
        ``/proc/<pid>/root`` links lead into their (writable) mount namespace."""
        if os.path.isdir("/proc"):
            linux.mount("proc", "/proc", "proc", PROC_FLAGS)

    def minimal_dev(self) -> None:
        """A /dev holding only harmless devices: no disk of the host can be opened from inside."""
        linux.mount("tmpfs", "/dev", "tmpfs", linux.MS_NOSUID, "mode=755")
        for name, tree in self._device_trees:
            with open(f"/dev/{name}", "w"):
                pass
            linux.move_mount(tree, f"/dev/{name}")
            os.close(tree)
            # The clone is the host's own device inode: read-only, so a command's chmod, chown or touch cannot
            # change the host's /dev/null (reading and writing the device still work: a read-only mount does
            # not refuse I/O to device files).
            linux.set_recursive_readonly(f"/dev/{name}")
        os.mkdir("/dev/shm", 0o1777)
        linux.mount("tmpfs", "/dev/shm", "tmpfs", TMPFS_FLAGS, "mode=1777")
        for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1")):
            os.symlink(target, f"/dev/{name}")
        os.symlink("/proc/self/fd/2", "/dev/stderr")

    def private_tmpfs(self) -> None:
        for path in self.private_dirs:
            if os.path.isdir(path):
                linux.mount("tmpfs", path, "tmpfs", TMPFS_FLAGS, "mode=1777")
        for path, tree in self._visible_trees:  # back over the fresh tmpfs, where they were, read-only
            os.makedirs(path, exist_ok=True)
            linux.move_mount(tree, path)
            os.close(tree)
            linux.set_recursive_readonly(path)
        self._visible_trees = []
        if not self.rootfs:
            os.makedirs(self.base, exist_ok=True)  # the base may sit under a private tmpfs now

    def loopback_up(self) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            fcntl.ioctl(probe, _SIOCSIFFLAGS, _LOOPBACK_UP)

    def set_identity(self) -> None:
        """The hostname, then the capabilities bash will not get: dropping them from the bounding set limits
        what the next exec grants, while this process keeps its own, which ``enter`` still needs."""
        socket.sethostname(self.hostname)
        linux.drop_bounding_capabilities()

    def clone_tree(self, mount_fd: int) -> None:
        self._tree = linux.open_tree_clone(mount_fd)

    def enter_rootfs(self) -> None:
        linux.move_mount(self._tree, self.base)
        os.close(self._tree)
        os.chroot(self.base)
        os.chdir("/")

    def attach_tree(self) -> None:
        linux.move_mount(self._tree, self.base)
        os.close(self._tree)
        os.chdir(self.base)


# ---------------------------------------------------------------------------------------- the loop


class _Child:
    """A forked child of the zygote: a spare waiting for its command, then the command itself."""

    __slots__ = ("channel", "pid", "pidfd", "reply", "waiting")

    def __init__(self, pid: int, pidfd: int, channel: socket.socket) -> None:
        self.pid = pid
        self.pidfd = pidfd
        self.channel = channel  # the zygote's end; the command arrives through it
        self.reply: socket.socket | None = None  # the main's reply socket, once it runs a command
        self.waiting = False  # a warm shell whose tree is not attached yet: its reply socket is polled


class Server:
    """The zygote's loop: hand each requested command to a spare, report its exit, keep spares ready."""

    def __init__(self, control: socket.socket, confinement: dict[str, object]) -> None:
        self.control = control
        self.confinement = confinement
        self.own_pid_namespace = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        self.own_mount_namespace = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        self.attaching: dict[int, _Child] = {}  # warm shells by the descriptor of their reply socket
        self.alive, self.keep_alive = os.pipe()  # children watch ``alive``: its end of file means we are gone
        self.poller = select.poll()
        self.poller.register(control, select.POLLIN)
        self.buffer = bytearray(MAX_REQUEST)
        self.spares: list[_Child] = []
        self.children: dict[int, _Child] = {}  # by pidfd: spares and running commands
        self.running = 0
        self.make_spares = True

    def loop(self) -> None:
        while True:
            events = self.poller.poll(0 if self.wants_spare() else None)
            if not events:  # nothing to answer: get a spare ready for a next command
                try:
                    self.spares.append(self.fork())
                except OSError:
                    self.make_spares = False  # retried after the next request
                continue
            for fd, _ in events:
                if fd in self.attaching:
                    self.attach(self.attaching[fd])
                elif fd != self.control.fileno():
                    self.reap(self.children.pop(fd))
                elif not self.request():
                    return

    def wants_spare(self) -> bool:
        """Refill at once when no spare is left; otherwise only while no command runs, because a fork and a
        spare's setup running next to a command slow it down (on a small machine, by as much as they cost)."""
        if not self.make_spares or len(self.spares) >= SPARES:
            return False
        return not self.spares or not self.running

    def fork(self) -> _Child:
        """A new child, PID 1 of a new PID namespace, which confines itself and then waits for its command."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            linux.unshare(linux.CLONE_NEWPID)  # for our next child only
            try:
                pid = os.fork()
            except BaseException:
                linux.setns(self.own_pid_namespace, linux.CLONE_NEWPID)
                raise
            if pid == 0:
                _serve_one(theirs, self.confinement, self.alive)
            linux.setns(self.own_pid_namespace, linux.CLONE_NEWPID)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        child = _Child(pid, os.pidfd_open(pid), mine)
        self.children[child.pidfd] = child
        self.poller.register(child.pidfd, select.POLLIN)
        return child

    def request(self) -> bool:
        data, fds = receive(self.control, self.buffer, 3)
        if not data:
            return False  # the main process closed the zygote, or died
        self.make_spares = True
        if len(fds) != 3:
            for fd in fds:
                os.close(fd)
            return True
        reply = socket.socket(fileno=fds[0])
        try:
            child = self.spares.pop(0) if self.spares else self.fork()
        except Exception as error:  # reported to the main process, which raises it
            os.close(fds[1])
            os.close(fds[2])
            _reply_and_close(reply, message(error=f"cannot start the command: {error}"))
            return True
        child.reply = reply
        self.running += 1
        if request_header(data).get("warm"):
            child.waiting = True
            self.attaching[reply.fileno()] = child
            self.poller.register(reply, select.POLLIN)
        try:
            # The pidfd first: the woken child may take this CPU until its command ends.
            send(reply, message(pid=child.pid), [child.pidfd])
            send(child.channel, data, fds)
        except OSError as error:
            _send_quietly(reply, message(error=f"cannot start the command: {error}"))
            signal.pidfd_send_signal(child.pidfd, signal.SIGKILL)  # its exit is reported as usual
        finally:
            os.close(fds[1])
            os.close(fds[2])
        return True

    def attach(self, child: _Child) -> None:
        """A warm shell's tree arrives (or its main side went away): attach it where a cold command gets it, in
        the shell's own mount namespace, entered for that alone. One attach per shell."""
        reply = child.reply
        assert reply is not None
        self.stop_waiting(child)
        try:
            data, fds = receive(reply, self.buffer, 1)
        except OSError:
            return
        if not data or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            return  # closed without a tree: the main side kills the shell
        try:
            self.attach_tree(child, fds[0])
        except OSError as error:
            _send_quietly(reply, message(error=f"cannot attach the sandbox tree: {error}"))
        else:
            _send_quietly(reply, message(attached=True))
        finally:
            os.close(fds[0])

    def attach_tree(self, child: _Child, mount_fd: int) -> None:
        if self.confinement.get("rootfs"):
            raise OSError("a shell over a root filesystem cannot be started before its tree")
        linux.setns(child.pidfd, linux.CLONE_NEWNS)
        try:
            tree = linux.open_tree_clone(mount_fd)
            try:
                linux.move_mount(tree, str(self.confinement["base"]))
            finally:
                os.close(tree)
        finally:
            try:
                linux.setns(self.own_mount_namespace, linux.CLONE_NEWNS)
            except OSError:
                os._exit(EXIT_FAILED)  # never serve on from inside a sandbox's mount namespace
            os.chdir("/")

    def stop_waiting(self, child: _Child) -> None:
        if child.waiting and child.reply is not None:
            child.waiting = False
            self.attaching.pop(child.reply.fileno(), None)
            self.poller.unregister(child.reply)

    def reap(self, child: _Child) -> None:
        self.stop_waiting(child)
        self.poller.unregister(child.pidfd)
        _, status = os.waitpid(child.pid, 0)
        os.close(child.pidfd)
        child.channel.close()
        if child in self.spares:  # killed while it waited: make no more until the next request
            self.spares.remove(child)
            self.make_spares = False
        if child.reply is not None:
            self.running -= 1
            _reply_and_close(child.reply, message(exited=os.waitstatus_to_exitcode(status)))


def serve(control_fd: int, confinement: str) -> None:
    """The zygote's entry point: serve the main process until it closes the control socket."""
    Server(socket.socket(fileno=control_fd), json.loads(confinement)).loop()


def _send_quietly(reply: socket.socket, data: bytes) -> None:
    try:
        send(reply, data)
    except OSError:
        pass  # the main process gave up on this command


def _reply_and_close(reply: socket.socket, data: bytes) -> None:
    _send_quietly(reply, data)
    reply.close()


def _moved_up(fd: int) -> int:
    """``fd`` moved to a number >= 10 (close-on-exec), its old number closed."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return moved


def _default_signals() -> None:
    """Every signal at its default disposition and none blocked, as in a fresh process: what the command gets
    must not depend on what the main process (or a library in it) ignored or blocked when the zygote started."""
    linux.default_signal_dispositions()
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _serve_one(channel: socket.socket, confinement: dict[str, object], alive: int) -> NoReturn:
    """In a forked child, PID 1 of its new PID namespace: confine, wait for one command, exec it. Never returns."""
    reply_fd = -1
    last_pid = -1
    try:
        keep = sorted({channel.fileno(), alive})
        os.closerange(3, keep[0])  # the zygote's other descriptors: other children's channels, replies...
        os.closerange(keep[0] + 1, keep[1])
        os.closerange(keep[1] + 1, 1 << 20)
        linux.set_parent_death_signal(signal.SIGKILL)
        if select.select([alive], [], [], 0)[0]:
            os._exit(EXIT_FAILED)  # the zygote died before the line above
        os.close(alive)
        os.setsid()
        try:
            # Opened while the host's /proc is still writable; a write resolves the PID namespace of the writer.
            last_pid = os.open("/proc/sys/kernel/ns_last_pid", os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            last_pid = -1  # reported below if a command asks for it
        confiner = Confiner(**confinement)  # type: ignore[arg-type]
        failure: BaseException | None = None
        try:
            confiner.prepare()
        except Exception as error:  # reported with the command it fails
            failure = error
        data, fds = receive(channel, bytearray(MAX_REQUEST), 3)
        if not data or len(fds) != 3:
            os._exit(EXIT_FAILED)  # the zygote discarded this spare
        reply_fd, output_fd, mount_fd = fds
        if failure is not None:
            raise failure
        argv, env, header = decode_request(data)
        warm = bool(header.get("warm"))
        if warm:  # out of the way of the descriptors the warm shell gets at 3 and 4
            reply_fd, output_fd, mount_fd = (_moved_up(fd) for fd in (reply_fd, output_fd, mount_fd))
            if last_pid >= 0:
                last_pid = _moved_up(last_pid)
        if header.get("terminal"):
            os.dup2(output_fd, 0)
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # we lead a new session: the pty becomes its terminal
        else:
            os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
        os.dup2(output_fd, 1)
        os.dup2(output_fd, 2)
        wanted = header.get("last_pid")
        if isinstance(wanted, int) and wanted > 1:
            if last_pid < 0:
                raise OSError("cannot set the next PID of the namespace: /proc/sys/kernel/ns_last_pid is not writable")
            os.write(last_pid, str(wanted).encode())
        if warm:
            if confiner.rootfs or last_pid < 0:
                raise OSError("a warm shell needs a host tree and a writable ns_last_pid")
            os.chdir("/")  # the tree is attached later; the boot script changes into it
            channel.close()
            os.dup2(mount_fd, WARM_BOOT_FD)  # mount_fd is the boot pipe here
            os.dup2(last_pid, WARM_LAST_PID_FD)
        else:
            confiner.enter(mount_fd)
        _default_signals()
        os.execve(argv[0], argv, env)
    except BaseException as error:  # the child must never return into the zygote's loop
        if reply_fd >= 0:
            try:
                os.write(reply_fd, message(error=f"{type(error).__name__}: {error}"))
            except BaseException:
                pass
    finally:
        os._exit(EXIT_FAILED)
