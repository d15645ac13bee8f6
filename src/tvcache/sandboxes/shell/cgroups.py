"""Resource limits per confined process tree, with cgroups: pids, memory (no swap), CPU; and what hit them.

Each tree a sandbox runs (a one-shot command, a persistent shell, a CRIU-restored copy) gets a cgroup of its own
with the sandbox's limits, under one parent per owner process (``tvcache-<pid>-<start>``, as layer stores are
named, so that the next start removes what a killed owner left behind). A sandbox runs one tree at a time (its
calls are serialised, and its shell is replaced, never doubled), so a tree's limits are the sandbox's limits.

Why a cgroup per tree, made ahead with the zygote's spares, rather than one per sandbox that each new process
is moved into: moving a process into a cgroup (a write to ``cgroup.procs``) waits for an RCU grace period
unless the hierarchy is mounted ``favordynmods`` — 7 to 11 ms measured here when moves are sporadic, twice a
one-shot command. A new process inherits its parent's cgroups for free, so each spare makes its cgroup and moves
*itself* in while it prepares, ahead of its command, and everything it starts is born there; warm shells are
spares too, and the CRIU keeper's child enters its cgroup just before it execs ``criu restore`` (run with
``--manage-cgroups=ignore``, so that the restored tree stays where CRIU was, whatever cgroups the dump saw). On
cgroup v2, ``CLONE_INTO_CGROUP`` would avoid the move, but ``os.fork`` cannot pass it.

Two implementations of one interface (``TreeCgroup``): **cgroup v2** (``memory.max``, ``memory.swap.max``,
``memory.oom.group``, ``pids.max``, ``cpu.max``; hits counted in ``memory.events`` and ``pids.events``, which
notify pollers) and **cgroup v1** (one directory per hierarchy: ``memory.limit_in_bytes``,
``memory.memsw.limit_in_bytes``, ``pids.max``, ``cpu.cfs_quota_us``; hits counted in ``memory.oom_control`` and
``pids.events``, read every ``CHECK_SECONDS`` while a tree runs). The process that named a tree's cgroup watches
it (the zygote, or the CRIU keeper; ``LimitWatch``): at the first hit it kills the tree, and reports the hit with
the tree's exit (``{"exited": code, "limit": kind}``). A persistent shell's sandbox also reads the counters after
each call (``HitReader``), so that a hit during a call ends that call even when the kill comes a moment later.

``host_cgroups`` (main process only) finds what the host offers, once per process: v2 where ``/sys/fs/cgroup``
(or a delegated subtree) has the pids, memory and cpu controllers, else v1 with the three hierarchies, else
nothing, said once in a warning. This module is imported by the zygote, so it loads only light modules.
"""

from __future__ import annotations

import errno
import os
import re
import select
import signal
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = [
    "CHECK_SECONDS",
    "CgroupHost",
    "HitReader",
    "LimitWatch",
    "TreeCgroup",
    "cgroup_mounts",
    "counter_fields",
    "host_cgroups",
    "read_small_file",
    "remove_leftovers",
]

MEMORY, PIDS = "memory", "pids"  # the kinds of limit hits reported
V1_CONTROLLERS = ("memory", "pids", "cpu")  # in this order in a spec's "parents"
CPU_PERIOD_US = 100_000
CHECK_SECONDS = 0.02  # v1's pids.events has no notification: read this often while a tree runs
KILL_SECONDS = 5.0  # a bound on emptying a cgroup (a fork bomb is capped by its pids limit)
PARENT_PREFIX = "tvcache-"
_OWNER = re.compile(r"^tvcache-(\d+)-(\d+)$")
_POLLPRI = select.POLLPRI | select.POLLERR


