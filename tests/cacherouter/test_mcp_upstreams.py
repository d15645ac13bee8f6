"""MCP servers as registry sources: real third-party servers (npm and PyPI), and a fixture server that misbehaves."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp")

from mcp import Client, StdioServerParameters  # noqa: E402
from mcp import types as mcp_types  # noqa: E402
from mcp_support import (  # noqa: E402
    ECHO,
    alive,
    fixture,
    git_repository,
    install_npm_servers,
    npm_entry,
    pids,
    pypi_server,
    tool,
    wait_until,
)
from pydantic import BaseModel, ConfigDict  # noqa: E402

from cacherouter.channels.mainview import MainView  # noqa: E402
from cacherouter.errors import ConfigError  # noqa: E402
from cacherouter.evaluation.runner import EVAL_REPO  # noqa: E402
from cacherouter.tools.gateway import Gateway, GatewayConfig  # noqa: E402
from cacherouter.tools.upstream_hub import UpstreamHub, UpstreamResult  # noqa: E402
from cacherouter.tools.upstreams import (  # noqa: E402
    UpstreamConfig,
    check_input_schema,
    namespaced_name,
    parse_upstreams,
)

CORE = ("base", "geography", "internet")


class Verbatim(BaseModel):
    model_config = ConfigDict(extra="allow")


@pytest.fixture(scope="session")
def npm_servers() -> Path:
    return install_npm_servers()


def upstream_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "cacherouter-mcp-upstreams"]


def result(outcome: Any) -> UpstreamResult:
    assert isinstance(outcome, UpstreamResult)
    return outcome


# ---------------------------------------------------------------- config and names


def test_namespaced_names_are_stable_safe_and_never_collide() -> None:
    assert namespaced_name("git", "git_status") == "git__git_status"
    dotted, underscored = namespaced_name("fs", "read.file"), namespaced_name("fs", "read_file")
    assert underscored == "fs__read_file"
    assert dotted.startswith("fs__read_file-")
    assert dotted != underscored
    long = namespaced_name("srv", "x" * 200)
    assert len(long) <= 64
    assert long == namespaced_name("srv", "x" * 200)


def test_the_config_is_checked_with_messages_that_name_the_server(tmp_path: Path) -> None:
    parsed = parse_upstreams({"mcpServers": {"git": {"command": "mcp-server-git", "deny": ["git_reset"]}}})
    assert parsed[0].takes("git_status")
    assert not parsed[0].takes("git_reset")
    for bad, words in (
        ({"servers": {"a_b": {"command": "x"}}}, "no '_'"),
        ({"servers": {"s": {"command": "x", "url": "http://h/mcp"}}}, "exactly one"),
        ({"servers": {"s": {"command": "x", "colour": 1}}}, "unknown key"),
        ({"servers": {"s": {"command": "x", "timeout": 0}}}, "timeout"),
        ({"servers": []}, "'servers'"),
    ):
        with pytest.raises(ConfigError, match=words):
            parse_upstreams(bad)


def test_schema_checks_name_what_is_wrong() -> None:
    assert check_input_schema({"type": "object", "properties": {"x": {"type": "string"}}}) is None
    assert "not 'object'" in (check_input_schema({"type": "array"}) or "")
    assert "JSON Schema does not know" in (
        check_input_schema({"type": "object", "properties": {"x": {"type": "str"}}}) or ""
    )
    assert "required" in (check_input_schema({"type": "object", "required": "x"}) or "")


# ---------------------------------------------------------------- real third-party servers


def test_real_npm_and_pypi_servers_join_the_long_tail_with_their_declared_schemas(
    npm_servers: Path, tmp_path: Path
) -> None:
    repo = git_repository(tmp_path / "repo")
    upstreams = (
        UpstreamConfig(name="git", command=pypi_server("mcp-server-git"), args=("--repository", str(repo))),
        UpstreamConfig(name="time", command=pypi_server("mcp-server-time"), args=("--local-timezone", "UTC")),
        UpstreamConfig(
            name="memory",
            command="node",
            args=(npm_entry(npm_servers, "memory"),),
            env=(("MEMORY_FILE_PATH", str(tmp_path / "memory.jsonl")),),
        ),
        UpstreamConfig(name="everything", command="node", args=(npm_entry(npm_servers, "everything"),)),
    )
    with Gateway(GatewayConfig(root=EVAL_REPO, upstreams=upstreams)) as gateway:
        registry = gateway.registry
        assert {s.name: s.state for s in gateway.upstreams} == dict.fromkeys(
            ("everything", "git", "memory", "time"), "up"
        )
        assert {"git__git_status", "time__convert_time", "memory__read_graph", "everything__echo"} <= set(
            registry.tools
        )
        assert registry.tools["weather"].script is not None  # the scripts are still there
        # The schema each server declares, member order included, as a client talking to it directly sees it.
        parameters = StdioServerParameters(command=upstreams[0].command, args=list(upstreams[0].args))

        async def direct() -> list[Any]:
            async with Client(parameters, cache=None) as client:
                page = await client.session.send_request(mcp_types.ListToolsRequest(params=None), Verbatim)
                return list((page.model_extra or {})["tools"])

        import anyio

        for declared in anyio.run(direct):
            spec = registry.tools[f"git__{declared['name']}"]
            assert json.dumps(spec.input_schema()) == json.dumps(declared["inputSchema"])
            assert spec.package == "mcp:git"
        status = result(gateway.call("git__git_status", {"repo_path": str(repo)}))
        assert status.ok
        assert "working tree clean" in status.result["content"][0]["text"]
        image = result(gateway.call("everything__get-tiny-image", {}))
        assert any(block["type"] == "image" for block in image.result["content"])
        structured = result(gateway.call("everything__get-structured-content", {"location": "New York"}))
        assert "structuredContent" in structured.result
        # The main view over the same registry: no upstream tool in it, whatever the upstreams are.
        view = MainView.from_registry(registry, CORE)
        assert not any(name.count("__") for name in view.core_tools)
    assert not upstream_threads()


def test_a_streamable_http_upstream(npm_servers: Path, tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        ["node", npm_entry(npm_servers, "everything"), "streamableHttp"],
        env={"PATH": "/usr/bin:/bin", "PORT": str(port)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: _listening(port), what=f"server-everything on port {port}")
        upstream = UpstreamConfig(name="web", url=f"http://127.0.0.1:{port}/mcp")
        with Gateway(GatewayConfig(root=None, upstreams=(upstream,))) as gateway:
            assert gateway.upstreams[0].state == "up", gateway.upstreams
            echoed = result(gateway.call("web__echo", {"message": "over http"}))
            assert echoed.ok
            assert "over http" in echoed.result["content"][0]["text"]
    finally:
        server.kill()
        server.wait(timeout=10)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# ---------------------------------------------------------------- changes: list_changed, reconnects, joins


def test_list_changed_swaps_the_registry_and_the_main_view_bytes_stay(tmp_path: Path) -> None:
    config, tools_file = fixture(tmp_path, "fx", [ECHO, tool("notify")])
    seen: list[int] = []
    with Gateway(GatewayConfig(root=EVAL_REPO, upstreams=(config,))) as gateway:
        gateway.subscribe(lambda registry: seen.append(registry.generation))
        view = MainView.from_registry(gateway.registry, CORE)
        tools_file.write_text(json.dumps([ECHO, tool("notify"), tool("fresh", "A tool that came later.")]))
        assert result(gateway.call("fx__notify", {})).ok
        wait_until(lambda: "fx__fresh" in gateway.registry.tools, what="the new tool after list_changed")
        assert seen, "the swap was announced to the gateway's subscribers"
        assert MainView.from_registry(gateway.registry, CORE).tools_json == view.tools_json
        assert gateway.upstreams[0].list_changed == 1


def test_servers_join_and_leave_through_the_upstreams_file(tmp_path: Path) -> None:
    first, _ = fixture(tmp_path, "one", [ECHO])
    second, _ = fixture(tmp_path, "two", [tool("other")])

    def write(*configs: UpstreamConfig) -> None:
        servers = {c.name: {"command": c.command, "args": list(c.args), "timeout": c.timeout} for c in configs}
        (tmp_path / "upstreams.json").write_text(json.dumps({"servers": servers}))

    write(first)
    with Gateway(GatewayConfig(root=None, upstreams_file=tmp_path / "upstreams.json")) as gateway:
        assert set(gateway.registry.tools) == {"one__echo"}
        write(first, second)
        gateway.poll()
        assert set(gateway.registry.tools) == {"one__echo", "two__other"}
        write(second)
        gateway.poll()
        assert set(gateway.registry.tools) == {"two__other"}
        wait_until(lambda: not any(alive(p) for p in pids(tmp_path, "one")), what="the server that left to exit")
        (tmp_path / "upstreams.json").write_text("{not json")
        gateway.poll()
        assert "keep serving" in (gateway.last_error or "")
        assert set(gateway.registry.tools) == {"two__other"}


# ---------------------------------------------------------------- results pass through


def test_results_come_back_exactly_as_the_server_sent_them(tmp_path: Path) -> None:
    config, _ = fixture(tmp_path, "fx", [ECHO, tool("fail")])
    with Gateway(GatewayConfig(root=None, upstreams=(config,))) as gateway:
        echoed = result(gateway.call("fx__echo", {"text": "hi"}))
        assert echoed.result == {
            "content": [
                {"type": "text", "text": "echo: hi"},
                {"type": "image", "data": echoed.result["content"][1]["data"], "mimeType": "image/png"},
            ],
            "structuredContent": {"echoed": {"text": "hi"}},
            "isError": False,
            "_meta": {"fixture/served-by": "mcp_fixture_server"},
        }
        failed = result(gateway.call("fx__fail", {}))
        assert not failed.ok
        assert failed.error is None
        assert failed.result["isError"] is True


# ---------------------------------------------------------------- faults


def test_an_upstream_that_never_answers_initialize_is_reported_and_the_rest_serve(tmp_path: Path) -> None:
    mute, _ = fixture(tmp_path, "mute", [ECHO], "--never-initialize", timeout=1.0)
    good, _ = fixture(tmp_path, "good", [ECHO])
    started = time.monotonic()
    gateway = Gateway(GatewayConfig(root=None, upstreams=(mute, good)))
    try:
        assert time.monotonic() - started < 8.0
        states = {s.name: s for s in gateway.upstreams}
        assert states["mute"].state == "down"
        assert "no answer within 1s" in (states["mute"].last_error or "")
        assert any(p.path == "mcp:mute" for p in gateway.registry.problems)
        assert result(gateway.call("good__echo", {"text": "still here"})).ok
    finally:
        gateway.close()
    assert not upstream_threads()
    assert not any(alive(p) for p in pids(tmp_path, "mute") + pids(tmp_path, "good"))


def test_invalid_schemas_and_duplicate_names_leave_the_rest_serving_and_keep_the_last_good(tmp_path: Path) -> None:
    broken = {"name": "broken", "inputSchema": {"type": "object", "properties": {"x": "not a schema"}}}
    config, tools_file = fixture(tmp_path, "fx", [ECHO, tool("notify"), broken, tool("twice"), tool("twice")])
    with Gateway(GatewayConfig(root=None, upstreams=(config,))) as gateway:
        assert set(gateway.registry.tools) == {"fx__echo", "fx__notify"}
        messages = {p.path: p.message for p in gateway.registry.problems}
        assert "breaks the MCP schema" in messages["mcp:fx/broken"]
        assert "listed 2 times" in messages["mcp:fx/twice"]
        # echo's definition breaks: its last good one keeps serving; a type JSON Schema lacks is caught too.
        bad_echo = {**ECHO, "inputSchema": {"type": "object", "properties": {"text": {"type": "str"}}}}
        tools_file.write_text(json.dumps([bad_echo, tool("notify")]))
        generation = gateway.registry.generation
        gateway.call("fx__notify", {})
        wait_until(lambda: gateway.registry.generation > generation, what="the relisting")
        assert gateway.registry.tools["fx__echo"].input_schema() == ECHO["inputSchema"]
        message = {p.path: p.message for p in gateway.registry.problems}["mcp:fx/echo"]
        assert "does not know" in message
        assert "last good definition keeps serving" in message
        assert result(gateway.call("fx__echo", {"text": "x"})).ok


def test_a_list_changed_storm_costs_a_bounded_number_of_listings(tmp_path: Path) -> None:
    config, _ = fixture(tmp_path, "fx", [ECHO, tool("storm")])
    with Gateway(GatewayConfig(root=None, upstreams=(config,), upstream_debounce=0.2)) as gateway:
        swaps: list[int] = []
        gateway.subscribe(lambda registry: swaps.append(registry.generation))
        assert result(gateway.call("fx__storm", {"count": 2000})).ok
        wait_until(lambda: gateway.upstreams[0].list_changed == 2000, what="every notification to arrive")
        assert result(gateway.call("fx__echo", {"text": "calm"})).ok  # the storm never blocked calls
        wait_until(lambda: gateway.upstreams[0].listings >= 2, what="the relisting")
        time.sleep(0.5)  # let a runaway relisting loop show itself, if there were one
        assert gateway.upstreams[0].listings <= 4
        assert swaps == []  # the same tools: nothing to swap


def test_a_crash_mid_call_is_a_clear_error_then_the_server_is_reconnected(tmp_path: Path) -> None:
    config, _ = fixture(tmp_path, "fx", [ECHO, tool("crash")])
    other, _ = fixture(tmp_path, "other", [ECHO])
    with Gateway(GatewayConfig(root=None, upstreams=(config, other))) as gateway:
        before = gateway.registry
        started = time.monotonic()
        crashed = result(gateway.call("fx__crash", {}))
        assert time.monotonic() - started < 5.0
        assert crashed.error is not None
        assert "closed the connection during the call" in crashed.error
        assert result(gateway.call("other__echo", {"text": "unaffected"})).ok
        wait_until(lambda: {s.name: s.connects for s in gateway.upstreams}["fx"] == 2, what="the reconnect")
        assert result(gateway.call("fx__echo", {"text": "back"})).ok
        assert gateway.registry.tools == before.tools  # a reconnect with the same tools changes nothing
        first_pid = pids(tmp_path, "fx")[0]
        assert not alive(first_pid)
    assert not any(alive(p) for p in pids(tmp_path, "fx") + pids(tmp_path, "other"))
    assert not upstream_threads()


def test_a_server_that_stays_down_loses_its_tools_after_keep_tools_for(tmp_path: Path) -> None:
    config, _ = fixture(tmp_path, "fx", [ECHO, tool("crash")], "--once", str(tmp_path / "served"), keep_tools_for=0.5)
    with Gateway(GatewayConfig(root=None, upstreams=(config,))) as gateway:
        gateway.call("fx__crash", {})
        wait_until(lambda: gateway.upstreams[0].state == "down", what="the crash to be noticed")
        down = result(gateway.call("fx__echo", {"text": "x"}))
        assert down.error is not None
        assert "not connected" in down.error
        wait_until(lambda: "fx__echo" not in gateway.registry.tools, what="the tools to be dropped")
        assert any("serves only once" in (s.last_error or "") or s.state == "down" for s in gateway.upstreams)


def test_a_missing_command_is_reported_not_raised(tmp_path: Path) -> None:
    missing = UpstreamConfig(name="ghost", command=str(tmp_path / "no-such-server"), timeout=2.0)
    with Gateway(GatewayConfig(root=EVAL_REPO, upstreams=(missing,))) as gateway:
        status = gateway.upstreams[0]
        assert status.state == "down"
        assert "no-such-server" in (status.last_error or "")
        assert "weather" in gateway.registry.tools
    assert shutil.which("no-such-server") is None


def test_upstream_stderr_reaches_the_log_line_by_line_with_the_servers_name(tmp_path: Path) -> None:
    config, _ = fixture(tmp_path, "fx", [tool("stderr")])
    log = tmp_path / "errlog.txt"
    with log.open("w") as errlog, UpstreamHub((config,), errlog=errlog) as hub:
        written = hub.call(hub.tools["fx__stderr"], {"lines": ["first line", "second: with a colon"]})
        assert written.ok, written
        wait_until(lambda: "second" in log.read_text(), what="the server's stderr in the log")
    assert log.read_text().splitlines() == ["[fx] first line", "[fx] second: with a colon"]


def test_a_call_gets_its_servers_call_timeout_or_the_callers_shorter_limit(tmp_path: Path) -> None:
    config, _ = fixture(tmp_path, "fx", [tool("sleep")], timeout=1.0, call_timeout=1.5)
    with Gateway(GatewayConfig(root=None, upstreams=(config,))) as gateway:
        started = time.monotonic()
        own = result(gateway.call("fx__sleep", {"seconds": 30}, timeout=60))  # the router's 60 s: not longer
        assert 1.4 < time.monotonic() - started < 3.5
        assert own.error is not None
        assert "the gateway gave up after 1.5 s (call_timeout of server fx)" in own.error
    config, _ = fixture(tmp_path, "fy", [tool("sleep")], timeout=1.0, call_timeout=30)
    with Gateway(GatewayConfig(root=None, upstreams=(config,))) as gateway:
        shorter = result(gateway.call("fy__sleep", {"seconds": 30}, timeout=1.2))
        assert shorter.error is not None
        assert "gave up after 1.2 s (this call's limit, shorter than server fy's call_timeout of 30 s)" in shorter.error
