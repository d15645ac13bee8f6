"""A stateful veRL BaseTool for the tests: a key-value store per rollout (keyed by ``agent_data.request_id``,
as stateful veRL tools keep per-trajectory state), counting its real executions."""

from __future__ import annotations

from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

STORES: dict[str, dict[str, int]] = {}
EXECUTIONS: list[tuple[str, dict[str, Any]]] = []


class KVTool(BaseTool):
    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        EXECUTIONS.append((self.name, dict(parameters)))
        store = STORES.setdefault(kwargs["agent_data"].request_id, {})
        op, key = parameters["op"], parameters["key"]
        if op == "set":
            store[key] = int(parameters["value"])
        elif op == "incr":
            store[key] = store.get(key, 0) + 1
        elif op != "get":
            return ToolResponse(text=f"unknown op {op!r}"), -1.0, {}
        return ToolResponse(text=f"{key}={store.get(key)}"), 0.0, {"size": len(store)}