class TreeCgroup:
    """The cgroup of one confined process tree: named (``named``: nothing is made yet), made with the limits of
    its spec (``make``; ``create`` does both), entered by the tree's first process (``enter``) or given one
    (``add``), watched (``hit_since``), emptied (``kill_all``) and removed (``remove``). ``named`` picks the
    implementation the spec names."""

    name: str
    polled = False  # True when limit hits show only by reading (v1: no notifications)

    def __init__(self, spec: dict[str, object], name: str) -> None:
        self.name = name
        self.limits = _limits(spec)

    @staticmethod
    def named(spec: dict[str, object], name: str) -> TreeCgroup:
        return V2Cgroup(spec, name) if spec.get("version") == 2 else V1Cgroup(spec, name)

    @staticmethod
    def create(spec: dict[str, object], name: str) -> TreeCgroup:
        """A new cgroup ``name`` under the spec's parent(s), with its limits set; OSError if not."""
        group = TreeCgroup.named(spec, name)
        group.make()
        return group

    def make(self) -> None:
        """Make its directories and set the limits (a leftover of the same name is taken over); OSError if not,
        and then nothing is left."""
        try:
            for path in self.directories():
                try:
                    os.mkdir(path)
                except FileExistsError:
                    pass
            self.set_limits()
        except BaseException:
            self.remove()
            raise

    def set_limits(self) -> None:
        raise NotImplementedError

    def procs_files(self) -> list[str]:
        return [f"{path}/cgroup.procs" for path in self.directories()]

    def enter(self) -> None:
        """Move the calling process in (a new process inherits it: everything it starts is born here)."""
        self.add(0)

    def add(self, pid: int) -> None:
        """Move process ``pid`` (0: the caller) in; it should have no children yet, which stay where they are."""
        for path in self.procs_files():
            _write(path, str(pid))

    def alarms(self) -> list[tuple[int, int]]:
        """Descriptors that wake a poller (``select.poll`` events) when a limit may have been hit."""
        return []

    def rearm(self, fd: int) -> None:
        """Reset the alarm ``fd`` after it fired."""

    def counter_files(self) -> tuple[str, str]:
        """The files counting OOM kills and refused forks."""
        raise NotImplementedError

    def counts(self) -> dict[str, int]:
        """Hits so far, by kind."""
        memory, pids = (counter_fields(read_small_file(path)) for path in self.counter_files())
        return {MEMORY: memory.get("oom_kill", 0), PIDS: pids.get("max", 0)}

    def hit_since(self, mark: dict[str, int]) -> str | None:
        """The kind of the first limit hit since ``mark`` (``counts()`` then), or None. Memory comes first: an
        OOM kill is the more certain harm, and a memory hog may also hit the pids limit while it is killed."""
        try:
            now = self.counts()
        except OSError:
            return None
        for kind in (MEMORY, PIDS):
            if now.get(kind, 0) > mark.get(kind, 0):
                return kind
        return None

    def procs(self) -> list[int]:
        found: set[int] = set()
        for path in self.procs_files():
            found.update(int(pid) for pid in read_small_file(path).split())
        return sorted(found)

    def kill_all(self, timeout: float = KILL_SECONDS) -> bool:
        """SIGKILL every process in it until none is left (True), or the timeout (False)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                pids = self.procs()
            except FileNotFoundError:
                return True
            if not pids:
                return True
            if time.monotonic() >= deadline:
                return False
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.001)  # dying processes leave the list once they exit

    def directories(self) -> list[str]:
        raise NotImplementedError

    def close(self) -> None:
        """Close the descriptors it holds (its alarms)."""

    def remove(self, timeout: float = 1.0) -> bool:
        """Remove it once empty (kill what is left first); True when it is gone. Idempotent."""
        self.close()
        return _remove_directories(self.directories(), timeout)


class V2Cgroup(TreeCgroup):
    """One directory of the unified hierarchy; memory.events and pids.events notify pollers of each change."""

    def __init__(self, spec: dict[str, object], name: str) -> None:
        super().__init__(spec, name)
        self.path = os.path.join(_parents(spec)[0], name)
        self._fds: list[int] = []

    def set_limits(self) -> None:
        limits = self.limits
        if limits.get("memory") is not None:
            _write(f"{self.path}/memory.max", str(limits["memory"]))
            _write(f"{self.path}/memory.swap.max", "0")  # a hog must not push the host into swap
            _write(f"{self.path}/memory.oom.group", "1")  # an OOM kill takes the whole tree
        if limits.get("pids") is not None:
            _write(f"{self.path}/pids.max", str(limits["pids"]))
        if limits.get("cpus") is not None:
            _write(f"{self.path}/cpu.max", f"{round(_number(limits['cpus']) * CPU_PERIOD_US)} {CPU_PERIOD_US}")

    def alarms(self) -> list[tuple[int, int]]:
        if not self._fds:
            try:
                for path in self.counter_files():
                    self._fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
                    os.read(self._fds[-1], 4096)  # read once: a poller wakes on the next change only
            except OSError:
                self.close()  # not made (its tree failed to start): nothing to watch
        return [(fd, _POLLPRI) for fd in self._fds]

    def rearm(self, fd: int) -> None:
        os.pread(fd, 4096, 0)

    def counter_files(self) -> tuple[str, str]:
        return f"{self.path}/memory.events", f"{self.path}/pids.events"

    def kill_all(self, timeout: float = KILL_SECONDS) -> bool:
        try:
            _write(f"{self.path}/cgroup.kill", "1")  # the kernel kills it all at once, forks racing it included
        except FileNotFoundError:
            return True
        except OSError:
            pass  # before Linux 5.14: kill by the list
        return super().kill_all(timeout)

    def directories(self) -> list[str]:
        return [self.path]

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)


class V1Cgroup(TreeCgroup):
    """One directory in each of the memory, pids and cpu hierarchies. v1 notifies OOMs only through an eventfd
    registered by the watcher, and refused forks not at all: its counters are read (``polled``) instead."""

    polled = True

    def __init__(self, spec: dict[str, object], name: str) -> None:
        super().__init__(spec, name)
        self.paths = {
            controller: os.path.join(parent, name)
            for controller, parent in zip(V1_CONTROLLERS, _parents(spec), strict=True)
        }

    def set_limits(self) -> None:
        limits, memory = self.limits, self.paths["memory"]
        if limits.get("memory") is not None:
            _write(f"{memory}/memory.limit_in_bytes", str(limits["memory"]))
            if os.path.exists(f"{memory}/memory.memsw.limit_in_bytes"):  # swap accounting is on: none at all
                _write(f"{memory}/memory.memsw.limit_in_bytes", str(limits["memory"]))
        if limits.get("pids") is not None:
            _write(f"{self.paths['pids']}/pids.max", str(limits["pids"]))
        if limits.get("cpus") is not None:
            cpu = self.paths["cpu"]
            _write(f"{cpu}/cpu.cfs_period_us", str(CPU_PERIOD_US))
            _write(f"{cpu}/cpu.cfs_quota_us", str(round(_number(limits["cpus"]) * CPU_PERIOD_US)))

    def counter_files(self) -> tuple[str, str]:
        return f"{self.paths['memory']}/memory.oom_control", f"{self.paths['pids']}/pids.events"

    def directories(self) -> list[str]:
        return list(self.paths.values())


class HitReader:
    """Reads the hit counters of an existing tree's cgroup (made by the zygote or the keeper, which name it when
    the tree starts), cheaply: a persistent shell's sandbox checks them after every call, since a limit hit
    during a call must end it with an error even when the watcher's kill comes a moment later."""

    def __init__(self, spec: dict[str, object], name: str) -> None:
        files = TreeCgroup.named(spec, name).counter_files()
        self._fds: list[int] = []
        try:
            for path in files:
                self._fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
        except BaseException:
            self.close()
            raise

    def hit(self) -> str | None:
        """The kind of the first limit hit since the tree started, or None (also once the cgroup is gone)."""
        try:
            memory, pids = (os.pread(fd, 4096, 0) for fd in self._fds)
        except (OSError, ValueError):
            return None
        if counter_fields(memory.decode()).get("oom_kill", 0):
            return MEMORY
        if counter_fields(pids.decode()).get("max", 0):
            return PIDS
        return None

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)


