"""CRIU process snapshots: dump a confined process tree to an image directory and restore copies of it.

This is the *CRIU route* of persistent shell snapshots (issue 13): when processes live on beside the shell (a
background server, a REPL), the sandbox's whole process tree is dumped, and every fork restores it into fresh
namespaces over the fork's own files. The tree must be what the zygote starts: its root is PID 1 of its own PID
namespace and leads its own session (``setsid`` ran inside the namespace), with its own mount, network, IPC and
UTS namespaces. Then any number of restored copies can live at once, each in a new PID namespace that CRIU
creates, so PIDs never clash with the original or with each other (nor with an old tree still being reaped).

What crosses the boundary, and how:

* the terminal: the shell's pty slave (its master is in the main process) is dumped as an external tty, and a
  restore is handed a new pty slave in its place (``tty_fd``), which becomes the restored session's terminal;
* the files: the sandbox's tree (a detached overlay mount attached inside the namespace at
  ``tree_mountpoint``) is dumped as an external mount, and a restore binds the fork's tree (``tree_mount_fd``)
  there; every other mount is the host's, seen read-only (``--ext-mount-map auto``);
* nothing else: no other descriptor from outside is dumped or handed in (a tree holding one, such as a socket
  to the outside, fails to dump: the snapshot is declined). Network locking is skipped: the tree's network
  namespace has only its own loopback. When no process of the tree can configure that namespace (no
  CAP_NET_ADMIN: a sandbox's tree), it is not dumped at all: the dump's CRIU runs inside it (``nsenter``), so it
  is CRIU's own namespace, and a restore's CRIU runs in a new one with its loopback up, exactly what the zygote
  made (``_cannot_configure_network``), made ahead by the restore's keeper, which the tree gets (network
  ``"new loopback, CRIU's own"``). Neither runs ip(8) or iptables, nor walks the conntrack tables, as CRIU
  does for every namespace it dumps (about 10 ms each, whatever they hold: the walk covers the kernel's whole
  hash, 262,144 buckets here). Images of ``"new loopback"``, from before, named the namespace external, and the
  keeper hands its new one in under that name; those of ``"loopback"`` had CRIU make an empty one and join it.

Speed: each restore's keeper is started ahead of it (``Keepers``, one kept idle per factory), and CRIU's probe
of the kernel, which it keeps only on a tmpfs, is kept for this boot in a directory of root's and handed to
every dump and restore on a tmpfs over /run in a mount namespace of their own (``kernel_data_path``).

Each restored tree is held by a small *keeper* process (``_criu_keeper``), its parent, through the zygote's
``Spawned`` handle (``RestoredTree``): ``kill``, ``send_signal``, ``wait``, ``returncode`` as for a command the
zygote started; ``close`` (or the end of the main process) kills the tree.

Finding CRIU: ``$TVCACHE_CRIU``, else ``/var/cache/tvcache/criu/criu`` (written by ``scripts/install-criu.sh``,
``make criu``), else ``criu`` on PATH; it must be recent enough for this kernel and pass ``criu check``
(``find_criu``; probed once per process). Without it, ``find_criu`` returns None and says why, once.

Images hold the memory of the dumped processes (any secret a shell held): their directory is 0700 and every
file 0600, whatever the umask (CRIU runs with umask 077, and what it wrote is tightened after the dump). A
restore's scratch directory (``tvcache-criu-<pid>-<start>-*`` in the temporary directory) is removed when the
restore ends; one a killed process left behind is removed by the next process that looks for CRIU or restores.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ...errors import CriuError
from ...private_storage import DIRECTORY_MODE, private_tree
from ..ownership import owner_is_gone, process_tag
from ._criu_keeper import NETWORK_KEY, NEW_LOOPBACK, OWN_LOOPBACK
from .zygote import Spawned
from .zygote_process import send

__all__ = [
    "INSTALLED_PATH",
    "Criu",
    "CriuDump",
    "CriuRestore",
    "Keepers",
    "RestoredTree",
    "criu_unavailable_reason",
    "discard_images",
    "find_criu",
    "remove_dead_scratch",
    "required_version",
]

CRIU_ENV = "TVCACHE_CRIU"
INSTALLED_PATH = "/var/cache/tvcache/criu/criu"
META_FILE = "tvcache-criu.json"
TREE_KEY = "tvcache-tree"
DUMP_TIMEOUT = 60.0
RESTORE_TIMEOUT = 60.0
PROBE_TIMEOUT = 30.0
STOP_SECONDS = 5.0  # for CRIU to clean up after a timeout, before it is killed
LOG_LINES = 25
# CRIU runs ip(8) to save and restore a network namespace's addresses and routes; nothing else of our environment
# reaches it.
CRIU_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
_PTY_MAJORS = range(136, 144)  # Unix98 pty slaves
_VERSION = re.compile(r"^Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", re.MULTILINE)
# Options of both directions: mounts of the host seen in the tree's namespace are bound from the host's own
# (auto), including shared or slave ones; network locking needs iptables/nftables and guards only connections
# to the outside, which the tree's private loopback cannot have.
_MOUNTS = ("--ext-mount-map", "auto", "--enable-external-sharing", "--enable-external-masters")
# Cgroups are ours, not CRIU's: a restored tree stays in the cgroup CRIU runs in (the keeper's child enters the
# fork's own before it execs CRIU), never in the one the dumped tree was in. Needed on both sides (runc does the
# same to restore a container into another cgroup); ``=``: the mode is an optional argument.
_CGROUPS = ("--manage-cgroups=ignore",)
SCRATCH_PREFIX = "tvcache-criu-"
# A dump is handed the probe of the kernel a restore kept (``kernel_data_path``, ``_criu_keeper``) the same
# way: on a tmpfs over /run, in a mount namespace of its own; CRIU is exec'd, so that a timeout's signals reach
# it alone. Without the tmpfs it probes, as it would anyway.
_WITH_KERNEL_DATA = (
    "unshare",
    "--mount",
    "--propagation",
    "private",
    "--",
    "sh",
    "-c",
    'mount -t tmpfs -o mode=755,nosuid,nodev,noexec tmpfs /run 2>/dev/null && cat "$0" >/run/criu.kdat; exec "$@"',
)
_UMASK = 0o077  # what CRIU writes (images, logs, the restore's scratch) is its user's alone


def required_version(kernel: str | None = None) -> tuple[int, int]:
    """The oldest CRIU that can snapshot a shell with live processes on this kernel. Kernels >= 6.13 add a
    ``[vvar_vclock]`` mapping CRIU < 4.1 rejects (criu#2532); kernels >= 6.16 refuse ``SO_PASSCRED`` on inet
    sockets, which CRIU < 4.2 fails on when dumping any TCP socket, such as a background server's (criu#2705)."""
    release = kernel if kernel is not None else os.uname().release
    match = re.match(r"(\d+)\.(\d+)", release)
    numbers = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
    return (4, 2) if numbers >= (6, 16) else (4, 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class CriuDump:
    """A dumped tree: its image directory (``discard_images`` removes it), how long the dump took and its
    size; ``tty`` and ``tree`` say what a restore must be handed (a terminal, the fork's tree)."""

    images: Path
    seconds: float
    image_bytes: int
    tty: str | None
    tree: str | None


@dataclass(frozen=True, kw_only=True, slots=True)
class CriuRestore:
    """A restored copy: its handle (kill, wait, close as for a zygote's command), its root's PID in the
    caller's namespace, and how long the restore took until the tree ran."""

    tree: RestoredTree
    pid: int
    seconds: float


class RestoredTree(Spawned):
    """A restored tree, through its keeper. ``close`` kills the tree (when it still runs) and reaps the keeper."""

    def __init__(self, channel: socket.socket, keeper: subprocess.Popen[bytes]) -> None:
        super().__init__(channel)
        self._keeper = keeper

    def close(self) -> None:
        super().close()  # the keeper sees its channel close: it kills the tree, reaps it and exits
        try:
            self._keeper.wait(10)
        except subprocess.TimeoutExpired:
            self._keeper.kill()
            self._keeper.wait()


@dataclass(frozen=True, kw_only=True, slots=True)
class Criu:
    """A working CRIU: ``path`` runs it (a binary, or the installer's wrapper), ``version`` as it reports it."""

    path: str
    version: tuple[int, int, int]

    def dump(
        self,
        pid: int,
        images: str | os.PathLike[str],
        *,
        tree_mountpoint: str | None = None,
        leave_running: bool = True,
        timeout: float = DUMP_TIMEOUT,
        root: Mapping[str, object] | None = None,
    ) -> CriuDump:
        """Dump the tree rooted at ``pid`` (in the caller's PID namespace) into ``images``, a directory that
        must not exist yet. ``tree_mountpoint``: where the sandbox's tree is attached inside the tree's mount
        namespace (a restore then needs a tree to put there). ``root``: the confinement (``zygote.Confinement`` as
        a dict) whose own root the tree runs in, which a restore rebuilds (None: the host's root). With
        ``leave_running`` (the default) the tree goes on afterwards, as it does when the dump fails. Raises
        CriuError with CRIU's log; nothing is left then."""
        images = Path(images)
        try:
            images.parent.mkdir(parents=True, exist_ok=True)
            images.mkdir(DIRECTORY_MODE)
        except FileExistsError:
            raise CriuError(f"CRIU image directory {images} already exists; pass a path that does not") from None
        os.chmod(images, DIRECTORY_MODE)  # not the umask's
        try:
            tty = _tty_key(pid)
            argv = [self.path, "dump", "-t", str(pid), "-D", str(images), "-o", "dump.log", *_MOUNTS, *_CGROUPS]
            argv += ["--network-lock", "skip"]
            if leave_running:
                argv.append("--leave-running")
            if tty is not None:
                argv += ["--external", tty]
            if tree_mountpoint is not None:
                argv += ["--external", f"mnt[{tree_mountpoint}]:{TREE_KEY}"]
            network = OWN_LOOPBACK if _cannot_configure_network(pid) else None
            if network is not None and not shutil.which("nsenter", path=CRIU_PATH):
                network = NEW_LOOPBACK  # the namespace is named external instead: dumped as such, conntrack and all
                argv += ["--external", f"net[{os.stat(f'/proc/{pid}/ns/net').st_ino}]:{NETWORK_KEY}"]
            # A tree in a root of its own has no other container's mount to leave out, and its host paths, bound
            # from an overlay root (a host that is a container itself), must not be.
            for mountpoint in _foreign_mounts(pid, tree_mountpoint) if root is None else []:
                argv += ["--skip-mnt", mountpoint]
            kept = kernel_data_path(self.version)
            if kept is not None and shutil.which("unshare", path=CRIU_PATH) and os.path.isfile(kept):
                argv = [*_WITH_KERNEL_DATA, kept, *argv]
            if network == OWN_LOOPBACK:
                argv = ["nsenter", f"--net=/proc/{pid}/ns/net", "--", *argv]
            began = time.perf_counter()
            code, output = _run(argv, timeout)
            seconds = time.perf_counter() - began
            if code != 0:
                raise CriuError(
                    f"criu dump of process {pid} failed ({_how(code, timeout)}):\n"
                    f"{_log_tail(images / 'dump.log', output)}"
                )
            meta: dict[str, object] = {"tty": tty, "tree": tree_mountpoint, "criu": ".".join(map(str, self.version))}
            meta["network"] = network
            meta["root"] = dict(root) if root is not None else None
            (images / META_FILE).write_text(json.dumps(meta))
            private_tree(images)  # in case a CRIU ignores its umask for some file
            size = sum(entry.stat().st_size for entry in images.iterdir() if entry.is_file())
            return CriuDump(images=images, seconds=seconds, image_bytes=size, tty=tty, tree=tree_mountpoint)
        except BaseException:
            shutil.rmtree(images, ignore_errors=True)
            raise

    def restore(
        self,
        images: str | os.PathLike[str],
        *,
        tty_fd: int | None = None,
        tree_mount_fd: int | None = None,
        last_pid: int | None = None,
        timeout: float = RESTORE_TIMEOUT,
        cgroups: dict[str, object] | None = None,
        keepers: Keepers | None = None,
    ) -> CriuRestore:
        """Restore a copy of the tree dumped in ``images``, in new namespaces, and return once it runs.
        ``tty_fd``: the new terminal (a pty slave) when the tree had one; ``tree_mount_fd``: the fork's tree (a
        detached mount) when the dump named a ``tree_mountpoint``; ``last_pid``: the last PID handed out in the
        dumped tree's PID namespace (its ``ns_last_pid``), so that the copy's next process gets the PID the
        original's would have (CRIU's own restore moves it); ``cgroups``: the spec of the copy's own cgroup
        (``cgroups``: its limits, watched by the keeper), or None; ``keepers``: where the restore's keeper process comes
        from (None: one started now). The caller keeps its descriptors. Raises CriuError
        with CRIU's log when the restore fails; nothing is left running or mounted then."""
        images = Path(images)
        meta = _read_meta(images)
        if meta.get("tty") and tty_fd is None:
            raise CriuError(f"the tree in {images} had a terminal: pass a pty slave as tty_fd to restore it")
        if meta.get("tree") and tree_mount_fd is None:
            raise CriuError(f"the tree in {images} ran over a sandbox tree: pass the fork's as tree_mount_fd")
        remove_dead_scratch()
        # Named by its process (and that process's start time), for leak checks and for the next process to
        # tell a killed owner's leftover from a live one's.
        tag = process_tag(os.getpid()) or f"{os.getpid()}-0"
        scratch = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{tag}-"))
        try:
            return self._restore(images, meta, scratch, tty_fd, tree_mount_fd, last_pid, timeout, cgroups, keepers)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _restore(
        self,
        images: Path,
        meta: dict[str, object],
        scratch: Path,
        tty_fd: int | None,
        tree_mount_fd: int | None,
        last_pid: int | None,
        timeout: float,
        cgroups: dict[str, object] | None,
        keepers: Keepers | None,
    ) -> CriuRestore:
        argv = [self.path, "restore", "-D", str(images), "-W", str(scratch), "-o", "restore.log", *_MOUNTS, *_CGROUPS]
        # Detached, with the root as the keeper's child; `--root`: the tree's mounts are rebuilt under it, the
        # external ones bound from the host's: a copy of the mount points of the sandbox's own root, which the
        # keeper makes, for a tree dumped with one (``root``); else the host's root.
        argv += ["-d", "--restore-sibling", "--pidfile", str(scratch / "pid")]
        if meta.get("root") is None:
            argv += ["--root", "/"]
        inherit: list[tuple[int, str]] = []  # (descriptor, CRIU's key)
        if meta.get("tty") and tty_fd is not None:
            inherit.append((tty_fd, str(meta["tty"])))
        mount = bool(meta.get("tree"))
        spec = {
            "argv": argv,
            "pidfile": str(scratch / "pid"),
            "log": str(scratch / "restore.log"),
            "scratch": str(scratch),
            "inherit": [key for _, key in inherit],
            "mount": mount,
            "tree_key": TREE_KEY,
            "last_pid": last_pid,
            "root": meta.get("root"),
            "cgroups": cgroups,
            "kernel_data": kernel_data_path(self.version),
            "network": meta.get("network"),
        }
        began = time.perf_counter()
        keeper, mine = keepers.take() if keepers is not None else _start_keeper()
        try:
            fds = [fd for fd, _ in inherit] + ([tree_mount_fd] if mount and tree_mount_fd is not None else [])
            send(mine, json.dumps(spec).encode(), fds)
        except BaseException:
            mine.close()
            _end_keeper(keeper)
            raise
        tree = RestoredTree(mine, keeper)
        try:
            deadline = time.monotonic() + timeout
            # ``exited`` handles the messages that came (the pid among them) before ``pid`` is looked at.
            while not tree.exited and tree.pid is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CriuError(f"criu restore of {images} did not finish within {timeout:g} s")
                select.select([mine], [], [], remaining)
            if tree.pid is None:
                # Spawned words a silent end as the zygote's; here it is the keeper's.
                said = [error for error in tree.errors if "zygote" not in error]
                raise CriuError(said[0] if said else f"criu restore of {images}: its keeper process died")
        except BaseException:
            tree.close()
            raise
        return CriuRestore(tree=tree, pid=tree.pid, seconds=time.perf_counter() - began)


class Keepers:
    """Keeper processes (``_criu_keeper``) started before the restores that use them: a new interpreter takes
    ~35 ms to start and import the keeper, the longest step of a restore after CRIU's own. ``size`` idle ones
    are kept (0: each started when it is needed); each serves one restore, and the next one is started as one is
    taken. An idle keeper waits on its channel for the request, and exits when the channel closes: ``close``,
    or the end of this process. Thread-safe."""

    def __init__(self, size: int = 1) -> None:
        self.size = size
        self._idle: list[tuple[subprocess.Popen[bytes], socket.socket]] = []
        self._lock = threading.Lock()
        self._closed = False

    def take(self) -> tuple[subprocess.Popen[bytes], socket.socket]:
        """A keeper waiting for its request, and the channel to send it on (the caller owns both)."""
        with self._lock:
            taken = None
            while self._idle and taken is None:
                keeper, channel = self._idle.pop(0)
                if keeper.poll() is None:
                    taken = keeper, channel
                else:
                    channel.close()
            missing = 0 if self._closed else self.size - len(self._idle)
        if missing > 0:  # started behind, off the restore's path
            threading.Thread(target=self._refill, args=(missing,), name="tvcache-criu-keepers", daemon=True).start()
        return taken if taken is not None else _start_keeper()

    def _refill(self, count: int) -> None:
        for _ in range(count):
            try:
                self._add(_start_keeper())
            except (OSError, CriuError):
                return  # the next take starts its own

    def idle_pids(self) -> set[int]:
        """The process ids of the keepers waiting for a restore (for leak checks: they are not a restore's)."""
        with self._lock:
            return {keeper.pid for keeper, _ in self._idle}

    def _add(self, started: tuple[subprocess.Popen[bytes], socket.socket]) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.size:
                self._idle.append(started)
                return
        started[1].close()
        _end_keeper(started[0])

    def close(self) -> None:
        """End the idle keepers (idempotent); those serving a restore live on with their trees."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for keeper, channel in idle:
            channel.close()
            _end_keeper(keeper)


def _start_keeper() -> tuple[subprocess.Popen[bytes], socket.socket]:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        keeper = subprocess.Popen(
            [*_keeper_command(), str(theirs.fileno())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/",
            env={"PATH": CRIU_PATH},
            pass_fds=[theirs.fileno()],
            start_new_session=True,
            umask=_UMASK,
        )
    except BaseException:
        mine.close()
        raise
    finally:
        theirs.close()
    return keeper, mine


def _end_keeper(keeper: subprocess.Popen[bytes]) -> None:
    """Reap a keeper whose channel closed before it had a tree (it exits on its own then)."""
    try:
        keeper.wait(10)
    except subprocess.TimeoutExpired:
        keeper.kill()
        keeper.wait()


KERNEL_DATA_DIR = "/var/cache/tvcache/criu-kdat"


@functools.cache
def kernel_data_path(version: tuple[int, int, int], directory: str = KERNEL_DATA_DIR) -> str | None:
    """Where restores keep CRIU's probe of this kernel, for this boot and this CRIU (``_criu_keeper``): in a
    directory of this user's alone (a planted file would be believed); the copies of earlier boots are removed.
    None when there is no such directory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip()
        os.makedirs(directory, mode=DIRECTORY_MODE, exist_ok=True)
        info = os.lstat(directory)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        return None
    for entry in os.listdir(directory):
        if not entry.startswith(boot):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, entry))
    return os.path.join(directory, f"{boot}-criu-{'.'.join(map(str, version))}")


