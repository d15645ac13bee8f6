"""``cacherouter serve-mcp --upstreams``: a fixed tool list for the client, every upstream tool behind the router."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
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

from cacherouter.mcp_servers.routing_server import DETERMINISTIC_LABEL, ROUTE_META, RoutingMCPServer  # noqa: E402
from cacherouter.models.base import ChatRequest, ChatResponse, ChatToolCall, ScriptedModel  # noqa: E402
from cacherouter.prompts import ROUTER_TOOL  # noqa: E402
from cacherouter.tools.gateway import Gateway, GatewayConfig  # noqa: E402
from cacherouter.tools.upstreams import UpstreamConfig  # noqa: E402


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


# ---------------------------------------------------------------- issue 26: fixes found driving serve-mcp for real


def upstreams_file(tmp_path: Path, *configs: UpstreamConfig, **keys: Any) -> Path:
    """An upstreams config file for fixture servers; ``keys`` are added to every server's entry."""
    servers = {c.name: {"command": c.command, "args": list(c.args), "timeout": c.timeout, **keys} for c in configs}
    path = tmp_path / "upstreams.json"
    path.write_text(json.dumps({"servers": servers}))
    return path


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEROUTER_")}
    return {**env, "PYTHONPATH": str(ROOT / "src")}


def serve_mcp(*args: str) -> StdioServerParameters:
    return StdioServerParameters(
        command=sys.executable, args=["-m", "cacherouter.cli", "serve-mcp", *args], env=cli_env()
    )


def text_of(result: dict[str, Any]) -> str:
    return str(result["content"][0]["text"])


def test_a_call_is_bounded_by_its_servers_call_timeout_and_a_slow_call_is_not_cut_by_the_connect_timeout(
    tmp_path: Path,
) -> None:
    # timeout (connect/list) 1 s, call_timeout 2.5 s: a 1.5 s call fits; a hung call ends at 2.5 s, said to be ours.
    config, _ = fixture(tmp_path, "fx", [tool("sleep")], timeout=1.0, call_timeout=2.5)
    with Gateway(GatewayConfig(root=None, upstreams=(config,))) as gateway:
        server = RoutingMCPServer(gateway, core=("fx__sleep",))

        async def scenario() -> None:
            async with Client(server.server, cache=None) as client:
                slow = await call(client, "fx__sleep", {"seconds": 1.5})
                assert slow.get("isError") is not True, slow
                assert text_of(slow) == "slept"
                started = time.monotonic()
                hung = await call(client, ROUTER_TOOL, {"tool": "fx__sleep", "arguments": {"seconds": 60}})
                elapsed = time.monotonic() - started
                assert hung["isError"] is True
                assert 2.3 < elapsed < 4.5, elapsed
                assert "the gateway gave up after 2.5 s (call_timeout of server fx)" in text_of(hung)
                assert "answered" not in text_of(hung)

        run(scenario)


def test_internal_router_checks_its_own_schema_and_says_what_is_wrong(tmp_path: Path) -> None:
    config, _ = fixture(tmp_path, "fx", [ECHO])
    with Gateway(GatewayConfig(root=None, upstreams=(config,))) as gateway:
        retrieval = RoutingMCPServer(gateway)
        routed = RoutingMCPServer(gateway, router_model=ScriptedModel(lambda request: ChatResponse(content="unused")))

        async def scenario() -> None:
            async with Client(retrieval.server, cache=None) as client:
                for arguments, words in (
                    ({"tool": "fx__echo", "argumentz": {"text": "x"}}, "unknown argument(s) 'argumentz'"),
                    ({"tool": 5}, "'tool' must be a string, got 5"),
                    ({"task": "echo x", "tool": "fx__echo", "arguments": {"text": "x"}}, "not both"),
                    ({"tool": "fx__echo", "arguments": "text=x"}, "'arguments' must be an object"),
                    ({"arguments": {"text": "x"}}, "'tool' is missing"),
                    ({"task": ["echo"]}, "'task' must be a string"),
                ):
                    answer = await call(client, ROUTER_TOOL, arguments)
                    assert answer["isError"] is True, (arguments, answer)
                    assert words in text_of(answer), (arguments, text_of(answer))
                    assert "structuredContent" not in answer  # the tool never ran
                ran = await call(client, ROUTER_TOOL, {"tool": "fx__echo", "arguments": {"text": "ok"}})
                assert ran["structuredContent"] == {"echoed": {"text": "ok"}}
            async with Client(routed.server, cache=None) as client:
                for arguments, words in (
                    ({"task": "echo x", "tool": "fx__echo"}, "unknown argument(s) 'tool'"),
                    ({"hint": "echo"}, "missing required argument(s) 'task'"),
                    ({"task": 5}, "'task' must be a string"),
                ):
                    answer = await call(client, ROUTER_TOOL, arguments)
                    assert answer["isError"] is True, (arguments, answer)
                    assert words in text_of(answer), (arguments, text_of(answer))

        run(scenario)


