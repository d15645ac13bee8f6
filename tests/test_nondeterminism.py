"""Non-determinism marks scoped to the task that showed them, and the first-hit check of undeclared tools
(issue 19, items 2 and 3). The KV store's tools are redeclared through ``Cache(tools=...)``: ``now`` (a clock,
read-only) and ``stamp`` (a clock written into the state) as nobody declared them, the others as deterministic."""

from __future__ import annotations

import asyncio
import json
import warnings
import zlib
from pathlib import Path

import pytest

from tvcache import Cache, NeverSnapshot, NondeterminismMark, NondeterminismWarning, ToolSpec
from tvcache.cli import main as cli

from kvstore import TOOLS, KVFactory

UNDECLARED = [
    ToolSpec(name="now", read_only=True, arguments={}),  # like mcp-server-time's get_current_time
    ToolSpec(name="stamp", arguments={"key": str}),
    ToolSpec(name="get", arguments={"key": str}),  # deterministic, but nobody said so
]


async def run(cache: Cache, factory: KVFactory, calls: list[tuple[str, dict]], task: str = "t") -> list:
    async with cache.session(task, sandbox=factory) as session:
        return [await session.call(name, args) for name, args in calls]


def rollout(cache: Cache, factory: KVFactory, calls: list[tuple[str, dict]], task: str = "t") -> list:
    return asyncio.run(run(cache, factory, calls, task))


# ------------------------------------------------------------------ the first-hit check (item 3)


def test_a_read_only_clock_nobody_declared_is_caught_at_its_first_hit() -> None:
    cache, factory = Cache(tools=UNDECLARED), KVFactory()
    (first,) = rollout(cache, factory, [("now", {})])
    with pytest.warns(NondeterminismWarning, match="'now' is non-deterministic in task 't'"):
        (second,) = rollout(cache, factory, [("now", {})])
    # Executed once more and compared: the fresh time is returned, not the cached one.
    assert second.output != first.output
    assert (second.hit, second.cached) == (False, False)
    (finding,) = cache.findings
    assert (finding.source, finding.cached_output, finding.fresh_output) == ("first-hit", first.output, second.output)
    assert cache.stats().nondeterministic == (NondeterminismMark(tool="now", task_id="t", reason=finding_reason()),)
    (third,) = rollout(cache, factory, [("now", {})])
    assert (third.hit, third.cached) == (False, False)  # marked in this task: executed every time


def finding_reason() -> str:
    return "the first-hit check of node 1 gave another result"


def test_the_check_runs_once_per_tool_and_task_and_agreeing_costs_one_execution() -> None:
    cache, factory = Cache(tools=UNDECLARED), KVFactory({"a": 1})
    calls = [("get", {"key": "a"}), ("get", {"key": "b"}), ("keys", {})]
    rollout(cache, factory, calls)
    factory.executed.clear()
    second = rollout(cache, factory, calls)
    assert [r.output for r in second] == ["1", "None", "a"]
    assert [(r.hit, r.verified) for r in second] == [(False, True), (True, False), (True, False)]
    assert factory.executed == {"get": 1}  # the first hit of the undeclared get; keys is declared deterministic
    third = rollout(cache, factory, calls)
    assert [r.hit for r in third] == [True, True, True]
    assert factory.executed == {"get": 1}
    rollout(cache, factory, calls, task="u")  # another task: its own first hit is checked again
    factory.executed.clear()
    other = rollout(cache, factory, calls, task="u")
    assert [r.verified for r in other] == [True, False, False]
    assert factory.executed == {"get": 1}
    stats = cache.stats()
    assert (stats.verified, stats.nondeterministic) == (2, ())
    assert stats.hit_rate == 7 / 15  # a verified call was executed: it saved nothing


