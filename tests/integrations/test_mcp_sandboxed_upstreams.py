"""The MCP proxy with sandboxed upstreams (``--sandbox-dir``) over real, stateful third-party MCP servers.

Each server keeps its state in a data directory: ``@modelcontextprotocol/server-memory`` (npm) its knowledge graph
in ``MEMORY_FILE_PATH``, ``mcp-server-git`` (PyPI) a git repository, ``@modelcontextprotocol/server-filesystem``
(npm) a directory tree. Rollouts of one task share a prefix and diverge with state-changing calls. The uncached
baseline runs every rollout against the real server over the data directory reset to its initial state by hand,
at the same path (results name paths); the proxied rollouts run with no reset at all. Whole results must agree,
hits must happen, the upstream must start only for connections that executed something, forks must come from
snapshots, and the data directory on the host must be exactly as it was.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp", reason="the 'mcp' extra is not installed: pip install 'tvcache[mcp]'")

from mcp import Client, MCPError, StdioServerParameters  # noqa: E402

from tvcache import Cache  # noqa: E402
from tvcache.graph import Node, ToolCallGraph  # noqa: E402
from tvcache.integrations.mcp_proxy import STATS_URI, CachingProxy, ProxySettings  # noqa: E402
from tvcache.integrations.mcp_sandbox import SandboxedUpstreams  # noqa: E402
from tvcache.policies import CostModel, NeverSnapshot  # noqa: E402
from tvcache.sandboxes.shell import linux  # noqa: E402

pytestmark = pytest.mark.skipif(
    not linux.overlay_supported(), reason="sandboxed upstreams need overlay mounts (root on Linux >= 6.8)"
)

ROOT = Path(__file__).resolve().parents[2]
Calls = list[tuple[str, dict[str, Any]]]
# Git commit hashes include the author's and committer's names and times: fixed, as a task's environment would.
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "tvcache",
    "GIT_AUTHOR_EMAIL": "tvcache@example.invalid",
    "GIT_COMMITTER_NAME": "tvcache",
    "GIT_COMMITTER_EMAIL": "tvcache@example.invalid",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+00:00",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+00:00",
}


def synchronous(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


@pytest.fixture(scope="module")
def npm_servers() -> Path:
    """The npm servers at the versions scripts/install-mcp-servers.sh pins (installed once, then cached)."""
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed: the npm MCP servers cannot run")
    script = ROOT / "scripts" / "install-mcp-servers.sh"
    done = subprocess.run([str(script)], capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        pytest.fail(f"{script} failed (exit {done.returncode}):\n{done.stderr}")
    return Path(done.stdout.strip().splitlines()[-1])


def npm_entry(servers: Path, name: str) -> str:
    return str(servers / "node_modules" / "@modelcontextprotocol" / f"server-{name}" / "dist" / "index.js")


def git_server() -> str:
    found = shutil.which("mcp-server-git", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("mcp-server-git is not installed (it is in the 'dev' extra)")
    return found


# ------------------------------------------------------------------ the servers and their rollouts


@dataclass(frozen=True, kw_only=True)
class Upstream:
    """A real server over a data directory it keeps its state in, and rollouts of one task against it."""

    name: str
    command: list[str]
    env: dict[str, str]
    rollouts: list[Calls]
    fork_depth: int  # how many state-changing calls the rollouts share
    setup: Callable[[Path], None] = field(default=lambda data: None)


def entity(name: str, *observations: str) -> dict[str, Any]:
    return {"name": name, "entityType": "thing", "observations": list(observations)}


def memory_upstream(servers: Path, data: Path) -> Upstream:
    prefix: Calls = [
        ("create_entities", {"entities": [entity("alice", "likes tea"), entity("bob")]}),
        ("create_relations", {"relations": [{"from": "alice", "to": "bob", "relationType": "knows"}]}),
        ("read_graph", {}),
    ]
    plays_go = ("add_observations", {"observations": [{"entityName": "bob", "contents": ["plays go"]}]})
    forget_bob = ("delete_entities", {"entityNames": ["bob"]})
    return Upstream(
        name="memory",
        fork_depth=2,
        command=["node", npm_entry(servers, "memory")],
        env={**os.environ, "MEMORY_FILE_PATH": str(data / "memory.jsonl")},
        rollouts=[
            [*prefix, plays_go, ("open_nodes", {"names": ["bob"]})],
            [*prefix, forget_bob, ("read_graph", {})],
            [*prefix, plays_go, ("search_nodes", {"query": "go"}), ("delete_observations", {"deletions": []})],
            [*prefix, forget_bob, ("read_graph", {})],  # a repeat
        ],
    )


def git_upstream(data: Path) -> Upstream:
    repo = data / "repo"
    at = {"repo_path": str(repo)}

    def setup(data: Path) -> None:
        repo.mkdir()
        (repo / "README").write_text("hello\n")
        env = {**os.environ, **GIT_IDENTITY}
        for argv in (["git", "init", "-q", "-b", "main"], ["git", "add", "."], ["git", "commit", "-q", "-m", "init"]):
            subprocess.run(argv, cwd=repo, env=env, check=True)

    prefix: Calls = [("git_status", at), ("git_create_branch", {**at, "branch_name": "feature"})]
    checkout = ("git_checkout", {**at, "branch_name": "feature"})
    branches = ("git_branch", {**at, "branch_type": "local"})
    return Upstream(
        name="git",
        fork_depth=1,
        command=[git_server(), "--repository", str(repo)],
        env={**os.environ, **GIT_IDENTITY},
        setup=setup,
        rollouts=[
            [*prefix, checkout, branches, ("git_log", at)],
            [*prefix, checkout, ("git_reset", at), ("git_commit", {**at, "message": "work"}), ("git_log", at)],
            [*prefix, branches, ("git_status", at)],
            [*prefix, checkout, branches, ("git_log", at)],
        ],
    )


def filesystem_upstream(servers: Path, data: Path) -> Upstream:
    def setup(data: Path) -> None:
        (data / "notes.txt").write_text("first line\n")

    notes = str(data / "notes.txt")
    prefix: Calls = [
        ("write_file", {"path": str(data / "plan.md"), "content": "# plan\n"}),
        ("edit_file", {"path": notes, "edits": [{"oldText": "first", "newText": "1st"}]}),
        ("read_text_file", {"path": notes}),
    ]
    tree = ("directory_tree", {"path": str(data)})
    return Upstream(
        name="filesystem",
        fork_depth=2,
        command=["node", npm_entry(servers, "filesystem"), str(data)],
        env=dict(os.environ),
        setup=setup,
        rollouts=[
            [*prefix, ("create_directory", {"path": str(data / "src")}), tree],
            [*prefix, ("move_file", {"source": notes, "destination": str(data / "moved.txt")}), tree],
            [*prefix, ("create_directory", {"path": str(data / "src")}), tree],
        ],
    )


# ------------------------------------------------------------------ helpers


@dataclass(frozen=True)
class SnapshotAtDepth:
    """Snapshot the state after the ``depth``-th state-changing call (where these rollouts diverge), so forks
    are exercised while most calls stay cheap (each snapshot restarts the upstream)."""

    depth: int
    name: str = "at-depth"

    def should_snapshot(self, graph: ToolCallGraph, node: Node, costs: CostModel) -> bool:
        return not node.read_only and node.snapshot is None and node.depth == self.depth


def dump(result: Any) -> Any:
    return result.model_dump(by_alias=True, mode="json", exclude_none=True)


def tree_state(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every entry under ``root``: mode, mtime and content digest (a write, a chmod, a touch all show)."""
    state = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() and not path.is_symlink() else ""
        state[str(path.relative_to(root))] = (info.st_mode, info.st_mtime_ns, digest)
    return state


