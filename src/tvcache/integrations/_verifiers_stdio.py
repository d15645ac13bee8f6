"""``python -m tvcache.integrations._verifiers_stdio``: one verifiers v1 ``Toolset`` served over stdio, the
upstream that ``tvcache mcp-proxy`` starts for ``CachedToolset`` (``_verifiers_v1``) when a call misses.

verifiers serves a toolset over streamable HTTP, once per rollout; the proxy speaks to its upstream over stdio and
starts one fresh for every sandbox it needs (a miss after hits, a replay, an audit), so this builds the toolset the
way verifiers' own server does — config, ``setup()``, ``setup_task(task)`` — and serves the same tools on stdio,
each annotated ``readOnlyHint`` when the ``CachedToolset`` config declares it read-only. What to serve comes in
environment variables (``TOOLSET``, ``CONFIG``, ``TASK``, ``READ_ONLY`` below), set by ``CachedToolset``.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from .optional_imports import import_ref, require

__all__ = ["CONFIG", "READ_ONLY", "TASK", "TOOLSET", "import_ref", "serve"]

TOOLSET = "TVCACHE_VF_TOOLSET"  # "module:Class" of the toolset
CONFIG = "TVCACHE_VF_TOOLSET_CONFIG"  # its config, as JSON
TASK = "TVCACHE_VF_TASK"  # {"cls": "module:Class", "task": JSON} of the rollout's TaskData, or absent
READ_ONLY = "TVCACHE_VF_READ_ONLY"  # JSON list of the tool names to annotate readOnlyHint


async def serve() -> None:
    require("verifiers.v1", "verifiers")
    mcpserver = require("mcp.server.mcpserver", "verifiers")
    mcp_types = require("mcp.types", "verifiers")
    cls = import_ref(os.environ[TOOLSET])
    toolset = cls(cls._config_cls().model_validate_json(os.environ.get(CONFIG) or "{}"))
    read_only = set(json.loads(os.environ.get(READ_ONLY) or "[]"))
    async with toolset._exit_stack:
        await toolset.setup()
        if os.environ.get(TASK):
            task = json.loads(os.environ[TASK])
            await toolset.setup_task(import_ref(task["cls"]).model_validate_json(task["task"]))
        server = mcpserver.MCPServer(toolset.server_name or cls.__name__)
        add_tool = server.add_tool

        def annotated(fn: Any, name: str | None = None, **kwargs: Any) -> None:
            if (name or fn.__name__) in read_only:
                kwargs["annotations"] = mcp_types.ToolAnnotations(readOnlyHint=True)
            add_tool(fn, name=name, **kwargs)

        server.add_tool = annotated
        toolset.register(server)
        await server.run_stdio_async()


if __name__ == "__main__":
    asyncio.run(serve())
