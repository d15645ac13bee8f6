"""The *keeper* of one CRIU-restored process tree: a small process that runs ``criu restore`` and is the parent
of the tree it restores, for as long as the tree lives (see ``criu`` for the why).

It runs in a fresh ``python -I -S`` interpreter (booted like the zygote, so it loads only light modules) and
speaks the zygote's reply protocol on its channel, so the main process holds the tree through a plain
``_zygote.Spawned``: ``{"pid": N}`` with the tree root's pidfd, then ``{"exited": code}``; or ``{"error": text}``
alone when the restore fails (the text carries CRIU's log). Why a keeper rather than the main process as the
parent: the restored root keeps the parent-death signal it was dumped with (the zygote's SIGKILL), which fires
when the parent *thread* exits, and the main process starts CRIU from short-lived worker threads; and a
failed restore leaves zombies that only their parent may reap, which a busy main process cannot do safely.

The channel is its lifeline: when the main process closes it (``Spawned.close``) or dies, the keeper kills the
tree (its root is PID 1 of its namespace: everything in it dies) and exits.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import tempfile

from . import linux
from .zygote_process import message, send

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn

LOG_LINES = 25


def _children() -> list[int]:
    pids: list[int] = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as listing:
                pids += [int(pid) for pid in listing.read().split()]
        except OSError:
            pass
    return pids


def _reap_all() -> None:
    """Kill and reap every child: CRIU itself, and the tasks a failed or abandoned restore left behind (CRIU's
    ``--restore-sibling`` makes the tree's root a child of this process)."""
    for pid in _children():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _log_tail(path: str) -> str:
    try:
        with open(path, errors="replace") as log:
            lines = log.read().splitlines()
    except OSError as error:
        return f"(no CRIU log: {error})"
    errors = [line for line in lines if "Error" in line or "BUG" in line]
    return "\n".join((errors or lines)[-LOG_LINES:])


def _attach_tree(mount_fd: int, scratch: str) -> str:
    """Attach the sandbox's (detached) tree in a mount namespace of this process only, where CRIU restoring it
    as an external mount can bind it from: nothing is ever attached in the caller's namespace. A clone is
    attached: attaching the caller's own detached mount would use it up (the descriptor is shared with the
    caller, whose sandbox attaches it again for its next shell, or a restore after its next snapshot)."""
    linux.unshare(linux.CLONE_NEWNS)
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    target = tempfile.mkdtemp(prefix="tree-", dir=scratch)
    clone = linux.open_tree_clone(mount_fd)
    os.close(mount_fd)
    try:
        linux.move_mount(clone, target)
    finally:
        os.close(clone)
    return target


def _run_criu(channel: socket.socket, argv: list[str], keep: list[int]) -> int | None:
    """Run CRIU with only ``keep`` (and stdio) open; its exit code, or None when the channel closed first."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child execs at once
        try:
            for fd in keep:
                os.set_inheritable(fd, True)
            os.execv(argv[0], argv)
        finally:
            os._exit(127)
    pidfd = os.pidfd_open(pid)
    try:
        while True:
            ready, _, _ = select.select([channel, pidfd], [], [])
            if channel in ready:
                return None
            if pidfd in ready:
                _, status = os.waitpid(pid, 0)
                return os.waitstatus_to_exitcode(status)
    finally:
        os.close(pidfd)


def _set_last_pid(pid: int, last_pid: int) -> None:
    """Set ``ns_last_pid`` of the PID namespace ``pid`` leads. The value a write sets is that of the *writer's*
    namespace, so a child of this process enters it (``setns`` moves only the children of the caller) and a
    grandchild, born there, writes it. A failure is reported: the restored copy would number processes
    differently from the original."""
    namespace = os.open(f"/proc/{pid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            linux.setns(namespace, linux.CLONE_NEWPID)
            inner = os.fork()
            if inner == 0:
                try:
                    fd = os.open("/proc/sys/kernel/ns_last_pid", os.O_WRONLY)
                    os.write(fd, str(last_pid).encode())
                    os._exit(0)
                finally:
                    os._exit(1)
            _, status = os.waitpid(inner, 0)
            code = os.waitstatus_to_exitcode(status)
        finally:
            os._exit(code)
    os.close(namespace)
    _, status = os.waitpid(child, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise OSError(f"cannot set the last PID of the restored tree's namespace to {last_pid}")


def _keep(channel: socket.socket, pid: int) -> None:
    """Report the restored root, then wait for its end or for the main process to let go of it."""
    pidfd = os.pidfd_open(pid)
    send(channel, message(pid=pid), [pidfd])
    ready, _, _ = select.select([channel, pidfd], [], [])
    if pidfd not in ready:  # the main process closed the channel, or died
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    try:
        send(channel, message(exited=os.waitstatus_to_exitcode(status)))
    except OSError:
        pass  # nobody listens any more


def serve(channel_fd: int, request: str) -> NoReturn:
    """The keeper's entry point. ``request``: JSON with ``argv`` (CRIU's, without the attach mapping),
    ``pidfile``, ``log``, ``scratch``, ``mount_fd`` (or null), ``inherit`` (descriptors CRIU keeps) and
    ``last_pid`` (or null: see ``_set_last_pid``)."""
    channel = socket.socket(fileno=channel_fd)
    os.set_inheritable(channel_fd, False)
    spec = json.loads(request)
    attached: str | None = None
    try:
        argv = list(spec["argv"])
        if spec["mount_fd"] is not None:
            attached = _attach_tree(spec["mount_fd"], spec["scratch"])
            argv += ["--external", f"mnt[{spec['tree_key']}]:{attached}"]
        code = _run_criu(channel, argv, spec["inherit"])
        for fd in spec["inherit"]:
            os.close(fd)
        _detach(attached)  # the restored tree has its own copy of the mount now
        attached = None
        if code is None:
            _reap_all()
        elif code != 0:
            _reap_all()
            send(channel, message(error=f"criu restore failed (exit {code}):\n{_log_tail(spec['log'])}"))
        else:
            with open(spec["pidfile"]) as pidfile:
                pid = int(pidfile.read().strip())
            if spec.get("last_pid") is not None:
                _set_last_pid(pid, int(spec["last_pid"]))
            _keep(channel, pid)
    except BaseException as error:  # reported; the keeper must never leave a tree behind
        _reap_all()
        try:
            send(channel, message(error=f"criu restore failed: {type(error).__name__}: {error}"))
        except OSError:
            pass
    finally:
        _detach(attached)
        os._exit(0)


def _detach(attached: str | None) -> None:
    if attached is not None:
        try:
            linux.umount(attached, 2)  # MNT_DETACH; the namespace goes with this process anyway
            os.rmdir(attached)
        except OSError:
            pass
