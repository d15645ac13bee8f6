"""``cacherouter serve-mcp --upstreams``: a fixed tool list for the client, every upstream tool behind the router."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp")

import anyio  # noqa: E402
from mcp import Client, StdioServerParameters  # noqa: E402
from mcp import types as mcp_types  # noqa: E402
from mcp_support import ECHO, ROOT, alive, fixture, pids, tool, wait_until  # noqa: E402
from pydantic import BaseModel, ConfigDict  # noqa: E402

from cacherouter.gateway import Gateway, GatewayConfig  # noqa: E402
from cacherouter.mcp_gateway import DETERMINISTIC_LABEL, ROUTE_META, RoutingMCPServer  # noqa: E402
from cacherouter.models import ChatRequest, ChatResponse, ChatToolCall, ScriptedModel  # noqa: E402
from cacherouter.prompts import ROUTER_TOOL  # noqa: E402


class Verbatim(BaseModel):
    model_config = ConfigDict(extra="allow")


async def raw(client: Client, request: Any) -> dict[str, Any]:
    """A result as the JSON the gateway sent."""
    sent = await client.session.send_request(request, Verbatim)
    return dict(sent.model_extra or {})


async def listing(client: Client) -> str:
    return json.dumps((await raw(client, mcp_types.ListToolsRequest(params=None)))["tools"])


async def call(client: Client, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    params = mcp_types.CallToolRequestParams(name=name, arguments=arguments)
    return await raw(client, mcp_types.CallToolRequest(params=params))


def run(test: Callable[[], Awaitable[None]]) -> None:
    anyio.run(test)


def test_the_listing_never_changes_while_upstreams_change_and_retrieval_runs_tools_verbatim(tmp_path: Path) -> None:
    config, tools_file = fixture(tmp_path, "fx", [ECHO, tool("notify")])
    other, _ = fixture(tmp_path, "other", [tool("lookup", "Look up reference data.")])
    with Gateway(GatewayConfig(root=None, upstreams=(config, other))) as gateway:
        server = RoutingMCPServer(gateway, core=("fx__notify",))

        async def scenario() -> None:
            async with Client(server.server, cache=None, mode="legacy") as client:
                before = await listing(client)
                names = [t["name"] for t in json.loads(before)]
                assert names == ["fx__notify", ROUTER_TOOL]
                assert DETERMINISTIC_LABEL in json.loads(before)[1]["description"]
                # An upstream adds a tool (list_changed), another leaves: the registry swaps, the listing does not.
                tools_file.write_text(json.dumps([ECHO, tool("notify"), tool("weather_now", "Current weather.")]))
                await call(client, "fx__notify", {})
                await anyio.to_thread.run_sync(
                    lambda: wait_until(lambda: "fx__weather_now" in gateway.registry.tools, what="the swap")
                )
                await anyio.to_thread.run_sync(lambda: gateway.set_upstreams((config,)))
                assert "other__lookup" not in gateway.registry.tools
                assert await listing(client) == before
                found = await call(client, ROUTER_TOOL, {"task": "echo a text back with a picture"})
                payload = json.loads(found["content"][0]["text"])
                assert payload["mode"] == DETERMINISTIC_LABEL
                assert "fx__echo" in [c["name"] for c in payload["candidates"]]
                ran = await call(client, ROUTER_TOOL, {"tool": "fx__echo", "arguments": {"text": "hi"}})
                assert ran["content"][0] == {"type": "text", "text": "echo: hi"}
                assert ran["content"][1]["type"] == "image"
                assert ran["structuredContent"] == {"echoed": {"text": "hi"}}
                assert ran["isError"] is False
                assert ran["_meta"]["fixture/served-by"] == "mcp_fixture_server"
                assert ran["_meta"][ROUTE_META]["tool"] == "fx__echo"
                unknown = await call(client, ROUTER_TOOL, {"tool": "other__lookup", "arguments": {}})
                assert unknown["isError"] is True
                assert "no tool" in unknown["content"][0]["text"]

        run(scenario)


def test_with_a_router_model_the_router_picks_and_the_result_is_the_upstreams(tmp_path: Path) -> None:
    config, _ = fixture(tmp_path, "fx", [ECHO, tool("fail")])

    def router(request: ChatRequest) -> ChatResponse:
        names = [d["function"]["name"] for d in json.loads(request.tools_json)]
        assert "fx__echo" in names
        return ChatResponse(tool_calls=(ChatToolCall(id="r0", name="fx__echo", arguments={"text": "routed"}),))

    with Gateway(GatewayConfig(root=None, upstreams=(config,))) as gateway:
        server = RoutingMCPServer(gateway, router_model=ScriptedModel(router))
        assert server.mode == "router model"

        async def scenario() -> None:
            async with Client(server.server, cache=None) as client:
                tools = json.loads(await listing(client))
                assert [t["name"] for t in tools] == [ROUTER_TOOL]
                assert set(tools[0]["inputSchema"]["properties"]) == {"task", "hint"}
                ran = await call(client, ROUTER_TOOL, {"task": "echo the word routed"})
                assert ran["content"][0] == {"type": "text", "text": "echo: routed"}
                assert ran["structuredContent"] == {"echoed": {"text": "routed"}}
                assert ran["_meta"][ROUTE_META] == {"tool": "fx__echo", "mode": "router model"}

        run(scenario)


def test_serve_mcp_with_upstreams_over_stdio_and_nothing_left_behind(tmp_path: Path) -> None:
    config, _ = fixture(tmp_path, "fx", [ECHO, tool("crash")])
    upstreams = tmp_path / "upstreams.json"
    upstreams.write_text(json.dumps({"servers": {"fx": {"command": config.command, "args": list(config.args)}}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEROUTER_")}
    parameters = StdioServerParameters(
        command=sys.executable,
        args=["-m", "cacherouter.cli", "serve-mcp", "--upstreams", str(upstreams), "--core", "fx__echo"],
        env={**env, "PYTHONPATH": str(ROOT / "src")},
    )

    async def scenario() -> None:
        async with Client(parameters, cache=None) as client:
            tools = json.loads(await listing(client))
            assert [t["name"] for t in tools] == ["fx__echo", ROUTER_TOOL]
            echoed = await call(client, "fx__echo", {"text": "direct"})
            assert echoed["structuredContent"] == {"echoed": {"text": "direct"}}
            crashed = await call(client, ROUTER_TOOL, {"tool": "fx__crash", "arguments": {}})
            assert crashed["isError"] is True
            assert "closed the connection during the call" in crashed["content"][0]["text"]
            assert json.loads(await listing(client)) == tools

    run(scenario)
    started = pids(tmp_path, "fx")
    assert started
    wait_until(lambda: not any(alive(p) for p in pids(tmp_path, "fx")), what="every upstream process to exit")