class LimitWatch:
    """Watches the cgroups of the running trees of one process (the zygote's, or the keeper's), for its poll
    loop: ``timeout`` bounds its wait, ``fired`` takes the descriptors that woke it, ``check`` calls ``kill`` on
    each tree over a limit (once) and remembers the kind, which ``unwatch`` then returns."""

    def __init__(self, kill: Callable[[object], None]) -> None:
        self._kill = kill
        self._trees: dict[object, tuple[TreeCgroup, dict[str, int]]] = {}
        self._alarms: dict[int, object] = {}
        self._hits: dict[object, str] = {}
        self._polled = 0
        self._next_check = 0.0

    def watch(self, key: object, group: TreeCgroup, poller: select.poll) -> None:
        self._trees[key] = (group, {})  # a new cgroup: every hit is since its start
        for fd, events in group.alarms():
            self._alarms[fd] = key
            poller.register(fd, events)
        self._polled += group.polled

    def unwatch(self, key: object, poller: select.poll) -> str | None:
        """Stop watching ``key``'s tree (it ended): the kind of limit it hit, from the last check or now."""
        entry = self._trees.pop(key, None)
        hit = self._hits.pop(key, None)
        if entry is None:
            return hit
        group, mark = entry
        for fd, _ in group.alarms():
            self._alarms.pop(fd, None)
            poller.unregister(fd)
        self._polled -= group.polled
        return hit or group.hit_since(mark)

    def timeout(self, wanted: float | None) -> float | None:
        """The poll timeout (seconds, None: forever) given the loop's own ``wanted``."""
        if not self._polled:
            return wanted
        due = max(0.0, self._next_check - time.monotonic())
        return due if wanted is None else min(wanted, due)

    def owns(self, fd: int) -> bool:
        return fd in self._alarms

    def fired(self, fd: int) -> None:
        key = self._alarms[fd]
        self._trees[key][0].rearm(fd)
        self._check(key)

    def check(self) -> None:
        """Check every tree when a poll is due (v1), and kill those over a limit."""
        if self._polled and time.monotonic() >= self._next_check:
            self._next_check = time.monotonic() + CHECK_SECONDS
            for key, (group, _) in list(self._trees.items()):
                if group.polled:
                    self._check(key)

    def _check(self, key: object) -> None:
        if key in self._hits:
            return
        group, mark = self._trees[key]
        hit = group.hit_since(mark)
        if hit is not None:
            self._hits[key] = hit
            self._kill(key)


