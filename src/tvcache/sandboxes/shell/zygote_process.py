"""The code that runs inside the zygote process and its children (see ``zygote`` for the why and the protocol).

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
import stat
import struct
import termios

from . import linux
from .cgroups import LimitWatch, TreeCgroup

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import NoReturn

SPARES = 2  # confined children kept ready; more concurrent commands fork theirs on demand
BUSY_RETRY_SECONDS = 0.05  # how soon an idle zygote tries again to remove a cgroup the kernel still held
MAX_REQUEST = 1 << 20  # argv strings are limited to 128 KiB each by the kernel; a packet to ~208 KiB by default
MAX_REPLY = 1 << 16
EXIT_FAILED = 127
FD_BYTES = array.array("i").itemsize
# A warm shell's two extra descriptors, closed by its boot script before any command runs: the pipe its state
# arrives on, and the namespace's ns_last_pid (opened while /proc was writable), to number its PIDs on from.
# What covers the memory of a sandbox's PID 1 (bash, for a persistent shell: the driver's ground truth, read from
# outside by ``bash_observer``): its own environ, read-only.
HIDDEN_MEMORY = ("/proc/1/mem", "/proc/1/task/1/mem")
WARM_BOOT_FD = 3
WARM_LAST_PID_FD = 4
_SIOCSIFFLAGS = 0x8914
_LOOPBACK_UP = struct.pack("16sH14s", b"lo", 0x1, b"")  # IFF_UP
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


def loopback_up() -> None:
    """Bring up the loopback of this process's network namespace (a new one has it down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        fcntl.ioctl(probe, _SIOCSIFFLAGS, _LOOPBACK_UP)


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


class HostRoot:
    """The host paths a zygote's commands see, gathered once per zygote (per command, that cost a spare
    ~1 ms): a detached copy of the commands' new root, read-only, with the host paths bound in and the mount
    points of the rest made, and detached copies of the visible host paths under the private dirs (they go over
    each command's fresh tmpfs). Each command clones them, a few system calls whatever their number. The
    root's tmpfs (mount points and symlinks only) is one for all commands, read-only in each."""

    def __init__(self, root: int, private: list[tuple[str, int]]) -> None:
        self.root = root
        self.private = private

    def fds(self) -> list[int]:
        return [self.root, *(tree for _, tree in self.private)]

    @classmethod
    def build(cls, confiner: Confiner) -> HostRoot:
        """Built in the zygote's own mount namespace, which it enters for good (a slave of the host's: nothing
        mounted here reaches the host): a tmpfs stacked over ``/`` and entered, where the host paths (cloned
        before) are attached relative to it, copied, and detached again. Commands clone the copies before they
        leave this namespace: the kernel clones a detached mount only in the namespace it was made in."""
        linux.unshare(linux.CLONE_NEWNS)
        linux.mount(None, "/", None, linux.MS_REC | linux.MS_SLAVE)
        trees: list[tuple[str, int]] = []
        private: list[tuple[str, int]] = []
        try:
            for path in (*confiner.system, *confiner.visible):
                tree = linux.open_tree_recursive(path)
                linux.set_tree_attributes(tree, linux.VIEW_ATTRIBUTES)
                under = any(_below(path, top) for top in confiner.private_dirs)
                (private if under else trees).append((path, tree))
            _enter_small_root()
            try:
                make_mount_points(confiner, {path: stat.S_ISDIR(os.fstat(tree).st_mode) for path, tree in trees})
                for path, tree in trees:
                    _attach(tree, path)
                trees = []
                linux.set_mount_attributes(".", linux.VIEW_ATTRIBUTES)
                return cls(linux.open_tree_recursive("."), private)
            finally:
                linux.detach_mount(".")
                os.chdir("/")
        except BaseException:
            for _, tree in (*trees, *private):
                os.close(tree)
            raise