def test_a_state_changing_call_is_checked_where_it_was_made_and_stays_exact() -> None:
    cache, factory = Cache(tools=UNDECLARED, snapshot_policy=NeverSnapshot()), KVFactory()
    calls = [("set", {"key": "a", "value": 1}), ("stamp", {"key": "s"}), ("get", {"key": "s"})]
    first = rollout(cache, factory, calls)
    with pytest.warns(NondeterminismWarning, match="'stamp' is non-deterministic in task 't'"):
        second = rollout(cache, factory, calls)
    assert second[0].hit
    # The stamp ran in the live sandbox brought to the state after `set`: a fresh stamp, and the read after
    # it reads that stamp, as uncached execution of the same calls would.
    assert second[1].output != first[1].output
    assert second[2].output == second[1].output.removeprefix("stamped ")
    assert [r.cached for r in second] == [True, False, False]


def test_declared_tools_and_a_cache_with_checks_off_are_not_checked() -> None:
    declared = Cache(tools=[ToolSpec(name="now", read_only=True, deterministic=True)])
    unchecked = Cache(tools=UNDECLARED, verify_undeclared=False)
    for cache in (declared, unchecked):
        factory = KVFactory()
        (first,) = rollout(cache, factory, [("now", {})])
        (second,) = rollout(cache, factory, [("now", {})])
        assert second.hit
        assert second.output == first.output  # trusted: what a declaration (or turning the check off) means
        assert factory.started == 1  # a hit needs no sandbox
        assert cache.stats().verified == 0


def test_only_one_of_many_concurrent_first_hits_runs_the_check() -> None:
    cache, factory = Cache(tools=UNDECLARED), KVFactory({"a": 1})
    rollout(cache, factory, [("get", {"key": "a"})])
    factory.executed.clear()

    async def group() -> list:
        return await asyncio.gather(*(run(cache, factory, [("get", {"key": "a"})]) for _ in range(4)))

    results = [r for rollout_results in asyncio.run(group()) for r in rollout_results]
    assert factory.executed == {"get": 1}
    assert sorted(r.verified for r in results) == [False, False, False, True]
    assert {r.output for r in results} == {"1"}


# ------------------------------------------------------------------ marks scoped to the evidence (item 2)


def test_a_divergence_in_one_task_leaves_the_tool_cached_in_the_others() -> None:
    lying = [ToolSpec(name="stamp", deterministic=True, arguments={"key": str})]  # mis-declared
    cache, factory = Cache(tools=lying, snapshot_policy=NeverSnapshot()), KVFactory()
    calls = [("stamp", {"key": "s"}), ("get", {"key": "s"})]
    for task in ("t", "u"):
        rollout(cache, factory, calls, task=task)
    with pytest.warns(NondeterminismWarning):  # a miss in t replays the stamp, which gives another result
        rollout(cache, factory, [("stamp", {"key": "s"}), ("incr", {"key": "x"})], task="t")
    in_u = rollout(cache, factory, calls, task="u")
    assert [r.hit for r in in_u] == [True, True]  # an exact repeat elsewhere is still served
    assert [(m.tool, m.task_id) for m in cache.nondeterministic_marks()] == [("stamp", "t")]
    assert cache.nondeterministic_tools == {}
    in_t = rollout(cache, factory, calls, task="t")
    assert [r.cached for r in in_t] == [False, False]


def test_marks_can_be_cleared_by_tool_and_task() -> None:
    cache, factory = Cache(tools=UNDECLARED), KVFactory()
    for task in ("t", "u"):
        rollout(cache, factory, [("now", {})], task=task)
        with pytest.warns(NondeterminismWarning):
            rollout(cache, factory, [("now", {})], task=task)
    with pytest.warns(NondeterminismWarning):
        cache.mark_nondeterministic("get", "declared by hand")
    assert len(cache.nondeterministic_marks()) == 3
    assert [m.tool for m in cache.nondeterministic_marks("t")] == ["get", "now"]
    assert cache.clear_nondeterministic("now", task_id="t") == 1
    assert [(m.tool, m.task_id) for m in cache.nondeterministic_marks()] == [("get", None), ("now", "u")]
    # Cached again in t, and checked again at its next first hit there (which catches it once more).
    with pytest.warns(NondeterminismWarning):
        (again,) = rollout(cache, factory, [("now", {})], task="t")
    assert again.cached is False
    assert cache.clear_nondeterministic() == 3
    assert cache.nondeterministic_marks() == []


# ------------------------------------------------------------------ durability and old journals


