"""The append-only journal: round trips, torn tails, corruption, locking, compaction."""

from __future__ import annotations

import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tvcache.errors import JournalError, TVCacheError
from tvcache.journal import DamagedLine, Journal, JournalScan, Rewrite, salvage

RECORDS: list[dict[str, Any]] = [
    {"t": "n", "task": "t1", "id": 1, "p": 0, "out": "hello"},
    {"t": "n", "task": "t1", "id": 2, "p": 1, "out": "naïve ☃ \n multi\nline", "err": True},
    {"t": "s", "task": "t1", "id": 2, "snap": {"kind": "x", "path": "/p", "bytes": 12, "meta": {}}},
    {"nested": {"list": [1, 2.5, None, False], "empty": {}}, "unicode": "\u2028\u2029\x00"},
    {},
]


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    opened = Journal(tmp_path)
    assert load(opened) == []
    yield opened
    opened.close()


def load_all(directory: Path, *, fsync: bool = False) -> list[dict[str, Any]]:
    """Open, load and close a journal, failing unless it is clean."""
    reopened = Journal(directory, fsync=fsync)
    try:
        records = load(reopened)
        assert reopened.scan == JournalScan()
        return records
    finally:
        reopened.close()


def load(journal: Journal) -> list[dict[str, Any]]:
    """The records of ``journal`` (line numbers dropped)."""
    return [record for _, record in journal.load()]


def write_records(directory: Path, records: list[dict[str, Any]]) -> bytes:
    writer = Journal(directory)
    try:
        assert load(writer) == []
        for record in records:
            writer.append(record)
    finally:
        writer.close()
    return (directory / Journal.FILE).read_bytes()


# ------------------------------------------------------------------------------------------ round trip


def test_append_and_reload_round_trip(tmp_path: Path, journal: Journal) -> None:
    for record in RECORDS:
        journal.append(record)
    assert journal.records_written == len(RECORDS)
    journal.close()
    assert load_all(tmp_path) == RECORDS
    assert load_all(tmp_path) == RECORDS  # loading does not change a clean journal


def test_file_format_is_one_checksummed_line_per_record(tmp_path: Path, journal: Journal) -> None:
    journal.append({"a": 1})
    journal.append({"b": "two"})
    lines = journal.path.read_bytes().splitlines(keepends=True)
    assert len(lines) == 2
    assert lines[0].endswith(b' {"a":1}\n')
    assert all(len(line.split(b" ", 1)[0]) == 8 for line in lines)


def test_a_fresh_directory_is_created_and_loads_empty(tmp_path: Path) -> None:
    directory = tmp_path / "deep" / "cache"
    assert load_all(directory) == []
    assert (directory / Journal.FILE).exists()


def test_appends_accumulate_across_reopens(tmp_path: Path) -> None:
    for index in range(3):
        opened = Journal(tmp_path)
        assert load(opened) == [{"i": i} for i in range(index)]
        opened.append({"i": index})
        opened.close()
    assert load_all(tmp_path) == [{"i": 0}, {"i": 1}, {"i": 2}]


def test_append_before_load_and_after_close_is_refused(tmp_path: Path) -> None:
    opened = Journal(tmp_path)
    with pytest.raises(JournalError, match="closed \\(or was never loaded\\)"):
        opened.append({"a": 1})
    list(opened.load())
    opened.close()
    opened.close()  # idempotent
    with pytest.raises(JournalError, match="closed"):
        opened.append({"a": 1})
    assert isinstance(JournalError("x"), TVCacheError)


def test_fsync_mode_round_trips(tmp_path: Path) -> None:
    opened = Journal(tmp_path, fsync=True)
    assert load(opened) == []
    for record in RECORDS:
        opened.append(record)
    opened.close()
    assert load_all(tmp_path, fsync=True) == RECORDS


# ---------------------------------------------------------------------------------- damage on disk


def damaged_copy(line: bytes) -> bytes:
    """The same line with one body byte changed: same length, wrong checksum."""
    body_index = 12
    flipped = bytes([line[body_index] ^ 0x01])
    return line[:body_index] + flipped + line[body_index + 1 :]


