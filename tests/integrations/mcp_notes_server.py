"""A real, stateful MCP server for the proxy tests: notes in the server process's memory.

Every process start and every tool execution is appended to the file named by ``$NOTES_LOG``, so tests count
what really ran upstream. Run: ``python mcp_notes_server.py`` (stdio).
"""

from __future__ import annotations

import os
import time

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


@server.tool(
    title="Find notes",
    annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=True, open_world_hint=False),
    meta={"tests.tvcache/origin": "mcp_notes_server"},
)
def find(text: str, case_sensitive: bool = False) -> list[str]:
    """The names of the notes that contain ``text``, sorted."""
    # Declared with more than the other tools (a title, more annotations, _meta, parameters out of alphabetical
    # order) so the proxy tests see it listed exactly as the server declares it.
    log(f"call find {text}")
    if case_sensitive:
        return sorted(name for name, note in NOTES.items() if text in note)
    return sorted(name for name, note in NOTES.items() if text.lower() in note.lower())


@server.tool(annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=True))
def now() -> str:
    """The server's clock (nanoseconds since the epoch): read-only and idempotent, yet never the same twice."""
    log("call now")
    return str(time.time_ns())


if __name__ == "__main__":
    log(f"start {os.getpid()}")
    server.run()