# ------------------------------------------------------------------------------- the host (main process)


class CgroupHost:
    """What this host offers (found once per process by ``host_cgroups``): the version and this process's
    parent cgroup(s), made on first use; ``spec`` is what the zygote and the CRIU keeper build trees' cgroups
    from (JSON)."""

    def __init__(self, version: int, parents: list[str]) -> None:
        self.version = version
        self.parents = parents  # v2: [one directory]; v1: memory, pids, cpu

    def spec(self, *, pids: int | None, memory_bytes: int | None, cpus: float | None) -> dict[str, object]:
        return {
            "version": self.version,
            "parents": list(self.parents),
            "limits": {"pids": pids, "memory": memory_bytes, "cpus": cpus},
        }

    def trees(self) -> list[str]:
        """The names of this process's tree cgroups that exist now (for tests and inspection)."""
        with os.scandir(self.parents[0]) as entries:
            return sorted(entry.name for entry in entries if entry.is_dir())

    def remove_all(self) -> None:
        """Kill and remove every tree cgroup of this process, then its parent(s): at exit."""
        _remove_parents(self.parents)


_host: CgroupHost | str | None = None


def host_cgroups() -> CgroupHost | str:
    """This process's ``CgroupHost``, or why cgroup limits are not available here. Found once per process;
    the first call also removes what owners that are gone left behind (``remove_leftovers``)."""
    global _host
    if _host is None or (isinstance(_host, CgroupHost) and _host_owner != os.getpid()):
        _host = _find_host()
    return _host


_host_owner = 0


def _find_host() -> CgroupHost | str:
    global _host_owner
    from ..ownership import process_tag  # main process only (not loaded in the zygote)

    if os.geteuid() != 0:
        return "not root (cgroups would need a delegated subtree)"
    tag = process_tag(os.getpid())
    if tag is None:
        return "cannot read this process's start time"
    name = PARENT_PREFIX + tag
    reasons = []
    for make in (_v2_parents, _v1_parents):
        try:
            bases = make()
        except OSError as error:
            reasons.append(str(error))
            continue
        if isinstance(bases, str):
            reasons.append(bases)
            continue
        try:
            for base in bases:
                remove_leftovers(base)
            parents = [os.path.join(base, name) for base in bases]
            for parent in parents:
                os.makedirs(parent, exist_ok=True)
            if make is _v2_parents:
                _write(f"{parents[0]}/cgroup.subtree_control", "+memory +pids +cpu")
        except OSError as error:
            reasons.append(f"cannot make cgroups under {', '.join(bases)} ({error.strerror})")
            continue
        import atexit

        host = CgroupHost(2 if make is _v2_parents else 1, parents)
        _host_owner = os.getpid()
        atexit.register(_remove_at_exit, host, _host_owner)
        return host
    return "; ".join(reasons)


def _remove_at_exit(host: CgroupHost, owner: int) -> None:
    if os.getpid() == owner:  # not in a forked copy of the owner
        host.remove_all()