def _journal_line(record: dict) -> bytes:
    body = json.dumps(record, separators=(",", ":")).encode()
    return b"%08x " % zlib.crc32(body) + body + b"\n"


def test_marks_and_clears_survive_a_restart_and_old_tool_wide_records_still_load(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    path.mkdir()
    # A journal written before marks were scoped: the record names no task, so it still means every task.
    (path / "journal.log").write_bytes(_journal_line({"t": "nondet", "tool": "keys", "why": "old evidence"}))
    with Cache(path, tools=UNDECLARED) as cache:
        assert cache.nondeterministic_tools == {"keys": "old evidence"}
        factory = KVFactory()
        rollout(cache, factory, [("now", {}), ("get", {"key": "a"})])
        with pytest.warns(NondeterminismWarning):
            rollout(cache, factory, [("now", {}), ("get", {"key": "a"})])
        assert cache.clear_nondeterministic("keys") == 1
    with Cache(path, tools=UNDECLARED) as cache:
        assert [(m.tool, m.task_id) for m in cache.nondeterministic_marks()] == [("now", "t")]
        cache.compact()
    with Cache(path, tools=UNDECLARED) as cache:
        assert [(m.tool, m.task_id) for m in cache.nondeterministic_marks()] == [("now", "t")]


def test_the_cli_lists_and_clears_marks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cache"
    with Cache(path, tools=UNDECLARED) as cache, warnings.catch_warnings():
        warnings.simplefilter("ignore", NondeterminismWarning)
        for task in ("t", "u"):
            rollout(cache, KVFactory(), [("now", {})], task=task)
            rollout(cache, KVFactory(), [("now", {})], task=task)
    assert cli(["nondeterminism", str(path)]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(m["tool"], m["task"]) for m in listed["marks"]] == [("now", "t"), ("now", "u")]
    assert cli(["nondeterminism", str(path), "--task", "u", "--clear"]) == 0
    assert json.loads(capsys.readouterr().out)["cleared"] == 1
    with Cache(path) as cache:
        assert [(m.tool, m.task_id) for m in cache.nondeterministic_marks()] == [("now", "t")]


def test_the_store_backend_declares_its_tools() -> None:
    # The core tests count executions on the KV store; they rely on its tools being declared (see kvstore.py).
    assert all(spec.deterministic is not None for spec in TOOLS.values())


def test_adapters_open_caches_with_the_checks_they_are_given(tmp_path: Path) -> None:
    from tvcache.errors import InvalidInput
    from tvcache.integrations import open_cache

    for where in (None, tmp_path / "cache"):
        cache = open_cache(where, audit_rate=0.25, verify_undeclared=False)
        assert isinstance(cache, Cache)
        assert (cache.audit_rate, cache.verify_undeclared) == (0.25, False)
        cache.close()
    with pytest.raises(InvalidInput, match="audit_rate"):
        open_cache(None, audit_rate=2.0)


def test_the_demo_takes_an_audit_rate() -> None:
    from tvcache.cli import build_parser

    assert build_parser().parse_args(["demo", "--audit-rate", "0.5"]).audit_rate == 0.5
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--audit-rate", "1.5"])


def test_a_passed_check_is_journaled_so_a_reopened_cache_does_not_check_again(tmp_path: Path) -> None:
    """A proxy runs one process per connection over one cache directory: were passed checks kept in memory only,
    every connection would start the upstream again just to re-check tools it had checked already."""
    calls = [("get", {"key": "a"})]
    cache, factory = Cache(tmp_path / "c", tools=UNDECLARED), KVFactory({"a": 1})
    rollout(cache, factory, calls)  # the miss
    (second,) = rollout(cache, factory, calls)  # the first hit: checked, and it agrees
    assert second.verified
    cache.compact()  # the passed check survives compaction too
    cache.close()
    reopened, fresh = Cache(tmp_path / "c", tools=UNDECLARED), KVFactory({"a": 1})
    try:
        (third,) = rollout(reopened, fresh, calls)
        assert third.hit
        assert not third.verified
        assert fresh.started == 0
    finally:
        reopened.close()
