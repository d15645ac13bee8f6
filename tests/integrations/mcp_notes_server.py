"""A real, stateful MCP server for the proxy tests: notes in the server process's memory.

Every process start and every tool execution is appended to the file named by ``$NOTES_LOG``, so tests count
what really ran upstream. Run: ``python mcp_notes_server.py`` (stdio).
"""

from __future__ import annotations

import os

from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

server = MCPServer("notes")
NOTES: dict[str, str] = {}
READ_ONLY = ToolAnnotations(read_only_hint=True)


def log(line: str) -> None:
    path = os.environ.get("NOTES_LOG")
    if path:
        with open(path, "a") as handle:
            handle.write(line + "\n")


@server.tool()
def write(name: str, text: str) -> str:
    """Create or replace a note."""
    log(f"call write {name}")
    NOTES[name] = text
    return f"wrote {name} ({len(text)} chars)"


@server.tool()
def append(name: str, text: str) -> str:
    """Append to a note."""
    log(f"call append {name}")
    if name not in NOTES:
        raise ToolError(f"no note named {name!r}")
    NOTES[name] += text
    return NOTES[name]


@server.tool(annotations=READ_ONLY)
def read(name: str) -> str:
    """Read a note."""
    log(f"call read {name}")
    return NOTES.get(name, "")


@server.tool(annotations=READ_ONLY)
def names() -> list[str]:
    """The names of all notes, sorted."""
    log("call names")
    return sorted(NOTES)


if __name__ == "__main__":
    log(f"start {os.getpid()}")
    server.run()
