"""The append-only journal: round trips, torn tails, corruption, locking, compaction."""

from __future__ import annotations

import subprocess
import sys
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tvcache.errors import JournalError, TVCacheError
from tvcache.journal import Journal, JournalWarning

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
    assert list(opened.load()) == []
    yield opened
    opened.close()


def load_all(directory: Path, *, fsync: bool = False) -> list[dict[str, Any]]:
    """Open, load and close a journal, failing on any JournalWarning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", JournalWarning)
        reopened = Journal(directory, fsync=fsync)
        try:
            return list(reopened.load())
        finally:
            reopened.close()


def write_records(directory: Path, records: list[dict[str, Any]]) -> bytes:
    writer = Journal(directory)
    try:
        assert list(writer.load()) == []
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
        assert list(opened.load()) == [{"i": i} for i in range(index)]
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
    assert list(opened.load()) == []
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


@pytest.mark.parametrize(
    "tail_kind", ["half line", "bad checksum", "bad checksum then half line", "garbage", "blank line"]
)
def test_a_torn_tail_is_skipped_warned_and_truncated(tmp_path: Path, tail_kind: str) -> None:
    intact = write_records(tmp_path, RECORDS[:3])
    path = tmp_path / Journal.FILE
    extra = write_records(tmp_path / "other", [{"t": "n", "id": 9, "out": "x" * 50}])
    half = extra[: len(extra) // 2]
    tail = {
        "half line": half,
        "bad checksum": damaged_copy(extra),
        "bad checksum then half line": damaged_copy(extra) + half,
        "garbage": b"\x00\xff not a record at all",
        "blank line": b"\n",
    }[tail_kind]
    path.write_bytes(intact + tail)

    reopened = Journal(tmp_path)
    with pytest.warns(JournalWarning, match="torn by a crash") as caught:
        loaded = list(reopened.load())
    assert loaded == RECORDS[:3]
    assert str(path) in str(caught[0].message)
    assert path.read_bytes() == intact  # the torn tail is gone, new records start on a clean line
    reopened.append({"after": "crash"})
    reopened.close()
    assert load_all(tmp_path) == [*RECORDS[:3], {"after": "crash"}]


def test_a_journal_that_is_all_damage_is_truncated_to_empty(tmp_path: Path) -> None:
    path = tmp_path / Journal.FILE
    path.write_bytes(b"12345678 {not json}\npartial")
    reopened = Journal(tmp_path)
    with pytest.warns(JournalWarning, match="skipped 2 damaged record"):
        assert list(reopened.load()) == []
    assert path.read_bytes() == b""
    reopened.append({"fresh": True})
    reopened.close()
    assert load_all(tmp_path) == [{"fresh": True}]


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
    with pytest.warns(JournalWarning, match="skipped 1 damaged record") as caught:
        loaded = list(reopened.load())
    assert loaded == RECORDS[:2] + RECORDS[3:]
    assert "torn" not in str(caught[0].message)
    assert path.stat().st_size == size  # nothing after the damage is cut away
    reopened.append({"later": 1})
    reopened.close()
    again = Journal(tmp_path)
    with pytest.warns(JournalWarning, match="skipped 1 damaged record"):  # until a rewrite compacts it away
        assert list(again.load()) == [*loaded, {"later": 1}]
    again.close()


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
    assert journal.rewrite(iter(compacted)) == 2
    journal.append({"after": "rewrite"})
    assert not journal.path.with_suffix(".compact").exists()
    assert sorted(entry.name for entry in tmp_path.iterdir()) == [Journal.FILE, "lock"]
    journal.close()
    assert load_all(tmp_path) == [*compacted, {"after": "rewrite"}]


def test_rewrite_to_nothing(tmp_path: Path, journal: Journal) -> None:
    journal.append({"a": 1})
    assert journal.rewrite([]) == 0
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
    journal.append({"keep": 2})
    journal.close()
    assert load_all(tmp_path) == [{"keep": 1}, {"keep": 2}]


def test_rewrite_after_close_is_refused(tmp_path: Path) -> None:
    """BUG (pinned): after close() has released the directory lock, rewrite() still replaces the file and
    re-opens it for appending. Whoever took the lock meanwhile loses acknowledged records, and the closed
    journal accepts appends again."""
    closed = Journal(tmp_path)
    list(closed.load())
    closed.append({"a": 1})
    closed.close()
    owner = Journal(tmp_path)
    try:
        list(owner.load())
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
