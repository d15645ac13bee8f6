"""Skill bootstrapping: write a new skill into a separate package, validate it, then publish it atomically.

New skills go to the ``other`` package by default, which is not one of the main model's core packages, so the
main view never changes; the gateway's next poll registers the skill and the router can reach it. A skill is only
published after it parses, its schema extracts statically (from the generated header alone: the body may not
change the parser), and its own check run exits 0 — the gateway never sees a half-written or failing skill.

The check run is validation, not confinement. It runs a copy of the skill in a fresh temporary directory outside
the repository, with ``CACHEROUTER_REPO`` removed from its environment, so a relative path or the repository
variable does not lead it to the tools; but it runs as the same user on the same file system, so code that names
an absolute path can still read or write there. Run the builder itself in a sandbox (a container, a separate
user) when skills come from a model you do not trust.

Publishing holds an exclusive lock on ``.skill-builder.lock`` in the repository root around the name check and
the rename, so two builders running at once can neither publish one name twice nor trip over each other.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import SchemaError
from ..prompts import PLACEHOLDER_TOOL, ROUTER_TOOL
from .argparse_ast import extract_static
from .executor import ScriptResult, build_argv, run_script
from .registry import SKILL_FILE, is_segment, iter_scripts
from .schema import ScriptSchema

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
#: The environment variable through which tools find the repository; the check run does not get it.
REPO_VARIABLE = "CACHEROUTER_REPO"
#: Held around the name check and the publishing rename; a dot-file in the repository root, which scans ignore.
LOCK_FILE = ".skill-builder.lock"
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
    seen: set[str] = set()
    for p in params:
        # The body reads each parameter as ``args.<name>``: it must be an identifier, and once only.
        if not _NAME.fullmatch(p.name) or p.name == "help" or p.name in seen:
            raise SchemaError(
                f"parameter {p.name!r}: names are lowercase identifiers (a-z, 0-9, _; at most 64), "
                "unique, and not 'help'"
            )
        seen.add(p.name)
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
    _check_names(root, name, package)
    target = root / package / name
    description = " ".join(description.split())  # one line: SKILL.md front matter and the docstring stay intact
    source = render_skill_script(name, description, params, body)
    schema = _static_schema(name, source, render_skill_script(name, description, params, ""))
    argv = build_argv(schema, check_arguments)
    skill_md = f"---\nname: {name}\ndescription: {json.dumps(description, ensure_ascii=False)}\n---\n"
    skill_md += f"Bootstrapped skill. {description}\n"
    try:
        result = _check_run(name, package, source, skill_md, argv, timeout)
        with _repository_lock(root):
            _check_names(root, name, package)  # again: another builder may have published it meanwhile
            # The staging directory sits next to the target, so the rename below is atomic; dot-dirs are ignored
            # by scans, so the gateway never sees it half-written.
            (root / package).mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root / package))
            try:
                _write_skill(staging, name, source, skill_md)
                os.rename(staging, target)  # publish in one step
            finally:
                if staging.exists():
                    shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:
        raise SchemaError(f"cannot write skill {package}/{name}: {e}") from e
    return BuiltSkill(name=name, package=package, script=target / f"{name}.py", check_output=result.stdout)


def _check_names(root: Path, name: str, package: str) -> None:
    if not _NAME.fullmatch(name):
        raise SchemaError(f"skill name {name!r} must be lower_snake_case, at most 64 characters")
    if name.upper() in (ROUTER_TOOL, PLACEHOLDER_TOOL):
        raise SchemaError(f"skill name {name!r} is reserved for the {name.upper()} pseudo-tool; choose another name")
    if not is_segment(package):
        raise SchemaError(
            f"package {package!r} must be one directory name of letters, digits, '_', '.' or '-' that starts "
            "with a letter or digit"
        )
    taken = _script_named(root, name)
    if taken is not None:
        raise SchemaError(f"tool name {name!r} is already taken by {taken.relative_to(root)}; choose another name")
    if (root / package / name).exists():
        raise SchemaError(f"skill {package}/{name} already exists; choose another name")


def _static_schema(name: str, source: str, header: str) -> ScriptSchema:
    """The schema of the generated script, which must be the one of its header: the body may use the parser's
    result but not change the parser (an argument added after ``parse_args`` would be advertised, then refused)."""
    try:
        source.encode("utf-8")
        ast.parse(source)
    except UnicodeEncodeError as e:
        raise SchemaError(f"the skill cannot be written as UTF-8 ({e.reason})") from e
    except (SyntaxError, ValueError) as e:
        where = f"line {e.lineno}: {e.msg}" if isinstance(e, SyntaxError) else str(e)
        raise SchemaError(f"the skill body is not valid Python ({where})") from e
    extraction = extract_static(source, filename=f"{name}.py")
    if extraction.schema is None:
        raise SchemaError(f"the generated parser is not static: {extraction.dynamic_reason}")
    if extraction.schema != extract_static(header, filename=f"{name}.py").schema:
        raise SchemaError(
            "the skill body changes the parser (its schema differs from the one of the declared params); "
            "declare every argument in params and only read 'args' in the body"
        )
    return extraction.schema


def _check_run(name: str, package: str, source: str, skill_md: str, argv: list[str], timeout: float) -> ScriptResult:
    """Run a copy of the skill in a fresh temporary directory laid out like the repository, without
    ``CACHEROUTER_REPO``; raises :class:`SchemaError` unless it exits 0 in time."""
    env = {key: value for key, value in os.environ.items() if key != REPO_VARIABLE}
    with tempfile.TemporaryDirectory(prefix=".cacherouter-skill-check-") as tmp:
        skill_dir = Path(tmp) / package / name
        skill_dir.mkdir(parents=True)
        script = _write_skill(skill_dir, name, source, skill_md)
        result = run_script(script, argv, tool=name, timeout=timeout, env=env)
    if not result.ok:
        reason = "timed out" if result.timed_out else (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise SchemaError(f"the skill's check run failed: {reason}")
    return result


def _write_skill(directory: Path, name: str, source: str, skill_md: str) -> Path:
    script = directory / f"{name}.py"
    script.write_text(source, encoding="utf-8")
    (directory / SKILL_FILE).write_text(skill_md, encoding="utf-8")
    return script


@contextlib.contextmanager
def _repository_lock(root: Path) -> Iterator[None]:
    """Hold the repository's skill-builder lock (blocking): only a name check and a rename run under it."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOCK_FILE, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _script_named(root: Path, name: str) -> Path | None:
    """The script the registry names ``name``, if any. Tools are named after their scripts and the registry gives
    a name to one script only: a duplicate would be published "ok", then stay a registry problem."""
    if not root.is_dir():
        return None
    return next((script for _, _, script in iter_scripts(root) if script.stem == name), None)


def params_from_json(text: str) -> list[SkillParam]:
    try:
        items = json.loads(text) if text else []
        return [SkillParam(**item) for item in items]
    except (json.JSONDecodeError, TypeError) as e:
        raise SchemaError(f"params must be a JSON list of {{name, type, help, default, required}}: {e}") from e