def test_core_tools_are_listed_with_their_servers_whole_definition(tmp_path: Path) -> None:
    annotated = {
        **tool("delete_note", "Delete a note.", properties={"id": {"type": "string"}}),
        "title": "Delete a note",
        "annotations": {"title": "Delete note", "readOnlyHint": False, "destructiveHint": True, "openWorldHint": False},
        "outputSchema": {"type": "object", "properties": {"deleted": {"type": "boolean"}}, "required": ["deleted"]},
        "_meta": {"fixture/kind": "destructive"},
    }
    config, _ = fixture(tmp_path, "fx", [annotated, ECHO])
    with Gateway(GatewayConfig(root=None, upstreams=(config,))) as gateway:
        server = RoutingMCPServer(gateway, core=("fx__delete_note", "fx__echo"))

        async def scenario() -> None:
            async with Client(server.server, cache=None) as client:
                tools = json.loads(await listing(client))
                listed = {t["name"]: t for t in tools}
                assert listed["fx__delete_note"] == {**annotated, "name": "fx__delete_note"}
                assert listed["fx__echo"] == {**ECHO, "name": "fx__echo"}
                assert json.loads(server.listing()) == tools
                typed = {t.name: t for t in (await client.list_tools()).tools}  # the SDK's own reading of it
                annotations = typed["fx__delete_note"].annotations
                assert annotations is not None
                assert annotations.destructive_hint is True
                assert annotations.read_only_hint is False
                assert typed["fx__delete_note"].title == "Delete a note"
                assert typed["fx__delete_note"].output_schema == annotated["outputSchema"]

        run(scenario)


def test_a_core_tool_that_went_away_says_so(tmp_path: Path) -> None:
    config, tools_file = fixture(tmp_path, "fx", [ECHO, tool("notify")])
    with Gateway(GatewayConfig(root=None, upstreams=(config,))) as gateway:
        server = RoutingMCPServer(gateway, core=("fx__echo",))

        async def scenario() -> None:
            async with Client(server.server, cache=None) as client:
                assert (await call(client, "fx__echo", {"text": "here"}))["isError"] is False
                tools_file.write_text(json.dumps([tool("notify")]))
                await call(client, ROUTER_TOOL, {"tool": "fx__notify", "arguments": {}})
                await anyio.to_thread.run_sync(
                    lambda: wait_until(lambda: "fx__echo" not in gateway.registry.tools, what="echo to go")
                )
                gone = await call(client, "fx__echo", {"text": "still?"})
                assert gone["isError"] is True
                assert text_of(gone) == "fx__echo is gone: its MCP server 'fx' no longer lists 'echo'"
                assert "invalid arguments" not in text_of(gone)

        run(scenario)


def test_an_upstream_slow_to_exit_is_not_orphaned_when_the_client_disconnects(tmp_path: Path) -> None:
    # The SDK's stdio client closes the gateway's stdin, and SIGTERMs it 2 s later; the upstream ignores SIGTERM
    # and would linger 5 s after its own stdin closes, in a session of its own.
    config, _ = fixture(tmp_path, "slow", [ECHO], "--slow-exit", "5")
    parameters = serve_mcp("--upstreams", str(upstreams_file(tmp_path, config)), "--core", "slow__echo")

    async def scenario() -> None:
        async with Client(parameters, cache=None) as client:
            assert (await call(client, "slow__echo", {"text": "hi"}))["isError"] is False

    started = time.monotonic()
    run(scenario)
    assert time.monotonic() - started < 8.0
    assert pids(tmp_path, "slow")
    wait_until(lambda: not any(alive(p) for p in pids(tmp_path, "slow")), timeout=1.0, what="the upstream to be gone")


