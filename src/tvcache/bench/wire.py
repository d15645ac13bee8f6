"""A small load through the original TVCache wire format: rollouts sending, request for request, the sequence the
released ``ImmutableToolCallExecutor`` sends (read from the original release; this is our own code), against a
running ``tvcache serve``. Prints the end state: leases outstanding and envs per task against the budget.

    tvcache serve --port 8765 --max-snapshots-per-task 8 &
    python -m tvcache.bench.wire --url http://127.0.0.1:8765 --budget 8

The environments are in-process key-value stores named by env id (``KVEnvs``), so the load measures the
server and the protocol, not a sandbox. Every value a rollout gets is checked against executing its history
from scratch, uncached.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = ["KVEnvs", "LoadResult", "WireExecutor", "reference_value", "rollout_calls", "run_load"]

TEST = {"TV_CACHE_TOOL_TYPE": "TESTING TOOL"}  # the released executor's marker for the end-of-rollout test


def _apply(state: dict[str, int], call: dict[str, Any]) -> str:
    op, key = call["op"], call.get("key", "")
    if op == "set":
        state[key] = int(call["value"])
    elif op == "incr":
        state[key] = state.get(key, 0) + 1
    elif op != "get":
        raise ValueError(f"unknown op {op!r}")
    return f"{key}={state.get(key)}"


def _verdict(state: dict[str, int]) -> str:
    return "PASS" if sum(state.values()) % 2 == 0 else "FAIL"


def reference_value(history: Sequence[dict[str, Any]]) -> str:
    """What executing ``history`` from scratch, uncached, returns for its last call."""
    state: dict[str, int] = {}
    value = ""
    for call in history:
        value = _verdict(state) if call == TEST else _apply(state, call)
    return value


class KVEnvs:
    """Environments of the ``ToolCallEnv`` kind, held in this process: an env id names a state. Counts what the
    protocol makes the client do (forks, stops), and refuses to use a stopped env."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[str, dict[str, int]] = {}
        self._parents: dict[str, dict[str, int]] = {}  # an env's state when it was forked, for ``unchanged``
        self.stopped: set[str] = set()
        self._ids = itertools.count()
        self.created = 0
        self.forks = 0

    def new(self) -> str:
        with self._lock:
            env_id = f"env-{next(self._ids)}"
            self._states[env_id] = {}
            self._parents[env_id] = {}
            self.created += 1
            return env_id

    def _live(self, env_id: str) -> dict[str, int]:
        if env_id in self.stopped:
            raise RuntimeError(f"{env_id} was stopped, yet the cache handed it out")
        return self._states[env_id]

    def fork(self, env_id: str) -> str:
        with self._lock:
            state = dict(self._live(env_id))
            child = f"env-{next(self._ids)}"
            self._states[child] = state
            self._parents[child] = dict(state)
            self.forks += 1
            return child

    def execute(self, env_id: str, call: dict[str, Any]) -> str:
        with self._lock:
            state = self._live(env_id)
            return _verdict(state) if call == TEST else _apply(state, call)

    def unchanged(self, env_id: str) -> bool:
        """The released executor's ``hash() == "0000"``: the env's state is still the one it was forked in."""
        with self._lock:
            return self._states[env_id] == self._parents[env_id]

    def stop(self, env_id: str) -> None:
        with self._lock:
            self.stopped.add(env_id)


