"""A snapshot is attached in memory only together with its journal record (issue 19, item 9): a record the
journal cannot take leaves the node as it was, so memory and journal never disagree."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tvcache import Cache, ToolCall
from tvcache.protocol import Outcome, Snapshot


@pytest.mark.parametrize(
    "meta",
    [{"clock": float("nan")}, {"size": float("inf")}, {"layers": {"a", "b"}}],
    ids=["nan", "infinity", "a-set"],
)
def test_a_snapshot_the_journal_refuses_is_not_attached(tmp_path: Path, meta: dict[str, Any]) -> None:
    files = tmp_path / "files"
    files.mkdir()
    (files / "good").write_text("state")
    with Cache(tmp_path / "cache") as cache:
        graph = cache.graph("t")
        node = cache.store.record(
            graph, graph.root, ToolCall("sh", {"cmd": "make"}), Outcome(output="ok"), seconds=1.0, read_only=False
        )
        bad = Snapshot(kind="k", path=str(files / "bad"), bytes=1, meta=meta)
        with pytest.raises((ValueError, TypeError)):
            cache.store.attach_snapshot(graph, node, bad)
        assert node.snapshot is None
        assert (graph.snapshot_bytes, graph.snapshot_nodes) == (0, {})
        assert cache.stats().snapshots == 0
        # The node still takes a snapshot the journal can store, and it survives a reopen.
        good = Snapshot(kind="k", path=str(files / "good"), bytes=5, meta={"n": 1})
        cache.store.attach_snapshot(graph, node, good)
        assert node.snapshot == good
        cache.check_invariants()
    with Cache(tmp_path / "cache") as reopened:
        assert reopened.graph("t").node(node.id).snapshot == good
