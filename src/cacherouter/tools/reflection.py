"""Runtime reflection: the explicit fallback for parsers that static analysis cannot read.

This *runs* the script (in a child process, with a timeout, no stdin) up to the point where it asks argparse to
parse its arguments, then dumps the parser's actions instead of parsing. That executes the script's module-level
code, which is exactly what registration otherwise avoids, so it happens only when the caller opts in
(``allow_reflection=True`` / ``--allow-reflection``) and never by default. Like a tool run, it gets an
environment without the model endpoints' API keys (:func:`~cacherouter.tools.executor.tool_environment`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..errors import SchemaError
from .executor import tool_environment
from .schema import Action, ArgumentSpec, JsonType, ScriptSchema

# Runs inside the child: replaces parse_args/parse_known_args with a dump of the parser, then runs the script.
_HARNESS = r"""
import argparse, json, runpy, sys
MARK = "\x00cacherouter-reflection\x00"
def _value(v):
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    if isinstance(v, (list, tuple)):
        return [_value(x) for x in v]
    return None
def _dump(self, *args, **kwargs):
    out = {"description": self.description or "", "arguments": [], "groups": []}
    for action in self._actions:
        kind = type(action).__name__
        if kind in ("_HelpAction", "_VersionAction", "_SubParsersAction"):
            if kind == "_SubParsersAction":
                out["subparsers"] = True
            continue
        t = action.type
        out["arguments"].append({
            "dest": action.dest, "option_strings": list(action.option_strings), "kind": kind,
            "nargs": action.nargs if not isinstance(action.nargs, str) or action.nargs in "?*+" else "...",
            "choices": _value(list(action.choices)) if action.choices is not None else None,
            "default": _value(action.default) if action.default is not argparse.SUPPRESS else None,
            "has_default": action.default is not None and action.default is not argparse.SUPPRESS,
            "required": bool(action.required), "help": action.help if isinstance(action.help, str) else "",
            "hidden": action.help == argparse.SUPPRESS,
            "type": getattr(t, "__name__", type(t).__name__) if t is not None else None,
        })
    for group in self._mutually_exclusive_groups:
        out["groups"].append([[a.dest for a in group._group_actions], bool(group.required)])
    sys.stdout.write(MARK + json.dumps(out) + MARK)
    sys.stdout.flush()
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = _dump
argparse.ArgumentParser.parse_known_args = _dump
argparse.ArgumentParser.parse_intermixed_args = _dump
script = sys.argv[1]
sys.argv = [script]
runpy.run_path(script, run_name="__main__")
"""
_MARK = "\x00cacherouter-reflection\x00"
_KINDS: dict[str, Action] = {
    "_StoreAction": "store",
    "_StoreTrueAction": "store_true",
    "_StoreFalseAction": "store_false",
    "_StoreConstAction": "store_const",
    "_AppendAction": "append",
    "_ExtendAction": "extend",
    "_CountAction": "count",
    "BooleanOptionalAction": "boolean_optional",
}
_TYPES: dict[str, JsonType] = {"int": "integer", "float": "number", "str": "string"}


def reflect_schema(script: Path, *, timeout: float = 10.0, python: str = sys.executable) -> ScriptSchema:
    """Run ``script`` in a child process until it parses arguments, and read its parser from there."""
    script = script.absolute()  # the child runs in the script's directory, where a relative path means nothing
    try:
        proc = subprocess.run(
            [python, "-c", _HARNESS, str(script)],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            cwd=script.parent,
            env=tool_environment(),
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise SchemaError(f"{script}: reflection timed out after {timeout:g}s before the parser was built") from e
    parts = proc.stdout.split(_MARK)
    if len(parts) < 3:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SchemaError(f"{script}: reflection found no argparse parser (exit {proc.returncode}: {tail[0]})")
    data: dict[str, Any] = json.loads(parts[1])
    if data.get("subparsers"):
        raise SchemaError(f"{script}: sub-commands (add_subparsers) are not supported as one tool")
    specs = [_spec(item) for item in data["arguments"] if not item["hidden"]]
    return ScriptSchema(
        description=str(data["description"]).strip(),
        arguments=tuple(spec for spec in specs if spec is not None),
        exclusive_groups=tuple((tuple(dests), bool(req)) for dests, req in data["groups"]),
        source="reflection",
    )


def _spec(item: dict[str, Any]) -> ArgumentSpec | None:
    action = _KINDS.get(item["kind"])
    if action is None:
        return None
    type_name = item["type"]
    json_type: JsonType = _TYPES.get(type_name, "string") if type_name else "string"
    choices = tuple(item["choices"]) if item["choices"] is not None else None
    nargs = item["nargs"]
    option_strings = tuple(item["option_strings"])
    if action == "boolean_optional":  # argparse adds the --no- form itself; the argv builder derives it
        option_strings = tuple(o for o in option_strings if not o.startswith("--no-"))
    return ArgumentSpec(
        dest=item["dest"],
        option_strings=option_strings,
        action=action,
        json_type=json_type,
        nargs=nargs if nargs not in (None, 1) or action == "store" else None,
        choices=choices,
        default=item["default"],
        has_default=bool(item["has_default"]) or action in ("store_true", "store_false"),
        # argparse flags "*" and "?" positionals as required although an empty value satisfies them.
        required=bool(item["required"]) and not (not option_strings and nargs in ("?", "*")),
        help=item["help"].replace("%(default)s", str(item["default"])).strip(),
        path_like=type_name in ("Path", "PosixPath", "FileType"),
    )
