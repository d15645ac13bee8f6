"""Upstream MCP servers run inside tvcache shell sandboxes, so every rollout's upstream starts from the task's
initial state and forks come from snapshots (``tvcache mcp-proxy --sandbox-dir DIR``; docs/mcp-proxy.md).

The upstream's data directory ``DIR`` (a git repository, a memory file's folder, a database's folder) is the
base tree of a shell sandbox factory (``ShellSandbox``): each sandbox sees it through an overlay of its own,
attached at ``DIR``'s own path, with a minimal view of the rest of the host, read-only (the system directories,
an allowlist of ``/etc``, and what the upstream's program needs: ``_program_paths``; ``host_view`` on the
factory lists it), private ``/tmp``, ``/run`` and ``/dev/shm``, and no network. The upstream process runs
confined there (PID 1 of its own namespaces, started by the factory's zygote); its stdin and stdout are one
end of a socket pair, its stderr is discarded (it could only share the socket with the JSON-RPC stream). So
the host's ``DIR`` never changes, and a fresh sandbox is the initial state.

A snapshot is the overlay's: the upstream is stopped first (stdin closed, a grace period, then killed), so its
files are complete and no process writes into the frozen layer, and it is started again over the sandbox's new
upper layer. A fork starts a fresh upstream over the snapshot's layers. No process memory is snapshotted: an
upstream is covered exactly when everything it remembers between calls is in ``DIR`` (server-memory with
``MEMORY_FILE_PATH`` inside ``DIR``; a server keeping state only in memory is not, and its forks would differ).

An upstream that died between two calls is started again in the sandbox's files before the next call; one that
dies during a call makes that call fail with a SandboxError (the session then drops the sandbox and rebuilds the
state by replay for the rollout's next call): its effects are unknown, so nothing about it is cached.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import mcp.types as types
from mcp.client import Transport
from mcp.shared.message import SessionMessage

from ..calls import ToolCall, ToolSpec
from ..errors import SandboxError
from ..protocol import Outcome, Snapshot
from ..sandboxes.shell import linux
from ..sandboxes.shell.sandbox import PRIVATE_DIRS, AnyShellSandbox, ShellSandboxFactory
from ..sandboxes.shell.zygote import Spawned
from .mcp_upstream import ProxySettings, UpstreamSandbox

__all__ = ["SANDBOXED_KIND", "SandboxedUpstream", "SandboxedUpstreams"]

SANDBOXED_KIND = "mcp-sandboxed"
STOP_GRACE_SECONDS = 2.0  # how long a stopped upstream may take to exit on its own before it is killed
_MAX_DIAGNOSTICS = 20
_CHUNK = 1 << 16

# $1: the working directory, $2: the fallback one (the data directory), then the upstream's argv. Errors before
# the upstream runs go to stdout, where the transport reads them as diagnostics (stderr is not connected).
_WRAPPER = r"""
cd -- "$1" 2>/dev/null || cd -- "$2" || exit 126
shift 2
if ! command -v -- "$1" >/dev/null 2>&1; then
    printf 'tvcache: the upstream command %s was not found in the sandbox (PATH=%s, working directory %s)\n' \
        "$1" "$PATH" "$PWD"
    exit 127
