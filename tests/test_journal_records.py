"""The typed journal records write exactly the lines the untyped dicts did, and read them back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tvcache import Cache, ToolCall
from tvcache.journal import Journal
from tvcache.protocol import Outcome, Snapshot
from tvcache.store.records import parse

# One line of each kind, as journals written before the records were typed hold them (keys in writing order).
OLD_LINES: list[dict[str, Any]] = [
    {"t": "nondet", "tool": "sh", "why": "a replay of node 3 gave another result"},
    {"t": "nondet", "tool": "sh", "why": "audit", "task": "t"},
    {"t": "det", "tool": "sh", "task": None},
    {"t": "det", "tool": "sh", "task": "t"},
    {"t": "checked", "task": "t", "tool": "ls"},
    {"t": "n", "task": "t", "id": 1, "p": 0, "name": "sh", "a": '{"cmd":"make"}', "o": "ok", "e": False,
     "s": 1.5, "r": False},
    {"t": "s", "task": "t", "id": 1, "snap": {"kind": "k", "path": "/p", "bytes": 3, "meta": {"n": 1}}},
    {"t": "x", "task": "t", "id": 1},
    {"t": "test", "task": "t", "id": 1, "k": "reward", "v": [1, {"a": None}]},
    {"t": "rm", "task": "t", "id": 1},
]  # fmt: skip


@pytest.mark.parametrize("line", OLD_LINES, ids=[f"{line['t']}-{index}" for index, line in enumerate(OLD_LINES)])
def test_a_record_writes_back_the_line_it_was_read_from(line: dict[str, Any]) -> None:
    written = parse(line).to_json()
    assert json.dumps(written) == json.dumps(line)  # same keys, same order, same values


@pytest.mark.parametrize(
    "line",
    [{"t": "zz", "task": "t"}, {"t": "n", "task": "t", "id": 1}, {"tool": "sh"}, {"t": "s", "task": "t", "id": 1}],
)
def test_a_malformed_record_is_refused_as_before(line: dict[str, Any]) -> None:
    with pytest.raises((KeyError, TypeError, ValueError)):
        parse(line)


def test_a_journal_written_through_the_store_reloads_the_same_state(tmp_path: Path) -> None:
    files = tmp_path / "files"
    files.mkdir()
    (files / "snap").write_text("state")
    with Cache(tmp_path / "cache") as cache:
        store, graph = cache.store, cache.graph("t")
        node = store.record(graph, graph.root, ToolCall("sh", {"cmd": "make"}), Outcome(output="ok"), seconds=1.0,
                            read_only=False)  # fmt: skip
        store.record_test(graph, node, "reward", {"score": 1})
        snapshot = Snapshot(kind="k", path=str(files / "snap"), bytes=5)
        assert store.attach_snapshot(graph, node, snapshot).attached
        lines = (tmp_path / "cache" / Journal.FILE).read_bytes().splitlines()
    kinds = [json.loads(line[9:])["t"] for line in lines]
    assert kinds == ["n", "test", "s"]
    with Cache(tmp_path / "cache") as reopened:
        again = reopened.graph("t").node(node.id)
        assert (again.output, again.tests, again.snapshot) == ("ok", {"reward": {"score": 1}}, snapshot)
