"""The MCP caching proxy: a real upstream MCP server subprocess behind it, a real MCP client in front."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp", reason="the 'mcp' extra is not installed: pip install 'tvcache[mcp]'")

import mcp.types as types  # noqa: E402
from mcp import Client, MCPError, StdioServerParameters  # noqa: E402
from pydantic import BaseModel, ConfigDict  # noqa: E402

from tvcache import Cache  # noqa: E402
from tvcache.cache import NondeterminismWarning  # noqa: E402
from tvcache.integrations.mcp_proxy import STATS_URI, CachingProxy, ProxySettings, open_proxy_cache  # noqa: E402

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
UPSTREAM = [sys.executable, str(HERE / "mcp_notes_server.py")]
NOTES_TOOLS = {"write", "append", "read", "names", "find", "now"}
# The mechanics tests declare the notes tools deterministic, as a user who knows them would, so the first-hit
# check of undeclared tools (tested on its own below) does not change what they count.
DECLARED = frozenset(NOTES_TOOLS - {"now"})

# Rollouts of one task, as an agent would make them: the first two agree, the third diverges late.
ROLLOUT = [
    ("write", {"name": "todo", "text": "buy milk"}),
    ("read", {"name": "todo"}),
    ("append", {"name": "todo", "text": ", eggs"}),
    ("names", {}),
    ("read", {"name": "todo"}),
]
DIVERGING = [*ROLLOUT[:3], ("append", {"name": "todo", "text": ", bread"}), ("read", {"name": "todo"})]


def synchronous(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test body on a fresh event loop (the suite uses no async pytest plugin)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


@pytest.fixture
def log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "upstream.log"
    monkeypatch.setenv("NOTES_LOG", str(path))
    return path


def upstream_events(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def dump(result: Any) -> Any:
    return result.model_dump(by_alias=True, mode="json", exclude_none=True)


async def uncached(calls: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    parameters = StdioServerParameters(command=UPSTREAM[0], args=UPSTREAM[1:], env=dict(os.environ))
    async with Client(parameters, cache=None) as client:
        return [dump(await client.call_tool(name, args)) for name, args in calls]


async def through_proxy(proxy: CachingProxy, calls: list[tuple[str, dict[str, Any]]]) -> tuple[list[Any], dict]:
    async with Client(proxy.server, cache=None) as client:
        listed = await client.list_tools()
        assert {tool.name for tool in listed.tools} == NOTES_TOOLS
        results = [dump(await client.call_tool(name, args)) for name, args in calls]
        stats = await client.read_resource(STATS_URI)
        return results, json.loads(stats.contents[0].text)  # type: ignore[union-attr]


@synchronous
async def test_a_group_of_rollouts_hits_from_the_second_on_and_matches_the_uncached_server(log: Path) -> None:
    expected = await uncached(ROLLOUT)
    expected_diverging = await uncached(DIVERGING)
    log.unlink()  # count only what the proxied rollouts run upstream

    cache = Cache()
    settings = ProxySettings(command=UPSTREAM, task_id="notes-task", deterministic=DECLARED)
    first, stats1 = await through_proxy(CachingProxy(settings, cache), ROLLOUT)
    assert first == expected
    assert stats1["session"]["hits"] == 0
    assert stats1["upstream_starts"] == 1

    second_proxy = CachingProxy(settings, cache)
    second, stats2 = await through_proxy(second_proxy, ROLLOUT)
    assert second == expected
    # The listing and all five calls hit: the second rollout never started the upstream server.
    assert stats2["session"]["hits"] == 1 + len(ROLLOUT)
    assert stats2["session"]["misses"] == 0
    assert second_proxy.upstream_starts == 0
    assert [e for e in upstream_events(log) if e.startswith("start")] == [upstream_events(log)[0]]

    third_proxy = CachingProxy(settings, cache)
    third, stats3 = await through_proxy(third_proxy, DIVERGING)
    assert third == expected_diverging
    # Listing + the shared prefix hit; the new append misses in a fresh upstream that replays the two
    # state-changing calls before it (read-only calls are not replayed); the last read misses in the new state.
    assert stats3["session"]["hits"] == 4
    assert stats3["session"]["misses"] == 2
    assert stats3["session"]["calls_replayed"] == 2
    assert third_proxy.upstream_starts == 1
    cache.close()


@synchronous
async def test_read_only_calls_do_not_extend_the_path(log: Path) -> None:
    cache = Cache()
    settings = ProxySettings(command=UPSTREAM, task_id="t", deterministic=DECLARED)
    await through_proxy(CachingProxy(settings, cache), ROLLOUT[:3])  # write, read, append
    proxy = CachingProxy(settings, cache)
    results, stats = await through_proxy(proxy, [ROLLOUT[0], ROLLOUT[2]])  # write, append: no read between
    assert results == await uncached([ROLLOUT[0], ROLLOUT[2]])
    assert stats["session"]["hits"] == 3  # listing, write, append
    assert proxy.upstream_starts == 0
    cache.close()


@synchronous
async def test_tool_errors_and_unknown_tools(log: Path) -> None:
    cache = Cache()
    proxy = CachingProxy(ProxySettings(command=UPSTREAM, task_id="t"), cache)
    calls = [("append", {"name": "missing", "text": "x"})]
    results, _ = await through_proxy(proxy, calls)
    assert results == await uncached(calls)
    assert results[0]["isError"] is True
    async with Client(CachingProxy(ProxySettings(command=UPSTREAM, task_id="t"), cache).server) as client:
        with pytest.raises(MCPError, match="Unknown tool: nope"):
            await client.call_tool("nope", {})
    cache.close()


def test_settings_need_a_command_and_derive_a_stable_task() -> None:
    from tvcache.errors import InvalidInput, TVCacheError

    with pytest.raises(TVCacheError, match="after '--'"):
        ProxySettings(command=[])
    with pytest.raises(InvalidInput, match="both --uncached and --deterministic"):
        ProxySettings(command=["x"], uncached=frozenset({"a"}), deterministic=frozenset({"a", "b"}))
    for rate in (-0.1, 1.5, float("nan")):
        with pytest.raises(InvalidInput, match="--audit-rate must be between 0 and 1"):
            ProxySettings(command=["x"], audit_rate=rate)
    one = ProxySettings(command=["python", "server.py"]).task
    assert one == ProxySettings(command=["python", "server.py"]).task
    assert one != ProxySettings(command=["python", "other.py"]).task


@pytest.fixture
def proxy_command() -> Iterator[list[str]]:
    return [sys.executable, "-c", "from tvcache.cli import main; raise SystemExit(main())", "mcp-proxy"]


async def run_cli_proxy(command: list[str], calls: list[tuple[str, dict[str, Any]]]) -> tuple[list[Any], dict]:
    parameters = StdioServerParameters(command=command[0], args=command[1:], env=dict(os.environ))
    async with Client(parameters, cache=None) as client:
        results = [dump(await client.call_tool(name, args)) for name, args in calls]
        stats = await client.read_resource(STATS_URI)
        return results, json.loads(stats.contents[0].text)  # type: ignore[union-attr]


@synchronous
async def test_cli_proxy_processes_share_a_durable_cache_directory(
    log: Path, tmp_path: Path, proxy_command: list[str]
) -> None:
    declared = [option for tool in sorted(DECLARED) for option in ("--deterministic", tool)]
    command = [*proxy_command, "--task", "notes", "--cache", str(tmp_path / "cache"), *declared, "--", *UPSTREAM]
    expected = await uncached(ROLLOUT)
    first, _ = await run_cli_proxy(command, ROLLOUT)
    starts = len([e for e in upstream_events(log) if e.startswith("start")])
    second, stats = await run_cli_proxy(command, ROLLOUT)
    assert first == second == expected
    # Every call and every listing (the SDK client lists tools on its own too) hit: no upstream was started.
    assert stats["session"]["hits"] >= len(ROLLOUT) + 1
    assert stats["session"]["misses"] == 0
    assert stats["upstream_starts"] == 0
    assert len([e for e in upstream_events(log) if e.startswith("start")]) == starts


@pytest.mark.parametrize("shards", [1, 2])
@synchronous
async def test_proxies_share_tvcache_serve_or_sharded_servers(log: Path, shards: int) -> None:
    for module in ("httpx", "starlette", "uvicorn"):
        pytest.importorskip(module, reason="the 'server' extra is not installed: pip install 'tvcache[server]'")
    from tvcache.integrations import open_cache
    from tvcache.server import CacheService, ServerThread

    services = [CacheService() for _ in range(shards)]
    threads = [ServerThread(service) for service in services]
    for thread in threads:
        thread.__enter__()
    try:
        urls = [thread.url for thread in threads]
        location = urls[0] if shards == 1 else urls
        settings = ProxySettings(command=UPSTREAM, task_id="served-notes", cache=location, deterministic=DECLARED)
        expected = await uncached(ROLLOUT)
        first_cache, second_cache = open_cache(location), open_cache(location)  # two rollout workers
        first, _ = await through_proxy(CachingProxy(settings, first_cache), ROLLOUT)
        proxy = CachingProxy(settings, second_cache)
        second, stats = await through_proxy(proxy, ROLLOUT)
        assert first == second == expected
        assert stats["session"]["hits"] == len(ROLLOUT) + 1
        assert proxy.upstream_starts == 0
        first_cache.close()
        second_cache.close()
    finally:
        for thread in threads:
            thread.__exit__(None, None, None)
        for service in services:
            service.close()


# ---------------------------------------------------------------- listings pass through, field for field

HANDSHAKE_ERA = "2025-11-25"  # the initialize-handshake protocol the npm servers speak
MODERN_ERA = types.LATEST_PROTOCOL_VERSION  # what the Python SDK (the notes server, the proxy) speaks by default


@pytest.fixture(scope="session")
def npm_servers() -> Path:
    """The npm MCP servers at the versions scripts/install-mcp-servers.sh pins (installed once, then cached)."""
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed: the npm MCP servers (older protocol era) cannot run")
    script = ROOT / "scripts" / "install-mcp-servers.sh"
    done = subprocess.run([str(script)], capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        pytest.fail(f"{script} failed (exit {done.returncode}):\n{done.stderr}")
    return Path(done.stdout.strip().splitlines()[-1])


def npm_server(npm_servers: Path, name: str, tmp_path: Path) -> list[str]:
    entry = npm_servers / "node_modules" / "@modelcontextprotocol" / f"server-{name}" / "dist" / "index.js"
    return ["node", str(entry), *([str(tmp_path)] if name == "filesystem" else [])]


class Verbatim(BaseModel):
    """A result as the JSON that was sent (the SDK's typed models drop the fields they lack)."""

    model_config = ConfigDict(extra="allow")


async def listing(client: Client) -> tuple[str, list[Any], list[Any]]:
    """What a client gets from tools/list: the negotiated version, the tools as sent, the tools as typed."""
    sent = await client.session.send_request(types.ListToolsRequest(params=None), Verbatim)
    assert (sent.model_extra or {}).get("nextCursor") is None, "these servers list their tools on one page"
    typed = await client.list_tools()
    version = client.session.protocol_version
    assert version is not None
    return version, (sent.model_extra or {})["tools"], [dump(tool) for tool in typed.tools]


def same_json(proxied: list[Any], upstream: list[Any]) -> None:
    """The whole JSON of every tool, member order included (it is the order a model reads the arguments in)."""
    assert [tool["name"] for tool in proxied] == [tool["name"] for tool in upstream]
    for ours, theirs in zip(proxied, upstream, strict=True):
        assert json.dumps(ours) == json.dumps(theirs), f"tool {theirs['name']!r} is listed differently"


@pytest.mark.parametrize("client_era", [MODERN_ERA, HANDSHAKE_ERA])
@pytest.mark.parametrize("upstream", ["notes", "memory"])
@synchronous
async def test_the_proxy_lists_the_upstreams_tools_as_the_upstream_does_in_both_protocol_eras(
    upstream: str, client_era: str, log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: Any
) -> None:
    if upstream == "notes":
        command, upstream_era = UPSTREAM, MODERN_ERA
    else:
        command, upstream_era = npm_server(request.getfixturevalue("npm_servers"), upstream, tmp_path), HANDSHAKE_ERA
        monkeypatch.setenv("MEMORY_FILE_PATH", str(tmp_path / "memory.jsonl"))
    parameters = StdioServerParameters(command=command[0], args=command[1:], env=dict(os.environ))
    async with Client(parameters, cache=None) as direct:  # as the proxy's own upstream link negotiates
        version, sent, typed = await listing(direct)
    assert version == upstream_era, f"the {upstream} server no longer speaks {upstream_era}: repin it"
    if upstream == "memory":  # what issue 19 saw lost: a 2025-11-25 field a 2026-07-28 client never had
        assert all(tool["execution"] == {"taskSupport": "forbidden"} for tool in sent)

    cache = Cache()
    settings = ProxySettings(command=command, task_id=f"listing-{upstream}")
    mode = "legacy" if client_era == HANDSHAKE_ERA else "auto"
    for connection in range(2):  # the first lists upstream, the second from the cache
        proxy = CachingProxy(settings, cache)
        async with Client(proxy.server, cache=None, mode=mode) as client:
            proxied_version, proxied_sent, proxied_typed = await listing(client)
        assert proxied_version == client_era
        same_json(proxied_sent, sent)
        assert proxied_typed == typed  # and what the SDK client makes of it
        assert proxy.upstream_starts == (1 if connection == 0 else 0)
    cache.close()


@synchronous
async def test_the_cli_proxy_passes_an_older_era_servers_tools_through_stdio(
    npm_servers: Path, tmp_path: Path, proxy_command: list[str]
) -> None:
    upstream = npm_server(npm_servers, "filesystem", tmp_path)
    direct_parameters = StdioServerParameters(command=upstream[0], args=upstream[1:], env=dict(os.environ))
    async with Client(direct_parameters, cache=None) as direct:
        version, sent, typed = await listing(direct)
    assert version == HANDSHAKE_ERA
    assert any("execution" in tool for tool in sent)
    command = [*proxy_command, "--task", "fs", "--cache", str(tmp_path / "cache"), "--", *upstream]
    parameters = StdioServerParameters(command=command[0], args=command[1:], env=dict(os.environ))
    async with Client(parameters, cache=None) as client:
        proxied_version, proxied_sent, proxied_typed = await listing(client)
    assert proxied_version == MODERN_ERA
    same_json(proxied_sent, sent)
    assert proxied_typed == typed


# ---------------------------------------------------------------- what annotations mean for caching; audits

CLOCK = [("write", {"name": "todo", "text": "buy milk"}), ("read", {"name": "todo"}), ("now", {})]


@synchronous
async def test_no_annotation_makes_a_tool_deterministic_so_each_tools_first_hit_in_a_task_is_checked(
    log: Path,
) -> None:
    # `now` is annotated readOnlyHint and idempotentHint, as mcp-server-time's get_current_time is: read-only,
    # so keyed by the state it reads, but not deterministic. Nothing is declared, so every tool is checked once.
    cache = Cache()
    settings = ProxySettings(command=UPSTREAM, task_id="clock")
    first, _ = await through_proxy(CachingProxy(settings, cache), CLOCK)
    with pytest.warns(NondeterminismWarning, match="tool 'now' is non-deterministic in task 'clock'"):
        second, stats = await through_proxy(CachingProxy(settings, cache), CLOCK)
    assert second[:2] == first[:2] == await uncached(CLOCK[:2])
    assert second[2] != first[2], "a clock's second reading was served from cache"
    assert stats["session"]["verified"] == 2  # write and read executed again, agreeing
    assert stats["session"]["uncached"] == 1  # now: executed again, disagreeing, so answered fresh
    assert [(mark.tool, mark.task_id) for mark in cache.nondeterministic_marks()] == [("now", "clock")]
    third, stats = await through_proxy(CachingProxy(settings, cache), CLOCK)
    assert third[2] not in (first[2], second[2])  # marked: never served from cache in this task again
    assert stats["session"]["hits"] == 3  # the listing, write and read: checked once, then served
    cache.close()


@synchronous
async def test_the_audit_rate_reaches_the_cache_and_audits_hits_in_a_fresh_upstream(log: Path) -> None:
    settings = ProxySettings(command=UPSTREAM, task_id="audited", audit_rate=1.0, deterministic=DECLARED)
    cache = open_proxy_cache(settings)
    assert isinstance(cache, Cache)
    assert cache.audit_rate == 1.0
    rollout = ROLLOUT[:2]
    await through_proxy(CachingProxy(settings, cache), rollout)
    proxy = CachingProxy(settings, cache)
    _, stats = await through_proxy(proxy, rollout)  # the connection closes once its audits are done
    assert stats["session"]["hits"] == 1 + len(rollout)
    assert cache.stats().audits == 1 + len(rollout)
    assert cache.stats().audit_disagreements == 0
    assert proxy.upstream_starts == 1 + len(rollout)  # the rollout needed none: each audit starts its own
    cache.close()


def test_the_cli_takes_the_audit_rate_and_declarations(capsys: pytest.CaptureFixture[str]) -> None:
    from tvcache import cli

    args = cli.build_parser().parse_args(
        ["mcp-proxy", "--audit-rate", "0.25", "--deterministic", "a", "--uncached", "b", "--", "server"]
    )
    assert (args.audit_rate, args.deterministic, args.uncached) == (0.25, ["a"], ["b"])
    assert cli.main(["mcp-proxy", "--audit-rate", "2", "--", "server"]) == 2
    assert "--audit-rate must be between 0 and 1, got 2.0" in capsys.readouterr().err


@synchronous
async def test_an_upstream_that_dies_under_a_call_fails_it_uncached(log: Path) -> None:
    # The SDK answers a request whose connection closed with a CONNECTION_CLOSED error: that is no answer of the
    # upstream's, and caching it would serve "Connection closed" to every later rollout making the call.
    cache = Cache()
    settings = ProxySettings(command=UPSTREAM, task_id="crash", deterministic=DECLARED)
    async with Client(CachingProxy(settings, cache).server, cache=None) as client:
        await client.call_tool(*ROLLOUT[0])
        (pid,) = [int(event.split()[1]) for event in upstream_events(log) if event.startswith("start")]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(MCPError, match="closed the connection during ToolCall\\('read'"):
            await client.call_tool(*ROLLOUT[1])
    results, stats = await through_proxy(CachingProxy(settings, cache), ROLLOUT[:2])
    assert results == await uncached(ROLLOUT[:2])
    assert stats["session"]["hits"] == 2  # the listing and the write; the read was never cached
    cache.close()
