"""SWE-ReX on tvcache's persistent shell sandboxes: a runtime whose bash session is one confined, long-lived shell
on an overlay (``ShellSandbox.factory(tree, persistent=True)``), with no SWE-ReX runtime, container or server.

``ShellRuntime`` (in ``_swerex_shell_runtime``) speaks SWE-ReX's runtime API with its own request and response
models; ``ShellDeployment`` runs it uncached, ``swerex.CachingDeployment(shell_factory, ...)`` through a tvcache
graph, where snapshots carry the shell's state (working directory, variables, functions, aliases, options) so a
divergent rollout forks the snapshot nearest its divergence instead of replaying its prefix. This module holds
the sandbox those requests run in.

How each request maps onto the sandbox (one ``sh`` call each; ``SweRexShellSandbox`` does the mapping):

* ``create_session`` sources the request's ``startup_source`` files in the shell. A sandbox has one shell, so a
  runtime has one bash session at a time: a second session, or a new one after ``close_session``, is refused
  with ``InvalidToolCall`` (use one deployment per session). Session names are checked as SWE-ReX does
  (``SessionExistsError``, ``SessionDoesNotExistError``), before anything runs.
* ``run_in_session(BashAction)`` first checks the syntax with ``bash -n`` on the host, as SWE-ReX does
  (``BashIncorrectSyntaxError``), then types the command followed by SWE-ReX's own exit-code probe (``echo
  EXITCODESTART$?EXITCODEEND``), so ``$?`` afterwards is 0 as in SWE-ReX; ``check="ignore"`` leaves ``$?`` as
  the command set it and reports no exit code. Output is stripped of ANSI escapes as SWE-ReX strips it;
  ``check="raise"`` raises ``NonZeroExitCodeError`` with SWE-ReX's message, a timeout ``CommandTimeoutError``
  (the shell interrupts the command and lives on; never cached). An output cut by the sandbox's
  ``max_output_bytes`` or a shell that ended loses the exit code: ``NoExitCodeError`` under ``check="raise"``,
  else ``exit_code=None`` with a ``failure_reason``. Interrupts answer at once (a command never outlives its
  call here); interactive commands and ``expect`` patterns are refused (they depend on timing).
* ``execute``, ``read_file``, ``write_file`` and ``upload`` run in a fresh bash started from the session's
  shell with an empty environment (``exec -c``), so they see the session's files (its private ``/tmp`` too) but
  none of its variables, functions, aliases, options or umask, and leave its ``$?`` as it was; ``execute``
  gets the sandbox's environment (or ``env``), relative paths and ``cwd=None`` mean the sandbox's tree (``/``
  for a root filesystem), as a runtime started there would see them. Errors are the ones Python raises in
  SWE-ReX's ``LocalRuntime`` (``FileNotFoundError``, ``IsADirectoryError``, ``FileExistsError``, ...).

Not exactly as in a SWE-ReX ``LocalRuntime`` (documented in docs/harnesses.md): ``$LINENO`` and ``$_``
(every request moves them, as typed lines do), ``PS1``/``PS2``/``PS0`` (the protocol keeps them empty),
undecodable output bytes (replaced, not backslash-escaped), and a killed ``execute`` program's code (128+N, as
a shell reports it). Every request counts as state-changing, reads included: each moves ``$LINENO``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import importlib
import io
import json
import os
import re
import shlex
import shutil
import tarfile
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from ..calls import ToolCall, ToolSpec
from ..errors import InvalidToolCall, SandboxError, UnknownTool
from ..protocol import Outcome, Snapshot
from ..sandboxes.shell.process import FIXED_PATH
from ..sandboxes.shell.sandbox import ShellSandboxFactory
from .optional_imports import require

__all__ = [
    "PS1",
    "SHELL_KIND",
    "SweRexShellFactory",
    "SweRexShellSandbox",
    "answer",
    "keep_upload",
    "shell_tool_specs",
    "tree_digest",
]

SHELL_KIND = "swe-rex-shell"
PS1 = "SHELLPS1PREFIX"  # what SWE-ReX's BashSession reports as the matched expect string of a command
_TOOLS = ("create_session", "run_in_session", "execute", "read_file", "write_file", "upload")
_ANSI = re.compile(r"\x1B[@-_][0-?]*[ -/]*[@-~]")  # SWE-ReX's own _strip_control_chars
_PROBE = "\n\necho EXITCODESTART$?EXITCODEEND"  # the blank line ends a trailing backslash continuation first
_PROBED = re.compile(r"EXITCODESTART([0-9]+)EXITCODEEND\n\Z")
_END = "\n@@tvcache-swerex-end@@\n"
# check="ignore": a marker, then the command's status given back (`let` and `&& :` keep errexit from firing).
_MARK = (
    "\n\n\\builtin eval \"\\builtin printf '\\n@@%s@@\\n' tvcache-swerex-end; "
    '\\builtin let $?==0 || (\\builtin exit $?) && :"'
)
_NOTES = re.compile(r"(\[exit code \d+\]|\[killed by signal \d+\])?\Z")
_TIMED_OUT = re.compile(r"\[timed out after [^\]]*s\]\Z")

# The helper every non-session request runs in, started by `exec -c` (an empty environment) from a subshell of the
# session's shell: the session's files and mounts, none of its shell state. $0 is "tvcache", $1 the operation.
# Fields are printed one per line between two markers assembled at run time (so no echo of this script forges
# them); data crosses as base64. stdin carries the data of write/upload, else /dev/null.
_HELPER = r"""set -o pipefail
frame() {
  builtin printf '\n@@%s@@\n' tvcache-swerex; builtin printf '%s\n' "$@"; builtin printf '@@%s@@\n' tvcache-swerex-end
}
b64() { builtin printf %s "$1" | base64 -w0; }
op=$1 root=$2; shift 2
umask 0022; builtin cd -- "$root" || { frame failed "$(b64 "cannot enter $root")"; exit 0; }
case $op in
read)
  p=$1
  if [ -d "$p" ]; then frame isdir; elif [ ! -e "$p" ]; then frame missing; elif [ ! -r "$p" ]; then frame denied
  elif data=$(base64 -w0 -- "$p" 2>&1); then frame ok "$data"; else frame failed "$(b64 "$data")"; fi ;;
