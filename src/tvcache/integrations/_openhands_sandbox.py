"""The sandbox behind ``openhands.CachingWorkspace``: one persistent shell sandbox (``ShellSandbox.factory(tree,
persistent=True)``) answering the OpenHands SDK's workspace operations as tvcache tool calls.

The rule: do in the sandbox what the SDK's ``LocalWorkspace`` does on the host, and answer as it answers.

* ``execute_command`` runs ``/bin/sh -c COMMAND`` (``subprocess.Popen(shell=True)``'s shell) as a child of the
  session's shell, in its working directory, with the environment the SDK's own ``sanitized_env`` makes of the
  shell factory's (``AI_AGENT=openhands`` added), stdin at end of file. Its stdout and stderr are read through
  pipes until every writer has closed them, as the SDK's reader threads read them (a background process that
  keeps them open holds the answer back); past ``timeout`` the command is killed (``SIGKILL``, its process
  group with it) and the answer is exit code -1 with ``timeout_occurred``, never cached. A working directory
  that is missing raises the ``OSError`` ``Popen`` raises.
* ``file_upload`` and ``file_download`` copy as ``shutil.copy2`` does (contents, permission bits, access and
  modification times; into a directory by the source's name) and answer a ``FileOperationResult``, errors
  included in it as ``str(error)``, never raised. The host side of each (reading an upload's source, writing
  a download's destination) runs on the host, in Python, as there.
* ``git_changes`` and ``git_diff`` run the SDK's own ``openhands.sdk.git`` code inside the sandbox, with this
  process's Python (so the factory must show it: ``visible=sdk_paths()``), and answer its models or raise its
  exceptions. Its package initialiser is skipped there (it loads LiteLLM: seconds per call); the git modules
  need nothing from it.

Every command runs in a subshell (``exec -c`` bash with an empty environment), so the session's shell itself is
never changed by a call: its own state stays what the factory made it, and a snapshot carries only files and
processes. Downloads only read (``changed_state=False``); every other call may change files.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import json
import os
import shlex
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..calls import ToolCall, ToolSpec
from ..errors import InvalidToolCall, SandboxError, SnapshotDeclined, UnknownTool
from ..protocol import Outcome, Sandbox, Snapshot
from ..sandboxes.commands import FIXED_PATH
from ..sandboxes.shell.sandbox import ShellSandboxFactory
from ._over_shells import OverPersistentShells
from ._recorded_errors import class_path, rebuilt_described

__all__ = [
    "SHELL_KIND",
    "WorkspaceShellFactory",
    "WorkspaceShellSandbox",
    "sdk_paths",
    "workspace_tool_specs",
]

SHELL_KIND = "openhands-shell"
_FRAME = "@@tvcache-openhands@@"
_END = "@@tvcache-openhands-end@@"
_SLACK = 30.0  # seconds the shell call gets beyond a command's own timeout (its pipes may drain that long)

# The helper every call runs in: bash started by `exec -c` (an empty environment) from a subshell of the session's
# shell. $1 is the operation. Fields are printed one per line between two markers assembled at run time (so no
# echo of this script forges them); data crosses as base64; stdin carries an upload's data, else /dev/null.
_HELPER = r"""set -o pipefail
frame() {
  builtin printf '\n@@%s@@\n' tvcache-openhands; builtin printf '%s\n' "$@"
  builtin printf '@@%s@@\n' tvcache-openhands-end
}
why() { builtin printf %s "$1" | base64 -w0; }
op=$1; shift
umask 0022
case $op in
exec)
  cwd=$1 limit=$2 drain=$3 n=$4; shift 4; envs=("${@:1:n}"); shift "$n"
  if [ ! -e "$cwd" ]; then frame nocwd ENOENT; exit 0; fi
  if [ ! -d "$cwd" ]; then frame nocwd ENOTDIR; exit 0; fi
  builtin cd -- "$cwd" || { frame nocwd EACCES; exit 0; }
  d=$(mktemp -d) && mkfifo "$d/o" "$d/e" || { frame failed "$(why 'mktemp or mkfifo failed')"; exit 0; }
  trap 'rm -rf -- "$d"' EXIT
  # Readers first (a fifo opens for writing once read); each reads until every writer closed its pipe.
  timeout -s KILL "$drain" base64 -w0 <"$d/o" >"$d/O" & ro=$!
  timeout -s KILL "$drain" base64 -w0 <"$d/e" >"$d/E" & re=$!
  began=$EPOCHREALTIME
  env -i -- "${envs[@]}" "$(type -P timeout)" -s KILL "$limit" /bin/sh -c "$1" </dev/null >"$d/o" 2>"$d/e"
  rc=$? ended=$EPOCHREALTIME
  wait "$ro"; so=$?; wait "$re"; se=$?
  frame ok "$rc" "$began" "$ended" "$so" "$se" "$(<"$d/O")" "$(<"$d/E")" ;;
