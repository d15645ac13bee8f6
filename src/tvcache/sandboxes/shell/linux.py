"""Thin ctypes wrappers over the Linux calls the shell sandbox needs (x86_64 and aarch64 share these numbers).

The new mount API builds overlays as *detached* mounts (``fsopen``/``fsconfig``/``fsmount``): they are never
attached in the host's mount namespace, so a crash cannot leave a mount behind — the kernel drops a detached
mount with the last file descriptor that refers to it. ``lowerdir+`` takes one layer per call, so stacks of
hundreds of layers never hit the one-page limit of a mount option string.
"""

from __future__ import annotations

import ctypes
import os

__all__ = [
    "CAP_SYS_ADMIN",
    "CLONE_NEWIPC",
    "CLONE_NEWNET",
    "CLONE_NEWNS",
    "CLONE_NEWPID",
    "CLONE_NEWUTS",
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
MOUNT_ATTR_NODEV = 4

PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
CAP_SYS_ADMIN = 21
# Capabilities a sandboxed command could use to undo its confinement or reach past it.
# dac_read_search (open_by_handle_at reaches host files hidden under the private mounts), sys_admin, sys_module,
# sys_rawio, sys_chroot, sys_boot, sys_time, mknod, perfmon, bpf
CONFINING_CAPS = (2, CAP_SYS_ADMIN, 16, 17, 18, 22, 25, 27, 38, 39)


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
        # from inside the sandbox; commands get their devices from the sandbox's own /dev.
        return _check(_syscall(SYS_FSMOUNT, fs_fd, FSMOUNT_CLOEXEC, MOUNT_ATTR_NODEV), "fsmount overlay")
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


def drop_bounding_capabilities(caps: tuple[int, ...] = CONFINING_CAPS) -> None:
    for cap in caps:
        _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")
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