write)
  p=$1
  if [ -d "$p" ]; then frame isdir
  elif err=$( { mkdir -p -- "$(dirname -- "$p")" && base64 -d > "$p"; } 2>&1 ); then frame ok
  else frame failed "$(b64 "$err")"; fi ;;
putfile)
  t=$1; [ -d "$t" ] && t=${t%/}/$2
  if [ ! -d "$(dirname -- "$t")" ]; then frame missing
  elif err=$( { base64 -d > "$t" && chmod "$3" -- "$t"; } 2>&1 ); then frame ok
  else frame failed "$(b64 "$err")"; fi ;;
putdir)
  t=$1
  if [ -e "$t" ]; then frame exists
  elif err=$( { mkdir -p -- "$t" && base64 -d | tar -x --no-same-owner -f - -C "$t"; } 2>&1 ); then frame ok
  else frame failed "$(b64 "$err")"; fi ;;
exec)
  cwd=$1 merge=$2 n=$3; shift 3; envs=("${@:1:n}"); shift "$n"
  if [ -n "$cwd" ] && ! builtin cd -- "$cwd" 2>/dev/null; then frame nocwd; exit 0; fi
  o=$(mktemp) && e=$(mktemp) || { frame failed "$(b64 "mktemp failed")"; exit 0; }
  trap 'rm -f -- "$o" "$e"' EXIT
  if [ "$merge" = 1 ]; then env -i -- "${envs[@]}" "$@" </dev/null >"$o" 2>&1
  else env -i -- "${envs[@]}" "$@" </dev/null >"$o" 2>"$e"; fi
  rc=$?
  frame ok "$rc" "$(base64 -w0 < "$o")" "$(base64 -w0 < "$e")" ;;
esac
"""


def shell_tool_specs(deterministic: bool | None = None) -> dict[str, ToolSpec]:
    """The runtime's requests as cached tools; every one changes the state (each moves the shell's $LINENO)."""
    return {name: ToolSpec(name=name, deterministic=deterministic) for name in _TOOLS}


def tree_digest(path: Path) -> str:
    """A digest of a file or directory tree: relative names, kinds, modes, link targets and contents."""
    digest = hashlib.blake2b(digest_size=16)
    if not path.is_dir():  # a file is uploaded by its content (a link is followed, as the runtimes copy)
        digest.update(f"file\0{path.stat().st_mode:o}\0".encode() + path.read_bytes())
        return digest.hexdigest()
    for entry in sorted(path.rglob("*")):
        name = entry.relative_to(path).as_posix()
        mode = entry.lstat().st_mode
        digest.update(f"{name}\0{mode:o}\0".encode())
        if entry.is_symlink():
            digest.update(os.readlink(entry).encode())
        elif entry.is_file():
            digest.update(entry.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def keep_upload(source: Path, uploads: Path) -> dict[str, Any]:
    """Copy what an UploadRequest names into ``uploads`` (replays need it after the caller's file changed or
    vanished) and return the call's arguments: keyed by content, never by the local path."""
    digest = tree_digest(source)
    kept = uploads / digest / source.name
    if not kept.parent.exists():
        kept.parent.mkdir()
        if source.is_dir():
            shutil.copytree(source, kept, symlinks=True)
        else:
            shutil.copy2(source, kept)
    return {"digest": digest, "name": source.name}


