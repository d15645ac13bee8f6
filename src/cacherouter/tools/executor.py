"""Running a tool: validate the model's arguments against the schema, build an argv, run a child process.

No shell is involved: the argument vector is a list handed to :func:`subprocess.Popen`, so a value such as
``"; rm -rf /"`` reaches the script as one literal argument. Values that argparse itself would mistake for an
option (they start with ``-``) are passed in the ``--opt=value`` form, or after ``--`` for positionals.

A tool never sees the model endpoints' credentials: :func:`tool_environment` drops every ``CACHEROUTER_*_API_KEY``
variable (``CACHEROUTER_MAIN_API_KEY``, ``CACHEROUTER_ROUTER_API_KEY``) from the environment of every tool run,
since tools include model-written skills and ``run_python``.

A tool never outlives the call that started it. Each run is registered while it runs: a caller that gives up
stops it through a :class:`Cancellation`, and a server shutting down stops every run with :func:`kill_running`
(both kill the tool's whole process group). On Linux a tool also dies when the thread that started it is gone,
even if the server was killed with SIGKILL (see :func:`_parent_death_signal`).
"""

from __future__ import annotations

import ctypes
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ArgumentError, ToolExecutionError
from .schema import ArgumentSpec, ScriptSchema

MAX_OUTPUT_CHARS = 20_000
# Shown to the model after a stream cut at MAX_OUTPUT_CHARS; fixed text, so the same output gives the same bytes.
TRUNCATION_MARKER = f"\n[output truncated: only the first {MAX_OUTPUT_CHARS} characters are shown]"
_READ_LIMIT = 4 * MAX_OUTPUT_CHARS  # bytes kept per stream: enough for MAX_OUTPUT_CHARS of any UTF-8 text
_DRAIN_S = 0.5  # how long the pipes may stay open after the tool ended (a detached child may hold them)
_TICK_S = 0.05  # how often the reader checks whether the tool has ended while its pipes are still open


@dataclass(frozen=True, kw_only=True)
class ScriptResult:
    """What a tool run produced. A non-zero exit or a timeout is a result the model must see, not an error."""

    tool: str
    argv: tuple[str, ...]
    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False
    cancelled: bool = False  # stopped by a Cancellation or kill_running() before it ended
    stdout_truncated: bool = False  # stdout holds only the first MAX_OUTPUT_CHARS characters of the output
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.cancelled

    @property
    def shown_stdout(self) -> str:
        """``stdout`` as the model sees it: with :data:`TRUNCATION_MARKER` at the cut, if there was one."""
        return self.stdout + TRUNCATION_MARKER if self.stdout_truncated else self.stdout

    @property
    def shown_stderr(self) -> str:
        return self.stderr + TRUNCATION_MARKER if self.stderr_truncated else self.stderr

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tool": self.tool,
            "ok": self.ok,
            "exit_code": self.exit_code,
            "stdout": self.shown_stdout,
        }
        if self.stderr:
            out["stderr"] = self.shown_stderr
        if self.stdout_truncated:
            out["stdout_truncated"] = True
        if self.stderr_truncated:
            out["stderr_truncated"] = True
        if self.timed_out:
            out["error"] = f"timed out after {self.duration_s:.1f}s"
        elif self.cancelled:
            out["error"] = "cancelled: the tool was stopped before it ended"
        elif not self.ok:
            out["error"] = (self.stderr.strip().splitlines() or [f"exit code {self.exit_code}"])[-1]
        return out


