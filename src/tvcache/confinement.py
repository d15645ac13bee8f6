"""Check that a sandbox backend confines what runs in it: ``check_confinement(factory, probe)``.

Our users run untrusted, reward-seeking policies in these sandboxes, next to their training jobs, their keys and
other rollouts. Each check below plays a hostile command against one promise, from inside a sandbox, and looks
from the host for what it should not have reached. tvcache's own shell flavours (one-shot, persistent, restored
from CRIU, image-based) and its Docker backend run them all in the test suite; run them on yours::

    from tvcache.calls import ToolCall
    from tvcache.testing import ConfinementProbe, check_confinement

    check_confinement(
        factory,
        ConfinementProbe(shell=lambda command: ToolCall("sh", {"cmd": command})),
        storage=[factory_storage_dir],  # where the backend keeps layers, snapshots, images: nobody else may read
    )

A failed check raises ``ConfinementCheckFailed`` naming the check and the promise it found broken.

What the checks leave on the host while they run, and remove afterwards: a hidden directory with a secret file
and a listening unix socket in each of ``host_locations`` that exists and is writable, a TCP listener on
loopback, and one ``sleep`` process with a random argument. The limit checks (a fork bomb and a memory hog) run
only when the probe says which limits to expect; they stop the sandbox they ran in.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .calls import ToolCall
from .errors import SandboxError, TVCacheError
from .protocol import Outcome, Sandbox, SandboxFactory

__all__ = [
    "CONFINEMENT_CHECKS",
    "FORBIDDEN_CAPABILITIES",
    "ConfinementCheck",
    "ConfinementCheckFailed",
    "ConfinementProbe",
    "check_confinement",
]

# Host places a sloppy view would show: home directories, service data, mounts, the checker's own directory.
HOST_LOCATIONS = ("/root", "/home", "/srv", "/mnt", "/var/lib", "/var/cache", "/opt")
# Capabilities no sandboxed command may hold: each undoes confinement, reaches the host's kernel or devices, or
# takes more than a sandbox's share of the machine (numbers from linux/capability.h).
FORBIDDEN_CAPABILITIES: Mapping[str, int] = {
    "dac_read_search": 2,
    "linux_immutable": 9,
    "net_admin": 12,
    "ipc_lock": 14,
    "ipc_owner": 15,
    "sys_module": 16,
    "sys_rawio": 17,
    "sys_ptrace": 19,
    "sys_pacct": 20,
    "sys_admin": 21,
    "sys_boot": 22,
    "sys_nice": 23,
    "sys_resource": 24,
    "sys_time": 25,
    "sys_tty_config": 26,
    "mknod": 27,
    "lease": 28,
    "audit_control": 30,
    "mac_override": 32,
    "mac_admin": 33,
    "syslog": 34,
    "wake_alarm": 35,
    "block_suspend": 36,
    "perfmon": 38,
    "bpf": 39,
}
_MARK = "@@tvcache-confinement"


class ConfinementCheckFailed(TVCacheError, AssertionError):
    """A backend broke a confinement promise. ``check`` is the check's name (a key of ``CONFINEMENT_CHECKS``),
    ``property`` the promise; the message says what was seen instead."""

    def __init__(self, check: str, detail: str) -> None:
        self.check = check
        self.property = CONFINEMENT_CHECKS[check].property if check in CONFINEMENT_CHECKS else check
        super().__init__(f"confinement check {check!r} failed: {self.property}: {detail}")


@dataclass(frozen=True, kw_only=True)
class ConfinementProbe:
    """How ``check_confinement`` drives a backend.

    ``shell(command)``: a call that runs ``command`` with bash (as the sandbox's default user) and returns its
    output. ``setup``: calls made in every sandbox before the checks run; with ``fork=True`` the checks run in a
    fork of a snapshot taken after them (``setup=[start a background process]`` and a persistent shell: a
    sandbox restored from CRIU). ``memory_limit_bytes`` and ``pids_limit``: the limits the factory's sandboxes
    have; the limit checks run only when these are set. ``limit_timeout``: the seconds a call hitting a limit
    may take to return (its own timeout, plus the time to kill what it started)."""

    shell: Callable[[str], ToolCall]
    setup: Sequence[ToolCall] = ()
    fork: bool = False
    memory_limit_bytes: int | None = None
    pids_limit: int | None = None
    limit_timeout: float = 60.0
    output: Callable[[Outcome], str] = field(default=lambda outcome: outcome.output)


def _bind_unix(listener: socket.socket, path: Path) -> None:
    """Bind ``listener`` at ``path``; through a descriptor of its directory when the path is longer than the 107
    bytes a unix socket's address holds (a deep working directory is)."""
    if len(os.fsencode(str(path))) < 108:
        listener.bind(str(path))
        return
    directory = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        listener.bind(f"/proc/self/fd/{directory}/{path.name}")
    finally:
        os.close(directory)


class _Host:
    """What the checks plant on the host: secrets in hidden directories, a unix socket and a TCP listener that
    log every connection, and a process with a unique command line."""

    def __init__(self, locations: Iterable[str]) -> None:
        self.token = secrets.token_hex(12)
        self.directories: list[Path] = []
        self.sockets: list[tuple[Path, socket.socket]] = []
        for location in locations:
            if not os.path.isdir(location) or not os.access(location, os.W_OK):
                continue
            directory = Path(tempfile.mkdtemp(prefix=".tvcache-confinement-", dir=location))
            (directory / "secret").write_text(self.token)
            os.chmod(directory / "secret", 0o600)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            _bind_unix(listener, directory / "socket")
            os.chmod(directory / "socket", 0o600)
            listener.listen(8)
            listener.setblocking(False)
            self.directories.append(directory)
            self.sockets.append((directory / "socket", listener))
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp.bind(("127.0.0.1", 0))
        self.tcp.listen(8)
        self.tcp.setblocking(False)
        self.port = self.tcp.getsockname()[1]
        # A float no other process has on its command line: `sleep` takes it as seconds.
        self.sleeper_argument = f"86399.{int(self.token[:12], 16)}"
        self.sleeper = subprocess.Popen(["sleep", self.sleeper_argument])

    def connections(self) -> list[str]:
        """The listeners that were connected to since they opened."""
        reached = []
        for path, listener in [*self.sockets, (Path(f"127.0.0.1:{self.port}"), self.tcp)]:
            with contextlib.suppress(BlockingIOError):
                connection, _ = listener.accept()
                connection.close()
                reached.append(str(path))
        return reached

    def close(self) -> None:
        self.sleeper.kill()
        self.sleeper.wait()
        for _, listener in self.sockets:
            listener.close()
        self.tcp.close()
        for directory in self.directories:
            shutil.rmtree(directory, ignore_errors=True)


class _Run:
    """One check's run: the factory, the probe, what was planted on the host, the sandboxes to stop."""

    def __init__(
        self, name: str, factory: SandboxFactory, probe: ConfinementProbe, host: _Host, storage: Sequence[Path]
    ) -> None:
        self.name = name
        self.factory = factory
        self.probe = probe
        self.host = host
        self.storage = storage
        self._live: list[Sandbox] = []
        self._scratch = Path(tempfile.mkdtemp(prefix="tvcache-confinement-"))

    def expect(self, condition: bool, detail: str) -> None:
        if not condition:
            raise ConfinementCheckFailed(self.name, detail)

    async def sandbox(self) -> Sandbox:
        """A sandbox to probe: started, set up, and with ``fork`` a fork of a snapshot taken then."""
        sandbox = await self.factory.start()
        self._live.append(sandbox)
        for call in self.probe.setup:
            outcome = await sandbox.execute(call)
            self.expect(not outcome.is_error, f"the setup call {call} failed: {outcome.output!r:.300}")
        if not self.probe.fork:
            return sandbox
        snapshot = await sandbox.snapshot(self._scratch / f"snapshot-{len(self._live)}")
        fork = await self.factory.fork(snapshot)
        self._live.append(fork)
        return fork

    async def run(self, sandbox: Sandbox, command: str) -> tuple[str, int | None]:
        """``command``'s output and exit status, which it reports itself on a marked last line (so that the check
        does not depend on how the backend renders a status)."""
        outcome = await sandbox.execute(self.probe.shell(f'{command}\nprintf "\\n{_MARK} %s\\n" "$?"'))
        text = self.probe.output(outcome)
        head, marker, tail = text.rpartition(f"\n{_MARK} ")
        if not marker:
            return text, None
        status = tail.split(maxsplit=1)[0] if tail.split() else ""
        return head, int(status) if status.isdigit() else None

    async def close(self) -> None:
        for sandbox in self._live:
            with contextlib.suppress(Exception):
                await sandbox.stop()
        shutil.rmtree(self._scratch, ignore_errors=True)


async def _host_files(run: _Run) -> None:
    sandbox = await run.sandbox()
    for directory in run.host.directories:
        output, status = await run.run(sandbox, f"cat {directory}/secret; ls -a {directory}")
        run.expect(run.host.token not in output, f"a command read the host's secret {directory}/secret")
        run.expect(status != 0, f"a command listed the host directory {directory}: {output!r:.300}")
    for path in ("/etc/shadow", "/etc/gshadow"):
        output, status = await run.run(sandbox, f"head -c 64 {path} | od -c | head -2")
        run.expect("root" not in output, f"a command read the host's {path}")
    for root in run.storage:
        output, status = await run.run(sandbox, f"ls -a {root}")
        if status == 0:  # the same path may exist inside (an image's own /var/cache); it must not be the host's
            found = {name for name in output.split() if name not in (".", "..")}
            hosts = set(os.listdir(root)) if os.path.isdir(root) else set()
            run.expect(not (found & hosts), f"a command listed the host's storage {root}: {sorted(found & hosts)}")


async def _host_services(run: _Run) -> None:
    sandbox = await run.sandbox()
    for path, _ in run.host.sockets:
        output, status = await run.run(sandbox, f"test -e {path}")
        if status == 0:  # visible: it must still not connect (python3 only where the sandbox has it)
            await run.run(
                sandbox,
                # From its directory: a unix socket's path is limited to 107 bytes, the working directory's is not.
                f"cd {path.parent} && python3 -c 'import socket; s = socket.socket(socket.AF_UNIX); "
                f's.connect("{path.name}")\' 2>&1',
            )
    await run.run(sandbox, f"exec 3<>/dev/tcp/127.0.0.1/{run.host.port}")
    await asyncio.sleep(0.05)  # a connection made is queued at once; this only lets the kernel finish it
    reached = run.host.connections()
    run.expect(not reached, f"a command connected to the host's {', '.join(reached)}")


async def _host_processes(run: _Run) -> None:
    sandbox = await run.sandbox()
    output, _ = await run.run(sandbox, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '")
    run.expect(run.host.sleeper_argument not in output, "a command sees the host's processes in /proc")
    output, status = await run.run(
        sandbox, f"kill -0 {run.host.sleeper.pid} 2>&1 && cat /proc/{run.host.sleeper.pid}/cmdline"
    )
    run.expect(run.host.sleeper_argument not in output, "a command reached a host process by its PID")


async def _kernel(run: _Run) -> None:
    sandbox = await run.sandbox()
    output, status = await run.run(sandbox, "dmesg 2>&1 | head -3")
    run.expect(status != 0 or not output.strip() or "denied" in output or "not permitted" in output,
               f"a command read the host's kernel log: {output!r:.200}")  # fmt: skip
    output, status = await run.run(sandbox, "head -c 1 /dev/kmsg >/dev/null 2>&1")
    run.expect(status != 0, "a command read /dev/kmsg")
    output, status = await run.run(sandbox, "chrt -f 1 true 2>&1")
    run.expect(status != 0, "a command set a real-time scheduling policy (chrt -f)")
    output, status = await run.run(sandbox, "find /dev -type b 2>/dev/null | head -5")
    run.expect(not output.strip(), f"the sandbox has block devices: {output.split()}")


async def _capabilities(run: _Run) -> None:
    sandbox = await run.sandbox()
    output, _ = await run.run(sandbox, "grep -E '^Cap(Eff|Prm|Bnd|Amb|Inh):' /proc/$$/status")
    sets = {}
    for line in output.splitlines():
        name, _, value = line.partition(":")
        if value.strip():
            sets[name] = int(value.strip(), 16)
    run.expect({"CapEff", "CapBnd"} <= set(sets), f"no capability sets in /proc/$$/status: {output!r:.300}")
    for set_name, mask in sets.items():
        held = sorted(name for name, bit in FORBIDDEN_CAPABILITIES.items() if mask >> bit & 1)
        run.expect(not held, f"the shell's {set_name} holds {', '.join('cap_' + name for name in held)}")


async def _setuid(run: _Run) -> None:
    """A set-user-ID copy made inside raises nobody's privileges: inside (as an unprivileged user), nor on the
    host, where the backend's storage keeps the sandbox's files out of every other user's reach."""
    sandbox = await run.sandbox()
    name = f"suid-{run.host.token[:8]}"
    output, status = await run.run(sandbox, f'cp "$(command -v id)" ./{name} && chmod 4755 ./{name} && pwd')
    run.expect(status == 0, f"cannot make a set-user-ID file in the sandbox's tree: {output!r:.300}")
    output, status = await run.run(sandbox, "command -v setpriv")
    if status == 0:
        output, status = await run.run(sandbox, f"setpriv --reuid=65534 --regid=65534 --clear-groups ./{name} -u")
        run.expect(output.strip() != "0", "a set-user-ID file made in the sandbox gave an unprivileged user root")
    for root in run.storage:
        leaks = await asyncio.to_thread(_readable_by_nobody, root, name)
        run.expect(not leaks, f"another host user reaches the sandbox's files under {root}: {leaks[:3]}")


def _readable_by_nobody(root: Path, name: str) -> list[str]:
    """What an unprivileged host user (65534) can open under ``root``, and whether it can run ``name`` found
    there as root: a forked child drops to that user and walks the tree."""
    if not root.exists() or os.geteuid() != 0:
        return []
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            found: list[str] = []
            for directory, _, files in os.walk(root):
                for entry in files:
                    path = os.path.join(directory, entry)
                    with contextlib.suppress(OSError), open(path, "rb"):
                        found.append(path)
                    if entry == name:
                        result = subprocess.run([path, "-u"], capture_output=True, text=True, check=False)
                        if result.stdout.strip() == "0":
                            found.append(f"{path} ran as root")
            os.write(write, "\n".join(found).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as reader:
        data = reader.read().decode()
    os.waitpid(pid, 0)
    return [line for line in data.splitlines() if line]


async def _storage_modes(run: _Run) -> None:
    """The backend's storage directories are its user's alone (0700), so nothing in them is reachable."""
    for root in run.storage:
        if not root.exists():
            continue
        info = root.stat()
        run.expect(info.st_uid == os.geteuid(), f"{root} is owned by uid {info.st_uid}, not the cache's user")
        run.expect(stat.S_IMODE(info.st_mode) & 0o077 == 0, f"{root} has mode {stat.S_IMODE(info.st_mode):o}")


async def _fork_bomb(run: _Run) -> None:
    if run.probe.pids_limit is None:
        return
    sandbox = await run.sandbox()
    before = _host_processes_count()
    started = time.monotonic()
    outcome, followed = await _hostile(run, sandbox, ":(){ :|:& };:; sleep 3")
    elapsed = time.monotonic() - started
    run.expect(elapsed <= run.probe.limit_timeout, f"the fork bomb's calls took {elapsed:.1f} s")
    run.expect(followed, f"a fork bomb did not end with a clear error: {outcome!r:.300}")
    await sandbox.stop()
    await _recovered(run, lambda: _host_processes_count() <= before + 32, "the host's process count")


async def _memory_hog(run: _Run) -> None:
    limit = run.probe.memory_limit_bytes
    if limit is None:
        return
    sandbox = await run.sandbox()
    before = _available_memory()
    started = time.monotonic()
    # tail keeps a line whole until it ends: a stream with no newline grows it without bound.
    outcome, followed = await _hostile(run, sandbox, f"head -c {4 * limit} /dev/zero | tail -n 1 >/dev/null")
    elapsed = time.monotonic() - started
    run.expect(elapsed <= run.probe.limit_timeout, f"the memory hog's calls took {elapsed:.1f} s")
    run.expect(followed, f"a memory hog did not end with a clear error: {outcome!r:.300}")
    await sandbox.stop()
    await _recovered(run, lambda: _available_memory() >= before - (256 << 20), "the host's available memory")


async def _hostile(run: _Run, sandbox: Sandbox, command: str) -> tuple[object, bool]:
    """Run ``command``, then an ordinary call: one of the two must say that a limit was hit (an error outcome
    that names the limit), or the sandbox must refuse the second (untrusted). Neither may hang."""
    try:
        outcome = await asyncio.wait_for(sandbox.execute(run.probe.shell(command)), run.probe.limit_timeout)
    except SandboxError as error:
        return error, True
    if outcome.is_error and "limit" in outcome.output and not outcome.deterministic:
        return outcome, True
    try:
        after = await asyncio.wait_for(sandbox.execute(run.probe.shell("echo alive")), run.probe.limit_timeout)
    except SandboxError as error:
        return error, "limit" in str(error) or "untrusted" in str(error)
    return (outcome, after), after.is_error and "limit" in after.output


async def _recovered(run: _Run, condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        run.expect(time.monotonic() < deadline, f"{what} did not recover within 30 s of the sandbox's stop")
        await asyncio.sleep(0.1)


def _host_processes_count() -> int:
    return sum(1 for name in os.listdir("/proc") if name.isdigit())


def _available_memory() -> int:
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


CheckBody = Callable[[_Run], Awaitable[None]]


@dataclass(frozen=True, kw_only=True)
class ConfinementCheck:
    """One confinement promise and the coroutine that plays a hostile command against it."""

    name: str
    property: str
    body: CheckBody


CONFINEMENT_CHECKS: Mapping[str, ConfinementCheck] = {
    check.name: check
    for check in (
        ConfinementCheck(
            name="host-files",
            property="commands see none of the host's homes, service data, other trees or the backend's storage",
            body=_host_files,
        ),
        ConfinementCheck(
            name="host-services",
            property="commands reach no host socket: neither a unix socket on disk nor a loopback port",
            body=_host_services,
        ),
        ConfinementCheck(
            name="host-processes", property="commands see and signal only their own processes", body=_host_processes
        ),
        ConfinementCheck(
            name="kernel",
            property="commands read no kernel log, set no real-time priority and open no block device",
            body=_kernel,
        ),
        ConfinementCheck(
            name="capabilities",
            property="the shell holds no capability that undoes confinement or reaches the host",
            body=_capabilities,
        ),
        ConfinementCheck(
            name="storage-modes", property="the backend's storage is readable by its own user only", body=_storage_modes
        ),
        ConfinementCheck(
            name="setuid",
            property="a set-user-ID file made inside raises nobody's privileges, inside or on the host",
            body=_setuid,
        ),
        ConfinementCheck(
            name="fork-bomb",
            property="a fork bomb ends its call with a clear error and the host recovers",
            body=_fork_bomb,
        ),
        ConfinementCheck(
            name="memory-hog",
            property="a memory hog ends its call with a clear error and the host recovers",
            body=_memory_hog,
        ),
    )
}


async def run_confinement_check(
    name: str,
    factory: SandboxFactory,
    probe: ConfinementProbe,
    *,
    storage: Sequence[str | os.PathLike[str]] = (),
    host_locations: Iterable[str] = HOST_LOCATIONS,
) -> None:
    """Run the confinement check ``name`` (a key of ``CONFINEMENT_CHECKS``). Raises ``ConfinementCheckFailed``,
    also when the backend raised something else on the way."""
    check = CONFINEMENT_CHECKS.get(name)
    if check is None:
        raise ValueError(f"no confinement check {name!r}; the checks are {', '.join(CONFINEMENT_CHECKS)}")
    host = _Host([*host_locations, os.getcwd()])
    run = _Run(name, factory, probe, host, [Path(path) for path in storage])
    try:
        await check.body(run)
    except ConfinementCheckFailed:
        raise
    except Exception as error:
        raise ConfinementCheckFailed(name, f"the backend raised {error!r}") from error
    finally:
        await run.close()
        host.close()


def check_confinement(
    factory: SandboxFactory,
    probe: ConfinementProbe,
    *,
    storage: Sequence[str | os.PathLike[str]] = (),
    checks: Iterable[str] | None = None,
    host_locations: Iterable[str] = HOST_LOCATIONS,
) -> None:
    """Run the confinement checks (all of ``CONFINEMENT_CHECKS``, in order, or those named in ``checks``)
    against ``factory`` on their own event loop; call it where no loop is running. ``storage``: the host
    directories where the backend keeps its sandboxes' files, snapshots and images (none may be visible inside
    or readable by another host user). Must run as root for the host-side probes (planting secrets in
    ``host_locations``, dropping to an unprivileged user). The factory is left open. Raises
    ``ConfinementCheckFailed`` for the first broken promise."""
    names = list(CONFINEMENT_CHECKS if checks is None else checks)
    for name in names:
        if name not in CONFINEMENT_CHECKS:
            raise ValueError(f"no confinement check {name!r}; the checks are {', '.join(CONFINEMENT_CHECKS)}")

    async def run_all() -> None:
        for name in names:
            await run_confinement_check(name, factory, probe, storage=storage, host_locations=host_locations)

    asyncio.run(run_all())
