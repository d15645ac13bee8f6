"""Skill bootstrapping: write a new skill into a separate package, validate it, then publish it atomically.

New skills go to the ``other`` package by default, which is not one of the main model's core packages, so the
main view never changes; the gateway's next poll registers the skill and the router can reach it. A skill is
built in a staging directory and only renamed into the repository after it parses, its schema extracts
statically, and its own check run exits 0 — the gateway never sees a half-written or failing skill.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .argparse_ast import extract_static
from .errors import SchemaError
from .executor import build_argv, run_script
from .prompts import PLACEHOLDER_TOOL, ROUTER_TOOL
from .registry import iter_scripts

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_TYPES = {"string": "str", "integer": "int", "number": "float"}


@dataclass(frozen=True, kw_only=True)
class SkillParam:
    name: str
    type: str = "string"  # string, integer, number, boolean
    help: str = ""
    default: Any = None
    required: bool = False


@dataclass(frozen=True, kw_only=True)
class BuiltSkill:
    name: str
    package: str
    script: Path
    check_output: str


def render_skill_script(name: str, description: str, params: list[SkillParam], body: str) -> str:
    lines = [
        repr(description),  # the docstring, as a literal: quotes and backslashes in any description stay valid
        "import argparse",
        "",
        f"parser = argparse.ArgumentParser(description={description!r})",
    ]
    for p in params:
        flag = "--" + p.name.replace("_", "-")
        if p.type == "boolean":
            lines.append(f"parser.add_argument({flag!r}, action='store_true', help={p.help!r})")
            continue
        if p.type not in _TYPES:
            raise SchemaError(f"parameter {p.name!r}: type must be string, integer, number or boolean")
        extra = ", required=True" if p.required else f", default={p.default!r}"
        lines.append(f"parser.add_argument({flag!r}, type={_TYPES[p.type]}{extra}, help={p.help!r})")
    lines += ["args = parser.parse_args()", "", body.rstrip(), ""]
    return "\n".join(lines)


def build_skill(
    root: Path,
    *,
    name: str,
    description: str,
    params: list[SkillParam],
    body: str,
    check_arguments: dict[str, Any],
    package: str = "other",
    timeout: float = 20.0,
) -> BuiltSkill:
    """Write, validate and publish skill ``name``. Raises :class:`SchemaError` with the reason if it fails."""
    if not _NAME.match(name):
        raise SchemaError(f"skill name {name!r} must be lower_snake_case, at most 64 characters")
    if name.upper() in (ROUTER_TOOL, PLACEHOLDER_TOOL):
        raise SchemaError(f"skill name {name!r} is reserved for the {name.upper()} pseudo-tool; choose another name")
    taken = _script_named(root, name)
    if taken is not None:
        raise SchemaError(f"tool name {name!r} is already taken by {taken.relative_to(root)}; choose another name")
    target = root / package / name
    if target.exists():
        raise SchemaError(f"skill {package}/{name} already exists; choose another name")
    source = render_skill_script(name, description, params, body)
    try:
        ast.parse(source)
    except SyntaxError as e:
        raise SchemaError(f"the skill body is not valid Python (line {e.lineno}: {e.msg})") from e
    extraction = extract_static(source, filename=f"{name}.py")
    if extraction.schema is None:
        raise SchemaError(f"the generated parser is not static: {extraction.dynamic_reason}")
    (root / package).mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root / package))  # dot-dirs are ignored by scans
    try:
        script = staging / f"{name}.py"
        script.write_text(source, encoding="utf-8")
        (staging / "SKILL.md").write_text(
            f"---\nname: {name}\ndescription: {description}\n---\nBootstrapped skill. {description}\n",
            encoding="utf-8",
        )
        argv = build_argv(extraction.schema, check_arguments)
        result = run_script(script, argv, tool=name, timeout=timeout)
        if not result.ok:
            reason = "timed out" if result.timed_out else (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise SchemaError(f"the skill's check run failed: {reason}")
        os.rename(staging, target)  # publish in one step
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return BuiltSkill(name=name, package=package, script=target / f"{name}.py", check_output=result.stdout)


def _script_named(root: Path, name: str) -> Path | None:
    """The script the registry names ``name``, if any. Tools are named after their scripts and the registry keeps
    only the first of two with one name: a duplicate would be published "ok", then stay a registry problem."""
    if not root.is_dir():
        return None
    return next((script for _, _, script in iter_scripts(root) if script.stem == name), None)


def params_from_json(text: str) -> list[SkillParam]:
    try:
        items = json.loads(text) if text else []
        return [SkillParam(**item) for item in items]
    except (json.JSONDecodeError, TypeError) as e:
        raise SchemaError(f"params must be a JSON list of {{name, type, help, default, required}}: {e}") from e