def build_argv(schema: ScriptSchema, arguments: Mapping[str, Any]) -> list[str]:
    """Turn a JSON object of arguments into an argument vector for the script, checking it against ``schema``."""
    unknown = sorted(set(arguments) - {spec.dest for spec in schema.arguments})
    if unknown:
        known = ", ".join(spec.dest for spec in schema.arguments) or "none"
        raise ArgumentError(f"unknown argument(s) {unknown}; this tool takes: {known}")
    for dests, required in schema.exclusive_groups:
        given = [d for d in dests if d in arguments and arguments[d] not in (None, False)]
        if len(given) > 1:
            raise ArgumentError(f"arguments {given} are mutually exclusive; give at most one")
        if required and not given:
            raise ArgumentError(f"one of {list(dests)} is required")
    options: list[str] = []
    positionals: list[str] = []
    for spec in schema.arguments:
        if spec.dest not in arguments or arguments[spec.dest] is None:
            in_required_group = any(spec.dest in dests for dests, _ in schema.exclusive_groups)
            if spec.required and not in_required_group:
                raise ArgumentError(f"missing required argument {spec.dest!r}")
            continue
        value = arguments[spec.dest]
        if spec.positional:
            positionals.extend(_values(spec, value))
        else:
            options.extend(_option_tokens(spec, value))
    if any(token.startswith("-") for token in positionals):
        return [*options, "--", *positionals]
    return [*options, *positionals]


def _option_tokens(spec: ArgumentSpec, value: Any) -> list[str]:
    flag = next((s for s in spec.option_strings if s.startswith("--")), spec.option_strings[0])
    if spec.action in ("store_true", "store_const"):
        return [flag] if _boolean(spec, value) else []
    if spec.action == "store_false":
        return [] if _boolean(spec, value) else [flag]
    if spec.action == "boolean_optional":
        return [flag] if _boolean(spec, value) else ["--no-" + flag.lstrip("-")]
    if spec.action == "count":
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ArgumentError(f"{spec.dest}: expected a non-negative integer count, got {value!r}")
        return [flag] * value
    values = _values(spec, value)
    if spec.action == "append":
        return [_joined(flag, v) for v in values]
    if spec.is_array:
        if any(v.startswith("-") for v in values):
            raise ArgumentError(f"{spec.dest}: list items may not start with '-' ({values})")
        return [flag, *values]
    return [_joined(flag, values[0])]


def _joined(flag: str, value: str) -> str:
    # "--opt=value" keeps a value like "-5" from being read as an option; short options take it attached.
    return f"{flag}={value}" if flag.startswith("--") else f"{flag}{value}"


