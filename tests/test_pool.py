"""Warm pools: ready root sandboxes and forks prepared in the background, with results unchanged."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from tvcache import AlwaysSnapshot, Cache
from tvcache.protocol import close_factory
from tvcache.sandboxes import FolderSandbox, ShellSandbox, SQLiteSandbox, WarmPool
from tvcache.sandboxes.shell.linux import overlay_supported


def make_factory(tmp_path: Path):  # type: ignore[no-untyped-def]
    base = tmp_path / "base"
    base.mkdir()
    (base / "a.txt").write_text("a\n")
    if overlay_supported():
        return ShellSandbox.factory(base, fallback=False, store_root=tmp_path / "layers")
    return FolderSandbox.factory(base)


def test_ready_sandboxes_serve_starts_and_forks(tmp_path: Path) -> None:
    inner = make_factory(tmp_path)
    cache = Cache(snapshot_policy=AlwaysSnapshot())

    async def rollout(pool: WarmPool, cmds: list[str]) -> list[str]:
        async with cache.session("t", sandbox=pool) as session:
            return [(await session.call("sh", {"cmd": cmd})).output for cmd in cmds]

    async def main() -> WarmPool:
        pool = WarmPool(inner, roots=2, forks_per_snapshot=1)
        await pool.prepare()
        assert pool.stats.prepared == 2
        first = await rollout(pool, ["echo one >> a.txt", "cat a.txt"])
        await pool.drain()  # background forks of the snapshots it took
        second = await rollout(pool, ["echo one >> a.txt", "echo two >> a.txt", "cat a.txt"])
        third = await rollout(pool, ["echo one >> a.txt", "echo two >> a.txt", "wc -l a.txt"])
        assert first == ["", "a\none\n"]
        assert second == ["", "", "a\none\ntwo\n"]
        assert third == ["", "", "3 a.txt\n"]
        await pool.close()
        return pool

    pool = asyncio.run(main())
    stats = pool.stats
    assert stats.ready_starts == 1
    assert stats.cold_starts == 0
    assert stats.ready_forks == 2
    assert stats.cold_forks == 0
    assert 0.99 < stats.ready_rate <= 1.0
    cache.close()


def test_closing_the_pool_stops_what_it_prepared(tmp_path: Path) -> None:
    inner = make_factory(tmp_path)

    async def main() -> WarmPool:
        pool = WarmPool(inner, roots=3)
        await pool.prepare()
        sandbox = await pool.start()
        snapshot = await sandbox.snapshot(tmp_path / "snap")
        await pool.drain()
        pool.discard(snapshot)
        await sandbox.stop()
        await pool.close()
        await pool.close()
        return pool

    pool = asyncio.run(main())
    assert pool.stats.wasted >= 3
    if overlay_supported():
        assert inner.store.live_layers() == []  # type: ignore[union-attr]


def test_invalid_sizes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=">= 0"):
        WarmPool(make_factory(tmp_path), roots=-1)


def test_a_pool_closed_from_outside_the_loop_stops_what_it_prepared(tmp_path: Path) -> None:
    # A workload's close runs after the event loop: close_factory runs the pool's coroutine to its end there,
    # where a plain ``factory.close()`` would drop it un-awaited and leave the sandboxes running.
    inner = make_factory(tmp_path)
    pool = WarmPool(inner, roots=2)
    asyncio.run(pool.prepare())
    close_factory(pool)
    database = tmp_path / "db.sqlite"
    sqlite3.connect(database).close()
    close_factory(SQLiteSandbox.factory(database))  # a factory without close: nothing to do
    assert pool.stats.wasted == 2
    if overlay_supported():
        assert inner.store.live_layers() == []  # type: ignore[union-attr]
