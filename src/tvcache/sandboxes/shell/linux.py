"""Thin ctypes wrappers over the Linux calls the shell sandbox needs (x86_64 and aarch64 share these numbers).

The new mount API builds overlays as *detached* mounts (``fsopen``/``fsconfig``/``fsmount``): they are never
attached in the host's mount namespace, so a crash cannot leave a mount behind — the kernel drops a detached
mount with the last file descriptor that refers to it. ``lowerdir+`` takes one layer per call, so stacks of
hundreds of layers never hit the one-page limit of a mount option string.
"""

from __future__ import annotations

import ctypes
import errno
import os

__all__ = [
    "CAP_CHECKPOINT_RESTORE",
    "CAP_SYS_ADMIN",
    "CLONE_NEWIPC",
    "CLONE_NEWNET",
    "CLONE_NEWNS",
    "CLONE_NEWPID",
    "CLONE_NEWUTS",
    "KEPT_CAPABILITIES",
    "KEPT_CAPABILITY_MASK",
    "KEPT_CAPABILITY_NUMBERS",
    "LinuxError",
    "default_signal_dispositions",
    "drop_bounding_capabilities",
    "mount",
    "mount_overlay",
    "move_mount",
    "open_tree_clone",
    "open_tree_path",
    "set_parent_death_signal",
    "set_recursive_readonly",
    "setns",
    "umount",
    "unshare",
]

# The C library this interpreter is linked with (dlopen(NULL)); ctypes.util.find_library would run ldconfig, and
# would weigh down the zygote process (see zygote_process), which imports this module.
_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long

# rt_sigaction is one of the few calls whose number differs between the two architectures.
SYS_RT_SIGACTION = 134 if os.uname().machine == "aarch64" else 13
SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
SYS_FSOPEN = 430
SYS_FSCONFIG = 431
SYS_FSMOUNT = 432
SYS_MOUNT_SETATTR = 442

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18

AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC
MOVE_MOUNT_F_EMPTY_PATH = 0x4
FSOPEN_CLOEXEC = 1
FSMOUNT_CLOEXEC = 1
FSCONFIG_SET_FLAG = 0
FSCONFIG_SET_STRING = 1
FSCONFIG_CMD_CREATE = 6
MOUNT_ATTR_RDONLY = 1
MOUNT_ATTR_NOSUID = 2
MOUNT_ATTR_NODEV = 4

PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
CAP_SYS_ADMIN = 21
CAP_CHECKPOINT_RESTORE = 40
# The only capabilities a sandboxed command keeps (an allowlist: every other one, up to the kernel's last, is
# dropped, so a capability a newer kernel adds is never granted by default). What a root shell needs to work on
# its own tree: Docker's default set, less MKNOD (its /dev is ours), SYS_CHROOT (a root filesystem is entered by
# chroot, and a second chroot escapes the first, to the host's tree in the sandbox's mount namespace) and, by
# being an allowlist, less everything that reaches the host: SYSLOG (the kernel log), SYS_NICE (real-time
# scheduling), SYS_PTRACE, NET_ADMIN, SYS_RESOURCE, IPC_LOCK, LEASE, WAKE_ALARM, BLOCK_SUSPEND, AUDIT_CONTROL,
# MAC_*, DAC_READ_SEARCH (open_by_handle_at reaches host files hidden under the private mounts), SYS_ADMIN,
# SYS_MODULE, SYS_RAWIO, SYS_BOOT, SYS_TIME, PERFMON, BPF...
# CHECKPOINT_RESTORE is kept for warm persistent shells alone (``warm``): their bash sets its namespace's next
# PID itself, by writing ns_last_pid once it knows the snapshot it stands in for, and the kernel checks the
# writer's CHECKPOINT_RESTORE (or SYS_ADMIN) at that write. It reaches nothing outside the sandbox's own PID
# namespace (next PIDs, clone3 set_tid, /proc/<pid>/map_files of its own processes); drop it here when warm
# shells get their next PID another way.
KEPT_CAPABILITIES: dict[str, int] = {
    "CAP_CHOWN": 0,
    "CAP_DAC_OVERRIDE": 1,
    "CAP_FOWNER": 3,
    "CAP_FSETID": 4,
    "CAP_KILL": 5,
    "CAP_SETGID": 6,
    "CAP_SETUID": 7,
    "CAP_SETPCAP": 8,
    "CAP_NET_BIND_SERVICE": 10,
    "CAP_NET_RAW": 13,
    "CAP_AUDIT_WRITE": 29,
    "CAP_SETFCAP": 31,
    "CAP_CHECKPOINT_RESTORE": CAP_CHECKPOINT_RESTORE,
}
KEPT_CAPABILITY_NUMBERS = frozenset(KEPT_CAPABILITIES.values())
KEPT_CAPABILITY_MASK = sum(1 << number for number in KEPT_CAPABILITY_NUMBERS)


class LinuxError(OSError):
    """A Linux call failed; ``errno`` and the call are in the message."""


