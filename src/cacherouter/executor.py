"""Running a tool: validate the model's arguments against the schema, build an argv, run a child process.

No shell is involved: the argument vector is a list handed to :func:`subprocess.Popen`, so a value such as
``"; rm -rf /"`` reaches the script as one literal argument. Values that argparse itself would mistake for an
option (they start with ``-``) are passed in the ``--opt=value`` form, or after ``--`` for positionals.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ArgumentError, ToolExecutionError
from .schema import ArgumentSpec, ScriptSchema

MAX_OUTPUT_CHARS = 20_000


@dataclass(frozen=True, kw_only=True)
class ToolResult:
    """What a tool run produced. A non-zero exit or a timeout is a result the model must see, not an error."""

    tool: str
    argv: tuple[str, ...]
    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tool": self.tool, "ok": self.ok, "exit_code": self.exit_code, "stdout": self.stdout}
        if self.stderr:
            out["stderr"] = self.stderr
        if self.timed_out:
            out["error"] = f"timed out after {self.duration_s:.1f}s"
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


def run_script(
    script: Path,
    argv: list[str],
    *,
    tool: str,
    timeout: float = 60.0,
    cwd: Path | None = None,
    python: str = sys.executable,
    env: Mapping[str, str] | None = None,
) -> ToolResult:
    """Run ``python script *argv`` with a timeout; on timeout the whole process group is killed."""
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            [python, str(script), *argv],
            cwd=cwd or script.parent,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            env=dict(env) if env is not None else {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
            start_new_session=True,  # own process group, so a timeout also stops its children
        )
    except OSError as e:
        raise ToolExecutionError(f"cannot start tool {tool!r} ({script}): {e}") from e
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stdout, stderr = proc.communicate()
    return ToolResult(
        tool=tool,
        argv=tuple(argv),
        exit_code=None if timed_out else proc.returncode,
        stdout=stdout[:MAX_OUTPUT_CHARS],
        stderr=stderr[:MAX_OUTPUT_CHARS],
        duration_s=time.monotonic() - start,
        timed_out=timed_out,
    )
