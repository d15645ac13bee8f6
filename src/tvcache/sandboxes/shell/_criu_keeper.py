"""The *keeper* of one CRIU-restored process tree: a small process that runs ``criu restore`` and is the parent
of the tree it restores, for as long as the tree lives (see ``criu`` for the why).

It runs in a fresh ``python -I -S`` interpreter (booted like the zygote, so it loads only light modules),
which may be started before the restore it serves (``criu.Keepers``): it waits for its request on its channel,
then speaks the zygote's reply protocol there, so the main process holds the tree through a plain
``zygote.Spawned``: ``{"pid": N}`` with the tree root's pidfd, then ``{"exited": code}``; or ``{"error": text}``
alone when the restore fails (the text carries CRIU's log). Why a keeper rather than the main process as the
parent: the restored root keeps the parent-death signal it was dumped with (the zygote's SIGKILL), which fires
when the parent *thread* exits, and the main process starts CRIU from short-lived worker threads; and a
failed restore leaves zombies that only their parent may reap, which a busy main process cannot do safely.

The channel is its lifeline: when the main process closes it (``Spawned.close``) or dies, the keeper kills the
tree (its root is PID 1 of its namespace: everything in it dies) and exits.

Limits: given a cgroup spec, the keeper makes the tree's cgroup (``cgroups``), its CRIU child enters it just
before the exec (CRIU runs with ``--manage-cgroups=ignore``, so every restored process is born there, and the
keeper itself stays out), and the keeper watches it as the zygote does its commands': at a limit hit it kills
the tree and says so in its exit (``{"exited": code, "limit": kind}``); the cgroup is removed when the tree is
gone.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import tempfile

from . import linux
from .cgroups import LimitWatch, TreeCgroup
from .zygote_process import Confiner, loopback_up, make_mount_points, message, receive, send

# A tree's network namespace that nothing in it can configure is not in its images (see ``criu``): the dump's
# CRIU ran inside it (``OWN_LOOPBACK``), and the restore's runs in the keeper's new one, which the tree gets; images
# from before were dumped with it as an external namespace (``NEW_LOOPBACK``), and the keeper hands its new one
# in under ``NETWORK_KEY``.
OWN_LOOPBACK, NEW_LOOPBACK, NETWORK_KEY = "new loopback, CRIU's own", "new loopback", "tvcache-net"

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


def _make_root(confinement: dict[str, object], scratch: str) -> str:
    """The root a restored sandbox shell runs in, in a mount namespace of this process only: a read-only tmpfs
    with the mount points and symlinks of the new root it was dumped in (``zygote_process.HostRoot``). CRIU
    takes the root as given (``--root``) and restores the tree's mounts over it (the host paths bound from the
    host's own, as external mounts); with the host's root there, a restored shell would see the whole host."""
    linux.unshare(linux.CLONE_NEWNS)
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    confiner = Confiner(**confinement)  # type: ignore[arg-type]
    hidden = confiner.private_dirs  # the mount points below them are in the tmpfs images CRIU restores
    host_paths = {
        path: os.path.isdir(path)
        for path in (*confiner.system, *confiner.visible)
        if not any(path == top or path.startswith(top + "/") for top in hidden)
    }
    target = tempfile.mkdtemp(prefix="root-", dir=scratch)
    linux.mount("tmpfs", target, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, "mode=755")
    os.chdir(target)
    try:
        make_mount_points(confiner, host_paths)
    finally:
        os.chdir("/")
    linux.set_mount_attributes(target, linux.VIEW_ATTRIBUTES)
    return target


KERNEL_DATA = "/run/criu.kdat"


def _kernel_data_on_tmpfs(kept: str) -> bytes | None:
    """CRIU probes the kernel at every start (~30 ms here: it makes a network namespace and a veth pair to
    look) unless ``/run/criu.kdat`` holds what it found before, a file it keeps only on a tmpfs, which a
    reboot clears; the host's /run need not be one. So in this process's mount namespace a tmpfs goes over
    /run (the restored tree's own /run is a private tmpfs from its image, never the host's), holding the copy
    ``kept`` for this boot and this CRIU (``criu.kernel_data_path``) when there is one: its bytes, or None."""
    linux.unshare(linux.CLONE_NEWNS)
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    linux.mount("tmpfs", "/run", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC, "mode=755")
    try:
        with open(kept, "rb") as source:
            data = source.read()
    except OSError:
        return None
    descriptor = os.open(KERNEL_DATA, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(descriptor, data)
    finally:
        os.close(descriptor)
    return data


def _keep_kernel_data(kept: str, seeded: bytes | None) -> None:
    """Keep what CRIU found about the kernel (``_kernel_data_on_tmpfs``) for the next restore, when it is not
    what this one was given (CRIU replaces a stale copy with its own probe)."""
    try:
        with open(KERNEL_DATA, "rb") as source:
            data = source.read()
        if data == seeded:
            return
        partial = f"{kept}.{os.getpid()}"
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(descriptor, data)
        finally:
            os.close(descriptor)
        os.replace(partial, kept)
    except OSError:
        pass  # the next restore probes again


def _run_criu(channel: socket.socket, argv: list[str], keep: list[int], group: TreeCgroup | None) -> int | None:
    """Run CRIU with only ``keep`` (and stdio) open, in ``group``; its exit code, or None when the channel closed
    first."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child execs at once
        try:
            if group is not None:
                group.enter()  # CRIU, and so every process it restores, runs in the tree's cgroup
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