@dataclass(kw_only=True)
class WireExecutor:
    """One rollout's executor: the released ``ImmutableToolCallExecutor``'s requests, in its order.

    ``bank``: pre-forked envs by parent env id (the fork bank's ``deposit``, filled by ``deposit``)."""

    client: httpx.Client
    envs: KVEnvs
    task: str
    bank: dict[str, list[str]] = field(default_factory=dict)
    puts: list[dict[str, Any]] = field(default_factory=list)  # every PUT /put answer, for the budget checks

    def _headers(self) -> dict[str, str]:
        return {"X-Task-Name": self.task}

    def _ok(self, response: httpx.Response) -> dict[str, Any]:
        response.raise_for_status()
        answer: dict[str, Any] = response.json()
        return answer

    def _get(self, keys: list[str]) -> dict[str, Any]:
        params = {"task_name": self.task, "tool_calls": keys}
        return self._ok(self.client.get("/get", params=params, headers=self._headers()))

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._ok(self.client.post(path, json=body, headers=self._headers()))

    def execute(self, history: list[dict[str, Any]]) -> str:
        keys = [json.dumps(call) for call in history]
        if self._get(keys)["found"]:  # exact_match, then get, as the released client does
            return str(self._get(keys)["value"])
        match = self._post("/prefix_match", {"task_name": self.task, "tool_calls": keys})
        prefix: list[str] = match["history"] or []
        if len(prefix) == len(keys):  # put by someone else meanwhile
            return str(self._get(keys)["value"])
        if match["env_id"] is None:
            return self._execute_and_put(history, keys, 0, self.envs.new())
        fork = self._post("/should_fork", {"task_name": self.task, "history": prefix})
        if not fork["should_fork"]:
            raise AssertionError(f"should_fork refused an env prefix_match named: {fork}")
        parent = fork["env_id"]
        banked = self.bank.get(parent)
        child = banked.pop() if banked else self.envs.fork(parent)
        self._post("/unref", {"env_id": parent, "task_name": self.task})
        value = self._execute_and_put(history, keys, len(prefix), child)
        if history[-1] != TEST and self.envs.unchanged(child):
            self.client.post(
                "/mark_stateless",
                json={"task_name": self.task, "history": keys, "env_id": child},
                headers=self._headers(),
            )
        return value

    def _execute_and_put(self, history: list[dict[str, Any]], keys: list[str], start: int, env: str) -> str:
        values, times = [], []
        for call in history[start:]:
            started = time.perf_counter()
            values.append(self.envs.execute(env, call))
            times.append(time.perf_counter() - started)
        if history[-1] == TEST:
            self._post("/store_test_result", {"task_name": self.task, "history": keys[:-1], "test_result": values[-1]})
            self.envs.stop(env)
            return values[-1]
        body = {"task_name": self.task, "history": keys, "env_id": env, "values": values,
                "tool_exec_times": times, "start_idx": start}  # fmt: skip
        answer = self._ok(self.client.put("/put", json=body, headers=self._headers()))
        self.puts.append(answer)
        for removed in answer["removed_env_ids"]:
            self.envs.stop(removed)
        return values[-1]

    def test(self, history: list[dict[str, Any]]) -> str:
        keys = [json.dumps(call) for call in history]
        found = self._ok(
            self.client.get(
                "/get_test_result", params={"task_name": self.task, "tool_calls": keys}, headers=self._headers()
            )
        )
        if found["found"]:
            return str(found["test_result"])
        return self.execute([*history, TEST])

    def deposit(self, forks_per_env: int = 1) -> None:
        """The fork bank's ``deposit``: every env of the task, referenced, forked, and unreferenced."""
        envs = self._ok(self.client.get("/get_all_envs", params={"task_name": self.task}, headers=self._headers()))
        for env_id in envs["env_ids"]:
            self.bank[env_id] = [self.envs.fork(env_id) for _ in range(forks_per_env)]
            self._post("/unref", {"env_id": env_id, "task_name": self.task})


def rollout_calls(rng: random.Random, length: int) -> list[dict[str, Any]]:
    """A rollout over a few keys and values, so rollouts of a task share prefixes and diverge."""
    calls: list[dict[str, Any]] = []
    for _ in range(length):
        op = rng.choice(["set", "incr", "incr", "get"])
        call: dict[str, Any] = {"op": op, "key": rng.choice("ab")}
        if op == "set":
            call["value"] = rng.choice([1, 2])
        calls.append(call)
    return calls


@dataclass(frozen=True, kw_only=True)
class LoadResult:
    calls: int
    mismatches: int
    seconds: float
    leases_active: int
    wire_leases: int
    envs_per_task: dict[str, int]
    budget: int
    max_over_budget_leased: int  # the most envs a PUT /put answer reported kept over the budget by leases
    stopped_envs_in_graph: int


