"""The tool repository (package / skill / script) and the immutable registry built from it.

Layout::

    ROOT/
      <package>/                 e.g. base, geography, other (bootstrapped skills land in "other")
        <skill>/
          SKILL.md               front matter "name:" / "description:", then free text used for retrieval
          <script>.py            each script is one tool, named after its file (no leading "_")
          scripts/<script>.py    scripts may also sit one level down

A :class:`Registry` is a value: once built it never changes, so a reader holding one sees a consistent set of
tools while the gateway builds and swaps in the next. A script that cannot be registered is left out and listed
in :attr:`Registry.problems`; it never stops the others from registering. A script that was registered before
and is now broken keeps its last good entry (and is listed as a problem too), so an edit that breaks a tool
never makes it vanish from under a session that already advertised it; deleting the script removes it. For the
same reason a tool name stays with its script: a new script with a taken name is a problem, wherever it sits.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ..errors import RegistryError, SchemaError
from ..prompts import PLACEHOLDER_TOOL, ROUTER_TOOL
from .argparse_ast import extract_static
from .reflection import reflect_schema
from .schema import ScriptSchema

SKILL_FILE = "SKILL.md"
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
#: Names of the pseudo-tools the main and router channels define themselves.
RESERVED_NAMES = frozenset({ROUTER_TOOL, PLACEHOLDER_TOOL})


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Global limits that keep tool metadata compact enough for routing prompts."""

    max_name_length: int = 64
    max_description_length: int = 1024
    name_pattern: str = r"^[A-Za-z][A-Za-z0-9_-]*$"


@dataclass(frozen=True, kw_only=True)
class Problem:
    """A script that could not be registered, and why."""

    path: str
    message: str


@dataclass(frozen=True, kw_only=True)
class RegisteredTool:
    """One registered tool: a script (where it is, what its command line looks like) or an upstream MCP tool.

    An upstream tool has no script: ``upstream`` names its server (see :mod:`cacherouter.tools.upstreams`),
    ``upstream_tool`` its own name there, ``declared_schema`` the input schema the server declared, as JSON
    text in the server's own member order, and ``declared_fields`` the other fields of its definition.
    """

    name: str
    package: str
    skill: str
    description: str
    script: Path | None = None
    schema: ScriptSchema = field(default_factory=ScriptSchema)
    skill_text: str = ""  # SKILL.md body (a server's instructions for upstream tools), used by retrieval only
    digest: str = ""  # sha256 of the script source, or of an upstream tool's whole declared definition
    upstream: str = ""
    upstream_tool: str = ""
    declared_schema: str = ""
    # The rest of an upstream tool's declared definition (title, annotations, outputSchema, icons, _meta, ...) as
    # JSON text: the MCP gateway lists a core tool with it, verbatim.
    declared_fields: str = ""

    def input_schema(self) -> dict[str, Any]:
        if self.upstream:
            declared: dict[str, Any] = json.loads(self.declared_schema)
            return declared
        return self.schema.json_schema()

    def definition(self) -> dict[str, Any]:
        """The OpenAI-style function definition of this tool."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.input_schema()},
        }

    def search_text(self) -> str:
        """Everything retrieval may match against: name, description, parameters and the SKILL.md text."""
        if self.upstream:
            properties = self.input_schema().get("properties") or {}
            params = " ".join(
                f"{key} {value.get('description', '') if isinstance(value, dict) else ''}"
                for key, value in properties.items()
            )
        else:
            params = " ".join(f"{a.dest} {a.help}" for a in self.schema.arguments)
        return f"{self.name} {self.skill} {self.package} {self.description} {params} {self.skill_text}"


@dataclass(frozen=True, kw_only=True)
class Registry:
    """An immutable snapshot of the registered tools."""

    tools: Mapping[str, RegisteredTool] = field(default_factory=lambda: MappingProxyType({}))
    problems: tuple[Problem, ...] = ()
    generation: int = 0

    def __iter__(self) -> Iterator[RegisteredTool]:
        return iter(self.tools[name] for name in sorted(self.tools))

    def __len__(self) -> int:
        return len(self.tools)

    def get(self, name: str) -> RegisteredTool | None:
        return self.tools.get(name)

    @property
    def packages(self) -> Mapping[str, tuple[str, ...]]:
        """Package index: package name -> sorted tool names."""
        index: dict[str, list[str]] = {}
        for spec in self:
            index.setdefault(spec.package, []).append(spec.name)
        return MappingProxyType({pkg: tuple(names) for pkg, names in sorted(index.items())})

    def in_packages(self, packages: tuple[str, ...]) -> tuple[RegisteredTool, ...]:
        wanted = set(packages)
        return tuple(spec for spec in self if spec.package in wanted)


def is_segment(name: str) -> bool:
    """Whether ``name`` is a package or skill directory name the registry scans (one path segment, no dot-dir)."""
    return _SEGMENT.fullmatch(name) is not None


def iter_scripts(root: Path) -> Iterator[tuple[str, str, Path]]:
    """Yield (package, skill, script) for every candidate script under ``root``, in a stable order."""
    for package_dir in sorted(p for p in root.iterdir() if p.is_dir() and is_segment(p.name)):
        for skill_dir in sorted(p for p in package_dir.iterdir() if p.is_dir() and is_segment(p.name)):
            candidates = list(skill_dir.glob("*.py")) + list((skill_dir / "scripts").glob("*.py"))
            for script in sorted(candidates):
                if not script.name.startswith("_"):
                    yield package_dir.name, skill_dir.name, script


def repository_snapshot(root: Path) -> tuple[tuple[str, str], ...]:
    """A fingerprint of everything that affects the registry: (relative path, content hash) of each file.

    Content hashes rather than mtimes, so that two writes within one timestamp tick are still seen.
    """
    if not root.is_dir():
        raise RegistryError(f"tool repository {root} does not exist or is not a directory")
    entries: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__")))
        for name in sorted(filenames):
            if name.endswith(".py") or name == SKILL_FILE:
                path = Path(dirpath) / name
                try:
                    digest = hashlib.sha256(path.read_bytes()).hexdigest()
                except OSError:
                    continue  # vanished between listing and reading; the next poll sees the new state
                entries.append((str(path.relative_to(root)), digest))
    return tuple(entries)


def read_skill_file(skill_dir: Path) -> tuple[dict[str, str], str]:
    """Front matter (simple ``key: value`` lines between ``---`` fences) and body of a skill's SKILL.md."""
    path = skill_dir / SKILL_FILE
    if not path.is_file():
        return {}, ""
    text = path.read_text(encoding="utf-8", errors="replace")
    meta: dict[str, str] = {}
    body = text
    if text.startswith("---"):
        head, sep, rest = text[3:].partition("\n---")
        if sep:
            body = rest.lstrip("-\n")
            for line in head.splitlines():
                key, colon, value = line.partition(":")
                if colon and key.strip():
                    meta[key.strip().lower()] = _front_matter_value(value.strip())
    return meta, body.strip()