def _keep(channel: socket.socket, pid: int, group: TreeCgroup | None) -> None:
    """Report the restored root, then wait for its end (killing it at a limit hit) or for the main process to
    let go of it."""
    pidfd = os.pidfd_open(pid)
    send(channel, message(pid=pid, **({"cgroup": group.name} if group is not None else {})), [pidfd])

    def kill(_: object) -> None:
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass

    poller = select.poll()
    poller.register(channel, select.POLLIN)
    poller.register(pidfd, select.POLLIN)
    watch = LimitWatch(kill)
    if group is not None:
        watch.watch(pid, group, poller)
    while True:
        timeout = watch.timeout(None)
        ready = [fd for fd, _ in poller.poll(None if timeout is None else timeout * 1000)]
        watch.check()
        for fd in ready:
            if watch.owns(fd):
                watch.fired(fd)
        if pidfd in ready:
            break
        if channel.fileno() in ready:  # the main process closed the channel, or died
            kill(None)
            break
    _, status = os.waitpid(pid, 0)
    limit = watch.unwatch(pid, poller)
    try:
        send(channel, message(exited=os.waitstatus_to_exitcode(status), **({"limit": limit} if limit else {})))
    except OSError:
        pass  # nobody listens any more


def serve(channel_fd: int) -> NoReturn:
    """The keeper's entry point: it waits for one request on its channel (it may be started before it is
    needed: ``criu.Keepers``), and exits when the channel closes first. The request: JSON with ``argv``
    (CRIU's, without the descriptors and the attach mapping), ``pidfile``, ``log``, ``scratch``, ``inherit``
    (CRIU's keys of the descriptors that come with the request, in order), ``mount`` (whether the sandbox's
    tree, a detached mount, comes after them), ``tree_key``, ``root`` and ``cgroups`` (or null), ``network``
    ("new loopback": the tree gets the keeper's new network namespace, "loopback": it joins it; see ``criu``),
    ``last_pid`` (or null: see ``_set_last_pid``) and ``kernel_data`` (or null: see ``_kernel_data_on_tmpfs``)."""
    channel = socket.socket(fileno=channel_fd)
    os.set_inheritable(channel_fd, False)
    # The network namespace of a tree that cannot configure its own (``network``), made while the keeper waits:
    # a new one with its loopback up, as the zygote makes each tree's.
    host_network = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    linux.unshare(linux.CLONE_NEWNET)
    loopback_up()
    try:
        request, fds = receive(channel, bytearray(1 << 20), 8)
    except OSError:
        os._exit(0)
    if not request:
        os._exit(0)  # let go of before it was needed
    spec = json.loads(request)
    inherit = fds[: len(spec["inherit"])]
    mount_fd = fds[len(inherit)] if spec["mount"] and len(fds) > len(inherit) else None
    attached: str | None = None
    group: TreeCgroup | None = None
    try:
        if spec.get("cgroups") is not None:
            group = TreeCgroup.create(spec["cgroups"], f"criu-{os.getpid()}")
        argv = list(spec["argv"])
        for fd, key in zip(inherit, spec["inherit"], strict=True):
            argv += ["--inherit-fd", f"fd[{fd}]:{key}"]
        if spec.get("network") == "loopback":
            argv += ["--join-ns", f"net:/proc/{os.getpid()}/ns/net"]
        elif spec.get("network") == NEW_LOOPBACK:  # CRIU's external namespace, under its key
            network = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            inherit = [*inherit, network]
            argv += ["--inherit-fd", f"fd[{network}]:{NETWORK_KEY}"]
        elif spec.get("network") == OWN_LOOPBACK:
            pass  # CRIU restores the tree into its own namespace: the keeper's new one
        else:  # CRIU restores the dumped namespace itself, from the host's
            linux.setns(host_network, linux.CLONE_NEWNET)
        os.close(host_network)
        if spec.get("root") is not None:
            argv += ["--root", _make_root(spec["root"], spec["scratch"])]
        if mount_fd is not None:
            attached = _attach_tree(mount_fd, spec["scratch"])
            argv += ["--external", f"mnt[{spec['tree_key']}]:{attached}"]
        kept = spec.get("kernel_data")
        seeded = _kernel_data_on_tmpfs(kept) if kept is not None else None
        code = _run_criu(channel, argv, inherit, group)
        if kept is not None and code == 0:
            _keep_kernel_data(kept, seeded)
        for fd in inherit:
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
            _keep(channel, pid, group)
    except BaseException as error:  # reported; the keeper must never leave a tree behind
        _reap_all()
        try:
            send(channel, message(error=f"criu restore failed: {type(error).__name__}: {error}"))
        except OSError:
            pass
    finally:
        _detach(attached)
        if group is not None:  # the tree is gone (or was never restored): nothing should be left in it
            group.kill_all()
            group.remove()
        os._exit(0)


def _detach(attached: str | None) -> None:
    if attached is not None:
        try:
            linux.umount(attached, 2)  # MNT_DETACH; the namespace goes with this process anyway
            os.rmdir(attached)
        except OSError:
            pass
