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

from cacherouter.tools.executor import MAX_OUTPUT_CHARS
from cacherouter.tools.gateway import Gateway, GatewayConfig

pytest.importorskip("mcp", reason="the 'mcp' extra is not installed: pip install 'tvcache[mcp]'")

import anyio  # noqa: E402
import mcp.types as types  # noqa: E402
from anyio import wait_all_tasks_blocked  # noqa: E402
from anyio.abc import SocketAttribute, SocketListener, SocketStream  # noqa: E402
from mcp import Client, MCPError, StdioServerParameters  # noqa: E402
from mcp.client.subscriptions import ToolsListChanged  # noqa: E402

from cacherouter.mcp_servers.registry_server import GatewayMCPServer  # noqa: E402

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


GATE = """\"\"\"Report in, then wait for the test to let it through.\"\"\"
import argparse, socket
p = argparse.ArgumentParser(description="Report in, then wait for the test to let it through.")
p.add_argument("--port", type=int, required=True, help="where the test listens")
args = p.parse_args()
with socket.create_connection(("127.0.0.1", args.port), timeout=60) as s:
    s.sendall(b"in")
    s.recv(1)
print("through")
"""


@synchronous
async def test_the_protocol_answers_while_more_calls_are_in_flight_than_worker_threads(tmp_path: Path) -> None:
    root = make_repo(tmp_path / "repo")
    add_tool(root, "tail", "gate", "gate_tool").write_text(GATE)
    calls = 42  # more than anyio's 40 default worker threads, which the stdio transport needs too
    limit = 16  # the server's default limit on tools running at once
    arrived = 0
    enough, release = anyio.Event(), anyio.Event()

    async def gate(connection: SocketStream) -> None:
        nonlocal arrived
        async with connection:
            await connection.receive()
            arrived += 1
            if arrived == limit:
                enough.set()
            await release.wait()
            await connection.send(b"go")

    results: list[types.CallToolResult] = []

    async def call(client: Client, port: int) -> None:
        results.append(await client.call_tool("gate_tool", {"port": port}))

    async with (
        await anyio.create_tcp_listener(local_host="127.0.0.1") as listeners,
        anyio.create_task_group() as gates,
    ):
        [listener] = listeners.listeners
        assert isinstance(listener, SocketListener)
        gates.start_soon(listener.serve, gate)
        async with Client(server(root), cache=None) as client, anyio.create_task_group() as running:
            for _ in range(calls):
                running.start_soon(call, client, listener.extra(SocketAttribute.local_port))
            with anyio.fail_after(WAIT):
                await enough.wait()
                assert "gate_tool" in await names(client)  # answered while every call is still held
            assert arrived == limit  # the other calls wait for a slot: none ended, so none more started
            release.set()
        gates.cancel_scope.cancel()
    assert [text(r).strip() for r in results] == ["through"] * calls


LOUD = """\"\"\"Write a lot.\"\"\"
import argparse, sys
argparse.ArgumentParser(description="Write a lot.").parse_args()
sys.stdout.write("x" * 50_000)
sys.stderr.write("a warning\\n")
"""


@synchronous
async def test_long_output_is_cut_visibly_and_stdout_is_not_repeated(tmp_path: Path) -> None:
    root = make_repo(tmp_path / "repo")
    add_tool(root, "tail", "loud", "loud_tool").write_text(LOUD)
    marker = f"\n[output truncated: only the first {MAX_OUTPUT_CHARS} characters are shown]"
    async with Client(server(root), cache=None) as client:
        result = await client.call_tool("loud_tool", {})
    assert not result.is_error
    assert text(result) == "x" * MAX_OUTPUT_CHARS + marker
    # status, exit code, flags and stderr; stdout is in the text content only
    assert result.structured_content == {
        "tool": "loud_tool",
        "ok": True,
        "exit_code": 0,
        "stderr": "a warning\n",
        "stdout_truncated": True,
    }
    # the same marker and flag wherever a model reads a tool result
    direct = Gateway(GatewayConfig(root=root)).call("loud_tool", {})
    assert direct.stdout == "x" * MAX_OUTPUT_CHARS
    assert (direct.stdout_truncated, direct.stderr_truncated) == (True, False)
    assert direct.to_json()["stdout"] == "x" * MAX_OUTPUT_CHARS + marker
    assert direct.to_json()["stdout_truncated"] is True


@synchronous
async def test_list_changed_is_sent_only_when_the_listing_changes(tmp_path: Path) -> None:
    root = make_repo(tmp_path / "repo")
    gateway = Gateway(GatewayConfig(root=root))  # polled by hand: each poll below is one swap
    mcp_server = GatewayMCPServer(gateway)
    async with Client(mcp_server.server, cache=None) as client:
        async with client.listen(tools_list_changed=True) as subscription:
            before = (await client.list_tools()).tools
            skill = root / "base" / "echo" / "SKILL.md"
            skill.write_text(skill.read_text() + "More words for retrieval.\n")
            assert gateway.poll().changed
            (root / "base" / "echo" / "_helpers.py").write_text("HELPER = 1\n")  # no tool: a leading "_"
            assert gateway.poll().changed
            echo = root / "base" / "echo" / "echo_text.py"
            echo.write_text(echo.read_text() + "\ndef broken(:\n")  # served by its last good schema
            assert gateway.poll().changed
            await wait_all_tasks_blocked()  # any notification scheduled by those swaps has gone out
            assert mcp_server.notifications_sent == 0
            assert (await client.list_tools()).tools == before

            add_tool(root, "other", "fresh", "fresh_tool")
            assert gateway.poll().changed
            with anyio.fail_after(WAIT):
                event = await anext(aiter(subscription))
            assert isinstance(event, ToolsListChanged)
            assert "fresh_tool" in await names(client)
        await wait_all_tasks_blocked()
        assert mcp_server.notifications_sent == 1