def _boolean(spec: ArgumentSpec, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ArgumentError(f"{spec.dest}: expected true or false, got {value!r}")
    return value


def _values(spec: ArgumentSpec, value: Any) -> list[str]:
    items = list(value) if isinstance(value, list | tuple) else [value]
    if not spec.is_array and isinstance(value, list | tuple):
        raise ArgumentError(f"{spec.dest}: expected a single value, got a list")
    if spec.nargs == "+" and not items:
        raise ArgumentError(f"{spec.dest}: expected at least one value")
    if isinstance(spec.nargs, int) and len(items) != spec.nargs and spec.is_array:
        raise ArgumentError(f"{spec.dest}: expected exactly {spec.nargs} values, got {len(items)}")
    return [_scalar(spec, item) for item in items]


def _scalar(spec: ArgumentSpec, value: Any) -> str:
    if isinstance(value, bool) or value is None or isinstance(value, dict | list):
        raise ArgumentError(f"{spec.dest}: expected a {spec.json_type}, got {value!r}")
    if spec.json_type == "integer":
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            try:
                value = int(str(value))
            except ValueError as e:
                raise ArgumentError(f"{spec.dest}: expected an integer, got {value!r}") from e
    elif spec.json_type == "number":
        try:
            value = float(value) if not isinstance(value, int | float) else value
        except ValueError as e:
            raise ArgumentError(f"{spec.dest}: expected a number, got {value!r}") from e
    if spec.choices is not None and value not in spec.choices and str(value) not in map(str, spec.choices):
        raise ArgumentError(f"{spec.dest}: {value!r} is not one of {list(spec.choices)}")
    text = str(value)
    if "\x00" in text:
        raise ArgumentError(f"{spec.dest}: values may not contain NUL bytes")
    return text


def is_credential(name: str) -> bool:
    """Whether environment variable ``name`` holds a model endpoint's API key (never given to tools)."""
    return name.startswith("CACHEROUTER_") and name.endswith("_API_KEY")


def tool_environment(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment of a tool process: ``base`` (default ``os.environ``) without credentials, plus ``extra``."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not is_credential(k)}
    return {**env, "PYTHONDONTWRITEBYTECODE": "1", **extra}


def run_script(
    script: Path,
    argv: list[str],
    *,
    tool: str,
    timeout: float = 60.0,
    cwd: Path | None = None,
    python: str = sys.executable,
    env: Mapping[str, str] | None = None,
    cancel: Cancellation | None = None,
) -> ScriptResult:
    """Run ``python script *argv`` with a timeout; on timeout the whole process group is killed.

    ``env`` defaults to ``os.environ``; credentials are dropped from it either way (:func:`tool_environment`).
    The call returns within about ``timeout`` plus half a second even if a detached child holds the output open,
    and keeps at most a bounded amount of output in memory. ``cancel.cancel()`` (from any thread) kills the tool
    and makes this call return at once with a ``cancelled`` result, as does :func:`kill_running`.
    """
    script = script.absolute()  # the child runs in the script's directory, where a relative path means nothing
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            [python, str(script), *argv],
            cwd=cwd or script.parent,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=tool_environment(env),
            start_new_session=True,  # own process group, so a timeout also stops its children
            preexec_fn=_parent_death_signal(),
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise ToolExecutionError(f"cannot start tool {tool!r} ({script}): {e}") from e
    run = _register(proc, cancel)
    try:
        captured = _read_output(proc, timeout)
    finally:
        _unregister(run)
        if proc.poll() is None:  # interrupted while reading: do not leave the tool running
            _kill_group(proc)
        proc.wait()
    timed_out = captured.timed_out
    stopped = run.killed and not timed_out
    stdout, stdout_truncated = _decode(captured.stdout, cut=captured.stdout_overflowed)
    stderr, stderr_truncated = _decode(captured.stderr, cut=captured.stderr_overflowed)
    return ScriptResult(
        tool=tool,
        argv=tuple(argv),
        exit_code=None if timed_out or stopped else proc.returncode,
        stdout=stdout,
        stderr=stderr,
        duration_s=time.monotonic() - start,
        timed_out=timed_out,
        cancelled=stopped,
        stdout_truncated=stdout_truncated,
        stderr_truncated=stderr_truncated,
    )


class Cancellation:
    """Stops the tool runs it is passed to (``run_script(..., cancel=...)``), from any thread.

    For a caller that gives up on a call it cannot interrupt, such as a worker thread blocked in
    :func:`run_script`: killing the tool's process group makes that thread return within moments. A run that
    starts after :meth:`cancel` is killed as soon as it starts.
    """

    def __init__(self) -> None:
        self._cancelled = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        with _running_lock:
            self._cancelled = True
            for run in _running:
                if run.cancel is self:
                    _stop(run)


def kill_running() -> int:
    """Kill the process group of every tool this process is running now; returns how many were killed.

    For a server shutting down (end of input, SIGINT, SIGTERM): no tool may outlive it.
    """
    with _running_lock:
        runs = list(_running)
        for run in runs:
            _stop(run)
    return len(runs)


@dataclass(eq=False)  # compared and hashed by identity: one entry per run
class _Run:
    proc: subprocess.Popen[bytes]
    cancel: Cancellation | None
    killed: bool = False


# The runs in progress. Killing happens under the lock, so no run is killed after _unregister returned and
# run_script reaped its process (which frees the group id for reuse). The lock is held for a few system calls
# at most, and never taken in a signal handler (the MCP server handles signals on its event loop instead).
_running_lock = threading.Lock()
_running: set[_Run] = set()


def _register(proc: subprocess.Popen[bytes], cancel: Cancellation | None) -> _Run:
    run = _Run(proc=proc, cancel=cancel)
    with _running_lock:
        _running.add(run)
        if cancel is not None and cancel.cancelled:  # cancelled while the process was being started
            _stop(run)
    return run


def _unregister(run: _Run) -> None:
    with _running_lock:
        _running.discard(run)


def _stop(run: _Run) -> None:  # the caller holds _running_lock
    run.killed = True
    _kill_group(run.proc)


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


_prctl = _load_prctl()


def _parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the tool receive SIGKILL when the thread that started it ends (Linux only).

    This is the backstop for a server that dies without running its clean-up (SIGKILL, a crash): the normal
    paths (timeout, :class:`Cancellation`, :func:`kill_running`) kill the whole process group, but nothing in a
    dead server can, and the tool runs in its own session, out of reach of a kill aimed at the server's group.
    The kernel signals the tool itself only; processes the tool started are not covered by this backstop.

    Why a ``preexec_fn`` despite its warning about threads: the danger is Python code in the forked child
    taking a lock another thread held at the fork (imports, logging, I/O). This function does none of that: a
    foreign call to ``prctl`` bound at import time, ``getppid`` and, in the rare case, ``_exit``; CPython
    re-initialises its own locks in the child before running it. The cost is a ``fork`` instead of a ``vfork``:
    measured at about 4 ms per tool start in a server-sized process, next to some 25 ms for the tool's own
    interpreter to start. The signal follows the *thread* that forked, and that thread stays in
    :func:`run_script` until the tool has been reaped, so it never fires early.
    """
    prctl = _prctl
    if prctl is None:
        return None
    parent = os.getpid()
    kill = ctypes.c_ulong(signal.SIGKILL)

    def die_with_parent() -> None:
        prctl(_PR_SET_PDEATHSIG, kill)
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)

    return die_with_parent


@dataclass(frozen=True, kw_only=True)
class _Captured:
    stdout: bytes
    stderr: bytes
    stdout_overflowed: bool  # the tool wrote more than the _READ_LIMIT bytes kept
    stderr_overflowed: bool
    timed_out: bool


def _read_output(proc: subprocess.Popen[bytes], timeout: float) -> _Captured:
    """Read the tool's stdout and stderr until it ends; kill its process group at ``timeout``.

    Each stream keeps its first ``_READ_LIMIT`` bytes; the rest is read and dropped, so a chatty tool neither
    blocks on a full pipe nor fills our memory. Once the tool has ended or been killed, its pipes get ``_DRAIN_S``
    more: a child that inherited them (even one in its own session, which killing the group cannot reach) must
    not hold the call open.
    """
    if proc.stdout is None or proc.stderr is None:
        raise ToolExecutionError("the tool was started without output pipes")  # cannot happen; narrows types
    out, err = proc.stdout.fileno(), proc.stderr.fileno()
    kept = {out: bytearray(), err: bytearray()}
    overflowed = {out: False, err: False}
    deadline = time.monotonic() + timeout
    stop_at: float | None = None  # set once the tool has ended
    timed_out = False
    with selectors.DefaultSelector() as selector:
        for fd in kept:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            now = time.monotonic()
            if stop_at is None and proc.poll() is not None:
                stop_at = now + _DRAIN_S
            elif stop_at is None and now >= deadline:
                timed_out = True
                _kill_group(proc)
                stop_at = now + _DRAIN_S
            if stop_at is not None and now >= stop_at:
                _kill_group(proc)  # left-over children still holding the pipes
                break
            # A short tick, because the end of the tool shows on no file descriptor while a child holds the pipes.
            for key, _ in selector.select(timeout=min(_TICK_S, (stop_at or deadline) - now)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                buffer = kept[key.fd]
                room = _READ_LIMIT - len(buffer)
                buffer += chunk[:room]
                overflowed[key.fd] = overflowed[key.fd] or len(chunk) > room
    proc.stdout.close()
    proc.stderr.close()
    if stop_at is None:  # the tool closed its output but still runs: it gets the rest of its time
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
    return _Captured(
        stdout=bytes(kept[out]),
        stderr=bytes(kept[err]),
        stdout_overflowed=overflowed[out],
        stderr_overflowed=overflowed[err],
        timed_out=timed_out,
    )


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is already gone


def _decode(data: bytes, *, cut: bool) -> tuple[str, bool]:
    """As text mode would: UTF-8 with replacement, universal newlines; then the documented truncation.

    Returns the text and whether it is cut short: at MAX_OUTPUT_CHARS here, or already by the reader (``cut``).
    """
    text = data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    return text[:MAX_OUTPUT_CHARS], cut or len(text) > MAX_OUTPUT_CHARS