put)
  target=$1 name=$2 mode=$3 atime=$4 mtime=$5 content=$6
  parent=$(dirname -- "$target")
  if ! err=$(mkdir -p -- "$parent" 2>&1); then frame failed "$(why "$err")"; exit 0; fi
  [ "$content" = 1 ] || { frame ok; exit 0; }
  into=$target; [ -d "$into" ] && into=${into%/}/$name
  if [ -d "$into" ]; then frame oserror EISDIR "$into"; exit 0; fi
  if ! err=$( { base64 -d > "$into" && touch -a -d "@$atime" -- "$into" && touch -m -d "@$mtime" -- "$into" &&
                chmod "$mode" -- "$into"; } 2>&1 ); then frame failed "$(why "$err")"; exit 0; fi
  frame ok "$(stat -c %s -- "$target")" ;;
get)
  p=$1
  if [ -d "$p" ]; then frame oserror EISDIR "$p"; exit 0; fi
  if [ ! -e "$p" ]; then frame oserror ENOENT "$p"; exit 0; fi
  if ! data=$(base64 -w0 -- "$p" 2>/dev/null); then frame oserror EACCES "$p"; exit 0; fi
  frame ok "$(stat -L -c '%a %.9X %.9Y' -- "$p")" "$data" ;;
git)
  "$@" </dev/null 2>/dev/null || frame failed "$(why "python exited with status $?")" ;;
esac
"""

# What `git_changes` and `git_diff` run inside the sandbox: the SDK's own git module, as LocalWorkspace calls it.
# The SDK's package initialiser imports LiteLLM (seconds per call); the git modules need nothing from it, so the
# packages above them are entered without running their __init__.
_GIT = r"""
import importlib.util, json, sys, types
from pathlib import Path

def describe(error):
    cls = type(error)
    found = {"class": f"{cls.__module__}:{cls.__qualname__}", "args": list(error.args), "attrs": dict(vars(error))}
    if isinstance(error, OSError):
        found["filename"], found["filename2"] = error.filename, error.filename2
    return found

def enter(package):
    spec = importlib.util.find_spec(package)
    module = types.ModuleType(package)
    module.__path__ = list(spec.submodule_search_locations)
    sys.modules[package] = module

op, working_dir, path = sys.argv[1:4]
try:
    enter("openhands.sdk")
    enter("openhands.sdk.utils")
    if op == "git_changes":
        from openhands.sdk.git.git_changes import get_git_changes
        payload = {"value": [c.model_dump(mode="json") for c in get_git_changes(Path(working_dir) / path)]}
    else:
        from openhands.sdk.git.git_diff import get_git_diff
        payload = {"value": get_git_diff(Path(working_dir) / path).model_dump(mode="json")}
except Exception as error:
    payload = {"raise": describe(error)}
try:
    text = json.dumps(payload)
except TypeError:
    text = json.dumps({"unrecorded": repr(payload)})