class Confiner:
    """The steps that confine a command, run by its own process: PID 1 of a new PID namespace.

    ``prepare`` runs before the command is known (in a spare, ahead of time); ``enter`` attaches the sandbox's
    tree once it is. Both are lists of named steps, so that ``tvcache bench shell`` can time each one.

    The command gets a root of its own (``host_view`` says what is in it): a clone of the zygote's ``HostRoot``,
    stacked over ``/`` and pivoted into; the host's root is detached. Over a root filesystem (``rootfs``) the
    root is the sandbox's own tree, chrooted into at ``enter`` from an empty root (``empty_root``).
    """

    def __init__(
        self,
        *,
        base: str,
        rootfs: bool,
        private_dirs: Sequence[str],
        devices: Sequence[str],
        hostname: str,
        system: Sequence[str] = (),
        visible: Sequence[str] = (),
        links: Sequence[Sequence[str]] = (),
        tmpfs_size: str | None = None,
    ) -> None:
        self.base = base
        self.rootfs = rootfs
        self.private_dirs = list(private_dirs)
        self.devices = list(devices)
        self.hostname = hostname
        self.system = [] if rootfs else list(system)
        self.visible = [] if rootfs else list(visible)
        self.links = [] if rootfs else [(str(path), str(target)) for path, target in links]
        self.tmpfs_size = tmpfs_size
        self._private_tmpfs: PrivateTmpfs | None = None  # from minimal_dev to private_tmpfs
        self.host_root: HostRoot | str | None = None  # set by the zygote (a string: why it could not be built)
        self._device_trees: list[tuple[str, int]] = []
        self._private_trees: list[tuple[str, int]] = []
        self._root = -1
        self._tree = -1
        self._null = -1

    def prepare_steps(self) -> list[tuple[str, Callable[[], None]]]:
        steps: list[tuple[str, Callable[[], None]]] = []
        if not self.rootfs and self.host_root is None:  # outside a zygote (``tvcache bench shell``)
            steps.append(("view of the host (once per zygote)", self.build_host_root))
        if not self.rootfs:
            steps.append(("clone the new root", self.clone_root))
        steps += [("unshare mount/net/ipc/uts", self.unshare), ("clone devices", self.clone_devices)]
        if not self.rootfs:
            steps += [("attach the new root", self.attach_root), ("pivot root", _pivot_here)]
            steps += [("minimal /dev", self.minimal_dev), ("private tmpfs", self.private_tmpfs)]
            steps += [("mount proc", self.mount_proc)]
        else:
            steps += [("new root, empty", self.empty_root), ("pivot root", _pivot_here)]
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

    def build_host_root(self) -> None:
        """What a zygote does once, for a confiner used alone (this process enters a mount namespace of its own)."""
        self.host_root = HostRoot.build(self)

    def clone_root(self) -> None:
        """Copies of the zygote's new root and visible paths under the private dirs, taken in its namespace."""
        if not isinstance(self.host_root, HostRoot):
            raise OSError(f"cannot build the sandbox's view of the host: {self.host_root or 'not built'}")
        self._root = linux.clone_tree_recursive(self.host_root.root)
        self._private_trees = [(path, linux.clone_tree_recursive(tree)) for path, tree in self.host_root.private]

    def clone_devices(self) -> None:
        """Detached copies of the harmless devices, taken while the host's /dev is still there, and /dev/null
        opened (a command's stdin, taken before a root filesystem's /dev is there)."""
        self._device_trees = [(name, linux.open_tree_path(f"/dev/{name}")) for name in self.devices]
        self._null = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)

    def null_input(self) -> int:
        return self._null if self._null >= 0 else os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)

    def attach_root(self) -> None:
        """The new root stacked over ``/``, and entered."""
        try:
            linux.move_mount(self._root, "/")
            os.fchdir(self._root)
        finally:
            os.close(self._root)

    def mount_proc(self) -> None:
        """A proc of this PID namespace only: the host's would show host processes, and its
        ``/proc/<pid>/root`` links lead into their (writable) mount namespace."""
        if os.path.isdir("/proc"):
            linux.mount("proc", "/proc", "proc", PROC_FLAGS)
            # This process becomes the command (bash, for a persistent shell): its memory is the ground truth the
            # driver reads (``bash_observer``), so nothing inside may write it through /proc. Its own environ,
            # read-only, takes the place of its memory file.
            for path in HIDDEN_MEMORY:
                linux.mount("/proc/1/environ", path, None, linux.MS_BIND)
                linux.mount(None, path, None, linux.MS_BIND | linux.MS_REMOUNT | linux.MS_RDONLY)

    def minimal_dev(self) -> None:
        """A /dev holding only harmless devices: no disk of the host can be opened from inside. It is a directory
        of the private tmpfs (``PrivateTmpfs``), as ``/dev/shm`` and the private dirs will be."""
        private = [path for path in self.private_dirs if os.path.isdir(path)]
        self._private_tmpfs = PrivateTmpfs(["/dev/shm", *private], self.tmpfs_size)
        for name, tree in self._device_trees:
            with open(f"/dev/{name}", "w"):
                pass
            linux.move_mount(tree, f"/dev/{name}")
            os.close(tree)
            # The clone is the host's own device inode: read-only, so a command's chmod, chown or touch cannot
            # change the host's /dev/null (reading and writing the device still work: a read-only mount does
            # not refuse I/O to device files). The /dev tmpfs being nodev does not reach these: each device is
            # a mount of its own.
            linux.set_recursive_readonly(f"/dev/{name}")
        self._device_trees = []
        os.mkdir("/dev/shm", 0o1777)  # a private tmpfs dir (``private_tmpfs``)
        for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1")):
            os.symlink(target, f"/dev/{name}")
        os.symlink("/proc/self/fd/2", "/dev/stderr")

    def private_tmpfs(self) -> None:
        """Fresh tmpfs dirs (``PrivateTmpfs``), then the visible host paths under them, read-only where they were;
        and the mount point of the tree (the base may sit under a private tmpfs)."""
        private_tmpfs, self._private_tmpfs = self._private_tmpfs, None
        assert private_tmpfs is not None, "minimal_dev comes first"
        private_tmpfs.attach_dirs()
        for path, tree in self._private_trees:
            _attach(tree, path)
        self._private_trees = []
        if not self.rootfs:
            os.makedirs(self.base, exist_ok=True)

    def loopback_up(self) -> None:
        loopback_up()

    def set_identity(self) -> None:
        """The hostname, then the capabilities bash will not get: dropping them from the bounding set limits
        what the next exec grants, while this process keeps its own, which ``enter`` still needs."""
        socket.sethostname(self.hostname)
        linux.drop_bounding_capabilities()

    def clone_tree(self, mount_fd: int) -> None:
        self._tree = linux.open_tree_clone(mount_fd)

    def empty_root(self) -> None:
        """Over a root filesystem: a tmpfs over ``/`` holding only the tree's mount point, read-only, entered.
        Pivoted into ahead of time (detaching the host's root costs ~0.2 ms), the tree is chrooted into at
        ``enter``: the namespace then holds nothing of the host's filesystem to escape the chroot to."""
        _enter_small_root()
        os.makedirs(_here(self.base))
        linux.set_mount_attributes(".", linux.VIEW_ATTRIBUTES)

    def enter_rootfs(self) -> None:
        linux.move_mount(self._tree, self.base)
        os.close(self._tree)
        os.chroot(self.base)
        os.chdir("/")

    def attach_tree(self) -> None:
        linux.move_mount(self._tree, self.base)
        os.close(self._tree)
        os.chdir(self.base)


