"""SWE-ReX on tvcache's persistent shell sandboxes: a runtime whose bash session is one confined, long-lived shell
on an overlay (``ShellSandbox.factory(tree, persistent=True)``), with no SWE-ReX runtime, container or server.

``ShellRuntime`` (in ``_swerex_shell_runtime``) speaks SWE-ReX's runtime API with its own request and response
models; ``ShellDeployment`` runs it uncached, ``swerex.CachingDeployment(shell_factory, ...)`` through a tvcache
graph, where snapshots carry the shell's state (working directory, variables, functions, aliases, options) so a
divergent rollout forks the snapshot nearest its divergence instead of replaying its prefix. This module holds
the sandbox those requests run in.

How each request maps onto the sandbox (``SweRexShellSandbox`` does the mapping). The rule: type into the shell
what SWE-ReX 1.4's ``BashSession`` types, and read the answer as it reads its terminal.

* ``create_session`` types the request's ``startup_source`` files (``source`` each, unquoted) and BashSession's
  prompt settings (``export PS1='SHELLPS1PREFIX'``, ``PS2``, ``PS0``: a command sees them as there; the shell
  never prints prompts into an output). A start that outlasts ``startup_timeout`` (BashSession's ``sleep 0.3``
  counted) raises pexpect's ``TIMEOUT`` as there, not cached, while the sources run on (within the factory's
  ``timeout``); what they printed heads the next command's output, as in SWE-ReX. A sandbox has one shell, so
  a runtime has one bash session: a second, or a new one after ``close_session``, is refused with
  ``InvalidToolCall``. Session names are checked as SWE-ReX does (``SessionExistsError``,
  ``SessionDoesNotExistError``), before anything runs.
* ``run_in_session(BashAction)`` checks the syntax with the host's ``bash -n`` (``BashIncorrectSyntaxError``),
  then types what BashSession types (``typed_command``): the command split by bashlex and rejoined with ``" ;
  "`` (a here-document's body is lost, ``cmd &`` before another command becomes a syntax error), or, for a
  command bashlex cannot parse, the command and BashSession's terminator line, whose string is then the
  answer's ``expect_string``. Text that leaves bash reading (a here-document the split cut off) raises
  ``CommandTimeoutError`` at once, as SWE-ReX's wait ends. The output ends where an end marker typed after the
  text starts (a subshell that exits with the command's status, so ``$?`` and ``$_`` stay as the command left
  them); unless ``check="ignore"``, BashSession's exit-code probe (``echo EXITCODESTART$?EXITCODEEND``) follows
  as a call of its own and is read as SWE-ReX reads it (SWE-ReX's strings removed from the output; ``$?`` 0 and
  ``$_`` the probe's afterwards). ``check="raise"`` raises ``NonZeroExitCodeError`` or ``NoExitCodeError`` with
  SWE-ReX's messages; a timeout raises ``CommandTimeoutError`` (the command is interrupted, the shell lives
  on; never cached); a shell that ended (``exit``) raises pexpect's ``EOF``, then and for every later command.
  Interrupts answer at once; interactive commands and ``expect`` patterns are refused (they depend on timing).
* ``execute``, ``read_file``, ``write_file`` and ``upload`` run in a fresh bash started from the session's
  shell with an empty environment (``exec -c``), so they see the session's files (its private ``/tmp`` too) but
  none of its variables, functions, aliases, options or umask, and leave its ``$?`` and ``$_`` as they were;
  ``execute`` gets the sandbox's environment (or ``env``), relative paths and ``cwd=None`` mean the sandbox's
  tree (``/`` for a root filesystem), as a runtime started there would see them. Errors are the ones Python
  raises in SWE-ReX's ``LocalRuntime`` (``FileNotFoundError``, ``IsADirectoryError``, ``FileExistsError``, ...).

What still differs from a ``LocalRuntime``, each with the test that pins it: docs/harnesses.md (SWE-ReX). Every
request counts as state-changing, reads included: each moves the shell's ``$LINENO``.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import shlex
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..calls import ToolCall, ToolSpec
from ..errors import SandboxError, SnapshotDeclined, UnknownTool
from ..protocol import Outcome, Sandbox, Snapshot
from ..sandboxes.commands import FIXED_PATH
from ..sandboxes.shell.sandbox import ShellSandboxFactory
from ._file_trees import keep_copy, pack, upload_digest
from ._over_shells import OverPersistentShells
from ._recorded_errors import class_path, raise_recorded, recorded_payload
from .optional_imports import import_ref, require

__all__ = [
    "PS1",
    "SHELL_KIND",
    "UNIQUE",
    "SweRexShellFactory",
    "SweRexShellSandbox",
    "TypedCommand",
    "answer",
    "keep_upload",
    "rebuilt_response",
    "response_payload",
    "shell_tool_specs",
    "tree_digest",
    "typed_command",
]

SHELL_KIND = "swe-rex-shell"
PS1 = "SHELLPS1PREFIX"  # SWE-ReX's BashSession prompt: the expect string of a command it could split
UNIQUE = "UNIQUESTRING29234"  # its terminator after a command bashlex cannot parse: that command's expect string
_TOOLS = ("create_session", "run_in_session", "execute", "read_file", "write_file", "upload")
_ANSI = re.compile(r"\x1B[@-_][0-?]*[ -/]*[@-~]")  # SWE-ReX's own _strip_control_chars
# What BashSession types besides the user's text: its prompt settings after the startup sources (and a `sleep
# 0.3`, counted here, not slept); the terminator line after a command bashlex cannot parse; the exit-code probe
# after each command unless check="ignore", answered within a second.
_PROMPT_SETTINGS = (f"export PS1='{PS1}'", "export PS2=''", "export PS0=''")
_STARTUP_PAUSE = 0.3
_TERMINATOR = f"\n TMPEXITCODE=$? ; sleep 0.1; echo -n '{UNIQUE}' ; (exit $TMPEXITCODE)"
_EXIT_PROBE = "echo EXITCODESTART$?EXITCODEEND"
_PROBE_SECONDS = 1.0
# What `bash -n` says of text an interactive bash would go on reading (it waits for the rest of the command).
_OPEN_INPUT = ("delimited by end-of-file", "unexpected end of file", "unexpected EOF while looking for matching")
_END = "\n@@tvcache-swerex-end@@\n"
# After the typed text, on lines of its own: a marker printed by a subshell that exits with the command's status,
# so the output ends exactly where the marker starts and `$?` and `$_` stay as the command left them; `&&` keeps
# errexit from firing, and the stderr redirections keep `set -x` traces of these lines out of the output.
_MARK = (
    "\n\n( __tvcache_status=$?; \\builtin printf '\\n@@%s@@\\n' tvcache-swerex-end; "
    '\\builtin exit "$__tvcache_status" ) 2>/dev/null && { (( 1 )); } 2>/dev/null'
)
_MARK_ECHO = "\n" + _MARK.lstrip("\n") + "\n"  # what `set -v` echoes of it
_SHELL_ENDED = "[the shell ended"  # the sandbox's note when bash is gone
_NOTES = re.compile(r"(\[exit code \d+\]|\[killed by signal \d+\]|\[timed out after [^\]]*s\])?\Z")
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
    """A digest of a file or directory tree: relative names, kinds, modes, link targets and contents. A file alone
    is hashed with its whole ``st_mode`` (read through a link, as the runtimes copy it), a link by its target as
    it holds it: SWE-ReX's rules (``upload_digest``), kept since its digests are cached keys."""
    return upload_digest(path, whole_file_mode=True, pathlib_links=False)