fi
exec 0<&1 2>/dev/null
exec "$@"
"""


class SandboxedUpstreams:
    """The sandboxes of one upstream command over one data directory, shared by every connection of a process
    (forks need the snapshot's layers, which live in this object's layer store). ``close`` ends them.

    ``snapshots``: whether the cache may snapshot. A process serving a single connection (``tvcache mcp-proxy``
    on stdio) gains nothing from snapshots, which die with it, so it sets this False and every miss starts from
    the initial state and replays.
    """

    def __init__(self, settings: ProxySettings, *, snapshots: bool = True) -> None:
        if settings.sandbox_dir is None:
            raise SandboxError("SandboxedUpstreams needs ProxySettings(sandbox_dir=...)")
        data = Path(settings.sandbox_dir).resolve()
        if not data.is_dir():
            raise SandboxError(f"--sandbox-dir {data} does not exist or is not a directory")
        hidden = [path for path in PRIVATE_DIRS if data == Path(path)]
        if hidden:
            raise SandboxError(f"--sandbox-dir cannot be {data} itself: the sandbox replaces it with an empty tmpfs")
        if not linux.overlay_supported():
            raise SandboxError(
                "--sandbox-dir runs the upstream on an overlay of its data directory, and overlay mounts are not "
                "permitted here (run as root on Linux >= 6.8). Without them, run the proxy without --sandbox-dir "
                "and make the upstream command reset its data to the task's initial state each time it starts"
            )
        self.settings = settings
        self.data = data
        self.snapshots = snapshots
        self.command = list(settings.command)
        self.environment = dict(os.environ if settings.env is None else settings.env)
        self.cwd = settings.cwd or os.getcwd()
        self.files = ShellSandboxFactory(data, visible=_program_paths(self.command, data=data, cwd=self.cwd))
        self.process_starts = 0
        self._lock = threading.Lock()
        self._running: set[_UpstreamProcess] = set()

    def factory(self, tools: Mapping[str, ToolSpec], on_start: Callable[[], None]) -> SandboxedUpstreamFactory:
        """The sandbox factory of one connection: its tool specs, and a counter of the upstreams it starts."""
        return SandboxedUpstreamFactory(self, tools=tools, on_start=on_start)

    def running(self) -> list[int]:
        """Process ids (in this PID namespace) of the upstreams running now (not stopped, and not reported
        ended by the zygote), for inspection and tests."""
        with self._lock:
            running = list(self._running)
        return [process.pid for process in running if process.pid is not None and not process.exited]

    def _track(self, process: _UpstreamProcess, running: bool) -> None:
        with self._lock:
            if running:
                self._running.add(process)
                self.process_starts += 1
            else:
                self._running.discard(process)

    def close(self) -> None:
        """Kill every upstream still running and delete the layer store (its snapshots stop working)."""
        with self._lock:
            running = list(self._running)
        for process in running:
            process.kill()
        self.files.close()

    def __enter__(self) -> SandboxedUpstreams:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class SandboxedUpstreamFactory:
    """A ``SandboxFactory`` of sandboxed upstreams for one connection (``SandboxedUpstreams.factory``)."""

    kind = SANDBOXED_KIND

    def __init__(
        self, upstreams: SandboxedUpstreams, *, tools: Mapping[str, ToolSpec], on_start: Callable[[], None]
    ) -> None:
        self.upstreams = upstreams
        self._tools = tools
        self._on_start = on_start
        # Priors until measured. A start and a fork each launch one upstream process (a fork is never dearer: it
        # only skips replay), so both start neutral and are measured as they happen; a snapshot restarts the
        # upstream, and its prior is pessimistic, as the cost model wants (infinite when it cannot be reused).
        snapshot = 0.5 if upstreams.snapshots else math.inf
        self.cost_hints: Mapping[str, float] = {"start": 0.0, "fork": 0.0, "snapshot": snapshot}

    @property
    def tools(self) -> Mapping[str, ToolSpec]:
        return self._tools

    async def start(self) -> SandboxedUpstream:
        return await self._open(await self.upstreams.files.start())

    async def fork(self, snapshot: Snapshot) -> SandboxedUpstream:
        if snapshot.kind != SANDBOXED_KIND:
            raise SandboxError(f"cannot fork a sandboxed MCP upstream from a {snapshot.kind!r} snapshot")
        return await self._open(await self.upstreams.files.fork(_files_snapshot(snapshot, self.upstreams.files)))

    async def _open(self, files: AnyShellSandbox) -> SandboxedUpstream:
        sandbox = SandboxedUpstream(self.upstreams, files, on_start=self._on_start)
        try:
            await sandbox.open()
        except BaseException:
            await sandbox.stop()
            raise
        return sandbox

    def discard(self, snapshot: Snapshot) -> None:
        self.upstreams.files.discard(_files_snapshot(snapshot, self.upstreams.files))

    def __repr__(self) -> str:
        return f"SandboxedUpstreamFactory({str(self.upstreams.data)!r}, command={self.upstreams.command!r})"


def _program_paths(command: list[str], *, data: Path, cwd: str) -> tuple[str, ...]:
    """The host paths the upstream's program needs, which the sandbox's minimal view of the host would not show
    (``ShellSandboxFactory.host_view``): each program's prefix (``.../bin/x`` -> ``...``) as named and as
    resolved, with a script's interpreter; for a Python venv, the venv, its base interpreter's prefix and what
    its ``.pth`` files add to ``sys.path`` (an editable install's source); the files the arguments name (a
    script's directory, a whole ``node_modules`` tree); the working directory when arguments are relative to it.
    The data directory is the sandbox's tree: nothing overlapping it is added."""
    wanted: list[str] = []
    if command:
        found = shutil.which(command[0])
        if found is not None:
            for program in (os.path.abspath(found), *_interpreter(found)):
                wanted += _program_prefixes(program)
    for arg in command[1:]:
        if os.path.isabs(arg) and os.path.exists(arg):
            wanted.append(_tree_of(arg))
        elif _names_a_file(arg) and os.path.exists(os.path.join(cwd, arg)):
            wanted += [cwd, _tree_of(os.path.join(cwd, arg))]
    shown: list[str] = []
    for path in dict.fromkeys(os.path.abspath(path) for path in wanted):
        overlaps = _below(path, str(data)) or _below(str(data), path)
        if path != "/" and not overlaps and os.path.exists(path):
            shown.append(path)
    return tuple(path for path in shown if not any(other != path and _below(path, other) for other in shown))


def _names_a_file(arg: str) -> bool:
    """Whether a relative argument looks like a path (not an option, nor a bare word that may exist by chance)."""
    return not arg.startswith("-") and (os.sep in arg or arg.endswith((".py", ".js", ".mjs", ".cjs")))


def _below(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _interpreter(program: str) -> list[str]:
    """The interpreter of a ``#!`` script (through ``env``), if any."""
    try:
        with open(program, "rb") as handle:
            first = handle.readline(512)
    except OSError:
        return []
    if not first.startswith(b"#!"):
        return []
    words = os.fsdecode(first[2:]).split()
    if words and os.path.basename(words[0]) == "env":
        words = [word for word in words[1:] if not word.startswith("-")]
        found = shutil.which(words[0]) if words else None
        return [found] if found else []
    return words[:1] if words and os.path.isabs(words[0]) else []


def _program_prefixes(program: str) -> list[str]:
    prefixes = []
    for path in dict.fromkeys([program, os.path.realpath(program)]):
        directory = os.path.dirname(path)
        prefix = os.path.dirname(directory) if os.path.basename(directory) == "bin" else directory
        prefixes.append(prefix)
        config = os.path.join(prefix, "pyvenv.cfg")
        if os.path.isfile(config):
            prefixes += _venv_paths(prefix, config)
    return prefixes


def _venv_paths(venv: str, config: str) -> list[str]:
    """A venv's base interpreter's prefix (``home`` in ``pyvenv.cfg``) and the directories its ``.pth`` files
    put on ``sys.path``."""
    paths = []
    with open(config, errors="replace") as lines:
        for line in lines:
            key, _, value = line.partition("=")
            if key.strip() == "home" and os.path.isabs(value.strip()):
                paths.append(os.path.dirname(os.path.realpath(value.strip())))
    for pth in Path(venv).glob("lib/python*/site-packages/*.pth"):
        with contextlib.suppress(OSError):
            for line in pth.read_text(errors="replace").splitlines():
                if os.path.isabs(line.strip()) and os.path.isdir(line.strip()):
                    paths.append(line.strip())
    return paths


def _tree_of(path: str) -> str:
    """What to show for a file an argument names: the tree above its first ``node_modules`` (node resolves
    packages up from there), else its directory; a directory is shown whole."""
    path = os.path.abspath(path)
    parts = path.split(os.sep)
    if "node_modules" in parts:
        return os.sep.join(parts[: parts.index("node_modules")]) or os.sep
    return path if os.path.isdir(path) else os.path.dirname(path)


def _files_snapshot(snapshot: Snapshot, files: ShellSandboxFactory) -> Snapshot:
    return Snapshot(kind=files.kind, path=snapshot.path, bytes=snapshot.bytes, meta=snapshot.meta)


class SandboxedUpstream:
    """One overlay of the data directory and the upstream process running on it. Calls are serialised."""

    def __init__(self, upstreams: SandboxedUpstreams, files: AnyShellSandbox, *, on_start: Callable[[], None]) -> None:
        self._upstreams = upstreams
        self._files = files
        self._on_start = on_start
        self._lock = asyncio.Lock()
        self._process: _UpstreamProcess | None = None
        self._client: UpstreamSandbox | None = None

    async def open(self) -> SandboxedUpstream:
        async with self._lock:
            await self._launch()
        return self

    async def _launch(self) -> None:
        upstreams = self._upstreams
        # The overlay's mount: the upstream attaches a clone of it at the data directory's own path. Not public
        # on ShellSandbox (its commands are one-shot); the mount is replaced only by snapshot and stop, which
        # this class serialises with its calls.
        mount_fd = self._files._require_open()
        process = await asyncio.to_thread(_UpstreamProcess.spawn, upstreams, mount_fd)
        self._on_start()
        client = UpstreamSandbox(process.transport(), describe=f"{upstreams.command!r} (sandboxed in {upstreams.data})")
        try:
            await client.open()
        except SandboxError as error:
            await asyncio.to_thread(process.stop, 0.0)
            notes = process.diagnostics()
            raise SandboxError(f"{error}{'; it said: ' + ' | '.join(notes) if notes else ''}") from error
        except BaseException:
            await asyncio.to_thread(process.stop, 0.0)
            raise
        self._process, self._client = process, client

    async def _halt(self, grace: float) -> None:
        process, client, self._process, self._client = self._process, self._client, None, None
        if client is not None:
            await client.stop()
        if process is not None:
            await asyncio.to_thread(process.stop, grace)

    async def execute(self, call: ToolCall) -> Outcome:
        async with self._lock:
            if self._process is None or self._process.exited:
                # Died between calls (or stopped by a failed snapshot): its files are the sandbox's state, so a new
                # upstream over them is in the state the rollout reached.
                await self._halt(0.0)
                await self._launch()
            assert self._client is not None and self._process is not None
            outcome = await self._client.execute(call)
            if self._process.exited:
                # Whatever the call answered, the upstream ended with it: its effects are unknown.
                code = self._process.returncode
                await self._halt(0.0)
                raise SandboxError(
                    f"the sandboxed upstream MCP server exited (code {code}) during {call}; nothing of it is "
                    "cached, and the rollout's next call rebuilds its state in a new upstream"
                )
            return outcome

    async def snapshot(self, dest: Path) -> Snapshot:
        async with self._lock:
            # Stopped first: a running upstream would go on writing into the layer the snapshot freezes.
            await self._halt(STOP_GRACE_SECONDS)
            files = await self._files.snapshot(dest)
            await self._launch()  # the protocol's "keep running afterwards", over the new upper layer
        return Snapshot(kind=SANDBOXED_KIND, path=files.path, bytes=files.bytes, meta=files.meta)

    async def state_digest(self) -> str:
        return await self._files.state_digest()

    async def stop(self) -> None:
        async with self._lock:
            await self._halt(0.0)
            await self._files.stop()

    @property
    def pid(self) -> int | None:
        """The upstream process's id while it runs (for inspection and tests)."""
        process = self._process
        return None if process is None else process.pid


class _UpstreamProcess:
    """The upstream server confined in one sandbox: a zygote-started process and our end of its socket."""

    def __init__(self, upstreams: SandboxedUpstreams, spawned: Spawned, channel: socket.socket) -> None:
        self._upstreams = upstreams
        self._spawned = spawned
        self.channel = channel
        self._notes: list[str] = []
        self._stopped = False

    @classmethod
    def spawn(cls, upstreams: SandboxedUpstreams, mount_fd: int) -> _UpstreamProcess:
        files = upstreams.files
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [files.bash, "-c", _WRAPPER, "tvcache-mcp-upstream", upstreams.cwd, str(upstreams.data)]
        try:
            spawned = files.zygote.spawn(
                [*argv, *upstreams.command],
                env=upstreams.environment,
                mount_fd=mount_fd,
                output_fd=theirs.fileno(),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        spawned.wait_started()
        if spawned.errors:
            spawned.close()
            ours.close()
            raise SandboxError(f"cannot start the upstream in its sandbox: {'; '.join(spawned.errors)}")
        process = cls(upstreams, spawned, ours)
        upstreams._track(process, True)
        return process

    @property
    def pid(self) -> int | None:
        return self._spawned.pid

    @property
    def exited(self) -> bool:
        return self._stopped or self._spawned.exited

    @property
    def returncode(self) -> int | None:
        return self._spawned.returncode

    def diagnostics(self) -> list[str]:
        """What the upstream wrote on stdout that was not JSON-RPC (the wrapper's errors, a stray print)."""
        return list(self._notes)

    def note(self, line: str) -> None:
        if len(self._notes) < _MAX_DIAGNOSTICS:
            self._notes.append(line[:500])
        print(f"tvcache mcp-proxy: the sandboxed upstream wrote a non-JSON line: {line[:500]}", file=sys.stderr)

    def transport(self) -> Transport:
        return _socket_transport(self)

    def kill(self) -> None:
        self._spawned.kill()

    def stop(self, grace: float) -> None:
        """End the upstream (blocking): its stdin closes, it may exit within ``grace`` seconds, then it is killed
        (PID 1 of its namespace: everything it started dies with it)."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(OSError):
            self.channel.shutdown(socket.SHUT_RDWR)
        if grace > 0:
            self._spawned.wait(grace)
        self._spawned.kill()
        self._spawned.wait(None)
        self._spawned.close()
        self.channel.close()
        self._upstreams._track(self, False)


@contextlib.asynccontextmanager
async def _socket_transport(process: _UpstreamProcess) -> AsyncIterator[Any]:
    """The MCP client transport over the upstream's socket: newline-delimited JSON-RPC, as on stdio."""
    channel = process.channel
    channel.setblocking(False)
    loop = asyncio.get_running_loop()
    read_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, write_reader = anyio.create_memory_object_stream[SessionMessage](0)

    async def read() -> None:
        buffer = b""
        async with read_writer:
            with contextlib.suppress(OSError, anyio.ClosedResourceError, anyio.BrokenResourceError):
                while chunk := await loop.sock_recv(channel, _CHUNK):
                    *lines, buffer = (buffer + chunk).split(b"\n")
                    for line in lines:
                        message = _parse(process, line) if line.strip() else None
                        if message is not None:
                            await read_writer.send(message)

    async def write() -> None:
        async with write_reader:
            with contextlib.suppress(OSError, anyio.ClosedResourceError, anyio.BrokenResourceError):
                async for message in write_reader:
                    data = message.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                    await loop.sock_sendall(channel, data.encode())

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(read)
        tasks.start_soon(write)
        try:
            yield read_stream, write_stream
        finally:
            tasks.cancel_scope.cancel()
            for stream in (read_stream, write_stream):
                stream.close()


def _parse(process: _UpstreamProcess, line: bytes) -> SessionMessage | Exception | None:
    """One line from the upstream: a message; a protocol error (JSON that is no valid message, reported to the
    session as the stdio transport does); or None for text that is not JSON at all, kept as a diagnostic (passing
    it on as an error would fail the session's next request over a stray print)."""
    text = line.decode("utf-8", errors="replace")
    try:
        return SessionMessage(types.jsonrpc_message_adapter.validate_json(text, by_name=False))
    except ValueError as error:
        try:
            json.loads(text)
        except ValueError:
            process.note(text)
            return None
        return error