def _check(result: int, what: str) -> int:
    if result < 0:
        error = ctypes.get_errno()
        raise LinuxError(error, f"{what}: {os.strerror(error)}")
    return result


def _path(value: str | bytes | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return os.fsencode(value)


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def setns(fd: int, nstype: int) -> None:
    """Move this process into the namespace ``fd`` refers to (for PID namespaces: its future children)."""
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


def set_parent_death_signal(signal: int) -> None:
    """Have the kernel send ``signal`` to this process when the thread that forked it exits."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal, 0, 0, 0), "prctl PR_SET_PDEATHSIG")


def mount(
    source: str | bytes | None,
    target: str | bytes,
    fstype: str | bytes | None,
    flags: int,
    data: str | bytes | None = None,
) -> None:
    _check(
        _libc.mount(_path(source), _path(target), _path(fstype), ctypes.c_ulong(flags), _path(data)),
        f"mount {target!r}",
    )


def mount_overlay(lowers: list[str], upper: str, work: str) -> int:
    """A detached overlay mount of ``lowers`` (top first) with a writable ``upper``; returns its fd."""
    fs_fd = _check(_syscall(SYS_FSOPEN, b"overlay", FSOPEN_CLOEXEC), "fsopen overlay")
    try:
        for lower in lowers:
            _fsconfig_string(fs_fd, b"lowerdir+", lower)
        _fsconfig_string(fs_fd, b"upperdir", upper)
        _fsconfig_string(fs_fd, b"workdir", work)
        # Renaming a directory that lies in a lower layer fails with EXDEV unless overlay may record the move as
        # a redirect; without it, a directory the rollout made could be renamed (git mv) until a snapshot froze
        # it, and not after: cached and uncached runs would differ.
        _fsconfig_string(fs_fd, b"redirect_dir", "on")
        _check(_syscall(SYS_FSCONFIG, fs_fd, FSCONFIG_CMD_CREATE, None, None, 0), "fsconfig create overlay")
        # nodev: a device node in a layer (a forged published blob, or a base tree's stray one) cannot be opened
        # from inside the sandbox; commands get their devices from the sandbox's own /dev. nosuid: a setuid or
        # setgid file (or one with file capabilities) a command made, or a layer brought, grants nothing when run
        # from the tree, whoever runs it.
        attributes = MOUNT_ATTR_NODEV | MOUNT_ATTR_NOSUID
        return _check(_syscall(SYS_FSMOUNT, fs_fd, FSMOUNT_CLOEXEC, attributes), "fsmount overlay")
    finally:
        os.close(fs_fd)


def _fsconfig_string(fs_fd: int, key: bytes, value: str) -> None:
    _check(_syscall(SYS_FSCONFIG, fs_fd, FSCONFIG_SET_STRING, key, os.fsencode(value), 0), f"fsconfig {key!r}")


def open_tree_clone(fd: int) -> int:
    """A new detached copy of the mount referred to by ``fd`` (for attaching in another namespace)."""
    flags = OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_EMPTY_PATH
    return _check(_syscall(SYS_OPEN_TREE, fd, b"", flags), "open_tree clone")


def open_tree_path(path: str | bytes) -> int:
    """A detached bind mount of ``path`` (a file or a directory)."""
    flags = OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC
    return _check(_syscall(SYS_OPEN_TREE, AT_FDCWD, _path(path), flags), f"open_tree {path!r}")


def umount(target: str | bytes, flags: int = 0) -> None:
    _check(_libc.umount2(_path(target), ctypes.c_int(flags)), f"umount {target!r}")


def move_mount(fd: int, target: str | bytes) -> None:
    """Attach the detached mount ``fd`` at ``target``."""
    _check(
        _syscall(SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, _path(target), MOVE_MOUNT_F_EMPTY_PATH), f"move_mount {target!r}"
    )


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def set_recursive_readonly(path: str | bytes) -> None:
    attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    _check(
        _syscall(SYS_MOUNT_SETATTR, AT_FDCWD, _path(path), AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr)),
        f"mount_setattr {path!r}",
    )


def default_signal_dispositions() -> None:
    """Every catchable signal back to its default, including the two the C library keeps for itself (32, 33),
    which ``signal.signal`` cannot touch but a process may have inherited as ignored. Errors are ignored: a
    number the kernel refuses has nothing to reset."""
    action = ctypes.create_string_buffer(32)  # the kernel's sigaction, all zero: SIG_DFL, no flags, empty mask
    for number in range(1, 65):
        if number not in (9, 19):  # SIGKILL, SIGSTOP
            _syscall(SYS_RT_SIGACTION, number, action, None, 8)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_bounding_capabilities(keep: frozenset[int] = KEPT_CAPABILITY_NUMBERS) -> None:
    """Limit what the next exec grants to ``keep``: every other capability leaves the bounding set (up to the
    kernel's last: the first it calls invalid ends the loop), the inheritable and ambient sets are emptied (they
    would pass capabilities around the bounding set), and no exec may gain privileges again (setuid and file
    capabilities included). This process keeps its own effective set, which ``Confiner.enter`` still needs."""
    for cap in range(64):
        if cap in keep:
            continue
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0:
            if ctypes.get_errno() == errno.EINVAL:
                break  # past the kernel's last capability
            _check(-1, f"drop capability {cap}")
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc.capget(ctypes.byref(header), data), "capget")
    for half in data:
        half.inheritable = 0
    _check(_libc.capset(ctypes.byref(header), data), "capset (inheritable)")
    _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear the ambient capabilities")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def overlay_supported() -> bool:
    """True when this process may build overlay mounts with the new mount API (root, kernel >= 6.8)."""
    import tempfile

    if os.geteuid() != 0:
        return False
    with tempfile.TemporaryDirectory(prefix="tvcache-probe-") as scratch:
        lower, upper, work = (os.path.join(scratch, name) for name in ("l", "u", "w"))
        for directory in (lower, upper, work):
            os.mkdir(directory)
        try:
            os.close(mount_overlay([lower], upper, work))
        except OSError:
            return False
    return True


# ------------------------------------------------------------ the sandbox's own root (a minimal view of the host)
# Kept apart from the calls above: ``zygote_process.Confiner`` builds a new root of a few host paths with these,
# pivots into it and detaches the host's.

__all__ += [
    "MS_SLAVE",
    "NOSUID_NODEV",
    "VIEW_ATTRIBUTES",
    "clone_tree_recursive",
    "detach_mount",
    "mount_tmpfs_detached",
    "open_tree_recursive",
    "pivot_root",
    "set_mount_attributes",
    "set_tree_attributes",
]

SYS_PIVOT_ROOT = 41 if os.uname().machine == "aarch64" else 155  # another call whose number differs
MNT_DETACH = 2
MS_SLAVE = 1 << 19
NOSUID_NODEV = 0x2 | MOUNT_ATTR_NODEV  # MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV
# Every host path a sandbox sees: nothing written through it, no set-user-ID program, no device node.
VIEW_ATTRIBUTES = MOUNT_ATTR_RDONLY | NOSUID_NODEV


def pivot_root(new_root: str | bytes, put_old: str | bytes) -> None:
    _check(_syscall(SYS_PIVOT_ROOT, _path(new_root), _path(put_old)), f"pivot_root {new_root!r}")


def detach_mount(target: str | bytes) -> None:
    """Unmount ``target`` and everything below it, lazily (``umount2(MNT_DETACH)``)."""
    umount(target, MNT_DETACH)


def open_tree_recursive(path: str | bytes) -> int:
    """A detached recursive bind mount of ``path`` (a file or a directory, with the mounts below it)."""
    flags = OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE
    return _check(_syscall(SYS_OPEN_TREE, AT_FDCWD, _path(path), flags), f"open_tree {path!r}")


def _mount_setattr(dirfd: int, path: bytes, flags: int, attributes: int, what: str) -> None:
    attr = _MountAttr(attributes, 0, 0, 0)
    _check(_syscall(SYS_MOUNT_SETATTR, dirfd, path, flags, ctypes.byref(attr), ctypes.sizeof(attr)), what)


def set_tree_attributes(fd: int, attributes: int) -> None:
    """Set ``MOUNT_ATTR_*`` ``attributes`` on the (detached) mount ``fd`` and every mount below it."""
    _mount_setattr(fd, b"", AT_EMPTY_PATH | AT_RECURSIVE, attributes, "mount_setattr of a detached tree")


def set_mount_attributes(path: str | bytes, attributes: int) -> None:
    """Set ``MOUNT_ATTR_*`` ``attributes`` on the mount at ``path`` alone (not the mounts below it)."""
    _mount_setattr(AT_FDCWD, os.fsencode(path), 0, attributes, f"mount_setattr {path!r}")


def mount_tmpfs_detached(*, mode: str, size: str | None, attributes: int) -> int:
    """A new, detached tmpfs (``size``: a tmpfs ``size=`` value, None for the kernel's default); returns its fd."""
    fs_fd = _check(_syscall(SYS_FSOPEN, b"tmpfs", FSOPEN_CLOEXEC), "fsopen tmpfs")
    try:
        _fsconfig_string(fs_fd, b"mode", mode)
        if size is not None:
            _fsconfig_string(fs_fd, b"size", size)
        _check(_syscall(SYS_FSCONFIG, fs_fd, FSCONFIG_CMD_CREATE, None, None, 0), "fsconfig create tmpfs")
        return _check(_syscall(SYS_FSMOUNT, fs_fd, FSMOUNT_CLOEXEC, attributes), "fsmount tmpfs")
    finally:
        os.close(fs_fd)


def clone_tree_recursive(fd: int) -> int:
    """A new detached copy of the mount ``fd`` refers to and of every mount below it."""
    flags = OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_EMPTY_PATH | AT_RECURSIVE
    return _check(_syscall(SYS_OPEN_TREE, fd, b"", flags), "open_tree recursive clone")