sys.stdout.write("\n@@tvcache-openhands@@\nok\n" + text + "\n@@tvcache-openhands-end@@\n")
"""


def workspace_tool_specs(deterministic: bool | None = None) -> dict[str, ToolSpec]:
    """The workspace's operations as cached tools. Only ``execute_command`` runs what the agent wrote, so only
    its determinism is the caller's to declare (None: checked on its first hit per task)."""
    return {
        "execute_command": ToolSpec(name="execute_command", deterministic=deterministic),
        "file_upload": ToolSpec(name="file_upload", deterministic=True),
        "file_download": ToolSpec(name="file_download", read_only=True, deterministic=True),
        "git_changes": ToolSpec(name="git_changes", deterministic=True),
        "git_diff": ToolSpec(name="git_diff", deterministic=True),
    }


def sdk_paths() -> tuple[str, ...]:
    """The host paths a shell factory must show (``visible=``) for ``git_changes`` and ``git_diff``, which run
    the SDK's git code inside the sandbox with this process's Python: its environment and its base install."""
    return tuple(dict.fromkeys(os.path.realpath(path) for path in (sys.prefix, sys.base_prefix)))


def os_error(name: str, path: str) -> dict[str, Any]:
    """The description of the ``OSError`` Python raises for errno ``name`` on ``path``."""
    number = getattr(errno, name)
    cls = {"ENOENT": FileNotFoundError, "ENOTDIR": NotADirectoryError, "EISDIR": IsADirectoryError}.get(
        name, PermissionError if name == "EACCES" else OSError
    )
    return {"class": class_path(cls), "args": [number, os.strerror(number)], "filename": path}


class WorkspaceShellFactory(OverPersistentShells["WorkspaceShellSandbox"]):
    """tvcache sandboxes that answer workspace operations in persistent shells of ``shell``; their snapshots are
    the shell backend's (files plus shell state), under their own kind. ``uploads``: where the workspace keeps
    what it uploads (by content digest); ``environment``: what each command gets; ``python``: the interpreter
    that runs the SDK's git code in the sandbox."""

    kind = SHELL_KIND
    needs = "an OpenHands workspace needs"
    sandbox = "an OpenHands workspace sandbox"

    def __init__(
        self,
        shell: ShellSandboxFactory,
        *,
        uploads: Path,
        environment: Mapping[str, str],
        python: str,
        pauses: Path,
        deterministic: bool | None = None,
    ) -> None:
        super().__init__(shell, workspace_tool_specs(deterministic))
        self.uploads = uploads
        self.environment = dict(environment)
        self.python = python
        self.pauses = pauses
        self.live: WorkspaceShellSandbox | None = None  # the newest sandbox, what ``pause`` freezes

    def wrap(self, inner: Sandbox) -> WorkspaceShellSandbox:
        self.live = WorkspaceShellSandbox(inner, self)
        return self.live


