"""Differential tests: every call answered through the cache equals fresh, uncached execution of the same
history, over hundreds of random rollouts on both real backends, interleaving writes and reads."""

from __future__ import annotations

import asyncio
import random
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tvcache import AlwaysSnapshot, Budget, Cache, CostAwareSnapshots, NeverSnapshot, ToolCall
from tvcache.sandboxes import FolderSandbox, SQLiteSandbox

SQL = [
    "CREATE TABLE IF NOT EXISTS notes (id INTEGER PRIMARY KEY, body TEXT)",
    "INSERT INTO items (name, qty) VALUES ('bolt', 3)",
    "INSERT INTO items (name, qty) VALUES ('nut', 5)",
    "UPDATE items SET qty = qty + 1 WHERE name = 'bolt'",
    "DELETE FROM items WHERE qty > 5",
    "SELECT COUNT(*) FROM items",
    "SELECT name, qty FROM items ORDER BY id",
    "SELECT SUM(qty) FROM items",
    "SELECT * FROM notes",
    "INSERT INTO notes (body) VALUES ('hello')",
    "SELEC broken",
]
SHELL = [
    "cat a.txt",
    "echo x >> a.txt",
    "ls",
    "wc -l a.txt",
    "rm -f b.txt",
    "echo y > b.txt",
    "cat b.txt",
    "sed -i 's/x/z/' a.txt",
    "mkdir -p d && echo q > d/f",
    "find . -type f | sort",
    "cat missing.txt",
]


def sqlite_factory(tmp_path: Path) -> SQLiteSandbox:
    path = tmp_path / "base.sqlite"
    connection = sqlite3.connect(path)
    connection.execute("CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT, qty INTEGER)")
    connection.execute("INSERT INTO items (name, qty) VALUES ('washer', 1)")
    connection.commit()
    connection.close()
    return SQLiteSandbox.factory(path)


def folder_factory(tmp_path: Path) -> FolderSandbox:
    template = tmp_path / "template"
    template.mkdir()
    (template / "a.txt").write_text("x\n")
    return FolderSandbox.factory(template)


BACKENDS: dict[str, tuple[Any, str, str, list[str]]] = {
    "sqlite": (sqlite_factory, "sql", "query", SQL),
    "folder": (folder_factory, "sh", "cmd", SHELL),
}


async def uncached(factory: Any, calls: list[ToolCall]) -> list[str]:
    """Fresh execution of the whole history in a new sandbox: the ground truth for every prefix."""
    sandbox = await factory.start()
    try:
        return [(await sandbox.execute(call)).output for call in calls]
    finally:
        await sandbox.stop()


async def cached(cache: Cache, factory: Any, task: str, calls: list[ToolCall]) -> list[tuple[str, bool]]:
    async with cache.session(task, sandbox=factory) as session:
        results = [await session.call(call.name, call.arguments) for call in calls]
    return [(result.output, result.hit) for result in results]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("policy", ["cost-aware", "always", "never"])
def test_cached_equals_uncached_over_random_rollouts(tmp_path: Path, backend: str, policy: str) -> None:
    make, tool, argument, alphabet = BACKENDS[backend]
    factory = make(tmp_path)
    snapshots = {"cost-aware": CostAwareSnapshots(), "always": AlwaysSnapshot(), "never": NeverSnapshot()}[policy]
    cache = Cache(tmp_path / "cache", snapshot_policy=snapshots, budget=Budget(max_snapshots_per_task=6))
    rng = random.Random(f"{backend}:{policy}")
    rollouts = 120 if backend == "sqlite" else 60
    group = 4
    mismatches: list[tuple[Any, ...]] = []
    hits = calls_made = 0

    async def main() -> None:
        nonlocal hits, calls_made
        for start in range(0, rollouts, group):
            # A group of rollouts of the same task, concurrently, sharing prefixes like an RL group does.
            task = f"task-{start // group % 3}"
            stem = [rng.choice(alphabet) for _ in range(rng.randrange(0, 4))]
            histories = []
            for _ in range(group):
                tail = [rng.choice(alphabet) for _ in range(rng.randrange(1, 6))]
                histories.append([ToolCall(tool, {argument: text}) for text in stem + tail])
            through_cache = await asyncio.gather(*(cached(cache, factory, task, h) for h in histories))
            for history, answers in zip(histories, through_cache, strict=True):
                truth = await uncached(factory, history)
                for step, ((output, hit), expected) in enumerate(zip(answers, truth, strict=True)):
                    calls_made += 1
                    hits += hit
                    if output != expected:
                        mismatches.append((task, step, history[: step + 1], output, expected))

    asyncio.run(main())
    cache.check_invariants()
    stats = cache.stats()
    cache.close()
    assert mismatches == [], mismatches[:3]
    assert hits > 0
    assert calls_made >= rollouts * 2
    assert stats.audit_disagreements == 0
    assert stats.replay_divergences == 0


def test_the_papers_motivating_case_on_real_files(tmp_path: Path) -> None:
    template = tmp_path / "repo"
    template.mkdir()
    (template / "foo.py").write_text("print('old')\n")
    factory = FolderSandbox.factory(template)
    cache = Cache()
    rollout = [
        ("sh", {"cmd": "cat foo.py"}),
        ("sh", {"cmd": "sed -i s/old/new/ foo.py"}),
        ("sh", {"cmd": "cat foo.py"}),
    ]

    async def run() -> list:
        async with cache.session("fix-foo", sandbox=factory) as session:
            return [await session.call(name, args) for name, args in rollout]

    first = asyncio.run(run())
    assert [r.output for r in first] == ["print('old')\n", "", "print('new')\n"]
    assert [r.hit for r in first] == [False, False, False]  # the second cat is not served the first's result
    second = asyncio.run(run())
    assert [r.output for r in second] == [r.output for r in first]
    assert [r.hit for r in second] == [True, True, True]
    cache.close()