def test_the_gateway_stopped_by_sigterm_stops_every_upstream_process_group(tmp_path: Path) -> None:
    config, _ = fixture(tmp_path, "slow", [ECHO], "--slow-exit", "30")
    args = ["serve-mcp", "--upstreams", str(upstreams_file(tmp_path, config)), "--core", "slow__echo"]
    gateway = subprocess.Popen(
        [sys.executable, "-m", "cacherouter.cli", *args],
        env=cli_env(),
        stdin=subprocess.PIPE,  # held open: the client is still there when SIGTERM comes
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert gateway.stdin is not None
        assert gateway.stdout is not None
        initialize = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-11-25",
                "capabilities": {},
                "clientInfo": {"name": "test", "version": "1"},
            },
        }
        gateway.stdin.write(json.dumps(initialize) + "\n")
        gateway.stdin.flush()
        assert json.loads(gateway.stdout.readline())["id"] == 1  # serving: its signal handling is in place
        assert pids(tmp_path, "slow")
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(timeout=5.0) == -signal.SIGTERM
        wait_until(lambda: not any(alive(p) for p in pids(tmp_path, "slow")), timeout=1.0, what="the upstream")
    finally:
        gateway.kill()
        gateway.wait()
        for pid in pids(tmp_path, "slow"):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def test_a_slow_core_server_is_retried_while_the_gateway_serves(tmp_path: Path) -> None:
    # The first start answers initialize after 3 s, past its 1 s timeout; the retry answers at once.
    marker = tmp_path / "started-once"
    config, _ = fixture(tmp_path, "slow", [ECHO], "--slow-initialize", "3", "--slow-marker", str(marker), timeout=1.0)
    parameters = serve_mcp("--upstreams", str(upstreams_file(tmp_path, config)), "--core", "slow__echo")

    async def scenario() -> None:
        async with Client(parameters, cache=None) as client:
            tools = json.loads(await listing(client))
            assert [t["name"] for t in tools] == ["slow__echo", ROUTER_TOOL]
            echoed = await call(client, "slow__echo", {"text": "late"})
            assert echoed["structuredContent"] == {"echoed": {"text": "late"}}
            assert json.loads(await listing(client)) == tools

    run(scenario)
    assert len(pids(tmp_path, "slow")) >= 2  # retried


def test_serve_mcp_over_streamable_http_with_the_sdks_http_client(tmp_path: Path) -> None:
    config, _ = fixture(tmp_path, "fx", [ECHO, tool("fail")])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = ["serve-mcp", "--upstreams", str(upstreams_file(tmp_path, config)), "--core", "fx__echo"]
    args += ["--transport", "streamable-http", "--host", "127.0.0.1", "--port", str(port)]
    gateway = subprocess.Popen(
        [sys.executable, "-m", "cacherouter.cli", *args],
        env=cli_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert gateway.stderr is not None
        for line in gateway.stderr:
            if line.startswith("serving MCP over streamable HTTP"):
                break
        wait_until(lambda: _listening(port), what=f"the gateway on port {port}")

        async def scenario() -> None:
            async with Client(f"http://127.0.0.1:{port}/mcp", cache=None) as client:
                tools = json.loads(await listing(client))
                assert [t["name"] for t in tools] == ["fx__echo", ROUTER_TOOL]
                echoed = await call(client, "fx__echo", {"text": "over http"})
                assert echoed["structuredContent"] == {"echoed": {"text": "over http"}}
                assert echoed["_meta"][ROUTE_META] == {"tool": "fx__echo", "mode": "core"}
                failed = await call(client, ROUTER_TOOL, {"tool": "fx__fail", "arguments": {}})
                assert failed["isError"] is True

        run(scenario)
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(timeout=5.0) == -signal.SIGTERM
        wait_until(lambda: not any(alive(p) for p in pids(tmp_path, "fx")), timeout=2.0, what="the upstream")
    finally:
        gateway.kill()
        gateway.wait()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_chat_reaches_the_tools_of_its_upstreams_through_the_router(tmp_path: Path) -> None:
    zebra = tool("echo", "Echo a zebra text back, stripes and all.", properties={"text": {"type": "string"}})
    config, _ = fixture(tmp_path, "zoo", [zebra])
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cacherouter.cli",
            "chat",
            "--scripted",
            "--upstreams",
            str(upstreams_file(tmp_path, config)),
        ],
        input="echo the zebra text=stripes\n",
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "upstream zoo (stdio): 1 tools" in done.stderr
    assert "zoo__echo" in done.stdout, done.stdout
    assert "echo: stripes" in done.stdout, done.stdout
    assert not any(alive(p) for p in pids(tmp_path, "zoo"))


def test_web_takes_the_same_upstreams_option(tmp_path: Path) -> None:
    from cacherouter.cli import _started_gateway, build_parser

    config, _ = fixture(tmp_path, "zoo", [ECHO])
    args = build_parser().parse_args(["web", "--scripted", "--upstreams", str(upstreams_file(tmp_path, config))])
    with _started_gateway(args) as gateway:
        assert "zoo__echo" in gateway.registry.tools
        assert "weather" in gateway.registry.tools  # the bundled repository's scripts stay