def discard_images(images: str | os.PathLike[str]) -> None:
    """Remove a dump's image directory (idempotent)."""
    shutil.rmtree(images, ignore_errors=True)


@functools.cache
def remove_dead_scratch(directory: str | None = None) -> tuple[str, ...]:
    """Remove the restore scratch directories that processes which are gone left behind (a ``kill -9``
    mid-restore), once per process and directory (default: the temporary directory); returns what it removed."""
    root = Path(directory if directory is not None else tempfile.gettempdir())
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return ()
    for entry in entries:
        name = entry.name
        if not name.startswith(SCRATCH_PREFIX) or not owner_is_gone(name[len(SCRATCH_PREFIX) :]):
            continue
        try:
            info = entry.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid():  # never another user's, never a link
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(str(entry))
    return tuple(removed)


# ----------------------------------------------------------------------------------------- finding CRIU

_warned = False


def find_criu(*, warn: bool = True) -> Criu | None:
    """The CRIU to use, or None (``criu_unavailable_reason`` says why; with ``warn``, a RuntimeWarning says
    it once per process). Probed once per process: ``--version`` and ``criu check`` cost ~100 ms."""
    found = _probe()
    if isinstance(found, Criu):
        return found
    global _warned
    if warn and not _warned:
        _warned = True
        warnings.warn(
            f"CRIU process snapshots are unavailable: {found}; persistent shells with live processes decline "
            "snapshots (later states are replayed)",
            RuntimeWarning,
            stacklevel=2,
        )
    return None