# ------------------------------------------------------------------------------------------------ payloads


def _response(model: Any) -> dict[str, Any]:
    cls = type(model)
    return {"class": f"{cls.__module__}:{cls.__qualname__}", "response": model.model_dump(mode="json")}


def _error(cls: type[BaseException], *args: Any, **kwargs: Any) -> dict[str, Any]:
    return {"raise": {"class": f"{cls.__module__}:{cls.__qualname__}", "args": list(args), "kwargs": kwargs}}


def answer(payload: Mapping[str, Any], arguments: Mapping[str, Any]) -> Any:
    """The response (or the exception, raised) a sandbox's payload describes. ``arguments``: the request's."""
    recorded = payload.get("raise")
    if recorded is not None:
        module, _, name = recorded["class"].partition(":")
        raise getattr(importlib.import_module(module), name)(*recorded["args"], **recorded.get("kwargs", {}))
    abstract = require("swerex.runtime.abstract", "swe-rex")
    if "data" in payload:  # read_file: decoded here, as Path.read_text decodes (universal newlines included)
        raw = io.BytesIO(base64.b64decode(payload["data"]))
        with io.TextIOWrapper(raw, encoding=arguments.get("encoding"), errors=arguments.get("errors")) as text:
            return abstract.ReadFileResponse(content=text.read())
    module, _, name = payload["class"].partition(":")
    return getattr(importlib.import_module(module), name).model_validate(payload["response"])


# ------------------------------------------------------------------------------------------------- sandbox


class SweRexShellFactory:
    """tvcache sandboxes that answer SWE-ReX requests in persistent shells of ``shell``; their snapshots are the
    shell backend's (files plus shell state), under their own kind. ``uploads``: where the runtime keeps what it
    uploads (``keep_upload``)."""

    kind = SHELL_KIND

    def __init__(self, shell: ShellSandboxFactory, *, uploads: Path, deterministic: bool | None = None) -> None:
        if not isinstance(shell, ShellSandboxFactory) or not shell.persistent:
            raise InvalidToolCall(
                f"SWE-ReX sessions need a persistent shell factory, ShellSandbox.factory(tree, persistent=True); "
                f"got {shell!r}"
            )
        self.shell = shell
        self.uploads = uploads
        self._tools = shell_tool_specs(deterministic)
        self.cost_hints: Mapping[str, float] = getattr(shell, "cost_hints", {})

    @property
    def tools(self) -> Mapping[str, ToolSpec]:
        return self._tools

    async def start(self) -> SweRexShellSandbox:
        return SweRexShellSandbox(await self.shell.start(), self)

    async def fork(self, snapshot: Snapshot) -> SweRexShellSandbox:
        return SweRexShellSandbox(await self.shell.fork(self._inner(snapshot)), self)

    def discard(self, snapshot: Snapshot) -> None:
        self.shell.discard(self._inner(snapshot))

    def route_counts(self) -> dict[str, int]:
        return self.shell.route_counts()

    def _inner(self, snapshot: Snapshot) -> Snapshot:
        if snapshot.kind != self.kind:
            raise SandboxError(f"cannot fork a SWE-ReX shell sandbox from a {snapshot.kind!r} snapshot")
        return Snapshot(kind=self.shell.kind, path=snapshot.path, bytes=snapshot.bytes, meta=snapshot.meta)

    def __repr__(self) -> str:
        return f"SweRexShellFactory({self.shell!r})"