def torn_copies(directory: Path) -> list[bytes]:
    return [path.read_bytes() for path in sorted(directory.glob("journal.torn-*"))]


@pytest.mark.parametrize("tail_kind", ["half line", "garbage", "zeros"])
def test_a_torn_tail_is_copied_aside_and_truncated(tmp_path: Path, tail_kind: str) -> None:
    intact = write_records(tmp_path, RECORDS[:3])
    path = tmp_path / Journal.FILE
    extra = write_records(tmp_path / "other", [{"t": "n", "id": 9, "out": "x" * 50}])
    tail = {
        "half line": extra[: len(extra) // 2],
        "garbage": b"\x00\xff not a record at all",
        "zeros": b"\x00" * 4096,  # a power cut after the size grew but before the data landed
    }[tail_kind]
    path.write_bytes(intact + tail)

    reopened = Journal(tmp_path)
    assert load(reopened) == RECORDS[:3]
    assert reopened.scan.damaged == ()
    assert reopened.scan.torn_tail == DamagedLine(line=4, offset=len(intact), data=tail)
    assert reopened.scan.set_aside is not None
    assert reopened.scan.set_aside.read_bytes() == tail + b"\n"
    assert path.read_bytes() == intact  # the torn tail is gone, new records start on a clean line
    reopened.append({"after": "crash"})
    reopened.close()
    assert load_all(tmp_path) == [*RECORDS[:3], {"after": "crash"}]
    assert torn_copies(tmp_path) == [tail + b"\n"]


@pytest.mark.parametrize("last_kind", ["bad checksum", "blank line", "bad checksum then half line"])
def test_damage_to_the_last_complete_line_is_kept(tmp_path: Path, last_kind: str) -> None:
    """Only bytes after the last newline can be a write cut short; a complete line that fails its checksum held
    an acknowledged record, and cutting it off would destroy the only copy of what it was."""
    intact = write_records(tmp_path, RECORDS[:3])
    path = tmp_path / Journal.FILE
    extra = write_records(tmp_path / "other", [{"t": "n", "id": 9, "out": "x" * 50}])
    damaged = damaged_copy(extra) if last_kind != "blank line" else b"\n"
    torn = extra[: len(extra) // 2] if last_kind.endswith("half line") else b""
    path.write_bytes(intact + damaged + torn)

    reopened = Journal(tmp_path)
    assert load(reopened) == RECORDS[:3]
    assert reopened.scan.damaged == (DamagedLine(line=4, offset=len(intact), data=damaged),)
    assert (reopened.scan.torn_tail is not None) == bool(torn)
    assert path.read_bytes() == intact + damaged  # only the unfinished write went
    reopened.append({"later": 1})
    reopened.close()
    again = Journal(tmp_path)
    assert load(again) == [*RECORDS[:3], {"later": 1}]
    assert [line.data for line in again.scan.damaged] == [damaged]  # still there, until a rewrite
    again.close()


def test_a_journal_that_is_all_damage_keeps_its_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / Journal.FILE
    path.write_bytes(b"12345678 {not json}\npartial")
    reopened = Journal(tmp_path)
    assert load(reopened) == []
    assert [line.data for line in reopened.scan.damaged] == [b"12345678 {not json}\n"]
    assert reopened.scan.torn_tail is not None
    assert path.read_bytes() == b"12345678 {not json}\n"
    reopened.append({"fresh": True})
    reopened.close()
    again = Journal(tmp_path)
    assert load(again) == [{"fresh": True}]
    again.close()


@pytest.mark.parametrize(
    "damage",
    [
        damaged_copy,
        lambda line: b"zzzzzzzz" + line[8:],  # checksum that is not hex
        lambda line: line[:8] + b"_" + line[9:],  # missing separator
        lambda line: b"%08x [1,2,3]\n" % zlib.crc32(b"[1,2,3]"),  # intact, but not a JSON object
        lambda line: b"\n",
    ],
    ids=["flipped byte", "non-hex checksum", "no separator", "not an object", "empty line"],
)
def test_damage_in_the_middle_is_skipped_and_later_records_load(tmp_path: Path, damage: Any) -> None:
    data = write_records(tmp_path, RECORDS)
    lines = data.splitlines(keepends=True)
    lines[2] = damage(lines[2])
    path = tmp_path / Journal.FILE
    path.write_bytes(b"".join(lines))
    size = path.stat().st_size

    reopened = Journal(tmp_path)
    loaded = load(reopened)
    assert loaded == RECORDS[:2] + RECORDS[3:]
    assert reopened.scan.damaged == (DamagedLine(line=3, offset=len(lines[0]) + len(lines[1]), data=lines[2]),)
    assert reopened.scan.torn_tail is None
    assert path.stat().st_size == size  # nothing after the damage is cut away
    reopened.append({"later": 1})
    reopened.close()
    again = Journal(tmp_path)
    assert load(again) == [*loaded, {"later": 1}]
    assert len(again.scan.damaged) == 1  # until a rewrite compacts it away
    again.close()


def test_line_numbers_come_with_the_records(tmp_path: Path) -> None:
    data = write_records(tmp_path, RECORDS[:3])
    lines = data.splitlines(keepends=True)
    (tmp_path / Journal.FILE).write_bytes(lines[0] + b"\n" + lines[1] + lines[2])
    reopened = Journal(tmp_path)
    assert list(reopened.load()) == [(1, RECORDS[0]), (3, RECORDS[1]), (4, RECORDS[2])]
    reopened.close()


def test_salvage_reads_what_is_legible_of_a_damaged_line(tmp_path: Path) -> None:
    line = write_records(tmp_path, [{"t": "nondet", "tool": "now", "why": "replay of node 3", "task": "t"}])
    reworded = line.replace(b"node", b"mode")  # the checksum no longer matches, the JSON still parses
    assert salvage(reworded) == {"t": "nondet", "tool": "now", "why": "replay of mode 3", "task": "t"}
    assert salvage(damaged_copy(line)) == {"tool": "now", "task": "t"}  # the flipped byte broke the kind's quote
    broken = line.replace(b'"why":"', b'"why"?"')  # no longer JSON: the fields that still read are kept
    assert salvage(broken) == {"t": "nondet", "tool": "now", "task": "t"}
    call = write_records(tmp_path / "call", [{"t": "n", "task": "t", "id": 4, "p": 1, "name": "set", "a": "{}"}])
    assert salvage(call.replace(b'"p":1,', b'"p":1;')) == {"t": "n", "task": "t", "name": "set", "id": 4}
    assert salvage(b"\x00\xff\n") == {}


# ------------------------------------------------------------------------------------------ locking


def test_a_second_journal_in_the_same_process_is_refused(tmp_path: Path, journal: Journal) -> None:
    with pytest.raises(JournalError, match="tvcache serve") as caught:
        Journal(tmp_path)
    assert str(tmp_path) in str(caught.value)
    journal.append({"still": "usable"})
    journal.close()
    assert load_all(tmp_path) == [{"still": "usable"}]  # the lock is released by close()


def test_a_journal_held_by_another_process_is_refused(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\n"
            "from tvcache.journal import Journal\n"
            "journal = Journal(sys.argv[1])\n"
            "list(journal.load())\n"
            "journal.append({'from': 'holder'})\n"
            "print('ready', flush=True)\n"
            "sys.stdin.readline()\n"
            "journal.close()\n",
            str(tmp_path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "ready\n"
        with pytest.raises(JournalError, match="in use by another process.*tvcache serve"):
            Journal(tmp_path)
    finally:
        holder.communicate("done\n", timeout=30)
    assert holder.returncode == 0
    assert load_all(tmp_path) == [{"from": "holder"}]


# ----------------------------------------------------------------------------------------- rewrite


def test_rewrite_replaces_contents_and_later_appends_follow(tmp_path: Path, journal: Journal) -> None:
    for record in RECORDS:
        journal.append(record)
    compacted = [{"compacted": 1}, {"compacted": 2}]
    assert journal.rewrite(iter(compacted)) == Rewrite(records=2, set_aside=None)
    journal.append({"after": "rewrite"})
    assert not journal.path.with_suffix(".compact").exists()
    assert sorted(entry.name for entry in tmp_path.iterdir()) == [Journal.FILE, "lock"]
    journal.close()
    assert load_all(tmp_path) == [*compacted, {"after": "rewrite"}]


def test_rewrite_to_nothing(tmp_path: Path, journal: Journal) -> None:
    journal.append({"a": 1})
    assert journal.rewrite([]).records == 0
    assert journal.path.read_bytes() == b""
    journal.append({"b": 2})
    journal.close()
    assert load_all(tmp_path) == [{"b": 2}]


def test_a_failed_rewrite_leaves_the_journal_intact(tmp_path: Path, journal: Journal) -> None:
    journal.append({"keep": 1})

    def broken() -> Iterator[dict[str, Any]]:
        yield {"partial": 1}
        raise RuntimeError("compaction failed")

    with pytest.raises(RuntimeError, match="compaction failed"):
        journal.rewrite(broken())
    assert not (tmp_path / Journal.COMPACT).exists()
    journal.append({"keep": 2})
    journal.close()
    assert load_all(tmp_path) == [{"keep": 1}, {"keep": 2}]


def test_rewrite_after_close_is_refused(tmp_path: Path) -> None:
    """BUG (pinned): after close() has released the directory lock, rewrite() still replaces the file and
    re-opens it for appending. Whoever took the lock meanwhile loses acknowledged records, and the closed
    journal accepts appends again."""
    closed = Journal(tmp_path)
    load(closed)
    closed.append({"a": 1})
    closed.close()
    owner = Journal(tmp_path)
    try:
        load(owner)
        owner.append({"acknowledged": True})
        with pytest.raises(JournalError):
            closed.rewrite([{"stale": 1}])
        with pytest.raises(JournalError):
            closed.append({"stale": 2})
        owner.close()
        assert load_all(tmp_path) == [{"a": 1}, {"acknowledged": True}]
    finally:
        closed.close()
        owner.close()


def test_rewrite_copies_damaged_lines_and_lost_records_aside(tmp_path: Path) -> None:
    data = write_records(tmp_path, RECORDS[:4])
    lines = data.splitlines(keepends=True)
    lines[1] = damaged_copy(lines[1])
    (tmp_path / Journal.FILE).write_bytes(b"".join(lines))
    reopened = Journal(tmp_path)
    loaded = list(reopened.load())
    # the caller found that the record of line 3 no longer applies (it hung below the damaged one)
    result = reopened.rewrite([RECORDS[0]], lost=[(3, RECORDS[2])])
    assert result.records == 1
    assert result.set_aside is not None
    assert result.set_aside.name.startswith("journal.damaged-")
    assert result.set_aside.read_bytes() == lines[1] + lines[2]  # in journal order, byte for byte
    assert reopened.scan == JournalScan()  # the damage left the journal with the rewrite
    assert reopened.rewrite([RECORDS[0]]).set_aside is None  # and is not copied twice
    reopened.close()
    assert loaded[0] == (1, RECORDS[0])
    assert load_all(tmp_path) == [RECORDS[0]]


def test_a_compaction_left_by_a_kill_is_removed_on_load(tmp_path: Path) -> None:
    """A rewrite is killed before it replaces the journal: ``journal.compact`` holds part of a copy and the
    journal itself is whole. (The state is built exactly as such a kill leaves it; tests/test_journal_faults.py
    kills a real compaction.)"""
    write_records(tmp_path, RECORDS[:2])
    leftover = tmp_path / Journal.COMPACT
    leftover.write_bytes(b'0badc0de {"half":')
    reopened = Journal(tmp_path)
    assert load(reopened) == RECORDS[:2]
    assert reopened.scan.removed == (leftover,)
    assert not leftover.exists()
    reopened.close()