def keep_upload(source: Path, uploads: Path) -> dict[str, Any]:
    """Copy what an UploadRequest names into ``uploads`` (replays need it after the caller's file changed or
    vanished) and return the call's arguments: keyed by content, never by the local path."""
    digest = tree_digest(source)
    keep_copy(source, uploads / digest / source.name)
    return {"digest": digest, "name": source.name}


# ------------------------------------------------------------------------------------------------ payloads


def response_payload(model: Any) -> dict[str, Any]:
    """A SWE-ReX response model as a payload (both flavours write it): its class and its JSON."""
    return {"class": class_path(type(model)), "response": model.model_dump(mode="json")}


def rebuilt_response(payload: Mapping[str, Any]) -> Any:
    """The response model ``response_payload`` wrote."""
    return import_ref(payload["class"]).model_validate(payload["response"])


def _error(cls: type[BaseException], *args: Any, **kwargs: Any) -> dict[str, Any]:
    return recorded_payload(cls, args, kwargs=kwargs)  # "kwargs" always written, {} included


def answer(payload: Mapping[str, Any], arguments: Mapping[str, Any]) -> Any:
    """The response (or the exception, raised) a sandbox's payload describes. ``arguments``: the request's."""
    raise_recorded(payload)
    abstract = require("swerex.runtime.abstract", "swe-rex")
    if "data" in payload:  # read_file: decoded here, as Path.read_text decodes (universal newlines included)
        raw = io.BytesIO(base64.b64decode(payload["data"]))
        with io.TextIOWrapper(raw, encoding=arguments.get("encoding"), errors=arguments.get("errors")) as text:
            return abstract.ReadFileResponse(content=text.read())
    return rebuilt_response(payload)


