"""The main model's fixed view: core tools chosen by package, plus the two pseudo-tools, as canonical bytes.

The view is rendered once and then only ever reused: hot reloads, new skills and gateway restarts change the
registry, never a view that already exists. A session stores its view's text, so a resumed session keeps it too.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from ..canonical import render_tools
from ..errors import ConfigError
from ..prompts import PLACEHOLDER_TOOL, ROUTER_TOOL, placeholder_tool_definition, router_tool_definition
from ..tools.registry import Registry


@dataclass(frozen=True, kw_only=True)
class MainView:
    packages: tuple[str, ...]
    core_tools: tuple[str, ...]
    tools_json: str  # the canonical tool segment sent with every main-model request

    @classmethod
    def from_registry(cls, registry: Registry, packages: tuple[str, ...]) -> MainView:
        specs = registry.in_packages(packages)
        missing = sorted(set(packages) - set(registry.packages))
        if missing:
            raise ConfigError(f"core package(s) {missing} have no registered tools; known: {list(registry.packages)}")
        definitions = [spec.definition() for spec in specs]
        definitions += [router_tool_definition(), placeholder_tool_definition()]
        return cls(
            packages=tuple(sorted(packages)),
            core_tools=tuple(spec.name for spec in specs),
            tools_json=render_tools(definitions),
        )

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MainView:
        return cls(
            packages=tuple(data["packages"]), core_tools=tuple(data["core_tools"]), tools_json=str(data["tools_json"])
        )

    def to_json(self) -> dict[str, Any]:
        return {"packages": list(self.packages), "core_tools": list(self.core_tools), "tools_json": self.tools_json}

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.tools_json.encode("utf-8")).hexdigest()

    def definitions(self) -> list[dict[str, Any]]:
        loaded: list[dict[str, Any]] = json.loads(self.tools_json)
        return loaded

    def is_core(self, name: str) -> bool:
        return name in self.core_tools and name not in (ROUTER_TOOL, PLACEHOLDER_TOOL)