_ROOT_SIZE = "4m"  # the new root holds only mount points and symlinks
_ROOT_ATTRIBUTES = linux.NOSUID_NODEV


def _enter_small_root() -> None:
    """A small tmpfs (mount points and symlinks only) stacked over ``/`` and made the working directory, where
    the new root is built before the pivot."""
    root = linux.mount_tmpfs_detached(mode="0755", size=_ROOT_SIZE, attributes=_ROOT_ATTRIBUTES)
    try:
        linux.move_mount(root, "/")
        os.fchdir(root)
    finally:
        os.close(root)


class PrivateTmpfs:
    """One new tmpfs of ``size`` bytes (None: the kernel's default) for ``/dev`` (mode 755) and the private dirs
    ``paths`` (each empty, mode 1777), each a directory of it mounted at its place. One file system for them all,
    not one each: a process snapshot (CRIU) archives and unpacks each tmpfs with a tar and a gzip process of its
    own, about 3 ms apiece, and every fork pays that. CRIU also needs the file system's own root mounted: it is,
    at ``/dev``, under the directory that is ``/dev`` (``/proc/self/mountinfo`` lists two mounts there); nothing
    in the sandbox can unmount it to reach the other directories (and a hard link between two of them still
    fails: they are different mounts). ``/dev`` is attached at once, the private dirs by ``attach_dirs``."""

    def __init__(self, paths: list[str], size: str | None) -> None:
        self._paths = paths
        self._root = linux.mount_tmpfs_detached(mode="0755", size=size, attributes=linux.NOSUID_NODEV)
        try:
            for name, mode in [("dev", 0o755)] + [(str(index), 0o1777) for index in range(len(paths))]:
                os.mkdir(name, dir_fd=self._root)
                os.chmod(name, mode, dir_fd=self._root)  # mkdir's mode goes through the umask
            linux.move_mount(self._root, "/dev")
            self._attach("dev", "/dev")
        except BaseException:
            os.close(self._root)
            raise

    def attach_dirs(self) -> None:
        """The private dirs, once their mount points exist (``/dev/shm`` is made in ``/dev`` meanwhile)."""
        try:
            for index, path in enumerate(self._paths):
                self._attach(str(index), path)
        finally:
            os.close(self._root)

    def _attach(self, name: str, path: str) -> None:
        directory = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self._root)
        try:
            tree = linux.open_tree_clone(directory)
        finally:
            os.close(directory)
        try:
            linux.move_mount(tree, path)
        finally:
            os.close(tree)