# ------------------------------------------------------------------------------------------------- sandbox


class SweRexShellFactory(OverPersistentShells["SweRexShellSandbox"]):
    """tvcache sandboxes that answer SWE-ReX requests in persistent shells of ``shell``; their snapshots are the
    shell backend's (files plus shell state), under their own kind. ``uploads``: where the runtime keeps what it
    uploads (``keep_upload``)."""

    kind = SHELL_KIND
    needs = "SWE-ReX sessions need"
    sandbox = "a SWE-ReX shell sandbox"

    def __init__(self, shell: ShellSandboxFactory, *, uploads: Path, deterministic: bool | None = None) -> None:
        super().__init__(shell, shell_tool_specs(deterministic))
        self.uploads = uploads

    def wrap(self, inner: Sandbox) -> SweRexShellSandbox:
        return SweRexShellSandbox(inner, self)


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
        self._pending = ""  # what a start past its startup_timeout printed: SWE-ReX gives it to the next command
        self._ended = ""  # why the session's shell is gone (it ran `exit`): later commands raise pexpect's EOF
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
        if self._pending:
            raise SnapshotDeclined("the session's start timed out: its output waits for the next command")
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
        """Typed as BashSession types it: the sources (unquoted), then its prompt settings. Past
        ``startup_timeout`` (its `sleep 0.3` counted) SWE-ReX raises pexpect's TIMEOUT while the sources run on,
        and their output heads the next command's: so here, within the shell factory's timeout."""
        abstract = require("swerex.runtime.abstract", "swe-rex")
        sources, limit = request["startup_source"], request["startup_timeout"]
        command = " ; ".join([*(f"source {path}" for path in sources), *_PROMPT_SETTINGS])
        started = time.monotonic()
        outcome = await self._sh(command, max(limit, self._factory.shell.timeout))
        elapsed = time.monotonic() - started + (_STARTUP_PAUSE if sources else 0.0)
        output = _strip(_NOTES.sub("", outcome.output))
        if _SHELL_ENDED in output:
            return self._end(output), outcome.deterministic
        if elapsed > limit or _TIMED_OUT.search(outcome.output):
            self._pending = output
            message = (
                f"Timeout exceeded: the session's start (sourcing {sources!r}) took {elapsed:.2f} s, more than "
                f"startup_timeout={limit} s; the sources ran on, and their output heads the next command's"
            )
            return _error(require("pexpect", "swe-rex").TIMEOUT, message), False
        return response_payload(abstract.CreateBashSessionResponse(output=output)), outcome.deterministic

    async def _run_in_session(self, action: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """What BashSession._run_normal does, step by step: the syntax check, the text it types (``typed``), the
        string it waits for, then (unless check="ignore") the exit-code probe on a line of its own."""
        exceptions = require("swerex.exceptions", "swe-rex")
        command = action["command"]
        if "\x00" in command:
            return _error(ValueError, "embedded null byte"), True
        if self._ended:
            return _error(require("pexpect", "swe-rex").EOF, self._ended), True
        code, stdout, stderr = await _bash_parse(command)
        if code != 0:
            return _syntax_error(command, code, stdout, stderr), True
        typed = typed_command(command)
        if typed.expect == PS1 and typed.text != command.strip():
            stderr = (await _bash_parse(typed.text))[2]  # the split and rejoined text, as bash will read it
        timeout = f"timeout after {action['timeout']} seconds while running command {typed.text!r}"
        if _waits_for_input(typed.text, stderr):  # SWE-ReX waits for a prompt bash never prints
            return _error(exceptions.CommandTimeoutError, timeout), True
        output, deterministic = self._take_pending(), True
        if typed.text:  # an empty line runs nothing: SWE-ReX gets its prompt back at once
            outcome = await self._sh(typed.text + _MARK, action["timeout"])
            deterministic = outcome.deterministic
            if _TIMED_OUT.search(outcome.output) and not deterministic:
                return _error(exceptions.CommandTimeoutError, timeout), False
            text, marked = _split_marked(outcome.output)
            if _SHELL_ENDED in text:
                return self._end(text), deterministic
            if typed.expect == UNIQUE and UNIQUE not in text and marked:  # it kept the terminator off the terminal
                return _error(exceptions.CommandTimeoutError, timeout), deterministic
            if typed.expect == UNIQUE and action["check"] == "ignore":  # SWE-ReX stops at the terminator
                text = text.split(UNIQUE, 1)[0]
            output += _strip(text if marked else _NOTES.sub("", text)).replace(_MARK_ECHO, "")
        if action["check"] == "ignore":
            return response_payload(_observation(output=output, expect_string=typed.expect)), deterministic
        probed = await self._probe(typed.text, output)
        return self._checked(action, typed, probed), deterministic and probed.deterministic

    def _checked(self, action: dict[str, Any], typed: TypedCommand, probed: _Probed) -> dict[str, Any]:
        """The answer to a command whose exit code was probed, as check="silent" or "raise" makes it."""
        exceptions = require("swerex.exceptions", "swe-rex")
        if probed.exit_code is None:
            if action["check"] == "raise":
                return _error(exceptions.NoExitCodeError, probed.error)
            return response_payload(_observation(output=probed.output, expect_string=typed.expect))
        if action["check"] == "raise" and probed.exit_code != 0:
            message = (
                f"Command {action['command']!r} failed with exit code {probed.exit_code}. Here is the output:\n"
                f"{probed.output!r}"
            )
            if action["error_msg"]:
                message = f"{action['error_msg']}: {message}"
            return _error(exceptions.NonZeroExitCodeError, message)
        observation = _observation(output=probed.output, exit_code=probed.exit_code, expect_string=typed.expect)
        return response_payload(observation)

    def _end(self, text: str) -> dict[str, Any]:
        """The session's shell ended (``exit``): SWE-ReX's pexpect raises EOF, now and for every later command."""
        how = re.search(r"\[the shell ended([^;\]]*)", text)
        self._ended = (
            f"End Of File (EOF): the session's shell ended{how.group(1) if how else ''}; as in SWE-ReX, the "
            "session is gone (start a new deployment for a new one)"
        )
        return _error(require("pexpect", "swe-rex").EOF, self._ended)

    async def _probe(self, typed: str, output: str) -> _Probed:
        """BashSession's exit-code probe, typed as its own line as SWE-ReX types it (so ``$?``, ``$_`` and the
        user's own ``echo`` play as there), and its answer read as SWE-ReX reads it: ``output`` completed by what
        came before the probe's answer, with SWE-ReX's prompt and terminator strings removed."""
        outcome = await self._sh(_EXIT_PROBE, _PROBE_SECONDS)
        text = _strip(outcome.output)
        end = text.find("EXITCODEEND")
        if _TIMED_OUT.search(text) or end < 0:
            return _Probed(output=output, error="timeout while getting exit code", deterministic=outcome.deterministic)
        raw = text[:end]
        codes = re.findall("EXITCODESTART([0-9]+)", raw)
        if len(codes) != 1:
            error = f"failed to parse exit code from output {raw!r} (command: {typed!r}, matches: {codes})"
            return _Probed(output=output, error=error, deterministic=outcome.deterministic)
        output = (output + raw.split("EXITCODESTART")[0]).replace(UNIQUE, "").replace(PS1, "")
        return _Probed(output=output, exit_code=int(codes[0]), deterministic=outcome.deterministic)

    def _take_pending(self) -> str:
        pending, self._pending = self._pending, ""
        return pending

    # ---------------------------------------------------- requests beside it

    async def _helper(self, operation: str, *args: str, data: bytes | None = None, timeout: float | None = None) -> Any:
        """Run the helper script (see ``_HELPER``): the outcome and the fields of its frame (None if it printed
        none: it timed out, or the output was cut)."""
        if any("\x00" in arg for arg in args):
            return None, None
        quoted = " ".join(shlex.quote(arg) for arg in (operation, self._root, *args))
        stdin = f"<<< {base64.b64encode(data).decode()}" if data is not None else "</dev/null"
        # In a subshell that exits with the session's status: its `$?` and `$_` stay as they were (see _MARK).
        command = (
            "( __tvcache_status=$?; "
            f"( \\builtin exec -c {self._bash} --norc --noprofile -c {self._helper_script} tvcache {quoted} ) "
            f'{stdin} || :; \\builtin exit "$__tvcache_status" ) 2>/dev/null && {{ (( 1 )); }} 2>/dev/null'
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
        return response_payload(response), deterministic

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
        return response_payload(abstract.WriteFileResponse()), outcome.deterministic

    async def _upload(self, request: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        source = self._factory.uploads / request["digest"] / request["name"]
        target = request["target_path"]
        if source.is_dir():
            outcome, fields = await self._helper("putdir", target, data=pack(source, follow_links=True))
        else:
            mode = f"{source.stat().st_mode & 0o7777:o}"
            outcome, fields = await self._helper("putfile", target, source.name, mode, data=source.read_bytes())
        if fields is None:
            return self._helper_failed(outcome, f"uploading to {target!r}")
        if fields[0] != "ok":
            return _os_error(fields[0], fields, target), outcome.deterministic
        abstract = require("swerex.runtime.abstract", "swe-rex")
        return response_payload(abstract.UploadResponse()), outcome.deterministic

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


@dataclass(frozen=True, kw_only=True, slots=True)
class _Probed:
    """The exit-code probe's reading: the command's whole output and status, or why there is none."""

    output: str = ""
    exit_code: int | None = None
    error: str = ""
    deterministic: bool = True


def _split_marked(text: str) -> tuple[str, bool]:
    """The output before the marker, and whether the marker closed it (nothing but the sandbox's exit-status
    note after it)."""
    at = text.rfind(_END)
    if at < 0 or not _NOTES.fullmatch(text[at + len(_END) :]):
        return text, False
    return text[:at], True


def _observation(**fields: Any) -> Any:
    return require("swerex.runtime.abstract", "swe-rex").BashObservation(**fields)


@dataclass(frozen=True, kw_only=True, slots=True)
class TypedCommand:
    """What SWE-ReX's BashSession types for a BashAction's command, and the string it then waits for."""

    text: str
    expect: str  # PS1 (its prompt), or UNIQUE after a command bashlex cannot parse (the text ends in _TERMINATOR)


def typed_command(command: str) -> TypedCommand:
    """The command as SWE-ReX 1.4's BashSession types it: split by bashlex into its top-level commands, rejoined
    with ``" ; "`` on one line (so a here-document's body is lost, and ``cmd &`` before another is a syntax
    error, as there); if bashlex fails (``[[ ]]``, ``$(( ))``, ``case``, arrays, quoted here-documents, ...), as
    written followed by SWE-ReX's terminator line."""
    try:
        parts = _top_level_commands(command)
    except Exception:  # bashlex fails in many ways (ParsingError, NotImplementedError, AttributeError, ...)
        return TypedCommand(text=command + _TERMINATOR, expect=UNIQUE)
    return TypedCommand(text=" ; ".join(parts), expect=PS1)


def _top_level_commands(command: str) -> list[str]:
    text = command.strip()
    if not text or all(line.strip().startswith("#") for line in text.splitlines()):
        return []  # bashlex cannot parse these; SWE-ReX types an empty line
    nodes = require("bashlex", "swe-rex").parse(text)
    return [text[slice(*_extent(node))] for node in nodes]


def _extent(node: Any) -> tuple[int, int]:
    """Where a bashlex node starts and ends, its parts included (not a redirection's here-document body)."""
    start, end = node.pos
    for part in getattr(node, "parts", []):
        part_start, part_end = _extent(part)
        start, end = min(start, part_start), max(end, part_end)
    return start, end


def _waits_for_input(typed: str, parse_errors: str) -> bool:
    """Whether an interactive bash given ``typed`` would go on reading the command (an open here-document, quote
    or compound command, as ``bash -n`` reported in ``parse_errors``; or a last line ending in a backslash)."""
    backslashes = len(typed) - len(typed.rstrip("\\"))
    return backslashes % 2 == 1 or any(sign in parse_errors for sign in _OPEN_INPUT)


async def _bash_parse(text: str) -> tuple[int, str, str]:
    """``bash -n`` of ``text`` on the host, as SWE-ReX checks a command: its exit code, stdout and stderr."""
    process = await asyncio.create_subprocess_exec(
        "bash",
        "-n",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8"},
    )
    out, err = await process.communicate(f"{text}\n".encode(errors="surrogateescape"))
    code = process.returncode if process.returncode is not None else -1
    return code, out.decode(errors="backslashreplace"), err.decode(errors="backslashreplace")


def _syntax_error(command: str, code: int, stdout: str, stderr: str) -> dict[str, Any]:
    message = (
        f"Error (exit code {code}) while checking bash command \n{command!r}\n"
        f"---- Stderr ----\n{stderr}\n---- Stdout ----\n{stdout}"
    )
    exceptions = require("swerex.exceptions", "swe-rex")
    extra = {"bash_stdout": stdout, "bash_stderr": stderr}
    return _error(exceptions.BashIncorrectSyntaxError, message, extra_info=extra)