def cgroup_mounts() -> Iterator[tuple[str, str, set[str]]]:
    """(mount point, filesystem type, super options) of the cgroup mounts, from mountinfo."""
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            before, _, after = line.partition(" - ")
            fields, tail = before.split(), after.split()
            if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
                yield fields[4], tail[0], set(tail[2].split(","))


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and "" -> its v2 path."""
    own = {}
    with open("/proc/self/cgroup") as handle:
        for line in handle:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                own[controller] = path
    return own


def _v2_parents() -> list[str] | str:
    """Where this process may make v2 cgroups with all three controllers: its own cgroup when it is the root of
    its cgroup namespace (a container), else beside it, in its parent (where the controllers are enabled
    already, or can be), so that no process sits in a cgroup whose controllers are given to children."""
    mount = next((point for point, kind, _ in cgroup_mounts() if kind == "cgroup2"), None)
    if mount is None:
        return "no cgroup2 mount"
    own = _own_cgroups().get("", "/")
    here = os.path.normpath(mount + own)
    base = here if own == "/" else os.path.dirname(here)
    available = set(read_small_file(f"{base}/cgroup.controllers").split())
    missing = [name for name in ("memory", "pids", "cpu") if name not in available]
    if missing:
        return f"cgroup v2 at {mount} does not offer {', '.join(missing)}"
    enabled = set(read_small_file(f"{base}/cgroup.subtree_control").split())
    if not {"memory", "pids", "cpu"} <= enabled:
        _write(f"{base}/cgroup.subtree_control", "+memory +pids +cpu")
    return [base]


def _v1_parents() -> list[str] | str:
    """This process's own cgroup in each of the memory, pids and cpu hierarchies (nested: its own limits still
    hold over its sandboxes)."""
    points = {}
    for point, kind, options in cgroup_mounts():
        if kind == "cgroup":
            for controller in V1_CONTROLLERS:
                if controller in options:
                    points[controller] = point
    missing = [controller for controller in V1_CONTROLLERS if controller not in points]
    if missing:
        return f"no cgroup v1 hierarchy for {', '.join(missing)}"
    own = _own_cgroups()
    return [os.path.normpath(points[controller] + own.get(controller, "/")) for controller in V1_CONTROLLERS]


def remove_leftovers(base: str) -> list[str]:
    """Remove the parent cgroups under ``base`` whose owner process is gone (killed before it cleaned up):
    their processes are killed first. Returns the paths removed."""
    from ..ownership import owner_is_gone

    removed: list[str] = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        if _OWNER.match(name) is None or not owner_is_gone(name.removeprefix(PARENT_PREFIX)):
            continue
        path = os.path.join(base, name)
        if _remove_parents([path]):
            removed.append(path)
    return removed


# ------------------------------------------------------------------------------------------- helpers


def _remove_parents(parents: list[str]) -> bool:
    """Kill what runs in the parents' child cgroups, remove them, then the parents; True when all are gone."""
    children: dict[str, list[str]] = {}
    for parent in parents:
        try:
            with os.scandir(parent) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        children.setdefault(entry.name, []).append(entry.path)
        except FileNotFoundError:
            continue
    gone = True
    for paths in children.values():
        gone = _remove_directories(paths, 1.0) and gone
    return _remove_directories(parents, 1.0) and gone


def _remove_directories(paths: list[str], timeout: float) -> bool:
    """rmdir each (a cgroup goes once its processes are gone: they are killed, then waited for)."""
    deadline = time.monotonic() + timeout
    pending = list(paths)
    while pending:
        for path in list(pending):
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError as error:
                if error.errno != errno.EBUSY:
                    return False
                _kill_listed(path)
                if time.monotonic() >= deadline:
                    return False
                continue
            pending.remove(path)
        if pending:
            time.sleep(0.001)
    return True


def _kill_listed(path: str) -> None:
    try:
        pids = read_small_file(f"{path}/cgroup.procs").split()
    except OSError:
        return
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _parents(spec: dict[str, object]) -> list[str]:
    parents = spec.get("parents")
    return [str(parent) for parent in parents] if isinstance(parents, list) else []


def _limits(spec: dict[str, object]) -> dict[str, object]:
    limits = spec.get("limits")
    return limits if isinstance(limits, dict) else {}


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float | str) else 0.0


def counter_fields(text: str) -> dict[str, int]:
    """The ``key value`` lines of a cgroup counter file (``memory.events``, ``pids.events``...) with numbers."""
    found = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            found[key] = int(value)
    return found


def read_small_file(path: str) -> str:
    """A cgroup file's text, in one read (close-on-exec: the zygote forks while it reads)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 1 << 16).decode()
    finally:
        os.close(fd)


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
