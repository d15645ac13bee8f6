"""Folder sandboxes: each sandbox is a private copy of a template directory, driven by shell commands.

The built-in ``sh`` tool runs ``bash -c cmd`` inside the folder. The folder's files are the *whole* state, so
anything that could hold state elsewhere is cut off:

- every command is a fresh process: no shell variables, functions, ``cd`` or aliases carry over between calls;
- the environment is fixed (``PATH``, ``HOME`` = the folder, ``LANG``/``LC_ALL`` = C.UTF-8, ``TZ`` = UTC) and
  nothing is inherited from the host process; stdin is ``/dev/null``;
- each command runs in its own process group, which is killed (SIGKILL) as soon as the command ends or times
  out, so background processes cannot keep running or writing. A process that deliberately leaves the group
  (``setsid``) escapes this; when it still holds the output pipe the call reports it and is non-deterministic.

What the sandbox cannot see: commands that read the clock, randomness or the network return different results
for the same state. ``sh`` is still declared deterministic (otherwise nothing could be cached); keep such commands
out of cached tools or wrap them in a ``FolderTool`` declared ``deterministic=False``.

State changes are *proved*, not guessed: unless a tool is declared read-only, the folder is digested before and
after the call (paths, types, modes, sizes, mtimes, contents and link targets; not access times).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import os
import shutil
import stat
import tempfile
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ..calls import ToolCall, ToolSpec
from ..errors import SandboxError
from ..protocol import Outcome, Snapshot, remove_tree, require_new_destination
from .commands import (
    FIXED_PATH,
    SH_TOOL,
    command_timeout,
    fixed_environment,
    kill_group,
    render_shell,
    run_cancellable,
    validated,
)
from .ownership import tree_bytes
from .threads import finish_in_thread

__all__ = ["SH_TOOL", "FolderSandbox", "FolderSandboxFactory", "FolderTool", "digest_folder"]

KIND = "folder"
DIGEST_BYTES = 16
_CHUNK = 1 << 16


@dataclass(frozen=True, kw_only=True, slots=True)
class FolderTool:
    """A Python tool over the sandbox folder: ``fn(folder, **arguments) -> str``, run in a worker thread."""

    fn: Callable[..., str]
    spec: ToolSpec

    @classmethod
    def wrap(
        cls,
        fn: Callable[..., str],
        *,
        name: str | None = None,
        read_only: bool = False,
        deterministic: bool = True,
        arguments: Mapping[str, type | tuple[type, ...]] | None = None,
        optional_arguments: Mapping[str, type | tuple[type, ...]] | None = None,
        description: str | None = None,
    ) -> FolderTool:
        """A tool named after ``fn`` (or ``name``), described by its docstring unless ``description`` is given."""
        spec = ToolSpec(
            name=name or fn.__name__,
            read_only=read_only,
            deterministic=deterministic,
            description=description if description is not None else inspect.getdoc(fn) or "",
            arguments=arguments,
            optional_arguments=dict(optional_arguments or {}),
        )
        return cls(fn=fn, spec=spec)


def digest_folder(folder: Path) -> str:
    """blake2b over the sorted tree: relative path, type, mode, size, mtime_ns, content or link target.

    Access times are left out (reading a file is not a change); directory sizes too (they depend on the
    filesystem, not on the content).
    """
    hasher = hashlib.blake2b(digest_size=DIGEST_BYTES)
    _digest_entry(hasher, os.fsencode(folder), b".", os.lstat(folder))
    return hasher.hexdigest()


def _frame(hasher: Any, data: bytes) -> None:
    hasher.update(len(data).to_bytes(8, "little"))
    hasher.update(data)


def _digest_entry(hasher: Any, path: bytes, relative: bytes, info: os.stat_result) -> None:
    mode = info.st_mode
    if stat.S_ISDIR(mode):
        kind, size = b"d", 0
    elif stat.S_ISREG(mode):
        kind, size = b"f", info.st_size
    elif stat.S_ISLNK(mode):
        kind, size = b"l", info.st_size
    else:
        kind, size = b"o", 0
    _frame(hasher, relative)
    _frame(hasher, b"%s %o %d %d" % (kind, stat.S_IMODE(mode), size, info.st_mtime_ns))
    try:
        if kind == b"f":
            content = hashlib.blake2b(digest_size=DIGEST_BYTES)
            with open(path, "rb") as file:
                while chunk := file.read(_CHUNK):
                    content.update(chunk)
            _frame(hasher, content.digest())
        elif kind == b"l":
            _frame(hasher, os.readlink(path))
        elif kind == b"d":
            with os.scandir(path) as scan:
                entries = sorted(scan, key=lambda entry: entry.name)
            _frame(hasher, b"%d" % len(entries))
            for entry in entries:
                name = os.fsencode(entry.name)
                _digest_entry(
                    hasher, os.path.join(path, name), relative + b"/" + name, entry.stat(follow_symlinks=False)
                )
    except OSError as error:  # unreadable (chmod 000): its metadata above still tells changes apart
        _frame(hasher, f"<unreadable: {error.strerror}>".encode())


def _remove_tree(path: Path) -> None:
    if path.exists() or path.is_symlink():
        remove_tree(path)


def _copy_folder(source: Path, dest: Path) -> None:
    """Copy a tree keeping symlinks as links, hard links as links (a fork must not split two names of one file),
    modes, mtimes and extended attributes as they are, and owners too when running as root (only root can give
    a file to another user; a fork must show the owners its sandbox showed); dest must not exist."""
    copied: dict[tuple[int, int], str] = {}
    keep_owners = os.geteuid() == 0

    def copy_keeping_links(src: str, dst: str) -> str:
        info = os.lstat(src)
        if info.st_nlink > 1:
            first = copied.setdefault((info.st_dev, info.st_ino), dst)
            if first != dst:
                os.link(first, dst)
                return dst
        shutil.copyfile(src, dst, follow_symlinks=False)
        if keep_owners:  # before the mode: chown clears setuid and setgid bits (and file capabilities)
            os.lchown(dst, info.st_uid, info.st_gid)
        shutil.copystat(src, dst, follow_symlinks=False)
        return dst

    try:
        shutil.copytree(source, dest, symlinks=True, copy_function=copy_keeping_links)
        if keep_owners:
            _copy_owners(source, dest)
    except (shutil.Error, OSError) as error:
        _remove_tree(dest)
        raise SandboxError(
            f"cannot copy {source} to {dest}: {error}; special files (pipes, sockets) cannot be copied, "
            "and the disk may be full"
        ) from error


def _copy_owners(source: Path, dest: Path) -> None:
    """Give the directories and symlinks of a copied tree the owners of the source's (files got theirs while
    copied). Neither loses anything to chown: it clears setuid and setgid bits of files only."""
    for directory, dirs, files in os.walk(source):
        relative = os.path.relpath(directory, source)
        info = os.lstat(directory)
        os.lchown(os.path.join(dest, relative), info.st_uid, info.st_gid)
        for name in dirs + files:  # os.walk lists symlinks to directories among dirs, and does not follow them
            path = os.path.join(directory, name)
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                os.lchown(os.path.join(dest, relative, name), info.st_uid, info.st_gid)


class FolderSandboxFactory:
    """Starts folder sandboxes from a template directory (never modified) and forks them from snapshots.

    Sandbox folders live under a private temp root (``root``), removed by ``close()``, when the factory is
    garbage collected, or at interpreter exit.
    """

    kind: str = KIND

    def __init__(
        self,
        template_dir: str | os.PathLike[str],
        *,
        tools: Mapping[str, FolderTool] | None = None,
        timeout: float = 60.0,
        prove_read_only: bool = True,
        max_output_bytes: int = 1_000_000,
    ) -> None:
        template = Path(template_dir)
        if not template.is_dir():
            raise SandboxError(f"folder template {template} does not exist or is not a directory")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if max_output_bytes < 1:
            raise ValueError(f"max_output_bytes must be >= 1, got {max_output_bytes}")
        bash = shutil.which("bash", path=FIXED_PATH)
        if bash is None:
            raise SandboxError(f"bash was not found on {FIXED_PATH}; install bash to use folder sandboxes")
        extra = dict(tools or {})
        for name, tool in extra.items():
            if name != tool.spec.name:
                raise ValueError(f"tool registered as {name!r} but its spec is named {tool.spec.name!r}")
            if name == SH_TOOL.name:
                raise ValueError(f"{name!r} is the built-in shell tool; give the extra tool another name")
        self.template = template
        self.timeout = float(timeout)
        self.prove_read_only = prove_read_only
        self.max_output_bytes = max_output_bytes
        self.bash = bash
        self.extra_tools: Mapping[str, FolderTool] = MappingProxyType(extra)
        self._tools: Mapping[str, ToolSpec] = MappingProxyType(
            {SH_TOOL.name: SH_TOOL, **{name: tool.spec for name, tool in extra.items()}}
        )
        # Rough priors in seconds for a small template; the cache replaces them with measurements.
        self.cost_hints: dict[str, float] = {"start": 0.005, "fork": 0.005, "snapshot": 0.005}
        self._root = Path(tempfile.mkdtemp(prefix="tvcache-folder-"))
        self._cleanup = weakref.finalize(self, _remove_tree, self._root)

    @property
    def tools(self) -> Mapping[str, ToolSpec]:
        return self._tools

    @property
    def root(self) -> Path:
        """The temp directory holding every live sandbox folder of this factory."""
        return self._root

    async def start(self) -> FolderSandbox:
        return await self._spawn(self.template)

    async def fork(self, snapshot: Snapshot) -> FolderSandbox:
        if snapshot.kind != KIND:
            raise SandboxError(f"cannot fork a folder sandbox from a {snapshot.kind!r} snapshot; use its own backend")
        path = Path(snapshot.path)
        if not path.is_dir():
            raise SandboxError(
                f"snapshot folder {path} is missing (discarded or deleted); rebuild the state by replaying its calls"
            )
        return await self._spawn(path)

    def discard(self, snapshot: Snapshot) -> None:
        _remove_tree(Path(snapshot.path))

    def close(self) -> None:
        """Remove the temp root and every sandbox folder in it; live sandboxes of this factory stop working."""
        self._cleanup()

    async def _spawn(self, source: Path) -> FolderSandbox:
        if not self._cleanup.alive:
            raise SandboxError("this folder sandbox factory was closed; create a new one")

        def copy() -> Path:
            folder = Path(tempfile.mkdtemp(dir=self._root, prefix="sandbox-"))
            folder.rmdir()  # copytree creates it, with the source's mode and mtime
            _copy_folder(source, folder)
            return folder

        # A cancelled caller waits until the source is no longer read (a fork's caller may release the snapshot
        # as soon as it returns), and the copy goes.
        return FolderSandbox(self, await finish_in_thread(copy, undo=_remove_tree))

    def __repr__(self) -> str:
        return f"FolderSandboxFactory({str(self.template)!r}, tools={sorted(self._tools)})"


class FolderSandbox:
    """One private working folder. Calls are serialised by a lock; blocking work runs in worker threads, and a
    cancelled caller keeps the lock until its thread is done (``finish_in_thread``), so a thread still copying,
    digesting or running a tool never overlaps the next call, snapshot or ``stop()``."""

    def __init__(self, factory: FolderSandboxFactory, folder: Path) -> None:
        self._factory = factory
        self._folder: Path | None = folder
        self._lock = asyncio.Lock()
        self._live_groups: set[int] = set()
        # The digest after the last proved call: nothing touches the folder between calls, so it is the next
        # call's "before" digest, which halves the digesting work.
        self._last_digest: str | None = None

    @classmethod
    def factory(
        cls,
        template_dir: str | os.PathLike[str],
        *,
        tools: Mapping[str, FolderTool] | None = None,
        timeout: float = 60.0,
        prove_read_only: bool = True,
        max_output_bytes: int = 1_000_000,
    ) -> FolderSandboxFactory:
        """A factory of sandboxes copied from ``template_dir``, serving ``sh`` plus the extra ``tools``.

        ``timeout`` is the default and maximum seconds per ``sh`` call; ``prove_read_only`` digests the folder
        around each call not declared read-only to report whether it changed anything.
        """
        return FolderSandboxFactory(
            template_dir,
            tools=tools,
            timeout=timeout,
            prove_read_only=prove_read_only,
            max_output_bytes=max_output_bytes,
        )

    @property
    def folder(self) -> Path:
        """The sandbox's working folder (raises SandboxError once stopped)."""
        return self._require_open()

    def _require_open(self) -> Path:
        if self._folder is None:
            raise SandboxError("this folder sandbox was stopped; start or fork a new one from the factory")
        return self._folder

    async def execute(self, call: ToolCall) -> Outcome:
        spec, arguments = validated(call, self._factory.tools)
        timeout = self._factory.timeout
        if call.name == SH_TOOL.name:
            timeout = command_timeout(arguments, timeout)
        async with self._lock:
            folder = self._require_open()
            prove = self._factory.prove_read_only and not spec.read_only
            before = (self._last_digest or await self._digest(folder)) if prove else None
            self._last_digest = None
            if call.name == SH_TOOL.name:
                outcome = await self._run_sh(folder, arguments["cmd"], timeout)
            else:
                outcome = await self._run_tool(folder, self._factory.extra_tools[call.name], arguments)
            changed: bool | None = False if spec.read_only else None
            if prove:
                self._last_digest = await self._digest(folder)
                changed = before != self._last_digest
        return Outcome(
            output=outcome.output,
            is_error=outcome.is_error,
            changed_state=changed,
            deterministic=outcome.deterministic,
        )

    async def _run_sh(self, folder: Path, command: str, timeout: float) -> Outcome:
        limit = self._factory.max_output_bytes
        try:
            result = await run_cancellable(
                [self._factory.bash, "-c", command],
                live_groups=self._live_groups,
                cwd=folder,
                env=fixed_environment(str(folder)),
                timeout=timeout,
                limit=limit,
            )
        except OSError as error:
            raise SandboxError(f"cannot run bash in {folder}: {error}; was the folder removed?") from error
        return render_shell(result, limit, timeout)

    async def _digest(self, folder: Path) -> str:
        try:
            return await finish_in_thread(lambda: digest_folder(folder))
        except OSError as error:
            raise SandboxError(
                f"cannot read the sandbox folder {folder}: {error}; it was removed or made unreadable from outside, "
                "so stop this sandbox and fork a new one"
            ) from error

    async def _run_tool(self, folder: Path, tool: FolderTool, arguments: dict[str, Any]) -> Outcome:
        try:
            output = await finish_in_thread(lambda: tool.fn(folder, **arguments))
        except Exception as error:  # the tool's failure is the agent's observation, not a broken sandbox
            # The folder's absolute path differs in every sandbox: show paths relative to it, so the same
            # failure reads the same wherever it happens (and a cached error equals a fresh one).
            message = str(error).replace(str(folder) + os.sep, "").replace(str(folder), ".")
            return Outcome(output=f"Error: {type(error).__name__}: {message}", is_error=True)
        if not isinstance(output, str):
            raise SandboxError(
                f"folder tool {tool.spec.name!r} returned {type(output).__name__}; a FolderTool must return str"
            )
        return Outcome(output=output)

    async def snapshot(self, dest: Path) -> Snapshot:
        dest = Path(dest)
        async with self._lock:
            folder = self._require_open()

            def copy() -> int:
                require_new_destination(dest)
                dest.parent.mkdir(parents=True, exist_ok=True)
                partial = dest.with_name(dest.name + ".partial")
                _remove_tree(partial)
                _copy_folder(folder, partial)
                os.replace(partial, dest)  # a crash never leaves a half-copied tree under the final name
                return tree_bytes(dest)

            # Cancelled: the copy finishes (the lock is kept until it has) and goes, as no one will record it.
            size = await finish_in_thread(copy, undo=lambda _: _remove_tree(dest))
        return Snapshot(kind=KIND, path=str(dest), bytes=size)

    async def state_digest(self) -> str:
        async with self._lock:
            folder = self._require_open()
            self._last_digest = await self._digest(folder)
            return self._last_digest

    async def stop(self) -> None:
        async with self._lock:
            folder, self._folder = self._folder, None
            if folder is None:
                return
            for group in list(self._live_groups):  # a call whose awaiting task was cancelled may still run
                kill_group(group)
            await finish_in_thread(lambda: _remove_tree(folder))
