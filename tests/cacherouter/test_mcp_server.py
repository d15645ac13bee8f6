"""``cacherouter serve-mcp`` in a subprocess (stdio) against a real MCP client: list, call, hot reload, notify."""

from __future__ import annotations

import asyncio
import functools
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from support import add_tool, make_repo

pytest.importorskip("mcp", reason="the 'mcp' extra is not installed: pip install 'tvcache[mcp]'")

import anyio  # noqa: E402
import mcp.types as types  # noqa: E402
from mcp import Client, MCPError, StdioServerParameters  # noqa: E402
from mcp.client.subscriptions import ToolsListChanged  # noqa: E402

WAIT = 30.0  # every wait is bounded by this; a healthy run takes well under a second per wait


def synchronous(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test body on a fresh event loop (the suite uses no async pytest plugin)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


def server(root: Path) -> StdioServerParameters:
    argv = ["-m", "cacherouter.cli", "serve-mcp", "--repo", str(root), "--poll-interval", "0.05"]
    return StdioServerParameters(command=sys.executable, args=argv, env=dict(os.environ))


def text(result: types.CallToolResult) -> str:
    block = result.content[0]
    assert isinstance(block, types.TextContent)
    return block.text


async def names(client: Client) -> list[str]:
    return [tool.name for tool in (await client.list_tools()).tools]


@synchronous
async def test_serves_registry_and_notifies_on_hot_reload(tmp_path: Path) -> None:
    root = make_repo(tmp_path / "repo")
    async with Client(server(root), cache=None) as client:
        listed = (await client.list_tools()).tools
        assert [t.name for t in listed] == ["city_weather", "echo_text", "show_time", "stock_price"]
        echo = next(t for t in listed if t.name == "echo_text")
        assert echo.description == "Echo some text back."
        assert echo.input_schema["properties"]["text"]["default"] == "hi"  # from the AST extraction

        result = await client.call_tool("echo_text", {"text": "a b; c"})
        assert not result.is_error
        assert text(result).strip() == "echo_text:a b; c"  # one argv item, no shell
        assert result.structured_content is not None
        assert result.structured_content["exit_code"] == 0

        bad = await client.call_tool("echo_text", {"nope": 1})
        assert bad.is_error
        assert "unknown argument" in text(bad)
        with pytest.raises(MCPError, match="Unknown tool"):
            await client.call_tool("no_such_tool", {})

        async with client.listen(tools_list_changed=True) as subscription:
            add_tool(root, "other", "fresh", "fresh_tool", "A tool added while serving.")
            # A poll may land between the writes of SKILL.md and the script: then a second event follows.
            with anyio.fail_after(WAIT):
                async for event in subscription:
                    assert isinstance(event, ToolsListChanged)
                    if "fresh_tool" in await names(client):
                        break
        fresh = await client.call_tool("fresh_tool", {"text": "new"})
        assert text(fresh).strip() == "fresh_tool:new"


@synchronous
async def test_handshake_era_clients_get_list_changed_notifications(tmp_path: Path) -> None:
    root = make_repo(tmp_path / "repo")
    changed = asyncio.Event()

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            changed.set()

    async with Client(server(root), cache=None, mode="legacy", message_handler=on_message) as client:
        assert client.server_capabilities.tools is not None
        assert client.server_capabilities.tools.list_changed
        assert "fresh_tool" not in await names(client)  # the first request registers the session for notices

        async def notified_until(expected: list[str]) -> None:
            # each change is announced; a poll between two writes announces an intermediate list first
            with anyio.fail_after(WAIT):
                while True:
                    await changed.wait()
                    changed.clear()
                    if await names(client) == expected:
                        return

        add_tool(root, "other", "fresh", "fresh_tool")
        await notified_until(["city_weather", "echo_text", "fresh_tool", "show_time", "stock_price"])
        # a broken script is reported and skipped; the rest keeps serving
        (root / "tail" / "stocks" / "broken_tool.py").write_text("import argparse\nparser = (\n")
        (root / "base" / "echo" / "echo_text.py").unlink()
        await notified_until(["city_weather", "fresh_tool", "show_time", "stock_price"])
