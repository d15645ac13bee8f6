"""Sessions over the core: laziness, coalescing, non-determinism, snapshots, budgets, audits, faults."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from tvcache import (
    AlwaysSnapshot,
    Budget,
    Cache,
    CostAwareSnapshots,
    InvalidInput,
    InvalidTaskId,
    InvalidToolCall,
    NeverSnapshot,
    NondeterminismWarning,
    ReplayError,
    SandboxError,
    SessionClosed,
    SnapshotUnusable,
    ToolSpec,
    UnknownTool,
)

from kvstore import FaultyForks, KVFactory

ROLLOUT = [
    ("set", {"key": "a", "value": 1}),
    ("get", {"key": "a"}),
    ("incr", {"key": "a"}),
    ("get", {"key": "a"}),
    ("keys", {}),
]


async def run(cache: Cache, factory: KVFactory, calls: list[tuple[str, dict]], task: str = "t") -> list:
    async with cache.session(task, sandbox=factory) as session:
        return [await session.call(name, args) for name, args in calls]


def test_second_rollout_is_all_hits_and_starts_no_sandbox() -> None:
    cache, factory = Cache(), KVFactory()
    first = asyncio.run(run(cache, factory, ROLLOUT))
    started = factory.started
    second = asyncio.run(run(cache, factory, ROLLOUT))
    assert [r.hit for r in first] == [False] * 5
    assert [r.hit for r in second] == [True] * 5
    assert [r.output for r in second] == [r.output for r in first]
    assert factory.started == started == 1
    assert factory.live == 0
    cache.check_invariants()


def test_read_after_write_is_not_served_the_earlier_read() -> None:
    cache, factory = Cache(), KVFactory({"a": 0})
    results = asyncio.run(run(cache, factory, [("get", {"key": "a"}), ("incr", {"key": "a"}), ("get", {"key": "a"})]))
    assert [r.output for r in results] == ["0", "a=1", "1"]
    assert results[2].hit is False


def test_proven_read_only_calls_do_not_extend_the_path() -> None:
    cache, factory = Cache(), KVFactory({"a": 0, "b": 5})
    asyncio.run(run(cache, factory, [("get", {"key": "a"}), ("get", {"key": "b"}), ("incr", {"key": "a"})]))
    results = asyncio.run(run(cache, factory, [("get", {"key": "b"}), ("incr", {"key": "a"})]))
    assert [r.hit for r in results] == [True, True]


def test_miss_after_hits_forks_the_snapshot_and_replays_only_the_rest() -> None:
    cache = Cache(snapshot_policy=AlwaysSnapshot())
    factory = KVFactory()
    asyncio.run(run(cache, factory, ROLLOUT))
    factory.executed.clear()
    results = asyncio.run(run(cache, factory, [*ROLLOUT[:3], ("incr", {"key": "a"})]))
    assert [r.hit for r in results] == [True, True, True, False]
    assert results[-1].output == "a=3"
    assert factory.forked == 1
    assert factory.executed == {"incr": 1}  # forked at the snapshot after the first incr: nothing replayed


def test_without_snapshots_a_miss_replays_from_a_fresh_sandbox() -> None:
    cache = Cache(snapshot_policy=NeverSnapshot())
    factory = KVFactory()
    asyncio.run(run(cache, factory, ROLLOUT))
    factory.executed.clear()
    results = asyncio.run(run(cache, factory, [*ROLLOUT[:3], ("incr", {"key": "a"})]))
    assert results[-1].output == "a=3"
    assert factory.forked == 0
    assert factory.executed == {"set": 1, "incr": 2}  # replayed set+incr, then executed the new incr
    assert cache.stats().calls_replayed == 2


def test_cost_aware_policy_snapshots_only_expensive_states() -> None:
    cache = Cache(snapshot_policy=CostAwareSnapshots())
    factory = KVFactory(start=0.0, fork=0.01, snapshot=0.01)
    calls = [("set", {"key": "a", "value": 1}), ("slow", {"key": "a", "seconds": 0.05}), ("incr", {"key": "a"})]
    asyncio.run(run(cache, factory, calls))
    graph = cache.graph("t")
    snapshotted = {node.call.name for node in graph.snapshot_nodes.values()}
    # rebuilding after "slow" costs >= 50 ms > 20 ms of snapshot + fork; "set" alone costs microseconds.
    assert "slow" in snapshotted
    assert "set" not in snapshotted


def test_catch_up_replays_a_lagging_live_sandbox_when_that_is_cheapest() -> None:
    cache = Cache(snapshot_policy=NeverSnapshot())
    factory = KVFactory(start=1.0)  # starting is expensive: catching the live sandbox up is cheaper
    asyncio.run(run(cache, factory, [("set", {"key": "a", "value": 1}), ("incr", {"key": "a"})]))
    factory.executed.clear()
    calls = [
        ("get", {"key": "z"}),  # miss: the sandbox starts at the root
        ("set", {"key": "a", "value": 1}),  # hit: the sandbox lags behind
        ("incr", {"key": "a"}),  # hit
        ("incr", {"key": "a"}),  # miss: replay the two hits in the live sandbox, then execute
    ]
    results = asyncio.run(run(cache, factory, calls))
    assert [r.hit for r in results] == [False, True, True, False]
    assert results[-1].output == "a=3"
    assert factory.started == 2  # one per rollout: no restart for the catch-up
    assert factory.executed == {"get": 1, "set": 1, "incr": 2}


def test_concurrent_identical_misses_execute_once() -> None:
    cache, factory = Cache(), KVFactory()
    slow = ("slow", {"key": "a", "seconds": 0.2})

    async def main() -> list:
        return await asyncio.gather(*(run(cache, factory, [slow]) for _ in range(6)))

    results = asyncio.run(main())
    assert factory.executed["slow"] == 1
    assert sum(r[0].hit for r in results) == 5
    assert sum(r[0].coalesced for r in results) == 5
    assert {r[0].output for r in results} == {"a=1"}


def test_coalescing_works_across_threads_with_sync_sessions() -> None:
    cache, factory = Cache(), KVFactory()
    outputs: list[str] = []
    barrier = threading.Barrier(4)

    def worker() -> None:
        with cache.session_sync("t", sandbox=factory) as session:
            barrier.wait()
            outputs.append(session.call("slow", {"key": "k", "seconds": 0.2}).output)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert outputs == ["k=1"] * 4
    assert factory.executed["slow"] == 1


def test_waiters_take_over_when_the_executing_session_fails() -> None:
    cache, factory = Cache(), KVFactory()

    async def main() -> None:
        first = cache.session("t", sandbox=factory)
        claim = cache.store.claim(cache.graph("t"), cache.graph("t").root, _call("incr", {"key": "a"}))
        assert claim.owner
        waiter = asyncio.create_task(first.call("incr", {"key": "a"}))
        await asyncio.sleep(0)  # let the waiter join the claimed future
        cache.store.resolve(
            cache.graph("t"), cache.graph("t").root, _call("incr", {"key": "a"}), node=None, error=RuntimeError("x")
        )
        result = await waiter
        assert result.output == "a=1"
        assert result.hit is False
        await first.close()

    asyncio.run(main())


def test_non_deterministic_tools_are_never_served_from_cache() -> None:
    cache, factory = Cache(), KVFactory()
    calls = [("set", {"key": "a", "value": 1}), ("now", {}), ("get", {"key": "a"})]
    first = asyncio.run(run(cache, factory, calls))
    second = asyncio.run(run(cache, factory, calls))
    assert [r.hit for r in second] == [True, False, True]
    assert second[1].cached is False
    assert first[1].output != second[1].output


def test_a_non_deterministic_state_change_leaves_the_cached_paths() -> None:
    cache, factory = Cache(), KVFactory()
    calls = [("set", {"key": "a", "value": 1}), ("stamp", {"key": "s"}), ("get", {"key": "s"})]
    asyncio.run(run(cache, factory, calls))
    second = asyncio.run(run(cache, factory, calls))
    assert [r.hit for r in second] == [True, False, False]
    assert [r.cached for r in second] == [True, False, False]
    assert all(node.call.name != "get" for node in cache.graph("t").nodes() if node.call)


def test_test_results_are_cached_per_state() -> None:
    cache, factory = Cache(), KVFactory()
    checks = 0

    def reward(sandbox) -> int:
        nonlocal checks
        checks += 1
        return sandbox.data.get("a", 0) * 10

    async def rollout(calls):
        async with cache.session("t", sandbox=factory) as session:
            for name, args in calls:
                await session.call(name, args)
            return await session.test(reward, key="reward")

    one = asyncio.run(rollout(ROLLOUT[:3]))
    two = asyncio.run(rollout(ROLLOUT[:3]))
    three = asyncio.run(rollout(ROLLOUT[:1]))
    assert (one.value, one.hit) == (20, False)
    assert (two.value, two.hit) == (20, True)
    assert (three.value, three.hit) == (10, False)
    assert checks == 2


def test_budget_evicts_low_reuse_snapshots_and_frees_their_files() -> None:
    cache = Cache(snapshot_policy=AlwaysSnapshot(), budget=Budget(max_snapshots_per_task=2))
    factory = KVFactory()
    calls = [("incr", {"key": "a"})] * 5
    asyncio.run(run(cache, factory, calls))
    graph = cache.graph("t")
    assert len(graph.snapshot_nodes) == 2
    assert cache.stats().snapshots_evicted == 3
    files = list(cache.snapshot_root.rglob("*"))
    assert len([f for f in files if f.is_file()]) == 2
    cache.check_invariants()


def test_leased_snapshots_are_never_evicted() -> None:
    cache = Cache(snapshot_policy=AlwaysSnapshot(), budget=Budget(max_snapshots_per_task=1))
    factory = KVFactory()
    asyncio.run(run(cache, factory, [("incr", {"key": "a"})]))
    graph = cache.graph("t")
    (node,) = graph.snapshot_nodes.values()
    lease = cache.store.lease_snapshot(node, "kv")
    assert lease is not None
    asyncio.run(run(cache, factory, [("set", {"key": "b", "value": 2})]))
    assert node.snapshot is not None  # leased: kept even though the budget is exceeded
    cache.store.release(lease)
    asyncio.run(run(cache, factory, [("set", {"key": "c", "value": 3})]))
    assert node.snapshot is None


def test_audit_finds_a_tool_mis_declared_deterministic() -> None:
    cache = Cache(audit_rate=1.0, tools=[ToolSpec(name="now", read_only=True, deterministic=True)])
    factory = KVFactory()
    asyncio.run(run(cache, factory, [("now", {})]))
    with pytest.warns(NondeterminismWarning):
        asyncio.run(run(cache, factory, [("now", {})]))
    assert cache.stats().audit_disagreements == 1
    # Marked in the task where the audit saw it disagree (not tool-wide: see tests/test_nondeterminism.py).
    assert [(mark.tool, mark.task_id) for mark in cache.nondeterministic_marks()] == [("now", "t")]
    third = asyncio.run(run(cache, factory, [("now", {})]))
    assert third[0].hit is False


def test_audit_of_deterministic_tools_agrees() -> None:
    cache, factory = Cache(audit_rate=1.0), KVFactory()
    asyncio.run(run(cache, factory, ROLLOUT))
    asyncio.run(run(cache, factory, ROLLOUT))
    stats = cache.stats()
    assert stats.audits == 5
    assert stats.audit_disagreements == 0
    assert factory.live == 0


def test_replay_failure_is_reported_and_leaves_the_cache_consistent() -> None:
    cache = Cache(snapshot_policy=NeverSnapshot())
    factory = KVFactory()
    asyncio.run(run(cache, factory, [("incr", {"key": "a"}), ("incr", {"key": "a"})]))
    before = len(cache.graph("t"))
    factory.broken = True

    async def rollout() -> None:
        async with cache.session("t", sandbox=factory) as session:
            await session.call("incr", {"key": "a"})
            await session.call("incr", {"key": "a"})
            with pytest.raises(ReplayError, match="replaying"):
                await session.call("set", {"key": "b", "value": 1})

    asyncio.run(rollout())
    assert len(cache.graph("t")) == before
    assert factory.live == 0
    cache.check_invariants()


def test_a_broken_sandbox_raises_sandbox_error_and_nothing_is_cached() -> None:
    cache, factory = Cache(), KVFactory()

    async def rollout() -> None:
        async with cache.session("t", sandbox=factory) as session:
            with pytest.raises(SandboxError, match="fail"):
                await session.call("fail", {})

    asyncio.run(rollout())
    assert len(cache.graph("t")) == 1
    assert factory.live == 0


def test_tool_errors_are_results_and_cached() -> None:
    cache, factory = Cache(), KVFactory()
    first = asyncio.run(run(cache, factory, [("get", {"key": "missing"})]))
    second = asyncio.run(run(cache, factory, [("get", {"key": "missing"})]))
    assert first[0].is_error
    assert second[0].is_error
    assert second[0].hit


def test_bad_input_gets_clear_errors() -> None:
    cache, factory = Cache(), KVFactory()

    async def rollout() -> None:
        async with cache.session("t", sandbox=factory) as session:
            with pytest.raises(UnknownTool, match="declared tools are: dirty, fail, get"):
                await session.call("rm", {})
            with pytest.raises(InvalidToolCall, match="missing required argument"):
                await session.call("get", {})
            with pytest.raises(InvalidToolCall, match="must be string"):
                await session.call("get", {"key": 3})
            with pytest.raises(InvalidToolCall, match="not JSON-representable"):
                await session.call("get", {"key": {1, 2}})
            assert session.history == []
        with pytest.raises(SessionClosed):
            await session.call("get", {"key": "a"})

    asyncio.run(rollout())
    with pytest.raises(InvalidTaskId):
        cache.graph("")


def test_closing_the_cache_removes_in_memory_snapshots(tmp_path: Path) -> None:
    cache = Cache(snapshot_policy=AlwaysSnapshot())
    asyncio.run(run(cache, KVFactory(), ROLLOUT))
    root = cache.root
    assert any(root.rglob("*"))
    cache.close()
    assert not root.exists()


def _call(name: str, args: dict):
    from tvcache import ToolCall

    return ToolCall(name, args)


def test_concurrent_identical_checks_run_once() -> None:
    cache, factory = Cache(), KVFactory()
    runs = 0

    async def reward(sandbox) -> int:
        nonlocal runs
        runs += 1
        await asyncio.sleep(0.05)  # a slow verifier: the other sessions arrive while it runs
        return 1

    async def rollout():
        async with cache.session("t", sandbox=factory) as session:
            await session.call("incr", {"key": "a"})
            return await session.test(reward, key="reward")

    async def main() -> list:
        return await asyncio.gather(*(rollout() for _ in range(5)))

    results = asyncio.run(main())
    assert runs == 1
    assert sorted(r.hit for r in results) == [False, True, True, True, True]
    assert {r.value for r in results} == {1}


def test_a_cancelled_owner_does_not_cancel_the_sessions_waiting_on_it() -> None:
    cache, factory = Cache(), KVFactory()
    slow = ("slow", {"key": "a", "seconds": 0.2})

    async def main() -> str:
        owner = asyncio.create_task(run(cache, factory, [slow]))
        for _ in range(1000):  # until the owner has claimed the call (loop turns, no wall-clock waiting)
            if cache.store.inflight:
                break
            await asyncio.sleep(0)
        waiter = asyncio.create_task(run(cache, factory, [slow]))
        for _ in range(3):  # the waiter runs up to its wait on the owner's future
            await asyncio.sleep(0)
        owner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await owner
        (result,) = await waiter
        return result.output

    assert asyncio.run(main()) == "a=1"
    assert factory.live == 0


def test_a_check_that_changes_the_sandbox_does_not_leak_into_later_calls() -> None:
    cache, factory = Cache(snapshot_policy=NeverSnapshot()), KVFactory()

    async def vandal(sandbox) -> str:
        sandbox.data["a"] = 999  # a grader that writes into the sandbox
        return "graded"

    async def main() -> list:
        async with cache.session("t", sandbox=factory) as session:
            await session.call("set", {"key": "a", "value": 1})
            await session.test(vandal, key="grade")
            return [(await session.call("get", {"key": "a"})).output]

    assert asyncio.run(main()) == ["1"]  # what uncached execution of set + get returns


# ---------------------------------------------------------------- regressions found in review


def test_one_waiter_giving_up_does_not_cancel_the_call_for_the_others() -> None:
    cache, factory = Cache(), KVFactory()
    slow = ("slow", {"key": "a", "seconds": 0.2})

    async def main() -> tuple[list, list]:
        owner = asyncio.create_task(run(cache, factory, [slow]))
        for _ in range(1000):
            if cache.store.inflight:
                break
            await asyncio.sleep(0)
        impatient = asyncio.create_task(run(cache, factory, [slow]))
        patient = asyncio.create_task(run(cache, factory, [slow]))
        for _ in range(3):
            await asyncio.sleep(0)
        impatient.cancel()
        return await owner, await patient

    owner, patient = asyncio.run(main())
    assert owner[0].output == patient[0].output == "a=1"
    assert factory.executed["slow"] == 1


def test_a_call_cancelled_halfway_does_not_leak_its_effects_into_the_cache() -> None:
    cache, factory = Cache(snapshot_policy=NeverSnapshot()), KVFactory()

    async def first() -> None:
        async with cache.session("t", sandbox=factory) as session:
            await session.call("set", {"key": "a", "value": 1})
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(session.call("dirty", {"key": "a", "seconds": 5.0}), 0.05)
            await session.call("get", {"key": "a"})

    asyncio.run(first())
    second = asyncio.run(run(cache, factory, [("set", {"key": "a", "value": 1}), ("get", {"key": "a"})]))
    assert [r.output for r in second] == ["a=1", "1"]  # what `set a=1; get a` really returns


def test_a_failing_check_that_changed_the_sandbox_does_not_leak_either() -> None:
    cache, factory = Cache(snapshot_policy=NeverSnapshot()), KVFactory()

    async def vandal(sandbox) -> str:
        sandbox.data["a"] = 999
        raise RuntimeError("grader crashed")

    async def main() -> str:
        async with cache.session("t", sandbox=factory) as session:
            await session.call("set", {"key": "a", "value": 1})
            with pytest.raises(RuntimeError, match="grader crashed"):
                await session.test(vandal, key="grade")
            return (await session.call("get", {"key": "a"})).output

    assert asyncio.run(main()) == "1"


def test_a_tool_mis_declared_read_only_is_caught_by_the_backend() -> None:
    cache = Cache(tools=[ToolSpec(name="incr", read_only=True, arguments={"key": str})])
    factory = KVFactory()
    with pytest.warns(RuntimeWarning, match="declared read-only but changed"):
        asyncio.run(run(cache, factory, [("incr", {"key": "a"}), ("get", {"key": "a"})]))
    second = asyncio.run(run(cache, factory, [("get", {"key": "a"})]))
    assert second[0].output == "None"  # `get a` alone: the key was never incremented


def test_checks_need_an_explicit_key_when_their_name_cannot_tell_them_apart() -> None:
    cache, factory = Cache(), KVFactory()

    async def main() -> None:
        async with cache.session("t", sandbox=factory) as session:
            with pytest.raises(InvalidInput, match="pass key="):
                await session.test(lambda sandbox: 1)

    asyncio.run(main())


def test_a_replay_that_diverges_takes_the_rollout_off_the_cached_paths() -> None:
    cache = Cache(
        snapshot_policy=NeverSnapshot(), tools=[ToolSpec(name="stamp", deterministic=True, arguments={"key": str})]
    )
    factory = KVFactory()
    asyncio.run(run(cache, factory, [("stamp", {"key": "s"}), ("get", {"key": "s"})]))
    with pytest.warns(NondeterminismWarning):
        second = asyncio.run(run(cache, factory, [("stamp", {"key": "s"}), ("incr", {"key": "x"})]))
    assert second[0].hit
    assert second[1].cached is False  # executed in a state the graph does not describe: never recorded
    stamp = cache.graph("t").root.step(second[0].call)
    assert stamp is not None
    assert stamp.children is None or all(child.call.name != "incr" for child in stamp.children.values())


def test_a_result_the_journal_cannot_take_fails_cleanly_and_releases_waiters(tmp_path: Path) -> None:
    cache, factory = Cache(tmp_path / "cache"), KVFactory()

    async def main() -> list:
        return await asyncio.gather(*(run(cache, factory, [("weird", {})]) for _ in range(3)), return_exceptions=True)

    outcomes = asyncio.run(asyncio.wait_for(main(), 30))
    assert all(isinstance(outcome, SandboxError) for outcome in outcomes)
    assert "not valid Unicode" in str(outcomes[0])
    assert len(cache.graph("t")) == 1
    assert not cache.store.inflight
    cache.close()


def test_evicted_snapshots_are_freed_by_the_factory_that_made_them() -> None:
    cache = Cache(snapshot_policy=AlwaysSnapshot(), budget=Budget(max_snapshots_per_task=1))
    first, second = KVFactory(), KVFactory()
    asyncio.run(run(cache, first, [("incr", {"key": "a"})], task="t1"))
    for value in range(4):
        asyncio.run(run(cache, second, [("set", {"key": "b", "value": value})], task="t2"))
    assert first.discarded == []
    assert len(second.discarded) == 3


CHAIN = [("set", {"key": "a", "value": 1}), ("incr", {"key": "a"}), ("incr", {"key": "a"})]


def _deepest_snapshot(cache: Cache, task: str = "t") -> str:
    graph = cache.graph(task)
    node = max(graph.snapshot_nodes.values(), key=lambda n: n.depth)
    assert node.snapshot is not None
    return node.snapshot.path


def test_a_fork_failing_in_this_process_keeps_the_snapshot_and_forks_the_next_one_up() -> None:
    """A full disk here says nothing about the snapshot: it stays for the processes that can fork it, this one
    passes over it from now on, and the state comes from the next snapshot up (not a fresh start)."""
    cache = Cache(snapshot_policy=AlwaysSnapshot())
    factory = FaultyForks(OSError(28, "No space left on device"), start=1.0, fork=0.0, snapshot=0.0)
    asyncio.run(run(cache, factory, CHAIN))
    snapshots = cache.stats().snapshots
    factory.failing = {_deepest_snapshot(cache)}
    with pytest.warns(RuntimeWarning, match="not forking it in this process again"):
        results = asyncio.run(run(cache, factory, [*CHAIN, ("incr", {"key": "a"})]))
    assert [r.output for r in results] == ["a=1", "a=2", "a=3", "a=4"]
    assert (factory.started, factory.forked, len(factory.failed)) == (1, 1, 1)
    assert cache.stats().forks_failed == 1
    assert cache.stats().snapshots == snapshots + 1  # kept (and the new state's snapshot added)
    assert factory.discarded == []
    again = asyncio.run(run(cache, factory, [*CHAIN, ("set", {"key": "b", "value": 2})]))
    assert again[-1].output == "b=2"
    assert len(factory.failed) == 1  # not tried again here
    cache.check_invariants()


def test_a_snapshot_no_process_can_fork_is_dropped_and_freed() -> None:
    cache = Cache(snapshot_policy=AlwaysSnapshot())
    factory = FaultyForks(SnapshotUnusable("its data is gone from the store"), start=1.0, fork=0.0, snapshot=0.0)
    asyncio.run(run(cache, factory, CHAIN))
    snapshots = cache.stats().snapshots
    deepest = _deepest_snapshot(cache)
    factory.failing = {deepest}
    with pytest.warns(RuntimeWarning, match="dropping it"):
        results = asyncio.run(run(cache, factory, [*CHAIN, ("incr", {"key": "a"})]))
    assert results[-1].output == "a=4"
    assert (factory.forked, factory.discarded) == (1, [deepest])
    assert cache.stats().snapshots == snapshots  # one dropped, one taken
    assert deepest not in {n.snapshot.path for n in cache.graph("t").snapshot_nodes.values() if n.snapshot}
