"""A durable cache under faults: a full disk mid-record, damage inside the journal, and what killed processes
leave behind (orphan snapshot files, an interrupted compaction). Real faults: a full tmpfs, real SIGKILLs."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest

from killed_children import run_until
from tvcache import AlwaysSnapshot, Cache, JournalError, JournalWarning, NeverSnapshot, ToolCall
from tvcache.cli import main as cli_main
from tvcache.journal import Journal
from tvcache.recovery import LostCalls

from kvstore import KVFactory

PAGE = 4096

# ----------------------------------------------------------------------------------------------- helpers


def run(cache: Cache, calls: list[tuple[str, dict[str, Any]]], *, task: str = "t") -> list[Any]:
    async def rollout() -> list[Any]:
        async with cache.session(task, sandbox=KVFactory()) as session:
            return [await session.call(name, args) for name, args in calls]

    return asyncio.run(rollout())


def is_hit(cache: Cache, calls: list[tuple[str, dict[str, Any]]], *, task: str = "t") -> bool:
    return cache.graph(task).match([ToolCall(name, args) for name, args in calls]).hit


def open_quietly(path: Path, **options: Any) -> Cache:
    """Open a cache, failing on any warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return Cache(path, **options)


def open_warned(path: Path, **options: Any) -> tuple[Cache, str]:
    """Open a cache that must say exactly one thing: one JournalWarning, nothing else."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = Cache(path, **options)
    assert [warning.category for warning in caught] == [JournalWarning], [str(w.message) for w in caught]
    return cache, str(caught[0].message)


def journal_lines(path: Path) -> list[bytes]:
    return (path / "journal.log").read_bytes().splitlines(keepends=True)


def rewrite_line(path: Path, index: int, change: Any) -> bytes:
    """Apply ``change`` to line ``index`` of the journal in place (same file otherwise); returns the new line."""
    lines = journal_lines(path)
    lines[index] = change(lines[index])
    (path / "journal.log").write_bytes(b"".join(lines))
    return lines[index]


def flip_middle_byte(line: bytes) -> bytes:
    middle = len(line) // 2
    return line[:middle] + bytes([line[middle] ^ 0x01]) + line[middle + 1 :]


def line_of(path: Path, predicate: Any) -> int:
    for index, line in enumerate(journal_lines(path)):
        if predicate(json.loads(line[9:])):
            return index
    raise AssertionError("no such record")


# --------------------------------------------------------------------------------------- a full disk


def fill(filesystem: Path, *, leave: int) -> Path:
    """Fill ``filesystem`` to the last page, then free ``leave`` bytes (whole pages); returns the filler."""
    filler = filesystem / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while True:
            try:
                if os.write(fd, b"f" * PAGE) < PAGE:
                    break
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
                break
        size = os.fstat(fd).st_size
        os.ftruncate(fd, size - size % PAGE - leave)
    finally:
        os.close(fd)
    return filler


def test_a_record_cut_short_by_a_full_disk_leaves_the_journal_as_it_was(tiny_filesystem: Path) -> None:
    """The issue's repro: with 8 KiB free a 40 KB record is written only in part. The fragment must not stay in
    the journal, or the next acknowledged records glue onto it and are lost on reopen."""
    path = tiny_filesystem / "cache"
    cache = Cache(path, snapshot_policy=NeverSnapshot())
    try:
        run(cache, [("set", {"key": "a", "value": 1})])
        before = (path / "journal.log").read_bytes()
        filler = fill(tiny_filesystem, leave=2 * PAGE)
        with pytest.raises(JournalError) as caught:
            run(cache, [("set", {"key": "a", "value": 1}), ("set", {"key": "big", "value": "x" * 40_000})])
        assert (path / "journal.log").read_bytes() == before
        assert "nothing was recorded" in str(caught.value)
        assert not is_hit(cache, [("set", {"key": "a", "value": 1}), ("set", {"key": "big", "value": "x" * 40_000})])
        filler.unlink()
        smalls = [[("set", {"key": "a", "value": 1}), ("set", {"key": f"small-{i}", "value": i})] for i in (1, 2, 3)]
        for calls in smalls:
            run(cache, calls)  # acknowledged
    finally:
        cache.close()
    reopened = open_quietly(path)
    try:
        assert all(is_hit(reopened, calls) for calls in smalls)
        assert reopened.recovery is not None
        assert not reopened.recovery.lost_records
    finally:
        reopened.close()


def test_a_full_disk_with_no_byte_free_is_a_journal_error(tiny_filesystem: Path) -> None:
    """When not one byte fits, os.write raises ENOSPC itself; it reaches callers as a JournalError (which a
    server answers with 503), not as a raw OSError."""
    path = tiny_filesystem / "cache"
    cache = Cache(path, snapshot_policy=NeverSnapshot())
    try:
        run(cache, [("set", {"key": "a", "value": 1})])
        # pad the journal to whole pages, so that a full filesystem has no slack left in its last page either
        size = (path / "journal.log").stat().st_size
        empty_mark = len(b'00000000 {"t":"nondet","tool":"pad","why":""}\n')
        with pytest.warns(UserWarning, match="non-deterministic"):
            cache.mark_nondeterministic("pad", "p" * (-(size + empty_mark) % PAGE))
        assert (path / "journal.log").stat().st_size % PAGE == 0
        before = (path / "journal.log").read_bytes()
        filler = fill(tiny_filesystem, leave=0)
        with pytest.raises(JournalError, match="No space left on device"):
            run(cache, [("set", {"key": "a", "value": 1}), ("set", {"key": "b", "value": 2})])
        assert (path / "journal.log").read_bytes() == before
        filler.unlink()
        run(cache, [("set", {"key": "a", "value": 1}), ("set", {"key": "b", "value": 2})])
    finally:
        cache.close()
    reopened = open_quietly(path)
    try:
        assert is_hit(reopened, [("set", {"key": "a", "value": 1}), ("set", {"key": "b", "value": 2})])
    finally:
        reopened.close()


def test_a_cache_due_for_compaction_still_opens_on_a_full_disk(tiny_filesystem: Path, tmp_path: Path) -> None:
    """Compaction on open is optional: when the disk has no room for the compacted copy, the journal is whole as
    it is, so the cache opens (a durable server restarting on a full disk comes up) and says why it did not
    compact."""
    source = tmp_path / "source"
    with Cache(source, snapshot_policy=NeverSnapshot()) as cache, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(cache, [("set", {"key": "a", "value": 1})])
        for _ in range(520):  # superseded records: 1,040 of them against 1 live node
            cache.mark_nondeterministic("x", "r")
            cache.clear_nondeterministic("x")
    path = tiny_filesystem / "cache"
    path.mkdir()
    (path / "journal.log").write_bytes((source / "journal.log").read_bytes())
    filler = fill(tiny_filesystem, leave=0)
    try:
        cache, message = open_warned(path)
        try:
            assert "opening without compacting" in message
            assert is_hit(cache, [("set", {"key": "a", "value": 1})])
            assert not (path / "journal.compact").exists()
        finally:
            cache.close()
    finally:
        filler.unlink()


# ---------------------------------------------------------------------------------- damage in the middle

CHAIN = [("set", {"key": f"k{step}", "value": step}) for step in range(22)]


def test_damage_to_a_node_reports_the_subtree_it_takes_in_one_warning(tmp_path: Path) -> None:
    """One flipped byte in the record of a depth-1 node loses the 21 calls below it: the warning counts them
    (not one "does not apply" line per record), and new nodes stay off the ids the lost records use."""
    path = tmp_path / "cache"
    with Cache(path, snapshot_policy=NeverSnapshot()) as cache:
        run(cache, CHAIN)
    rewrite_line(path, line_of(path, lambda record: record.get("id") == 1), flip_middle_byte)

    cache, message = open_warned(path)
    try:
        assert "1 damaged record(s) were skipped (line 1 at byte 0" in message
        assert "21 acknowledged call(s) recorded below missing nodes are lost" in message
        assert "21 in task 't' below missing node 1 (nodes 2-22)" in message
        assert "stay in the journal" in message
        recovery = cache.recovery
        assert recovery is not None
        assert recovery.lost == (LostCalls(task_id="t", below=1, nodes=tuple(range(2, 23))),)
        assert recovery.lost_calls == 21
        assert (recovery.damaged[0].line, recovery.damaged[0].kind) == (1, "n")
        assert len(cache.graph("t")) == 1
        assert cache.graph("t").next_id == 23  # a restored line 1 could not graft new calls under an old id
        run(cache, CHAIN[:2])
        assert {node.id for node in cache.graph("t").nodes()} == {0, 23, 24}
        cache.check_invariants()
    finally:
        cache.close()


def test_damage_to_the_last_complete_line_is_kept_not_truncated(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    with Cache(path, snapshot_policy=NeverSnapshot()) as cache:
        run(cache, CHAIN[:3])
    damaged = rewrite_line(path, -1, flip_middle_byte)
    size = (path / "journal.log").stat().st_size

    cache, message = open_warned(path)
    try:
        assert "line 3" in message
        assert "truncated" not in message
        assert (path / "journal.log").stat().st_size == size
        run(cache, [*CHAIN[:2], ("set", {"key": "other", "value": 0})])
    finally:
        cache.close()
    assert damaged in journal_lines(path)
    cache, message = open_warned(path)  # still reported: nothing but a compaction removes it
    cache.close()
    assert "line 3" in message


def test_compaction_copies_the_damage_and_what_it_took_aside(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    with Cache(path, snapshot_policy=NeverSnapshot()) as cache:
        run(cache, CHAIN[:5])
    lines = journal_lines(path)
    damaged = rewrite_line(path, 1, flip_middle_byte)  # node 2: nodes 3-5 hang below it

    cache, _ = open_warned(path)
    try:
        with pytest.warns(JournalWarning, match="copies are in .*journal.damaged-") as caught:
            assert cache.compact() == 1
        copy = Path(str(caught[0].message).rsplit("copies are in ", 1)[1])
        assert copy.read_bytes() == damaged + b"".join(lines[2:5])  # byte for byte, in journal order
        assert cache.recovery is not None
        assert cache.recovery.set_aside == (str(copy),)
    finally:
        cache.close()
    with open_quietly(path) as reopened:
        assert len(reopened.graph("t")) == 2
    assert cli_main(["inspect", str(path)]) == 0


def test_compaction_on_open_copies_the_damage_aside_and_says_so_in_its_one_warning(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    with Cache(path, snapshot_policy=NeverSnapshot()) as cache:
        run(cache, CHAIN[:3])
    journal = Journal(path)
    for _ in journal.load():
        pass
    for _ in range(1100):  # dead weight: opening compacts the journal
        journal.append({"t": "x", "task": "t", "id": 0})
    journal.close()
    damaged = rewrite_line(path, 1, flip_middle_byte)
    node_3 = journal_lines(path)[2]

    cache, message = open_warned(path)
    try:
        assert "1 acknowledged call(s) recorded below missing nodes are lost" in message
        assert "a compaction removed the damaged lines and the records that depended on them" in message
        copy = Path(message.rsplit("copies are in ", 1)[1].rstrip("."))
        assert copy.read_bytes() == damaged + node_3
        assert len(journal_lines(path)) == 1
    finally:
        cache.close()
    with open_quietly(path) as reopened:
        assert len(reopened.graph("t")) == 2


def test_inspect_fails_on_a_damaged_journal_and_says_what_is_damaged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cache"
    with Cache(path, snapshot_policy=NeverSnapshot()) as cache:
        run(cache, CHAIN)
    assert cli_main(["inspect", str(path)]) == 0
    capsys.readouterr()
    rewrite_line(path, 0, flip_middle_byte)

    assert cli_main(["inspect", str(path)]) == 1
    out, err = capsys.readouterr()
    assert "line 1 at byte 0: a call record" in err
    assert "21 acknowledged call(s)" in err
    report = json.loads(out)
    assert report["journal"]["lost"] == [{"task_id": "t", "below": 1, "nodes": list(range(2, 23))}]
    assert report["journal"]["damaged"][0]["line"] == 1
    assert cli_main(["inspect", str(tmp_path / "nothing here")]) == 2
    assert not (tmp_path / "nothing here").exists()


# ----------------------------------------------------------------------------- damaged non-determinism marks


def marked_cache(path: Path) -> None:
    """A cache that has called ``keys`` and then marked it non-deterministic."""
    with Cache(path, snapshot_policy=NeverSnapshot()) as cache:
        run(cache, [("set", {"key": "a", "value": 1}), ("keys", {})])
        with pytest.warns(UserWarning, match="non-deterministic"):
            cache.mark_nondeterministic("keys", "declared by the test")


def keys_is_served_from_cache(cache: Cache) -> bool:
    return bool(run(cache, [("set", {"key": "a", "value": 1}), ("keys", {})])[1].hit)


def is_mark(record: dict[str, Any]) -> bool:
    return record.get("t") == "nondet"


@pytest.mark.parametrize(
    ("change", "recovered"),
    [
        (lambda line: line.replace(b"declared", b"declarex"), ("keys",)),  # the evidence text
        (lambda line: line.replace(b'"keys"', b'"keyz"'), ("keyz", "keys")),  # the tool's name itself
        (lambda line: line.replace(b'"t":"nondet"', b'"t":"nondeu"'), ("keys",)),  # the record's kind
        (lambda line: line.replace(b'"tool":', b'"tool"?'), ("keys",)),  # its JSON (the name still reads)
    ],
    ids=["reason", "tool name", "kind", "syntax"],
)
def test_a_damaged_mark_keeps_the_tool_uncached(tmp_path: Path, change: Any, recovered: tuple[str, ...]) -> None:
    path = tmp_path / "cache"
    marked_cache(path)
    rewrite_line(path, line_of(path, is_mark), change)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = Cache(path)
    try:
        assert "keys" in cache.nondeterministic_tools
        assert not keys_is_served_from_cache(cache)
        assert [warning.category for warning in caught] == [JournalWarning]
        message = str(caught[0].message)
        assert "line 3 at byte" in message
        assert "marked again, in every task: " + ", ".join(map(repr, recovered)) in message
        assert cache.recovery is not None
        assert cache.recovery.recovered_marks == recovered
        with pytest.warns(JournalWarning, match="copies are in"):
            cache.compact()  # drops the damaged line: the mark written in its place keeps the evidence
    finally:
        cache.close()
    with open_quietly(path) as reopened:
        assert "keys" in reopened.nondeterministic_tools
        assert not keys_is_served_from_cache(reopened)


@pytest.mark.parametrize("flipped", [b"\x0b", b"\x00", b" "], ids=["vt", "nul", "space"])
def test_a_damaged_newline_between_records_loses_neither(tmp_path: Path, flipped: bytes) -> None:
    """One flipped byte where a newline stood merges two records into one line that fails its checksum; read as
    one damaged record, it hid the intact mark behind its neighbour (a tool known non-deterministic served from
    cache again). Both records are intact but for that byte: both come back."""
    path = tmp_path / "cache"
    marked_cache(path)
    index = line_of(path, is_mark)
    data = (path / "journal.log").read_bytes()
    lines = journal_lines(path)
    boundary = sum(len(line) for line in lines[:index]) - 1  # the newline just before the mark's line
    assert data[boundary : boundary + 1] == b"\n"
    (path / "journal.log").write_bytes(data[:boundary] + flipped + data[boundary + 1 :])
    with open_quietly(path) as cache:
        assert "keys" in cache.nondeterministic_tools
        assert not keys_is_served_from_cache(cache)
        assert cache.graph("t").match([ToolCall("set", {"key": "a", "value": 1})]).hit  # the record before it


def test_a_cleared_mark_is_not_brought_back_by_its_damaged_record(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    marked_cache(path)
    rewrite_line(path, line_of(path, is_mark), lambda line: line.replace(b"declared", b"declarex"))
    cache, _ = open_warned(path)
    try:
        assert cache.clear_nondeterministic("keys") == 1
    finally:
        cache.close()
    cache, message = open_warned(path)  # the damage is still reported, but the later clear stands
    try:
        assert "marked again" not in message
        assert "keys" not in cache.nondeterministic_tools
    finally:
        cache.close()


def test_a_damaged_mark_whose_tool_cannot_be_read_refuses_to_open(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cache"
    marked_cache(path)
    index = line_of(path, is_mark)
    rewrite_line(path, index, lambda line: line.replace(b'"t":', b'"u":').replace(b'"tool":', b'"toil":'))

    with pytest.raises(JournalError, match=f"line {index + 1} at byte .*an illegible record.*will not open"):
        Cache(path)
    assert cli_main(["inspect", str(path)]) == 2
    assert "delete it (that accepts the risk)" in capsys.readouterr().err
    lines = journal_lines(path)
    del lines[index]
    (path / "journal.log").write_bytes(b"".join(lines))
    with open_quietly(path) as cache:  # the lock was released by the refusal; the line is gone
        assert keys_is_served_from_cache(cache)


# ------------------------------------------------------------------------------------- killed processes

STALLED_SNAPSHOT = textwrap.dedent(
    """
    import asyncio, sys, threading
    sys.path.insert(0, {tests!r})
    from kvstore import KVSandbox
    from tvcache import AlwaysSnapshot, Cache

    normal = KVSandbox.snapshot
    taken = []

    async def snapshot(self, dest):
        result = await normal(self, dest)
        taken.append(dest)
        if len(taken) == 2:  # the second snapshot is on disk; the process dies before journaling it
            print("written", dest, flush=True)
            threading.Event().wait()
        return result

    KVSandbox.snapshot = snapshot

    async def main():
        from kvstore import KVFactory
        cache = Cache({path!r}, snapshot_policy=AlwaysSnapshot())
        async with cache.session("t", sandbox=KVFactory()) as session:
            await session.call("set", {{"key": "a", "value": 1}})
            await session.call("set", {{"key": "b", "value": 2}})

    asyncio.run(main())
    """
)


def test_a_snapshot_written_but_never_journaled_is_removed_on_open(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    line = run_until(STALLED_SNAPSHOT.format(tests=str(Path(__file__).parent), path=str(path)), "written ")
    orphan = Path(line.split(" ", 1)[1].strip())
    assert orphan.exists()
    partial = orphan.with_name(orphan.name + ".partial")  # what a backend killed mid-copy leaves (sqlite, folder)
    partial.write_bytes(b"half a snapshot")
    strangers = [orphan.parent / "notes.txt", orphan.parent.parent / "README"]  # not named by the cache
    for stranger in strangers:
        stranger.write_text("not the cache's")

    cache = open_quietly(path)
    try:
        graph = cache.graph("t")
        kept = [Path(node.snapshot.path) for node in graph.snapshot_nodes.values() if node.snapshot is not None]
        assert len(kept) == 1
        assert kept[0].exists()
        assert not orphan.exists()
        assert not partial.exists()
        assert all(stranger.exists() for stranger in strangers)
        assert cache.recovery is not None
        assert set(cache.recovery.removed) == {str(orphan), str(partial)}
        assert run(cache, [("set", {"key": "a", "value": 1}), ("get", {"key": "a"})])[1].output == "1"
    finally:
        cache.close()


def test_snapshot_files_are_left_alone_where_a_record_may_still_name_them(tmp_path: Path) -> None:
    """A server's snapshots belong to its clients; and a damaged snapshot record may name any file."""
    path = tmp_path / "cache"
    with Cache(path, snapshot_policy=AlwaysSnapshot()) as cache:
        run(cache, CHAIN[:2])
        files = sorted(Path(node.snapshot.path) for node in cache.graph("t").snapshot_nodes.values() if node.snapshot)
    stray = files[0].with_name("99-0123abcd")
    stray.write_text("{}")
    with Cache(path, verify_snapshots=False) as server_like:
        assert server_like.recovery is not None
        assert server_like.recovery.removed == ()
    assert stray.exists()

    rewrite_line(path, line_of(path, lambda record: record.get("t") == "s"), flip_middle_byte)
    cache, _ = open_warned(path)
    try:
        assert all(file.exists() for file in files)
        assert stray.exists()
        with pytest.warns(JournalWarning, match="copies are in"):
            cache.compact()  # the damaged line moves to a copy beside the journal: it still guards the files
    finally:
        cache.close()
    with open_quietly(path):
        assert all(file.exists() for file in files)
        assert stray.exists()


KILLED_COMPACTION = textwrap.dedent(
    """
    import asyncio, sys, threading
    sys.path.insert(0, {tests!r})
    from kvstore import KVFactory
    from tvcache import Cache, NeverSnapshot

    cache = Cache({path!r}, snapshot_policy=NeverSnapshot())

    async def main():
        for rollout in range(20):
            async with cache.session("t", sandbox=KVFactory()) as session:
                await session.call("set", {{"key": "a", "value": rollout}})

    asyncio.run(main())
    live = cache.store.records

    def records():
        for index, record in enumerate(live()):
            if index == 10:  # half of the copy is written: die before it replaces the journal
                print("compacting", flush=True)
                threading.Event().wait()
            yield record

    cache.store.records = records
    cache.compact()
    """
)


def test_a_compaction_killed_halfway_leaves_nothing_behind(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    run_until(KILLED_COMPACTION.format(tests=str(Path(__file__).parent), path=str(path)), "compacting")
    leftover = path / "journal.compact"
    assert leftover.exists()

    cache = open_quietly(path)
    try:
        assert not leftover.exists()
        assert cache.recovery is not None
        assert cache.recovery.removed == (str(leftover),)
        assert len(cache.graph("t")) == 21
    finally:
        cache.close()