def _front_matter_value(text: str) -> str:
    """A front matter value: a double-quoted one is a JSON (and YAML) string, as the skill builder writes it;
    otherwise the text without the quotes around it."""
    if len(text) >= 2 and text[0] == text[-1] == '"':
        with contextlib.suppress(ValueError):
            value = json.loads(text)
            if isinstance(value, str):
                return value
    return text.strip("\"'")


def build_registry(
    root: Path,
    *,
    limits: Limits | None = None,
    allow_reflection: bool = False,
    reflection_timeout: float = 10.0,
    previous: Registry | None = None,
) -> Registry:
    """Scan ``root`` and build a new registry. Broken scripts are skipped and listed as problems.

    ``previous`` lets unchanged scripts (same content hash) reuse their schema, so a reload costs only the
    scripts that changed. Raises :class:`RegistryError` only when the repository itself cannot be read.
    """
    limits = limits or Limits()
    root = root.absolute()  # tools run in their own directory, so every script path must be absolute
    if not root.is_dir():
        raise RegistryError(f"tool repository {root} does not exist or is not a directory")
    name_re = re.compile(limits.name_pattern)
    reuse = {spec.digest: spec for spec in previous} if previous is not None else {}
    last_good = previous.tools if previous is not None else {}
    scripts = list(iter_scripts(root))
    holders = _previous_holders(last_good, {script for _, _, script in scripts})
    tools: dict[str, RegisteredTool] = {}
    problems: list[Problem] = []
    skill_cache: dict[Path, tuple[dict[str, str], str]] = {}
    for package, skill, script in scripts:
        rel = str(script.relative_to(root))
        name = script.stem
        if len(name) > limits.max_name_length or not name_re.match(name):
            problems.append(
                Problem(
                    path=rel,
                    message=f"tool name {name!r} breaks the naming limits ({limits.name_pattern}, "
                    f"<= {limits.max_name_length} chars); rename the script",
                )
            )
            continue
        if name in RESERVED_NAMES:
            problems.append(
                Problem(path=rel, message=f"tool name {name!r} is reserved for the router; rename the script")
            )
            continue
        holder = holders.get(name)
        if holder is not None and holder != script:
            problems.append(
                Problem(
                    path=rel,
                    message=f"tool name {name!r} is already taken by {holder.relative_to(root)}, which held it "
                    "before; rename this script",
                )
            )
            continue
        if name in tools:
            problems.append(
                Problem(
                    path=rel,
                    message=f"tool name {name!r} is already taken by {Path(tools[name].script or name).name} in "
                    f"package {tools[name].package!r}; rename one of them",
                )
            )
            continue
        try:
            source = script.read_bytes()
        except OSError as e:
            problems.append(Problem(path=rel, message=f"cannot read script: {e}"))
            continue
        digest = hashlib.sha256(source).hexdigest()
        skill_dir = script.parent.parent if script.parent.name == "scripts" else script.parent
        if skill_dir not in skill_cache:
            skill_cache[skill_dir] = read_skill_file(skill_dir)
        meta, body = skill_cache[skill_dir]
        cached = reuse.get(digest)
        if cached is not None and cached.script == script:
            schema = cached.schema
        else:
            try:
                schema = script_schema(
                    script,
                    source.decode("utf-8", errors="replace"),
                    allow_reflection=allow_reflection,
                    reflection_timeout=reflection_timeout,
                )
            except SchemaError as e:
                kept = last_good.get(name)
                if kept is not None and kept.script == script:
                    # Keep serving the last good schema; a call runs the current file and reports its error.
                    tools[name] = kept
                    problems.append(Problem(path=rel, message=f"{e} (the last good schema keeps serving)"))
                else:
                    problems.append(Problem(path=rel, message=str(e)))
                continue
        description = schema.description or meta.get("description", "") or f"{skill} tool from package {package}"
        if len(description) > limits.max_description_length:
            description = description[: limits.max_description_length - 3].rstrip() + "..."
        tools[name] = RegisteredTool(
            name=name,
            package=package,
            skill=skill,
            script=script,
            description=description,
            schema=schema,
            skill_text=body,
            digest=digest,
        )
    generation = previous.generation + 1 if previous is not None else 1
    return Registry(tools=MappingProxyType(tools), problems=tuple(problems), generation=generation)