SERVER_INFO = "io.modelcontextprotocol/serverInfo"


def as_answered(result: dict[str, Any], *, proxied: bool) -> dict[str, Any]:
    """The result without the note the proxy's SDK adds to the envelope when the upstream's result carried none
    (which server answered: the proxy is the server its clients talk to). An upstream's own note (the Python SDK
    adds it: the git server's) passes through and is compared like every other field."""
    meta = dict(result.get("_meta") or {})
    if not proxied or meta.get(SERVER_INFO) != {"name": "tvcache-mcp-proxy", "version": ""}:
        return result
    del meta[SERVER_INFO]
    return {**result, "_meta": meta} if meta else {key: value for key, value in result.items() if key != "_meta"}


async def call_all(client: Client, calls: Calls, *, proxied: bool) -> list[Any]:
    results = []
    for name, args in calls:
        try:
            results.append(as_answered(dump(await client.call_tool(name, args)), proxied=proxied))
        except MCPError as error:  # a protocol error is an answer too, compared like results
            results.append({"error": dump(error.error)})
    return results


async def uncached(upstream: Upstream, data: Path, initial: Path) -> list[list[Any]]:
    """Each rollout against the real server, its data directory reset by hand to the initial state first."""
    results = []
    for calls in upstream.rollouts:
        shutil.rmtree(data)
        shutil.copytree(initial, data, symlinks=True)
        parameters = StdioServerParameters(command=upstream.command[0], args=upstream.command[1:], env=upstream.env)
        async with Client(parameters, cache=None) as client:
            results.append(await call_all(client, calls, proxied=False))
    shutil.rmtree(data)
    shutil.copytree(initial, data, symlinks=True)
    return results


