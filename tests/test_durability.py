"""A durable cache loses nothing it acknowledged: SIGKILL mid-run, torn journals, reloads and compaction."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tvcache import AlwaysSnapshot, Cache, JournalError, JournalWarning, ToolCall

from kvstore import KVFactory

WRITER = textwrap.dedent(
    """
    import asyncio, json, sys
    sys.path.insert(0, {tests!r})
    from kvstore import KVFactory
    from tvcache import AlwaysSnapshot, Cache

    async def main():
        cache = Cache({path!r}, snapshot_policy=AlwaysSnapshot())
        factory = KVFactory()
        rollout = 0
        while True:
            async with cache.session(f"task-{{rollout % 7}}", sandbox=factory) as session:
                history = []
                for step in range(rollout % 5 + 1):
                    args = {{"key": f"k{{step % 3}}", "value": rollout % 11}}
                    result = await session.call("set", args)
                    history.append(["set", args])
                    # acknowledged: the call returned, so it must survive a crash from here on
                    print(json.dumps({{"task": session.task_id, "history": history, "output": result.output}}),
                          flush=True)
            rollout += 1

    asyncio.run(main())
    """
)


def test_sigkill_loses_no_acknowledged_insert(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    script = WRITER.format(tests=str(Path(__file__).parent), path=str(path))
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    acknowledged = []
    for line in process.stdout:
        acknowledged.append(json.loads(line))
        if len(acknowledged) >= 400:
            break
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    acknowledged.extend(json.loads(line) for line in process.stdout)  # whatever was already printed

    cache = Cache(path)
    try:
        for entry in acknowledged:
            history = [ToolCall(name, args) for name, args in entry["history"]]
            match = cache.graph(entry["task"]).match(history)
            assert match.hit, f"acknowledged insert lost: {entry}"
            assert match.output == entry["output"]
        cache.check_invariants()
    finally:
        cache.close()


def test_reload_restores_graphs_snapshots_tests_and_nondeterminism(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    factory = KVFactory()

    async def rollout(cache: Cache) -> list:
        async with cache.session("t", sandbox=factory) as session:
            results = [await session.call("set", {"key": "a", "value": 1}), await session.call("get", {"key": "a"})]
            await session.test(lambda sandbox: sandbox.data["a"], key="reward")
            return results

    with Cache(path, snapshot_policy=AlwaysSnapshot()) as cache:
        first = asyncio.run(rollout(cache))
        with pytest.warns(UserWarning):
            cache.mark_nondeterministic("keys", "declared by the test")
        snapshots = {node.id: node.snapshot for node in cache.graph("t").snapshot_nodes.values()}
    with Cache(path, snapshot_policy=AlwaysSnapshot()) as cache:
        graph = cache.graph("t")
        assert {node.id: node.snapshot for node in graph.snapshot_nodes.values()} == snapshots
        assert "keys" in cache.nondeterministic_tools
        started = factory.started
        second = asyncio.run(rollout(cache))
        assert [r.hit for r in second] == [True, True]
        assert [r.output for r in second] == [r.output for r in first]
        assert factory.started == started  # the test result was cached too: no sandbox needed
        cache.check_invariants()


def test_snapshots_whose_files_are_gone_are_dropped_on_reload(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    with Cache(path, snapshot_policy=AlwaysSnapshot()) as cache:
        asyncio.run(_calls(cache, KVFactory(), [("incr", {"key": "a"}), ("incr", {"key": "a"})]))
        victim = next(iter(cache.graph("t").snapshot_nodes.values()))
        Path(victim.snapshot.path).unlink()
    with Cache(path) as cache:
        graph = cache.graph("t")
        assert len(graph) == 3
        assert victim.id not in graph.snapshot_nodes
        assert len(graph.snapshot_nodes) == 1
        cache.check_invariants()


def test_torn_journal_tail_is_skipped_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    with Cache(path) as cache:
        asyncio.run(_calls(cache, KVFactory(), [("incr", {"key": "a"}), ("incr", {"key": "b"})]))
    journal = path / "journal.log"
    with open(journal, "ab") as handle:
        handle.write(b'0badc0de {"t":"n","task":"t","id":9')  # a write torn by a crash
    with pytest.warns(JournalWarning, match="torn"), Cache(path) as cache:
        assert len(cache.graph("t")) == 3
        asyncio.run(_calls(cache, KVFactory(), [("incr", {"key": "c"})]))
    with Cache(path) as cache:  # the tail was truncated: the new record loads cleanly
        assert len(cache.graph("t")) == 4


def test_a_second_process_cannot_open_the_same_directory(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    with Cache(path):
        code = f"from tvcache import Cache\nCache({str(path)!r})"
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert result.returncode != 0
        assert "tvcache serve" in result.stderr
    assert JournalError.__doc__


def test_compaction_keeps_the_live_state(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    with Cache(path, snapshot_policy=AlwaysSnapshot()) as cache:
        factory = KVFactory()
        for value in range(30):
            asyncio.run(_calls(cache, factory, [("set", {"key": "a", "value": value})]))
        before = {(n.id, n.output) for n in cache.graph("t").nodes()}
        written = cache.compact()
        assert written >= len(before) - 1
    with Cache(path) as cache:
        assert {(n.id, n.output) for n in cache.graph("t").nodes()} == before
        cache.check_invariants()


async def _calls(cache: Cache, factory: KVFactory, calls: list) -> list:
    async with cache.session("t", sandbox=factory) as session:
        return [await session.call(name, args) for name, args in calls]