def _here(path: str) -> str:
    """``path`` relative to the working directory: the new root while it is built, ``/`` after."""
    return path.lstrip("/") or "."


def _below(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _make_parents(path: str) -> None:
    parent = os.path.dirname(_here(path))
    if parent:
        os.makedirs(parent, exist_ok=True)


def make_mount_points(confiner: Confiner, host_paths: dict[str, bool]) -> None:
    """In the working directory, an empty tmpfs that becomes the new root: the host's symlinks, and the mount
    points of what is mounted there: ``host_paths`` (each a directory, True, or a file, False), ``/proc``,
    ``/dev``, the private dirs and the tree. A CRIU restore gets the same (``_criu_keeper``)."""
    for path, target in confiner.links:
        _make_parents(path)
        os.symlink(target, _here(path))
    for path, directory in host_paths.items():
        _make_mount_point(path, directory=directory)
    for path in ("/proc", "/dev", *confiner.private_dirs):
        os.makedirs(_here(path), exist_ok=True)
    if not any(_below(confiner.base, top) for top in confiner.private_dirs):
        os.makedirs(_here(confiner.base), exist_ok=True)


def _make_mount_point(path: str, *, directory: bool) -> None:
    target = _here(path)
    if not os.path.lexists(target):
        _make_parents(path)
        if directory:
            os.mkdir(target)
        else:
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))


def _attach(tree: int, path: str) -> None:
    """Attach the detached host path ``tree`` at ``path`` in the new root, making its mount point."""
    try:
        _make_mount_point(path, directory=stat.S_ISDIR(os.fstat(tree).st_mode))
        linux.move_mount(tree, _here(path))
    finally:
        os.close(tree)


def _pivot_here() -> None:
    """Make the working directory (a mount) the root, the old root detached: ``pivot_root(".", ".")`` stacks
    the old root over the new one, where it is unmounted, with everything below it."""
    linux.pivot_root(".", ".")
    linux.detach_mount(".")
    os.chdir("/")


# ---------------------------------------------------------------------------------------- the loop