def _previous_holders(last_good: Mapping[str, RegisteredTool], present: set[Path]) -> dict[str, Path]:
    """Tool name -> the script that held it in the previous registry and is still there.

    On a name clash the holder keeps the name and the newcomer is the problem: a script added anywhere in the
    repository must never take over a tool that sessions already advertise and call. Without a previous holder,
    the first script in scan order that registers gets the name.
    """
    return {name: spec.script for name, spec in last_good.items() if spec.script is not None and spec.script in present}


def script_schema(
    script: Path, source: str | None = None, *, allow_reflection: bool = False, reflection_timeout: float = 10.0
) -> ScriptSchema:
    """The schema of one script: static analysis, then reflection only if allowed and needed."""
    text = source if source is not None else script.read_text(encoding="utf-8", errors="replace")
    extraction = extract_static(text, filename=str(script))
    if extraction.schema is not None:
        return extraction.schema
    if not allow_reflection:
        raise SchemaError(
            f"{script.name}: parser is built dynamically ({extraction.dynamic_reason}); not registered. "
            "Declare the arguments literally, or allow reflection (runs the script) to register it"
        )
    return reflect_schema(script, timeout=reflection_timeout)


def write_package_indices(registry: Registry, directory: Path) -> None:
    """Write one JSON index per package (atomically), and delete indices of packages that are gone."""
    directory.mkdir(parents=True, exist_ok=True)
    wanted: set[str] = set()
    for package, names in registry.packages.items():
        target = directory / f"{package}.json"
        wanted.add(target.name)
        entries = [
            {"name": n, "description": registry.tools[n].description, "skill": registry.tools[n].skill} for n in names
        ]
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"package": package, "tools": entries}, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, target)  # readers see the old or the new index, never half of one
    for stale in directory.glob("*.json"):
        if stale.name not in wanted:
            stale.unlink()
