"""The MCP caching proxy: a real upstream MCP server subprocess behind it, a real MCP client in front."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import sys
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp", reason="the 'mcp' extra is not installed: pip install 'tvcache[mcp]'")

from mcp import Client, MCPError, StdioServerParameters  # noqa: E402

from tvcache import Cache  # noqa: E402
from tvcache.integrations.mcp_proxy import STATS_URI, CachingProxy, ProxySettings  # noqa: E402

HERE = Path(__file__).parent
UPSTREAM = [sys.executable, str(HERE / "mcp_notes_server.py")]

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
        assert {tool.name for tool in listed.tools} == {"write", "append", "read", "names"}
        results = [dump(await client.call_tool(name, args)) for name, args in calls]
        stats = await client.read_resource(STATS_URI)
        return results, json.loads(stats.contents[0].text)  # type: ignore[union-attr]


@synchronous
async def test_a_group_of_rollouts_hits_from_the_second_on_and_matches_the_uncached_server(log: Path) -> None:
    expected = await uncached(ROLLOUT)
    expected_diverging = await uncached(DIVERGING)
    log.unlink()  # count only what the proxied rollouts run upstream

    cache = Cache()
    settings = ProxySettings(command=UPSTREAM, task_id="notes-task")
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
    settings = ProxySettings(command=UPSTREAM, task_id="t")
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
    from tvcache.errors import TVCacheError

    with pytest.raises(TVCacheError, match="after '--'"):
        ProxySettings(command=[])
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
    command = [*proxy_command, "--task", "notes", "--cache", str(tmp_path / "cache"), "--", *UPSTREAM]
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
        settings = ProxySettings(command=UPSTREAM, task_id="served-notes", cache=location)
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
