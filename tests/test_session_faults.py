"""A session whose call ran but could not be recorded as the cache expected must not go on as if it had been.

Two ways in: the journal refuses the record (a full disk), and the record finds the same call already recorded in
the same state with another result (another worker whose claim outlived its TTL, or a second server). In both, the
live sandbox holds what *this* execution did, which no cached state describes.
"""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path
from typing import Any

import pytest

from tvcache import Cache, JournalError, NeverSnapshot, Outcome, Snapshot, ToolCall
from tvcache.graph import ToolCallGraph
from tvcache.protocol import SandboxWrapper

from kvstore import KVFactory, KVSandbox

PAGE = 4096
BIG = "2" * (2 * PAGE)


def fill(filesystem: Path) -> Path:
    """Fill ``filesystem`` until not one byte fits; returns the filler to remove."""
    filler = filesystem / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for chunk in (PAGE, 1):
            while True:
                try:
                    if os.write(fd, b"f" * chunk) < chunk:
                        break
                except OSError as error:
                    if error.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return filler


def test_a_call_the_journal_refused_does_not_poison_the_next_record(tiny_filesystem: Path) -> None:
    """``set k=<big>`` runs in the sandbox, then the full disk refuses its record: the rollout's state stays at the node
    before it, so the sandbox (which holds k=2) must not be taken as that state. Before the fix the next call,
    ``get k``, ran in it and was recorded at the state where k is 1 with the output 2 — a wrong hit for everyone
    after."""
    cache = Cache(tiny_filesystem / "cache", snapshot_policy=NeverSnapshot())
    factory = KVFactory()

    async def rollout() -> list[str]:
        async with cache.session("t", sandbox=factory) as session:
            outputs = [(await session.call("set", {"key": "k", "value": 1})).output]
            filler = fill(tiny_filesystem)
            with pytest.raises(JournalError):
                await session.call("set", {"key": "k", "value": BIG})  # more than the journal's last page holds
            filler.unlink()
            outputs.append((await session.call("get", {"key": "k"})).output)
            return outputs

    async def repeat() -> str:
        async with cache.session("t", sandbox=KVFactory()) as session:
            await session.call("set", {"key": "k", "value": 1})
            return (await session.call("get", {"key": "k"})).output

    try:
        assert asyncio.run(rollout()) == ["k=1", "1"]
        assert asyncio.run(repeat()) == "1"  # the cached answer at k=1 is the true one
    finally:
        cache.close()


class RacingSandbox(SandboxWrapper):
    """While executing ``incr``, another worker records the same call in the same state with another output (as a
    worker whose claim expired would): the record this session makes then finds that node."""

    def __init__(self, inner: KVSandbox, cache: Cache) -> None:
        super().__init__(inner)
        self.cache = cache

    async def execute(self, call: ToolCall) -> Outcome:
        outcome = await self.inner.execute(call)
        if call.name == "incr":
            graph: ToolCallGraph = self.cache.graph("t")
            other = Outcome(output="n=41", changed_state=True)
            self.cache.store.record(graph, graph.root, call, other, seconds=0.01, read_only=False)
        return outcome


class RacingFactory(KVFactory):
    def __init__(self, cache: Cache) -> None:
        super().__init__()
        self.cache = cache

    async def start(self) -> Any:
        return RacingSandbox(await super().start(), self.cache)

    async def fork(self, snapshot: Snapshot) -> Any:
        return RacingSandbox(await super().fork(snapshot), self.cache)


def test_a_call_found_recorded_with_another_result_takes_the_rollout_off_the_cached_paths() -> None:
    """The other worker's node says ``n=41``; this sandbox holds n=1. Going on at that node (as before the fix)
    served the other worker's cached descendants to a sandbox in another state; now the rollout runs uncached
    from here, with its own sandbox, and the tool is marked non-deterministic in the task."""
    cache = Cache(snapshot_policy=NeverSnapshot())
    factory = RacingFactory(cache)
    # what the other worker went on to record below its n=41 (its sandbox really was there)
    graph = cache.graph("t")

    async def rollout() -> list[tuple[str, bool]]:
        async with cache.session("t", sandbox=factory) as session:
            results = [await session.call("incr", {"key": "n"})]
            node = graph.match([ToolCall("incr", {"key": "n"})]).node
            cache.store.record(
                graph, node, ToolCall("get", {"key": "n"}), Outcome(output="41"), seconds=0.01, read_only=True
            )
            results.append(await session.call("get", {"key": "n"}))
            return [(r.output, r.cached) for r in results]

    with pytest.warns(Warning):
        outcomes = asyncio.run(rollout())
    assert outcomes == [("n=1", False), ("1", False)]
    assert any(mark.tool == "incr" for mark in cache.nondeterministic_marks("t"))