def criu_unavailable_reason() -> str | None:
    """Why ``find_criu`` finds no CRIU, or None when it finds one."""
    found = _probe()
    return None if isinstance(found, Criu) else found


@functools.cache
def _probe() -> Criu | str:
    remove_dead_scratch()
    if sys.platform != "linux":
        return "CRIU runs on Linux only"
    if os.geteuid() != 0:
        return "CRIU needs root"
    explicit = os.environ.get(CRIU_ENV)
    on_path = shutil.which("criu")
    candidates = [explicit] if explicit else [INSTALLED_PATH, *([on_path] if on_path else [])]
    reasons = []
    for path in candidates:
        found = _try(path)
        if isinstance(found, Criu):
            return found
        reasons.append(f"{path}: {found}")
    if not reasons:
        return f"no CRIU at {INSTALLED_PATH} or on PATH (install one with `make criu`)"
    return "; ".join(reasons) + " (install a working one with `make criu`)"


def _try(path: str) -> Criu | str:
    if not os.access(path, os.X_OK):
        return "not found" if not os.path.exists(path) else "not executable"
    try:
        reported = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=PROBE_TIMEOUT, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"does not run ({error})"
    match = _VERSION.search(reported.stdout)
    if match is None:
        return f"reports no version ({(reported.stdout + reported.stderr).strip()[:200]!r})"
    version = (int(match.group(1)), int(match.group(2)), int(match.group(3) or 0))
    wanted = required_version()
    if version[:2] < wanted:
        return (
            f"CRIU {'.'.join(map(str, version))} is too old for kernel {os.uname().release} "
            f"(needs >= {wanted[0]}.{wanted[1]})"
        )
    try:
        check = subprocess.run(
            [path, "check"], capture_output=True, text=True, timeout=PROBE_TIMEOUT, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"`criu check` did not finish ({error})"
    if check.returncode != 0:
        lines = [line for line in (check.stdout + check.stderr).splitlines() if "Error" in line]
        return f"`criu check` fails on this kernel: {' / '.join(lines[-3:]) or check.returncode}"
    return Criu(path=path, version=version)


# -------------------------------------------------------------------------------------------- helpers


def _tty_key(pid: int) -> str | None:
    """CRIU's key (``tty[rdev:dev]``) of the pty slave the root has as stdio, if any: its master is outside."""
    for fd in (0, 1, 2):
        try:
            info = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if stat.S_ISCHR(info.st_mode) and os.major(info.st_rdev) in _PTY_MAJORS:
            return f"tty[{info.st_rdev:x}:{info.st_dev:x}]"
    return None


CAP_NET_ADMIN = 12


def _cannot_configure_network(pid: int) -> bool:
    """Whether no process of the tree rooted at ``pid`` can change its network namespace (CAP_NET_ADMIN is
    out of the root's bounding set, which every descendant inherits, and writes to /proc/sys need it too):
    then that namespace is exactly a new one with its loopback up, as the zygote makes it, and a dump need not
    save it (CRIU runs ip(8) and iptables-save, then -restore, five or six programs each way): a restore joins
    such a new one, which its keeper made while it waited (``_criu_keeper``)."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("CapBnd:"):
                    return not int(line.split()[1], 16) >> CAP_NET_ADMIN & 1
    except (OSError, ValueError):
        pass
    return False


def _foreign_mounts(pid: int, tree_mountpoint: str | None) -> list[str]:
    """Mounts the tree's namespace copied from the host that belong to other containers (their overlay roots,
    their network namespace files): they come and go with those containers, and a restore that must bind one
    that is gone fails. They are left out of the dump (a restored copy sees the directories under them)."""
    try:
        lines = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        before, _, after = line.partition(" - ")
        fields = before.split()
        if len(fields) < 5 or not after:
            continue
        mountpoint = re.sub(r"\\([0-7]{3})", lambda octal: chr(int(octal.group(1), 8)), fields[4])
        if after.split()[0] in ("overlay", "nsfs") and mountpoint != tree_mountpoint:
            found.append(mountpoint)
    return found


def _run(argv: list[str], timeout: float) -> tuple[int, str]:
    """Run CRIU in its own session with no descriptor of ours; killed on timeout or interrupt. It ends with its
    whole process group (``_end_group``): a CRIU killed halfway (by our timeout, or by anyone) leaves the helpers
    it forked into the tree's namespaces behind, orphaned, and they would hold a pipe of its output open until
    our timeout (its output goes to a file)."""
    with tempfile.TemporaryFile() as output:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            cwd="/",
            env={"PATH": CRIU_PATH},
            start_new_session=True,
            umask=_UMASK,
        )
        ended = os.pidfd_open(process.pid)
        timed_out = False
        try:
            if not select.select([ended], [], [], timeout)[0]:
                timed_out = True
                _end_group(process.pid, ended, STOPPING)
        except BaseException:
            _end_group(process.pid, ended, STOPPING)
            raise
        finally:
            # Until it is reaped, the ended leader keeps its group's id: what is left in the group is CRIU's.
            _end_group(process.pid, ended, ENDING)
            process.wait()
            os.close(ended)
        if timed_out:
            return -1, f"(killed after {timeout:g} s)"
        output.seek(0)
        return process.returncode, output.read().decode(errors="replace")


# How CRIU's process group is ended: stopped (a timeout, an interrupt), SIGTERM first, as CRIU then takes its
# parasite code out of the tree and lets it go on, whereas a SIGKILL while the parasite runs takes the tree down;
# after CRIU ended, what it left (helpers it forked, which end on their own a moment later, or, orphaned by a
# CRIU that was killed, wait for it forever) gets time first: a helper killed at once, while it still tidies up,
# can take the dumped tree down too. Each step waits up to STOP_SECONDS for the group to be gone.
STOPPING = (signal.SIGTERM, signal.SIGKILL)
ENDING = (None, signal.SIGTERM, signal.SIGKILL)


def _end_group(leader: int, ended: int, signals: tuple[signal.Signals | None, ...]) -> None:
    """Send ``signals`` (None: none) in turn to CRIU's process group, led by ``leader`` (its pidfd ``ended``),
    until the leader has ended and nothing else is left in the group."""
    for signum in signals:
        if signum is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(leader, signum)
        deadline = time.monotonic() + STOP_SECONDS
        while not select.select([ended], [], [], 0)[0] or _group_members(leader):
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)
        else:
            return


def _group_members(group: int) -> list[int]:
    """The processes of process group ``group`` but its leader."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != group:
            try:
                with open(f"/proc/{entry}/stat", "rb") as handle:
                    fields = handle.read().rpartition(b")")[2].split()
            except OSError:
                continue
            if len(fields) > 2 and int(fields[2]) == group:
                members.append(int(entry))
    return members


