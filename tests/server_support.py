"""Helpers shared by the server tests: a real server on 127.0.0.1, a bounded wait, and real traffic for the
dashboard."""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tvcache import AlwaysSnapshot, RemoteCache

from kvstore import KVFactory


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_until(condition: Callable[[], bool], *, timeout: float = 10.0, interval: float = 0.005) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds (never an unbounded wait)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


# ------------------------------------------------------------------ dashboard traffic

TASKS = ("sql/chinook-top-artists", "shell/fix-off-by-one", "media/thumbnails")


@dataclass
class Counted:
    """What the clients' own sessions counted for one (task, epoch): the ground truth for the server's tallies."""

    hits: int = 0
    misses: int = 0


def _rollout(rng: random.Random, task_index: int) -> list[tuple[str, dict[str, Any]]]:
    """A rollout over the kv tools: a few choices per step, so later epochs find more of it cached."""
    calls: list[tuple[str, dict[str, Any]]] = [
        ("set", {"key": "n", "value": rng.choice([1, 2])}),
        ("get", {"key": "n"}),
    ]
    calls.append(("slow", {"key": rng.choice(["n", "m"]), "seconds": 0.01 * (task_index + 1)}))
    calls.append(("keys", {}))
    if rng.random() < 0.6:
        calls.append(("incr", {"key": rng.choice(["n", "m", "k"])}))
        calls.append(("get", {"key": "n"}))
    if task_index == 1 and rng.random() < 0.3:
        calls.append(("get", {"key": "missing"}))  # an error result
    return calls


def populate_dashboard(
    url: str, snapshot_dir: Path, *, token: str | None = None, epochs: int = 3, group: int = 4
) -> dict[tuple[str, int | None], Counted]:
    """Real rollouts through ``RemoteCache`` sessions, tagged by epoch (one extra untagged rollout), with groups
    of concurrent rollouts per task as an RL trainer runs them. Returns the sessions' own hit/miss counts."""
    rng = random.Random(7)
    counted: dict[tuple[str, int | None], Counted] = {}
    factory = KVFactory()

    async def rollout(cache: RemoteCache, task: str, calls: list[tuple[str, dict[str, Any]]]) -> None:
        async with cache.session(task, sandbox=factory) as session:
            for name, arguments in calls:
                await session.call(name, arguments)
        totals = counted.setdefault((task, cache.epoch), Counted())
        totals.hits += session.stats.hits
        totals.misses += session.stats.misses

    async def run(cache: RemoteCache, epoch: int | None, rollouts: int) -> None:
        cache.epoch = epoch
        for index, task in enumerate(TASKS):
            await asyncio.gather(*(rollout(cache, task, _rollout(rng, index)) for _ in range(rollouts)))

    # The client snapshots after every state-changing call, so the graphs show snapshot markers.
    with RemoteCache(url, token=token, snapshot_dir=snapshot_dir, snapshot_policy=AlwaysSnapshot()) as cache:
        for epoch in range(epochs):
            asyncio.run(run(cache, epoch, group))
        asyncio.run(run(cache, None, 1))
    return counted