def run_load(
    url: str,
    *,
    budget: int,
    tasks: int = 3,
    group: int = 4,
    epochs: int = 2,
    length: int = 6,
    seed: int = 0,
    token: str | None = None,
) -> LoadResult:
    """``tasks`` x ``group`` concurrent rollouts x ``epochs`` through the wire format; every value checked."""
    rng = random.Random(seed)
    plans = {f"task-{t}": [rollout_calls(rng, length) for _ in range(group)] for t in range(tasks)}
    envs = KVEnvs()
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    mismatches = 0
    calls = 0
    puts: list[dict[str, Any]] = []
    lock = threading.Lock()
    started = time.perf_counter()
    with httpx.Client(base_url=url, headers=headers, timeout=30.0) as client:

        def rollout(task: str, plan: list[dict[str, Any]], bank: dict[str, list[str]]) -> None:
            nonlocal mismatches, calls
            executor = WireExecutor(client=client, envs=envs, task=task, bank=bank)
            history: list[dict[str, Any]] = []
            wrong = 0
            for call in plan:
                history.append(call)
                wrong += executor.execute(list(history)) != reference_value(history)
            wrong += executor.test(list(history)) != reference_value([*history, TEST])
            with lock:
                mismatches += wrong
                calls += len(plan) + 1
                puts.extend(executor.puts)

        for epoch in range(epochs):
            banks: dict[str, dict[str, list[str]]] = {}
            for task in plans:
                if epoch > 0:  # the next batch's envs are pre-forked, as the training script does
                    depositor = WireExecutor(client=client, envs=envs, task=task)
                    depositor.deposit()
                    banks[task] = depositor.bank
            with ThreadPoolExecutor(max_workers=group) as pool:
                futures = [
                    pool.submit(rollout, task, plan, banks.get(task, {}))
                    for task, group_plans in plans.items()
                    for plan in group_plans
                ]
                for future in futures:
                    future.result()
        stats = client.get("/v1/stats").json()
        tasks_out = client.get("/v1/tasks").json()["tasks"]
        graph_envs: list[str] = []
        for task in plans:
            nodes = client.get("/v1/graph", params={"task_id": task}).json()["nodes"]
            graph_envs += [n["snapshot"]["path"] for n in nodes if n["snapshot"] is not None]
    return LoadResult(
        calls=calls,
        mismatches=mismatches,
        seconds=time.perf_counter() - started,
        leases_active=stats["leases_active"],
        wire_leases=stats.get("wire_leases", -1),
        envs_per_task={task["task_id"]: task["snapshots"] for task in tasks_out},
        budget=budget,
        max_over_budget_leased=max((answer["over_budget_leased"] for answer in puts), default=0),
        stopped_envs_in_graph=sum(1 for env in graph_envs if env in envs.stopped),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="a running `tvcache serve`")
    parser.add_argument("--budget", type=int, required=True, help="the server's --max-snapshots-per-task")
    parser.add_argument("--tasks", type=int, default=3)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--length", type=int, default=6)
    parser.add_argument("--token", default=None)
    args = parser.parse_args(argv)
    result = run_load(
        args.url, budget=args.budget, tasks=args.tasks, group=args.group, epochs=args.epochs, length=args.length,
        token=args.token,
    )  # fmt: skip
    print(f"{result.calls} calls in {result.seconds:.2f} s, {result.mismatches} mismatches")
    print(f"leases outstanding: {result.leases_active} (wire: {result.wire_leases})")
    for task, count in sorted(result.envs_per_task.items()):
        print(f"  {task}: {count} envs (budget {result.budget})")
    print(f"most envs kept over budget by leases at a PUT: {result.max_over_budget_leased}")
    print(f"envs in the graph already stopped by a client: {result.stopped_envs_in_graph}")
    return 0 if result.mismatches == 0 and result.leases_active == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
