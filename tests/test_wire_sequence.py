"""The released ``ImmutableToolCallExecutor``'s whole request sequence, replayed against ``tvcache serve``.

``tvcache.bench.wire.WireExecutor`` sends, request for request, what the released executor sends (read from the
original release, written anew): exact hit (``/get`` twice), miss with fork (``/prefix_match``, ``/should_fork``,
fork, ``/unref``, ``PUT /put``, ``/mark_stateless``), miss from scratch, tests (``/get_test_result``, then the
test executed and ``/store_test_result``), and the fork bank's ``/get_all_envs`` + ``/unref``. Every value is
checked against executing the history from scratch; leases and the budget are checked as the requests go.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tvcache import Budget
from tvcache.bench.wire import TEST, KVEnvs, WireExecutor, reference_value, run_load
from tvcache.server import CacheService, ServerThread


@pytest.fixture
def service() -> Iterator[CacheService]:
    service = CacheService(budget=Budget(max_snapshots_per_task=4))
    yield service
    service.close()


@pytest.fixture
def url(service: CacheService) -> Iterator[str]:
    with ServerThread(service) as server:
        yield server.url


def env_leases(service: CacheService) -> int:
    return sum(1 for held in service.leases.values() if held.tag is not None)


SET_A = {"op": "set", "key": "a", "value": 1}
INCR_A = {"op": "incr", "key": "a"}
GET_A = {"op": "get", "key": "a"}
INCR_B = {"op": "incr", "key": "b"}


def test_each_step_of_the_sequence_leaves_no_reference(url: str, service: CacheService) -> None:
    envs = KVEnvs()
    with httpx.Client(base_url=url) as client:
        first = WireExecutor(client=client, envs=envs, task="t")
        # Miss from scratch: no env anywhere, a new env executes everything and is put.
        assert first.execute([SET_A]) == "a=1"
        assert envs.created == 1
        assert env_leases(service) == 0
        # Miss with fork: prefix_match references the env, should_fork confirms it, unref ends it.
        assert first.execute([SET_A, INCR_A]) == "a=2"
        assert envs.forks == 1
        assert env_leases(service) == 0
        # A read that leaves the state as it was forked: marked stateless.
        assert first.execute([SET_A, INCR_A, GET_A]) == "a=2"
        tree = client.get("/visualize").json()["t"]
        path = tree["children"][json.dumps(SET_A)]["children"][json.dumps(INCR_A)]["children"]
        assert path[json.dumps(GET_A)]["stateless"] is True
        # Another rollout: exact hits execute nothing.
        second = WireExecutor(client=client, envs=envs, task="t")
        forks = envs.forks
        assert second.execute([SET_A]) == "a=1"
        assert second.execute([SET_A, INCR_A]) == "a=2"
        assert envs.forks == forks
        assert env_leases(service) == 0
        # The test: executed once in a fork of the deepest env, then served from the cache.
        assert second.test([SET_A, INCR_A]) == reference_value([SET_A, INCR_A, TEST])
        assert env_leases(service) == 0
        forks = envs.forks
        assert first.test([SET_A, INCR_A]) == reference_value([SET_A, INCR_A, TEST])
        assert envs.forks == forks
        # The fork bank's deposit: every env referenced, forked and unreferenced; a rollout then uses the bank.
        bank = WireExecutor(client=client, envs=envs, task="t")
        bank.deposit()
        assert env_leases(service) == 0
        third = WireExecutor(client=client, envs=envs, task="t", bank=bank.bank)
        forks = envs.forks
        assert third.execute([SET_A, INCR_B]) == "b=1"
        assert envs.forks == forks  # the pre-forked env was used
        assert env_leases(service) == 0
    assert service.leases == {}
    service.cache.graph("t").check_invariants()


def test_a_group_load_is_exact_leaks_nothing_and_keeps_the_budget(url: str, service: CacheService) -> None:
    result = run_load(url, budget=4, tasks=2, group=4, epochs=2, length=6, seed=3)
    assert result.mismatches == 0
    assert result.leases_active == 0
    assert service.leases == {}
    assert result.stopped_envs_in_graph == 0  # no env a client was told to stop is still handed out
    assert all(count <= 4 for count in result.envs_per_task.values()), result.envs_per_task
    assert sum(result.envs_per_task.values()) == 8  # rollouts diverge: the budget is used, and held
    for task in service.cache.tasks():
        service.cache.graph(task).check_invariants()