class SweRexShellSandbox:
    """One persistent shell sandbox answering SWE-ReX requests (see the module docstring). Its outputs are JSON
    payloads that ``answer`` turns into SWE-ReX responses or exceptions."""

    def __init__(self, inner: Any, factory: SweRexShellFactory) -> None:
        self.inner = inner
        self._factory = factory
        shell = factory.shell
        self._root = "/" if shell.rootfs else str(shell.base)
        self._environment = [f"{key}={value}" for key, value in shell.environment.items()]
        path = shell.environment.get("PATH", FIXED_PATH)
        self._helper_script = shlex.quote(f"PATH={shlex.quote(path)}\n{_HELPER}")  # its own tools; exec -c cleared PATH
        self._bash = shlex.quote(shell.bash)
        self._handlers: dict[str, Callable[[dict[str, Any]], Awaitable[tuple[dict[str, Any], bool]]]] = {
            "create_session": self._create_session,
            "run_in_session": self._run_in_session,
            "execute": self._execute,
            "read_file": self._read_file,
            "write_file": self._write_file,
            "upload": self._upload,
        }

    async def execute(self, call: ToolCall) -> Outcome:
        handler = self._handlers.get(call.name)
        if handler is None:
            raise UnknownTool(call.name, list(self._handlers))
        payload, deterministic = await handler(call.arguments)
        return Outcome(
            output=json.dumps(payload), is_error="raise" in payload, changed_state=True, deterministic=deterministic
        )

    async def snapshot(self, dest: Path) -> Snapshot:
        inner = await self.inner.snapshot(dest)
        return Snapshot(kind=SHELL_KIND, path=inner.path, bytes=inner.bytes, meta=inner.meta)

    async def state_digest(self) -> str | None:
        digest: str | None = await self.inner.state_digest()
        return digest

    async def stop(self) -> None:
        await self.inner.stop()

    @property
    def trusted(self) -> bool:
        return bool(getattr(self.inner, "trusted", True))

    # ------------------------------------------------------------ the session

    async def _sh(self, command: str, timeout: float | None) -> Outcome:
        arguments: dict[str, Any] = {"cmd": command}
        if timeout is not None:
            arguments["timeout"] = timeout
        outcome: Outcome = await self.inner.execute(ToolCall("sh", arguments))
        return outcome

    async def _create_session(self, request: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        abstract = require("swerex.runtime.abstract", "swe-rex")
        sources = request["startup_source"]
        # Typed as SWE-ReX types them (unquoted). SWE-ReX types a line at every session start (its prompt
        # settings), and so do we: `:` without sources (a snapshot of a shell that never ran a line is declined).
        command = " ; ".join(f"source {path}" for path in sources) or ":"
        outcome = await self._sh(command + _MARK, request["startup_timeout"])
        if _TIMED_OUT.search(outcome.output):
            exceptions = require("swerex.exceptions", "swe-rex")
            message = f"timeout after {request['startup_timeout']} seconds while sourcing {sources!r}"
            return _error(exceptions.CommandTimeoutError, message), False
        output, _ = _split_marked(outcome.output)
        return _response(abstract.CreateBashSessionResponse(output=_strip(output))), outcome.deterministic

    async def _run_in_session(self, action: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        abstract = require("swerex.runtime.abstract", "swe-rex")
        exceptions = require("swerex.exceptions", "swe-rex")
        command, check = action["command"], action["check"]
        if "\x00" in command:
            return _error(ValueError, "embedded null byte"), True
        syntax = await _check_syntax(command)
        if syntax is not None:
            return syntax, True
        outcome = await self._sh(command + (_MARK if check == "ignore" else _PROBE), action["timeout"])
        text = outcome.output
        if _TIMED_OUT.search(text) and not outcome.deterministic:
            message = f"timeout after {action['timeout']} seconds while running command {command!r}"
            return _error(exceptions.CommandTimeoutError, message), False
        exit_code: int | None = None
        if check == "ignore":
            output, found = _split_marked(text)
        else:
            probed = _PROBED.search(text)
            found = probed is not None
            output = text[: probed.start()] if probed is not None else text
            exit_code = int(probed.group(1)) if probed is not None else None
        output = _strip(output)
        reason = "" if found else _failure_reason(text)
        if check == "raise" and not found:
            message = f"failed to parse exit code from output {text[-200:]!r} (command: {command!r}): {reason}"
            return _error(exceptions.NoExitCodeError, message), outcome.deterministic
        if check == "raise" and exit_code != 0:
            message = f"Command {command!r} failed with exit code {exit_code}. Here is the output:\n{output!r}"
            if action["error_msg"]:
                message = f"{action['error_msg']}: {message}"
            return _error(exceptions.NonZeroExitCodeError, message), outcome.deterministic
        observation = abstract.BashObservation(
            output=output, exit_code=exit_code, failure_reason=reason, expect_string=PS1 if found else ""
        )
        return _response(observation), outcome.deterministic

    # ---------------------------------------------------- requests beside it

    async def _helper(self, operation: str, *args: str, data: bytes | None = None, timeout: float | None = None) -> Any:
        """Run the helper script (see ``_HELPER``): the outcome and the fields of its frame (None if it printed
        none: it timed out, or the output was cut)."""
        if any("\x00" in arg for arg in args):
            return None, None
        quoted = " ".join(shlex.quote(arg) for arg in (operation, self._root, *args))
        stdin = f"<<< {base64.b64encode(data).decode()}" if data is not None else "</dev/null"
        command = (
            '\\builtin set -- "$?" "$@"; '
            f"( \\builtin exec -c {self._bash} --norc --noprofile -c {self._helper_script} tvcache {quoted} ) "
            f"{stdin} || :; "
            '\\builtin eval "\\builtin shift; \\builtin let $1==0 || (\\builtin exit $1) && :"'
        )
        outcome = await self._sh(command, timeout)
        text = outcome.output
        begin = text.rfind("\n@@tvcache-swerex@@\n")
        end = text.find("@@tvcache-swerex-end@@\n", begin + 1)
        if begin < 0 or end < 0:
            return outcome, None
        return outcome, text[begin + len("\n@@tvcache-swerex@@\n") : end].split("\n")[:-1]

    def _helper_failed(self, outcome: Outcome | None, what: str) -> tuple[dict[str, Any], bool]:
        if outcome is None:
            return _error(ValueError, "embedded null byte"), True
        limit = self._factory.shell.max_output_bytes
        if _TIMED_OUT.search(outcome.output):
            exceptions = require("swerex.exceptions", "swe-rex")
            return _error(exceptions.CommandTimeoutError, f"{what} timed out"), False
        message = (
            f"{what} gave no answer in the sandbox ({outcome.output[-300:]!r}); a file or an output of more than "
            f"max_output_bytes={limit} (as base64) does not fit: raise the shell factory's max_output_bytes"
        )
        return _error(SandboxError, message), outcome.deterministic

    async def _execute(self, command: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        abstract = require("swerex.runtime.abstract", "swe-rex")
        exceptions = require("swerex.exceptions", "swe-rex")
        program = command["command"]
        if command["shell"]:
            argv = ["/bin/sh", "-c", program] if isinstance(program, str) else ["/bin/sh", "-c", *program]
        else:
            argv = [program] if isinstance(program, str) else list(program)
        env = self._environment if command["env"] is None else [f"{k}={v}" for k, v in command["env"].items()]
        merge = "1" if command["merge_output_streams"] else "0"
        cwd = command["cwd"] or ""
        outcome, fields = await self._helper("exec", cwd, merge, str(len(env)), *env, *argv, timeout=command["timeout"])
        if fields is None:
            if outcome is not None and _TIMED_OUT.search(outcome.output):
                message = f"Timeout ({command['timeout']}s) exceeded while running command"
                return _error(exceptions.CommandTimeoutError, message), False
            return self._helper_failed(outcome, "execute")
        deterministic: bool = outcome.deterministic
        if fields[0] == "nocwd":
            return _error(FileNotFoundError, 2, "No such file or directory", command["cwd"]), deterministic
        if fields[0] != "ok":
            return _error(OSError, base64.b64decode(fields[1]).decode(errors="replace")), deterministic
        code = int(fields[1])
        stdout = base64.b64decode(fields[2]).decode(errors="backslashreplace")
        stderr = base64.b64decode(fields[3]).decode(errors="backslashreplace")
        if not command["shell"] and code in (126, 127) and stderr.startswith("env: "):  # exec failed, as Popen's
            error = (PermissionError, 13, "Permission denied") if code == 126 else (FileNotFoundError, 2, _ENOENT)
            return _error(error[0], error[1], error[2], argv[0]), deterministic
        response = abstract.CommandResponse(stdout=stdout, stderr=stderr, exit_code=code)
        if command["check"] and code != 0:
            message = (
                f"Command {program!r} failed with exit code {code}. Stdout:\n{response.stdout!r}\n"
                f"Stderr:\n{response.stderr!r}"
            )
            if command["error_msg"]:
                message = f"{command['error_msg']}: {message}"
            return _error(exceptions.NonZeroExitCodeError, message), deterministic
        return _response(response), deterministic

    async def _read_file(self, request: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        path = request["path"]
        outcome, fields = await self._helper("read", path)
        if fields is None:
            return self._helper_failed(outcome, f"reading {path!r}")
        deterministic: bool = outcome.deterministic
        status = fields[0]
        if status == "ok":
            return {"data": fields[1]}, deterministic
        return _os_error(status, fields, path), deterministic

    async def _write_file(self, request: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        path = request["path"]
        outcome, fields = await self._helper("write", path, data=request["content"].encode())
        if fields is None:
            return self._helper_failed(outcome, f"writing {path!r}")
        if fields[0] != "ok":
            return _os_error(fields[0], fields, path), outcome.deterministic
        abstract = require("swerex.runtime.abstract", "swe-rex")
        return _response(abstract.WriteFileResponse()), outcome.deterministic

    async def _upload(self, request: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        source = self._factory.uploads / request["digest"] / request["name"]
        target = request["target_path"]
        if source.is_dir():
            outcome, fields = await self._helper("putdir", target, data=_pack(source))
        else:
            mode = f"{source.stat().st_mode & 0o7777:o}"
            outcome, fields = await self._helper("putfile", target, source.name, mode, data=source.read_bytes())
        if fields is None:
            return self._helper_failed(outcome, f"uploading to {target!r}")
        if fields[0] != "ok":
            return _os_error(fields[0], fields, target), outcome.deterministic
        abstract = require("swerex.runtime.abstract", "swe-rex")
        return _response(abstract.UploadResponse()), outcome.deterministic

    def __repr__(self) -> str:
        return f"SweRexShellSandbox({self.inner!r})"


_ENOENT = os.strerror(2)


def _os_error(status: str, fields: list[str], path: str) -> dict[str, Any]:
    """The OSError Python raises in SWE-ReX's LocalRuntime for what the helper found."""
    known = {
        "missing": (FileNotFoundError, 2),
        "isdir": (IsADirectoryError, 21),
        "denied": (PermissionError, 13),
        "exists": (FileExistsError, 17),
    }
    if status in known:
        cls, number = known[status]
        return _error(cls, number, os.strerror(number), path)
    detail = base64.b64decode(fields[1]).decode(errors="replace") if len(fields) > 1 else status
    return _error(OSError, f"{path}: {detail.strip()}")


def _strip(output: str) -> str:
    return _ANSI.sub("", output).replace("\r\n", "\n")


def _split_marked(text: str) -> tuple[str, bool]:
    """The output before the check="ignore" marker, and whether the marker closed it (nothing but the
    sandbox's exit-status note after it)."""
    at = text.rfind(_END)
    if at < 0 or not _NOTES.fullmatch(text[at + len(_END) :]):
        return text, False
    return text[:at], True


def _failure_reason(text: str) -> str:
    if "[the shell ended" in text:
        return "the shell ended: " + text[text.rfind("[the shell ended") :].strip()
    if "[output truncated" in text:
        return "the output was cut at the sandbox's max_output_bytes, and the exit code with it"
    return "the exit-code probe did not print"


async def _check_syntax(command: str) -> dict[str, Any] | None:
    """SWE-ReX's own check, on the host's bash: ``bash -n`` of the command (it only parses)."""
    process = await asyncio.create_subprocess_exec(
        "bash",
        "-n",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8"},
    )
    out, err = await process.communicate(f"{command}\n".encode(errors="surrogateescape"))
    if process.returncode == 0:
        return None
    stdout, stderr = out.decode(errors="backslashreplace"), err.decode(errors="backslashreplace")
    message = (
        f"Error (exit code {process.returncode}) while checking bash command \n{command!r}\n"
        f"---- Stderr ----\n{stderr}\n---- Stdout ----\n{stdout}"
    )
    exceptions = require("swerex.exceptions", "swe-rex")
    extra = {"bash_stdout": stdout, "bash_stderr": stderr}
    return _error(exceptions.BashIncorrectSyntaxError, message, extra_info=extra)


def _pack(path: Path) -> bytes:
    """A directory as a tar archive, links followed (as shutil.copytree copies by default)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", dereference=True) as archive:
        for entry in sorted(path.rglob("*")):
            archive.add(entry, arcname=entry.relative_to(path).as_posix(), recursive=False)
    return buffer.getvalue()