def _how(code: int, timeout: float) -> str:
    if code == -1:
        return f"timed out after {timeout:g} s"
    return f"exit {code}" if code >= 0 else f"killed by signal {-code}"


def _log_tail(log: Path, output: str) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        lines = output.splitlines()
    errors = [line for line in lines if "Error" in line or "BUG" in line]
    return "\n".join((errors or lines)[-LOG_LINES:]) or "(CRIU wrote no log)"


def _read_meta(images: Path) -> dict[str, object]:
    try:
        meta = json.loads((images / META_FILE).read_text())
    except (OSError, ValueError) as error:
        raise CriuError(f"{images} holds no usable CRIU dump ({error})") from None
    if not isinstance(meta, dict):
        raise CriuError(f"{images} holds no usable CRIU dump (malformed {META_FILE})")
    return meta


_BOOTSTRAP = """\
import importlib, sys, types
package = types.ModuleType("_tvcache_criu")
package.__path__ = [sys.argv[1]]
sys.modules["_tvcache_criu"] = package
importlib.import_module("_tvcache_criu._criu_keeper").serve(int(sys.argv[2]))
"""


def _keeper_command() -> list[str]:
    if not sys.executable:
        raise CriuError("cannot start the CRIU keeper process: sys.executable is unknown")
    directory = str(Path(__file__).resolve().parent)
    return [sys.executable, "-I", "-S", "-B", "-c", _BOOTSTRAP, directory]