class _Child:
    """A forked child of the zygote: a spare waiting for its command, then the command itself."""

    __slots__ = ("cgroup", "channel", "pid", "pidfd", "reply", "waiting")

    def __init__(self, pid: int, pidfd: int, channel: socket.socket, cgroup: TreeCgroup | None = None) -> None:
        self.cgroup = cgroup  # made for it, with the factory's limits (``cgroups``), or None: no limits
        self.pid = pid
        self.pidfd = pidfd
        self.channel = channel  # the zygote's end; the command arrives through it
        self.reply: socket.socket | None = None  # the main's reply socket, once it runs a command
        self.waiting = False  # a warm shell whose tree is not attached yet: its reply socket is polled


class Server:
    """The zygote's loop: hand each requested command to a spare, report its exit, keep spares ready."""

    def __init__(
        self, control: socket.socket, confinement: dict[str, object], cgroups: dict[str, object] | None = None
    ) -> None:
        self.control = control
        self.confinement = confinement
        # What commands see of the host (not with rootfs: their root is their tree), built once, first: it puts
        # the zygote in a mount namespace of its own.
        self.host_root: HostRoot | str | None = None
        if not confinement.get("rootfs"):
            try:
                self.host_root = HostRoot.build(Confiner(**confinement))  # type: ignore[arg-type]
            except OSError as error:  # reported by each command
                self.host_root = str(error)
        self.cgroups = cgroups  # each child's cgroup is made from it (``cgroups``); None: no limits
        self.limits = LimitWatch(self.kill_over_limit)
        self.made = 0
        self.unremoved: list[TreeCgroup] = []  # of reaped children: removed when nothing runs
        self.busy: list[TreeCgroup] = []  # not empty yet when that was tried: tried again after the next reap
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
            idle = self.wants_spare() or (self.unremoved and (not self.running or len(self.unremoved) > SPARES))
            # A cgroup still busy (its dead tasks not yet released: slow under load) is tried again soon, not
            # only when the next command ends.
            wanted = 0 if idle else (BUSY_RETRY_SECONDS if self.busy and not self.running else None)
            timeout = self.limits.timeout(wanted)
            events = self.poller.poll(None if timeout is None else timeout * 1000)
            self.limits.check()
            if not events:  # nothing to answer: get a spare ready for a next command, remove old cgroups
                if self.unremoved:
                    self.remove_cgroups()
                elif self.wants_spare():
                    try:
                        self.spares.append(self.fork())
                    except OSError:
                        self.make_spares = False  # retried after the next request
                elif self.busy and not self.running:
                    self.remove_cgroups()
                continue
            for fd, _ in events:
                if fd in self.attaching:
                    self.attach(self.attaching[fd])
                elif self.limits.owns(fd):
                    self.limits.fired(fd)
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
        self.made += 1
        # Named here, made by the child itself (``cgroups``: why), in parallel with this loop.
        group = None if self.cgroups is None else TreeCgroup.named(self.cgroups, f"{os.getpid()}-{self.made}")
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            linux.unshare(linux.CLONE_NEWPID)  # for our next child only
            try:
                pid = os.fork()
            except BaseException:
                linux.setns(self.own_pid_namespace, linux.CLONE_NEWPID)
                raise
            if pid == 0:
                _serve_one(theirs, self.confinement, self.alive, group, self.host_root)
            linux.setns(self.own_pid_namespace, linux.CLONE_NEWPID)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        child = _Child(pid, os.pidfd_open(pid), mine, group)
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
        if child.cgroup is not None:
            self.limits.watch(child, child.cgroup, self.poller)
        if request_header(data).get("warm"):
            child.waiting = True
            self.attaching[reply.fileno()] = child
            self.poller.register(reply, select.POLLIN)
        try:
            # The pidfd first: the woken child may take this CPU until its command ends.
            named = {"cgroup": child.cgroup.name} if child.cgroup is not None else {}
            send(reply, message(pid=child.pid, **named), [child.pidfd])
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
        _, status = os.waitpid(child.pid, 0)  # PID 1: everything in its namespace, and so its cgroup, is gone
        os.close(child.pidfd)
        child.channel.close()
        limit = self.limits.unwatch(child, self.poller)
        if child in self.spares:  # killed while it waited: make no more until the next request
            self.spares.remove(child)
            self.make_spares = False
        if child.reply is not None:
            self.running -= 1
            exited = {"exited": os.waitstatus_to_exitcode(status), **({"limit": limit} if limit else {})}
            _reply_and_close(child.reply, message(**exited))
        if child.cgroup is not None:  # removed once nothing runs: off the commands' path
            self.unremoved += [*self.busy, child.cgroup]
            self.busy = []

    def remove_cgroups(self) -> None:
        """Remove the cgroups of ended trees, and those the kernel still held last time; keep the ones still busy."""
        self.busy = [group for group in [*self.busy, *self.unremoved] if not group.remove(timeout=0)]
        self.unremoved = []

    def kill_over_limit(self, child: object) -> None:
        """A running child's tree hit a limit: end it now (the hit is reported with its exit)."""
        assert isinstance(child, _Child)
        try:
            signal.pidfd_send_signal(child.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def shutdown(self) -> None:
        """The main process is gone: end every child (PID 1 of its namespace) and remove their cgroups."""
        for child in list(self.children.values()):
            self.kill_over_limit(child)
        for child in list(self.children.values()):
            os.waitpid(child.pid, 0)
            if child.cgroup is not None:
                self.unremoved.append(child.cgroup)
        for group in [*self.unremoved, *self.busy]:
            group.remove()


def serve(control_fd: int, confinement: str, cgroups: str = "null") -> None:
    """The zygote's entry point: serve the main process until it closes the control socket. ``cgroups``: the
    spec of its children's cgroups (JSON, ``cgroups``), or null."""
    server = Server(socket.socket(fileno=control_fd), json.loads(confinement), json.loads(cgroups))
    server.loop()
    server.shutdown()


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


def _serve_one(
    channel: socket.socket,
    confinement: dict[str, object],
    alive: int,
    cgroup: TreeCgroup | None = None,
    host_root: HostRoot | str | None = None,
) -> NoReturn:
    """In a forked child, PID 1 of its new PID namespace: enter its cgroup, confine, wait for one command, exec
    it. Never returns."""
    reply_fd = -1
    last_pid = -1
    try:
        keep = sorted({channel.fileno(), alive, *(host_root.fds() if isinstance(host_root, HostRoot) else ())})
        # The zygote's other descriptors: other children's channels, replies...
        for low, high in zip([2, *keep], [*keep, 1 << 20], strict=True):
            os.closerange(low + 1, high)
        linux.set_parent_death_signal(signal.SIGKILL)
        if select.select([alive], [], [], 0)[0]:
            os._exit(EXIT_FAILED)  # the zygote died before the line above
        os.close(alive)
        entered: BaseException | None = None
        try:
            if cgroup is not None:  # first: whatever it starts is born in its cgroup (see ``cgroups``: why here)
                cgroup.make()
                cgroup.enter()
        except OSError as error:  # reported with the command: no command runs without its limits
            entered = OSError(f"cannot enter the sandbox's cgroup {cgroup.name if cgroup else ''}: {error}")
        os.setsid()
        try:
            # Opened while the host's /proc is still writable; a write resolves the PID namespace of the writer.
            last_pid = os.open("/proc/sys/kernel/ns_last_pid", os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            last_pid = -1  # reported below if a command asks for it
        confiner = Confiner(**confinement)  # type: ignore[arg-type]
        confiner.host_root = host_root
        failure: BaseException | None = None
        try:
            confiner.prepare()
        except Exception as error:  # reported with the command it fails
            failure = error
        data, fds = receive(channel, bytearray(MAX_REQUEST), 3)
        if not data or len(fds) != 3:
            os._exit(EXIT_FAILED)  # the zygote discarded this spare
        reply_fd, output_fd, mount_fd = fds
        failure = entered or failure
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
            os.dup2(confiner.null_input(), 0)
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