@dataclass(frozen=True, kw_only=True)
class Connection:
    results: list[Any]
    stats: dict[str, Any]
    upstream_starts: int


async def through_proxy(proxy: CachingProxy, calls: Calls) -> Connection:
    async with Client(proxy.server, cache=None) as client:
        await client.list_tools()
        results = await call_all(client, calls, proxied=True)
        stats = json.loads((await client.read_resource(STATS_URI)).contents[0].text)  # type: ignore[union-attr]
    return Connection(results=results, stats=stats, upstream_starts=proxy.upstream_starts)


def executed(stats: dict[str, Any]) -> int:
    """Calls this connection had the upstream execute: misses, first-hit checks, uncached calls."""
    session = stats["session"]
    return int(session["misses"] + session["verified"] + session["uncached"] + session["calls_replayed"])


def prepare(upstream_of: Callable[[Path], Upstream], tmp_path: Path) -> tuple[Upstream, Path, Path]:
    data = tmp_path / "data"
    data.mkdir()
    upstream = upstream_of(data)
    upstream.setup(data)
    initial = tmp_path / "initial"
    shutil.copytree(data, initial, symlinks=True)
    return upstream, data, initial


# ------------------------------------------------------------------ the bar


@pytest.mark.parametrize("server", ["memory", "git", "filesystem"])
@synchronous
async def test_divergent_rollouts_over_a_sandboxed_stateful_server_match_the_uncached_server(
    server: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if server == "git":
        upstream_of: Callable[[Path], Upstream] = git_upstream
    else:
        servers = request.getfixturevalue("npm_servers")
        make = memory_upstream if server == "memory" else filesystem_upstream
        upstream_of = functools.partial(make, servers)
    upstream, data, initial = prepare(upstream_of, tmp_path)
    expected = await uncached(upstream, data, initial)
    before = tree_state(data)

    settings = ProxySettings(command=upstream.command, env=upstream.env, sandbox_dir=str(data), task_id=server)
    cache = Cache(snapshot_policy=SnapshotAtDepth(upstream.fork_depth))
    with SandboxedUpstreams(settings) as sandboxes:
        # The last rollout once more at the end: its tools' first hits were checked by now, so it is all hits.
        rollouts = [*upstream.rollouts, upstream.rollouts[-1]]
        expected.append(expected[-1])
        connections = [
            await through_proxy(CachingProxy(settings, cache, sandboxes=sandboxes), calls) for calls in rollouts
        ]
        assert sandboxes.running() == []  # every upstream ended with its connection
        process_starts = sandboxes.process_starts

    mismatches = [
        (rollout, step, ours, theirs)
        for rollout, (connection, wanted) in enumerate(zip(connections, expected, strict=True))
        for step, (ours, theirs) in enumerate(zip(connection.results, wanted, strict=True))
        if ours != theirs
    ]
    assert mismatches == []
    assert [len(c.results) for c in connections] == [len(calls) for calls in rollouts]
    hits = sum(c.stats["session"]["hits"] for c in connections)
    assert hits > 0
    assert cache.stats().sandboxes_forked > 0, "no fork came from a snapshot"
    for connection in connections:
        # The upstream starts only for a connection that had it execute something.
        assert (connection.upstream_starts > 0) == (executed(connection.stats) > 0), connection.stats
    assert connections[0].stats["session"]["hits"] == 0
    repeat = connections[-1]
    assert repeat.stats["session"]["hits"] == 1 + len(rollouts[-1])  # the listing and every call
    assert executed(repeat.stats) == 0
    assert repeat.upstream_starts == 0
    assert sum(c.upstream_starts for c in connections) == process_starts
    assert tree_state(data) == before, "the host's data directory changed"
    assert cache.nondeterministic_marks() == []  # nothing disagreed: the first-hit checks all agreed
    cache.close()


@synchronous
async def test_an_upstream_that_dies_between_calls_is_restarted_in_the_sandboxs_state(
    npm_servers: Path, tmp_path: Path
) -> None:
    upstream, data, initial = prepare(functools.partial(memory_upstream, npm_servers), tmp_path)
    calls = upstream.rollouts[0]
    (expected, *_) = await uncached(upstream, data, initial)
    settings = ProxySettings(command=upstream.command, env=upstream.env, sandbox_dir=str(data), task_id="crash")
    cache = Cache(snapshot_policy=NeverSnapshot())  # a snapshot restarts the upstream too: only the crash may here
    with SandboxedUpstreams(settings) as sandboxes:
        proxy = CachingProxy(settings, cache, sandboxes=sandboxes)
        async with Client(proxy.server, cache=None) as client:
            first = await call_all(client, calls[:2], proxied=True)
            (pid,) = sandboxes.running()
            os.kill(pid, signal.SIGKILL)
            # Between calls: once its end was reported (a bounded wait on that, not a sleep).
            for _ in range(500):
                if pid not in sandboxes.running():
                    break
                await asyncio.sleep(0.01)
            assert sandboxes.running() == []
            rest = await call_all(client, calls[2:], proxied=True)
    assert first + rest == expected
    assert proxy.upstream_starts == 2
    cache.close()


@synchronous
async def test_the_cli_proxy_sandboxes_the_upstream_over_its_data_directory(npm_servers: Path, tmp_path: Path) -> None:
    upstream, data, initial = prepare(functools.partial(memory_upstream, npm_servers), tmp_path)
    calls = upstream.rollouts[1]
    expected = (await uncached(upstream, data, initial))[1]
    before = tree_state(data)
    proxy = [sys.executable, "-c", "from tvcache.cli import main; raise SystemExit(main())", "mcp-proxy"]
    command = [*proxy, "--cache", str(tmp_path / "cache"), "--sandbox-dir", str(data), "--", *upstream.command]
    for connection in range(2):
        parameters = StdioServerParameters(command=command[0], args=command[1:], env=upstream.env)
        async with Client(parameters, cache=None) as client:
            results = await call_all(client, calls, proxied=True)
            stats = json.loads((await client.read_resource(STATS_URI)).contents[0].text)  # type: ignore[union-attr]
        assert results == expected
        # The first process ran every call in a sandboxed upstream; the second (another process, the same
        # durable cache) checked each tool's first hit in a fresh sandbox, never in the host's directory.
        assert stats["upstream_starts"] >= 1
        assert tree_state(data) == before
        if connection == 1:
            assert stats["session"]["hits"] > 0
            assert stats["session"]["misses"] == 0


def test_the_cli_refuses_a_data_directory_that_is_not_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tvcache import cli

    assert cli.main(["mcp-proxy", "--sandbox-dir", str(tmp_path / "missing"), "--", "server"]) == 2
    assert "does not exist or is not a directory" in capsys.readouterr().err
