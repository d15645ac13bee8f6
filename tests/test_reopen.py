"""Reopening from a checkpoint: the state is exactly the journal's, tasks are read when first used, and a
checkpoint that is damaged, of another format, or no longer the journal's is not used, saying so. Real parts: the
KV sandbox, real files, real SIGKILLs; every comparison is against the same directory opened from the journal
alone."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import struct
import textwrap
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from killed_children import run_until
from tvcache import AlwaysSnapshot, Budget, Cache, JournalWarning, NeverSnapshot, ToolCall
from tvcache.journal import Journal, Prefix
from tvcache.recovery import JournalRecovery
from tvcache.store import LocalStore, checkpoint, durable

from kvstore import KVFactory

CHECKPOINT = checkpoint.FILE

# ----------------------------------------------------------------------------------------------- helpers


def rollout(cache: Cache, task: str, calls: list[tuple[str, dict[str, Any]]], *, test: str | None = None) -> list[Any]:
    async def run() -> list[Any]:
        async with cache.session(task, sandbox=KVFactory()) as session:
            results = [await session.call(name, args) for name, args in calls]
            if test is not None:
                await session.test(lambda sandbox: {"keys": sorted(sandbox.data)}, key=test)
            return results

    return asyncio.run(run())


def chain(prefix: str, length: int) -> list[tuple[str, dict[str, Any]]]:
    return [("set", {"key": f"{prefix}{step}", "value": step}) for step in range(length)]


def store_of(cache: Cache) -> LocalStore:
    store = cache.store
    assert isinstance(store, LocalStore)
    return store


def state_of(cache: Cache) -> dict[str, Any]:
    """Everything a reopened cache holds that a user can observe, graph by graph (reads every task)."""
    graphs = {}
    for task in sorted(cache.tasks()):
        graph = cache.graph(task)
        graph.check_invariants()
        nodes = []
        for node in sorted(graph.nodes(), key=lambda node: node.id):
            call = node.call
            if call is not None:  # a call read from a checkpoint is the call its bytes make, digest and all
                assert ToolCall.from_json(call.name, call.canonical_arguments).digest == call.digest
            nodes.append(
                (
                    node.id,
                    node.parent.id if node.parent is not None else None,
                    None if call is None else (call.name, call.canonical_arguments, call.digest),
                    node.output,
                    node.is_error,
                    node.seconds,
                    node.read_only,
                    node.depth,
                    node.snapshot.to_json() if node.snapshot is not None else None,
                    node.tests,
                )
            )
        graphs[task] = {
            "nodes": nodes,
            "next_id": graph.next_id,
            "snapshot_paths": sorted(graph.snapshot_paths.items()),
            "snapshot_bytes": graph.snapshot_bytes,
        }
    marks = sorted((mark.tool, mark.task_id or "", mark.reason) for mark in cache.nondeterministic_marks())
    return {"graphs": graphs, "marks": marks, "checked": store_of(cache).checked()}


def recovered(cache: Cache) -> JournalRecovery:
    recovery = cache.recovery
    assert recovery is not None
    return recovery


def comparable(recovery: JournalRecovery | None) -> JournalRecovery:
    """What opening found, without what differs between a directory and its copy (paths) or between the two
    routes by design (the checkpoint's own fields)."""
    assert recovery is not None
    return dataclasses.replace(
        recovery,
        journal="",
        from_checkpoint=0,
        checkpoint=None,
        removed=tuple(Path(path).name for path in recovery.removed),
        set_aside=tuple(Path(path).name for path in recovery.set_aside),
    )


@contextlib.contextmanager
def opened(path: Path, **options: Any) -> Iterator[Cache]:
    """Open a cache without rewriting the directory, failing on any warning while opening."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache = Cache(path, compact_on_open=False, **options)
    try:
        yield cache
    finally:
        cache.close()


def opened_warned(path: Path, **options: Any) -> tuple[Cache, str]:
    """Open a cache that must say exactly one thing: one JournalWarning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = Cache(path, compact_on_open=False, **options)
    assert [warning.category for warning in caught] == [JournalWarning], [str(w.message) for w in caught]
    return cache, str(caught[0].message)


def journal_only(path: Path) -> tuple[dict[str, Any], JournalRecovery]:
    """The state and recovery of a copy of ``path`` without its checkpoint: the journal replayed whole (a copy,
    because opening may journal records, such as detaching snapshots whose storage is gone)."""
    copy = path.with_name(path.name + "-journal-only")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(path, copy)
    (copy / CHECKPOINT).unlink(missing_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JournalWarning)
        cache = Cache(copy, compact_on_open=False)
    try:
        assert recovered(cache).from_checkpoint == 0
        return state_of(cache), recovered(cache)
    finally:
        cache.close()
        shutil.rmtree(copy)


def populate(path: Path) -> None:
    """A cache with everything a checkpoint holds — calls in five tasks (read-only ones too), snapshots, test
    results, marks tool-wide and in one task, a passed check — compacted, then a tail after it: calls at old and
    new states of t0, a removal in t1, a dropped snapshot in t2, a new chain in t3, a new task t9, a cleared
    mark. t4 has no tail records."""
    with Cache(path, snapshot_policy=AlwaysSnapshot()) as cache:
        for task in ("t0", "t1", "t2", "t3", "t4"):
            rollout(cache, task, chain("a", 5), test="check")
            rollout(cache, task, [*chain("a", 2), ("keys", {}), ("set", {"key": "b", "value": task})])
        with pytest.warns(UserWarning, match="non-deterministic"):
            cache.mark_nondeterministic("now", "declared by the test")
        store = store_of(cache)
        store.mark_nondeterministic("incr", "seen to differ", task_id="t1")
        store.pass_check("t2", "get")
        cache.compact()
        assert (path / CHECKPOINT).exists()
        rollout(cache, "t0", [*chain("a", 3), ("set", {"key": "tail", "value": 1})])
        rollout(cache, "t0", [*chain("a", 5), ("incr", {"key": "n"})], test="after")
        t1 = cache.graph("t1")
        below = t1.match([ToolCall(name, args) for name, args in chain("a", 2)]).node
        assert below is not None
        store.remove(t1, below)
        t2 = cache.graph("t2")
        store.drop_snapshot(t2, max(t2.snapshot_nodes.values(), key=lambda node: node.id))
        rollout(cache, "t3", chain("z", 3))
        rollout(cache, "t9", chain("new", 3))
        store.clear_nondeterministic("incr", task_id="t1")


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def journal_line(path: Path, *parts: bytes) -> tuple[int, bytes]:
    """The offset and bytes of the first journal line containing every one of ``parts``."""
    offset = 0
    for line in (path / Journal.FILE).read_bytes().splitlines(keepends=True):
        if all(part in line for part in parts):
            return offset, line
        offset += len(line)
    raise AssertionError(f"no journal line holds {parts}")


def header_of(path: Path) -> tuple[bytes, int, int, int, int]:
    fields: tuple[bytes, int, int, int, int] = struct.unpack_from("<8sIQQI", (path / CHECKPOINT).read_bytes())
    return fields


# ------------------------------------------------------------------------------------------ the journal


def test_a_rewrite_names_the_bytes_it_wrote_and_load_can_start_after_them(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    list(journal.load())
    result = journal.rewrite([{"a": 1}, {"b": 2}])
    data = (tmp_path / Journal.FILE).read_bytes()
    assert result.written == Prefix(size=len(data), lines=2, crc=zlib.crc32(data))
    assert journal.covers(result.written)
    journal.append({"c": 3})
    journal.close()
    appended = (tmp_path / Journal.FILE).read_bytes()[len(data) :]
    (tmp_path / Journal.FILE).write_bytes(data + b"\n" + appended + b"torn")
    again = Journal(tmp_path)
    assert again.covers(result.written)
    assert list(again.load(after=result.written)) == [(4, {"c": 3})]  # line 3 is the blank, damaged one
    assert (again.scan.damaged[0].line, again.scan.damaged[0].offset) == (3, len(data))  # counted from the start
    assert again.scan.torn_tail is not None
    assert again.scan.torn_tail.line == 5
    assert (tmp_path / Journal.FILE).read_bytes() == data + b"\n" + appended  # the torn tail cut where it began
    assert not again.covers(Prefix(size=result.written.size, lines=2, crc=result.written.crc ^ 1))
    assert not again.covers(Prefix(size=10**9, lines=2, crc=result.written.crc))  # longer than the journal
    again.close()


# ----------------------------------------------------------------------------------- the state is the same


def test_reopening_from_a_checkpoint_gives_exactly_what_replaying_the_journal_gives(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    populate(path)
    expected, expected_recovery = journal_only(path)
    with opened(path) as cache:
        store = store_of(cache)
        assert recovered(cache).from_checkpoint > 0
        assert recovered(cache).checkpoint is None
        assert comparable(cache.recovery) == comparable(expected_recovery)
        assert set(store.pending) == {"t0", "t1", "t2", "t3", "t4"}  # nothing read yet; tail records kept
        assert sorted(cache.tasks()) == ["t0", "t1", "t2", "t3", "t4", "t9"]
        assert state_of(cache) == expected
        assert not store.pending
        assert store.checkpoint is None  # closed once every task is read


def test_a_task_is_read_when_first_used_and_its_calls_hit_without_a_sandbox(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    populate(path)
    expected, _ = journal_only(path)
    with opened(path) as cache:
        store = store_of(cache)
        factory = KVFactory()

        async def hits() -> list[bool]:
            async with cache.session("t4", sandbox=factory) as session:
                return [(await session.call(name, args)).hit for name, args in chain("a", 5)]

        assert asyncio.run(hits()) == [True] * 5
        assert factory.started == factory.forked == 0
        assert set(store.pending) == {"t0", "t1", "t2", "t3"}
        stats = cache.stats()
        assert not store.pending  # the tasks with tail records were read for their counts
        assert (stats.tasks, stats.nodes, stats.snapshots, stats.snapshot_bytes) == (
            len(expected["graphs"]),
            sum(len(graph["nodes"]) - 1 for graph in expected["graphs"].values()),
            sum(len(graph["snapshot_paths"]) for graph in expected["graphs"].values()),
            sum(graph["snapshot_bytes"] for graph in expected["graphs"].values()),
        )
    with opened(path) as cache:
        cache.stats()
        assert set(store_of(cache).pending) == {"t4"}  # its counts are the checkpoint's: not read for them


def test_closing_writes_a_checkpoint_once_enough_records_are_not_in_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(durable, "CHECKPOINT_TAIL", 10)
    path = tmp_path / "cache"
    with Cache(path, snapshot_policy=NeverSnapshot()) as cache:
        rollout(cache, "t", chain("a", 9))
    assert not (path / CHECKPOINT).exists()  # 9 records: replaying them costs less than a compaction
    with Cache(path, snapshot_policy=NeverSnapshot(), compact_on_open=False) as cache:
        rollout(cache, "t", chain("b", 3))
    assert not (path / CHECKPOINT).exists()  # compact_on_open=False: neither opening nor closing rewrites
    with Cache(path, snapshot_policy=NeverSnapshot()) as cache:
        rollout(cache, "t", chain("c", 1))
    assert (path / CHECKPOINT).exists()
    with opened(path) as cache:
        assert recovered(cache).from_checkpoint == 13
        assert len(cache.graph("t")) == 14


# --------------------------------------------------------------------------------- a checkpoint not used


def damage_section(path: Path) -> None:
    flip(path / CHECKPOINT, 64)


def damage_index(path: Path) -> None:
    _, _, offset, length, _ = header_of(path)
    flip(path / CHECKPOINT, offset + length // 2)


def cut_short(path: Path) -> None:
    with open(path / CHECKPOINT, "r+b") as handle:
        handle.truncate(20)


def other_format(path: Path) -> None:
    magic, _, offset, length, crc = header_of(path)
    with open(path / CHECKPOINT, "r+b") as handle:
        handle.write(struct.pack("<8sIQQI", magic, checkpoint.FORMAT + 1, offset, length, crc))


def not_a_checkpoint(path: Path) -> None:
    (path / CHECKPOINT).write_bytes(b"hello, this is not a checkpoint at all\n")


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (damage_section, "it is damaged: the section of task 't0' fails its checksum"),
        (damage_index, "it is damaged: its index fails its checksum"),
        (cut_short, "it is cut short"),
        (other_format, f"it has format {checkpoint.FORMAT + 1}, and this version of tvcache reads format 1"),
        (not_a_checkpoint, "it is not a checkpoint (wrong magic bytes)"),
    ],
    ids=["section", "index", "cut short", "another format", "not a checkpoint"],
)
def test_an_unusable_checkpoint_is_not_used_the_journal_is_and_it_says_so(
    tmp_path: Path, damage: Any, said: str
) -> None:
    path = tmp_path / "cache"
    populate(path)
    expected, expected_recovery = journal_only(path)
    damage(path)
    cache, message = opened_warned(path)
    try:
        assert f"its checkpoint was not used ({said}), so the whole journal was replayed (nothing is lost" in message
        assert recovered(cache).from_checkpoint == 0
        assert comparable(cache.recovery) == comparable(expected_recovery)
        assert state_of(cache) == expected
    finally:
        cache.close()
    assert not (path / CHECKPOINT).exists()  # removed: it would only be refused again
    with opened(path) as reopened:  # said once
        assert state_of(reopened) == expected


def test_a_checkpoint_the_journal_no_longer_begins_with_is_not_used(tmp_path: Path) -> None:
    """A byte of the covered journal changed: the journal is replayed whole, so its damage is reported exactly
    as without a checkpoint, in the same one warning."""
    path = tmp_path / "cache"
    populate(path)
    offset, line = journal_line(path, b'"t":"n"', b'"task":"t3"')  # t3's first call: everything hangs below it
    flip(path / Journal.FILE, offset + len(line) // 2)
    expected, expected_recovery = journal_only(path)
    assert expected_recovery.damaged
    assert expected_recovery.lost
    cache, message = opened_warned(path)
    try:
        assert "does not begin with them: it was rewritten or changed after the checkpoint was written" in message
        assert "1 damaged record(s) were skipped (line " in message
        assert cache.recovery is not None
        assert comparable(cache.recovery) == comparable(expected_recovery)
        assert state_of(cache) == expected
    finally:
        cache.close()


def test_damage_in_the_tail_is_found_while_opening_as_without_a_checkpoint(tmp_path: Path) -> None:
    """A damaged tail record of a pending task: the calls recorded below it are lost and reported while opening,
    with the same lines, offsets, groups and reserved ids as replaying the whole journal gives."""
    path = tmp_path / "cache"
    populate(path)
    offset, line = journal_line(path, b'"task":"t3"', b"z0")
    flip(path / Journal.FILE, offset + len(line) // 2)
    expected, expected_recovery = journal_only(path)
    assert expected_recovery.lost_calls == 2  # z1 and z2, below the damaged z0
    cache, message = opened_warned(path)
    try:
        assert "2 acknowledged call(s) recorded below missing nodes are lost with them: 2 in task 't3'" in message
        assert recovered(cache).from_checkpoint > 0
        assert comparable(cache.recovery) == comparable(expected_recovery)
        assert state_of(cache) == expected  # next ids included: new calls stay off the lost records' ids
    finally:
        cache.close()


def test_a_tail_record_that_does_not_apply_without_damage_is_reported_when_its_task_is_read(tmp_path: Path) -> None:
    """No tvcache writes such a record (a call below a node that never existed, on an undamaged journal): it is
    found when its pending task is first read, and counted then as opening counts it without a checkpoint."""
    path = tmp_path / "cache"
    populate(path)
    journal = Journal(path)
    list(journal.load())
    stray = {"t": "n", "task": "t4", "id": 999, "p": 998, "name": "set", "a": "{}", "o": "", "e": False, "s": 0.0}
    journal.append({**stray, "r": False})
    journal.close()
    _, expected_recovery = journal_only(path)
    with opened(path) as cache:  # not read yet, so nothing to say
        with pytest.warns(JournalWarning, match="1 in task 't4' below missing node 998"):
            cache.graph("t4")
        assert comparable(cache.recovery) == comparable(expected_recovery)
        with pytest.warns(JournalWarning, match="copies are in"):
            cache.compact()  # the record that does not apply is copied aside, as any other


# ------------------------------------------------------------------------------------- killed processes

KILLED = textwrap.dedent(
    """
    import asyncio, sys, threading, warnings
    sys.path.insert(0, {tests!r})
    from kvstore import KVFactory
    from tvcache import Cache, NeverSnapshot
    from tvcache.store import checkpoint

    warnings.simplefilter("ignore")
    cache = Cache({path!r}, snapshot_policy=NeverSnapshot())

    async def chain(prefix):
        async with cache.session("t", sandbox=KVFactory()) as session:
            for step in range(5):
                await session.call("set", {{"key": prefix + str(step), "value": step}})

    asyncio.run(chain("a"))
    cache.compact()  # a checkpoint of the first five calls
    asyncio.run(chain("b"))
    cache.mark_nondeterministic("now", "declared")  # a compaction writes marks first: the journal's start changes
    {stall}
    cache.compact()
    """
)
STALL_BEFORE_COMMIT = """
def commit(self, written):  # the new journal is in place; the process dies before its checkpoint is
    print("journal replaced", flush=True)
    threading.Event().wait()
checkpoint.CheckpointWriter.commit = commit
"""
STALL_HALFWAY = """
add = checkpoint.CheckpointWriter.add
def halfway(self, line, *rest):  # half of the new journal and of its checkpoint are written
    if line == 4:
        print("compacting", flush=True)
        threading.Event().wait()
    add(self, line, *rest)
checkpoint.CheckpointWriter.add = halfway
"""


def test_a_kill_between_replacing_the_journal_and_writing_its_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    stall = textwrap.indent(STALL_BEFORE_COMMIT, "")
    run_until(KILLED.format(tests=str(Path(__file__).parent), path=str(path), stall=stall), "journal replaced")
    assert (path / "journal.checkpoint.partial").exists()
    cache, message = opened_warned(path)
    try:
        assert "it was rewritten or changed after the checkpoint was written" in message
        assert len(cache.graph("t")) == 11  # every acknowledged call, from the new journal
        assert "now" in cache.nondeterministic_tools
        assert recovered(cache).from_checkpoint == 0
    finally:
        cache.close()
    assert not (path / "journal.checkpoint.partial").exists()
    assert not (path / CHECKPOINT).exists()
    with Cache(path) as cache:
        cache.compact()
    with opened(path) as cache:
        assert recovered(cache).from_checkpoint == 11
        assert len(cache.graph("t")) == 11


def test_a_kill_halfway_through_a_compaction_keeps_the_old_checkpoint_in_use(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    run_until(KILLED.format(tests=str(Path(__file__).parent), path=str(path), stall=STALL_HALFWAY), "compacting")
    assert (path / Journal.COMPACT).exists()
    assert (path / "journal.checkpoint.partial").exists()
    with opened(path) as cache:  # the journal was never replaced: the old checkpoint still describes its start
        assert cache.recovery is not None
        assert cache.recovery.from_checkpoint == 5
        assert cache.recovery.removed == (str(path / Journal.COMPACT),)
        assert len(cache.graph("t")) == 11
        assert "now" in cache.nondeterministic_tools
    assert not (path / "journal.checkpoint.partial").exists()


# ---------------------------------------------------------------------------------- snapshots and budgets


def test_a_pending_snapshot_whose_storage_is_gone_is_dropped_while_opening(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    populate(path)
    with opened(path) as cache:
        graph = cache.graph("t4")
        gone = Path(next(iter(graph.snapshot_nodes.values())).snapshot.path)  # type: ignore[union-attr]
    gone.unlink()
    expected, expected_recovery = journal_only(path)
    with opened(path) as cache:
        assert cache.recovery is not None
        assert cache.recovery.dropped == (str(gone),) == expected_recovery.dropped
        assert comparable(cache.recovery) == comparable(expected_recovery)
        assert state_of(cache) == expected
    with opened(path) as cache:  # journaled as detached: neither counted again nor looked for
        assert recovered(cache).dropped == ()


def test_the_budget_across_tasks_counts_and_evicts_the_snapshots_of_pending_tasks(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    budget = Budget(max_snapshots_per_task=None, max_snapshots=6, max_bytes=None)
    with Cache(path, snapshot_policy=AlwaysSnapshot(), budget=budget) as cache:
        for task in ("t0", "t1", "t2"):
            rollout(cache, task, chain("a", 2))
        assert cache.stats().snapshots == 6
        cache.compact()
    with opened(path, snapshot_policy=AlwaysSnapshot(), budget=budget) as cache:
        store = store_of(cache)
        rollout(cache, "t0", chain("a", 1))  # a hit: no snapshot taken, nothing read but t0
        assert set(store.pending) == {"t1", "t2"}
        rollout(cache, "t3", chain("b", 1))  # a seventh snapshot: one of the six goes, wherever it is
        assert cache.stats().snapshots == 6
        assert cache.stats().snapshots_evicted == 1
        cache.check_invariants()
    with opened(path) as cache:
        assert cache.stats().snapshots == 6