class WorkspaceShellSandbox:
    """One persistent shell sandbox answering workspace operations (see the module docstring). Its outputs are
    JSON payloads the workspace turns into the SDK's models, or exceptions. ``pause`` freezes it into a snapshot
    of its own and stops its shell; the next use forks it back (a fork equals its origin)."""

    def __init__(self, inner: Any, factory: WorkspaceShellFactory) -> None:
        self.inner: Any = inner
        self._factory = factory
        shell = factory.shell
        path = shell.environment.get("PATH", FIXED_PATH)
        self._helper = shlex.quote(f"PATH={shlex.quote(path)}\n{_HELPER}")  # exec -c cleared PATH: its own tools
        self._bash = shlex.quote(shell.bash)
        self._env = [f"{key}={value}" for key, value in factory.environment.items()]
        self._paused: Snapshot | None = None
        self._pauses = 0
        self._lock = asyncio.Lock()  # pause and resume swap the shell under the calls

    # ------------------------------------------------------------ protocol

    async def execute(self, call: ToolCall) -> Outcome:
        handler = {
            "execute_command": self._execute_command,
            "file_upload": self._file_upload,
            "file_download": self._file_download,
            "git_changes": self._git,
            "git_diff": self._git,
        }.get(call.name)
        if handler is None:
            raise UnknownTool(call.name, list(self._factory.tools))
        async with self._lock:
            await self._resume()
            payload, deterministic = await handler(call)
        return Outcome(
            output=json.dumps(payload),
            is_error="raise" in payload or payload.get("error") is not None,
            changed_state=call.name != "file_download",
            deterministic=deterministic,
        )

    async def snapshot(self, dest: Path) -> Snapshot:
        async with self._lock:
            await self._resume()
            inner = await self.inner.snapshot(dest)
        return Snapshot(kind=SHELL_KIND, path=inner.path, bytes=inner.bytes, meta=inner.meta)

    async def state_digest(self) -> str | None:
        async with self._lock:
            await self._resume()
            digest: str | None = await self.inner.state_digest()
        return digest

    async def stop(self) -> None:
        async with self._lock:
            paused, self._paused = self._paused, None
            if paused is not None:
                self._factory.shell.discard(paused)
            else:
                await self.inner.stop()
        if self._factory.live is self:
            self._factory.live = None

    @property
    def trusted(self) -> bool:
        return bool(getattr(self.inner, "trusted", True))

    # ---------------------------------------------------------- pause, resume

    async def pause(self) -> bool:
        """Freeze this sandbox into a snapshot and stop its shell; False (and it runs on) where the shell
        backend declines the snapshot (processes it cannot carry)."""
        async with self._lock:
            if self._paused is not None:
                return True
            self._pauses += 1
            dest = self._factory.pauses / f"{id(self):x}-{self._pauses}"
            try:
                self._paused = await self.inner.snapshot(dest)
            except SnapshotDeclined:
                return False
            await self.inner.stop()
            return True

    async def resume(self) -> None:
        async with self._lock:
            await self._resume()

    async def _resume(self) -> None:
        paused = self._paused
        if paused is None:
            return
        self.inner = await self._factory.shell.fork(paused)
        self._paused = None
        self._factory.shell.discard(paused)

    # ------------------------------------------------------------ operations

    async def _run(self, operation: str, *args: str, data: bytes | None = None, timeout: float | None = None) -> Any:
        """Run the helper (``_HELPER``): the shell's outcome and the fields of the frame it printed (None if it
        printed none: the call timed out, or its output was cut)."""
        if any("\x00" in arg for arg in args):
            raise InvalidToolCall("an OpenHands workspace call cannot carry NUL characters (bash never sees them)")
        quoted = " ".join(shlex.quote(arg) for arg in (operation, *args))
        stdin = f"<<< {base64.b64encode(data).decode()}" if data is not None else "</dev/null"
        command = f"( \\builtin exec -c {self._bash} --norc --noprofile -c {self._helper} tvcache {quoted} ) {stdin}"
        arguments: dict[str, Any] = {"cmd": command}
        if timeout is not None:
            arguments["timeout"] = timeout
        outcome: Outcome = await self.inner.execute(ToolCall("sh", arguments))
        text = outcome.output
        begin = text.rfind(f"\n{_FRAME}\n")
        end = text.find(f"{_END}\n", begin + 1)
        if begin < 0 or end < 0:
            return outcome, None
        return outcome, text[begin + len(_FRAME) + 2 : end].split("\n")[:-1]

    def _no_answer(self, outcome: Outcome, what: str) -> SandboxError:
        limit = self._factory.shell.max_output_bytes
        return SandboxError(
            f"{what} gave no answer in the workspace's sandbox ({outcome.output[-300:]!r}); an output or a file "
            f"of more than max_output_bytes={limit} (as base64) does not fit: raise the shell factory's "
            "max_output_bytes"
        )

    async def _execute_command(self, call: ToolCall) -> tuple[dict[str, Any], bool]:
        arguments = call.arguments
        limit = max(float(arguments["timeout"]), 0.001)  # `timeout 0` would mean no limit at all
        drain = 2 * limit  # the SDK waits `timeout` for the process, then `timeout` more for its pipes
        env = self._env
        outcome, fields = await self._run(
            "exec", arguments["cwd"], f"{limit}", f"{drain}", str(len(env)), *env, arguments["command"],
            timeout=drain + _SLACK,
        )  # fmt: skip
        if fields is None:
            raise self._no_answer(outcome, "execute_command")
        if fields[0] == "nocwd":
            return {"raise": os_error(fields[1], arguments["cwd"])}, outcome.deterministic
        if fields[0] != "ok":
            raise SandboxError(f"execute_command failed in the sandbox: {_why(fields)}")
        code, began, ended = int(fields[1]), float(fields[2]), float(fields[3])
        drained = fields[4] == "0" and fields[5] == "0"
        timed_out = code == 137 and ended - began >= limit
        result = {
            "command": arguments["command"],
            "exit_code": -1 if timed_out else code,
            "stdout": _text(fields[6]),
            "stderr": _text(fields[7]),
            "timeout_occurred": timed_out,
        }
        # A timeout, or pipes a background process held past the drain: how much was read depends on timing.
        return {"result": result}, outcome.deterministic and drained and not timed_out

    async def _file_upload(self, call: ToolCall) -> tuple[dict[str, Any], bool]:
        arguments = call.arguments
        digest = arguments["digest"]
        data = None if digest is None else (self._factory.uploads / digest).read_bytes()
        outcome, fields = await self._run(
            "put", arguments["destination"], arguments["name"], f"{arguments['mode']:o}",
            _seconds(arguments["atime_ns"]), _seconds(arguments["mtime_ns"]), "0" if data is None else "1", data=data,
        )  # fmt: skip
        if fields is None:
            raise self._no_answer(outcome, "file_upload")
        if fields[0] == "ok":
            return {"size": int(fields[1]) if len(fields) > 1 else None}, outcome.deterministic
        if fields[0] == "oserror":
            return {"error": str(rebuilt_described(os_error(fields[1], fields[2])))}, outcome.deterministic
        return {"error": _why(fields)}, outcome.deterministic

    async def _file_download(self, call: ToolCall) -> tuple[dict[str, Any], bool]:
        source = call.arguments["source"]
        outcome, fields = await self._run("get", source)
        if fields is None:
            raise self._no_answer(outcome, "file_download")
        if fields[0] == "oserror":
            return {"raise": os_error(fields[1], fields[2])}, outcome.deterministic
        mode, atime, mtime = fields[1].split()
        found = {"mode": int(mode, 8), "atime_ns": _nanoseconds(atime), "mtime_ns": _nanoseconds(mtime)}
        return {"file": {**found, "data": fields[2]}}, outcome.deterministic

    async def _git(self, call: ToolCall) -> tuple[dict[str, Any], bool]:
        arguments = call.arguments
        argv = [self._factory.python, "-I", "-c", _GIT, call.name, arguments["working_dir"], arguments["path"]]
        started = time.monotonic()
        outcome, fields = await self._run("git", *argv)
        if fields is None:
            raise self._no_answer(outcome, call.name)
        if fields[0] != "ok":
            raise SandboxError(
                f"{call.name} could not run the SDK's git code in the sandbox ({_why(fields)}, after "
                f"{time.monotonic() - started:.1f} s): the shell factory must show this process's Python, "
                "ShellSandbox.factory(tree, persistent=True, visible=sdk_paths())"
            )
        payload: dict[str, Any] = json.loads(fields[1])
        if "unrecorded" in payload:
            raise SandboxError(f"{call.name} raised an error that cannot cross as JSON: {payload['unrecorded']}")
        return payload, outcome.deterministic

    def __repr__(self) -> str:
        return f"WorkspaceShellSandbox({self.inner!r}, paused={self._paused is not None})"


def _why(fields: list[str]) -> str:
    return base64.b64decode(fields[1]).decode(errors="replace") if len(fields) > 1 else fields[0]


def _text(encoded: str) -> str:
    """Output bytes as ``subprocess`` text mode reads them: UTF-8, universal newlines (undecodable bytes are
    replaced here; the SDK's reader thread stops at them)."""
    text = base64.b64decode(encoded).decode(errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _seconds(nanoseconds: int) -> str:
    return f"{nanoseconds // 1_000_000_000}.{nanoseconds % 1_000_000_000:09d}"


def _nanoseconds(seconds: str) -> int:
    whole, _, fraction = seconds.partition(".")
    return int(whole) * 1_000_000_000 + int(fraction.ljust(9, "0")[:9])
