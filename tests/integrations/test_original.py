"""The original release's environment classes under tvcache (``tvcache.integrations.original``).

``NotesEnv`` and ``NoteCall`` are written the way the release's ``train/integration.md`` describes (our own code):
a ``ToolCall`` with ``to_dict``/``from_dict``/``will_mutate_state``, a ``ToolCallEnv`` whose constructor takes
``env_id=None, task_name=...`` and restores an existing env when given an id, with ``execute``, ``fork``,
``stop``, ``test`` and ``get_id``. Its "sandbox server" is an in-process registry of states by env id, as the
guide's video sandbox is an HTTP server of sandboxes by id; the registry counts what was executed.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from tvcache import AlwaysSnapshot, Budget, Cache
from tvcache.errors import InvalidInput
from tvcache.integrations.original import ToolCallEnvExecutor
from tvcache.server import CacheService, ServerThread


class SandboxServer:
    """Where the envs live: states by env id, and counts of what the envs were asked to do."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.states: dict[str, dict[str, str]] = {}
        self.stopped: set[str] = set()
        self.executed: Counter[str] = Counter()
        self.forks = 0
        self.tests = 0


SERVER = SandboxServer()


class NoteCall:
    """A tool call: ``write`` and ``clear`` change the notes, ``read`` and ``count`` only look."""

    def __init__(self, function_name: str = "", argument: str = "") -> None:
        self.function_name = function_name
        self.argument = argument

    def to_dict(self) -> dict[str, Any]:
        return {"function_name": self.function_name, "argument": self.argument}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> NoteCall:
        return NoteCall(function_name=data.get("function_name", ""), argument=data.get("argument", ""))

    def will_mutate_state(self) -> bool:
        return self.function_name in ("write", "clear")


def apply(notes: dict[str, str], tool_call: NoteCall) -> str:
    name, argument = tool_call.function_name, tool_call.argument
    if name == "write":
        key, _, text = argument.partition("=")
        notes[key] = text
        return f"wrote {key}"
    if name == "clear":
        notes.clear()
        return "cleared"
    if name == "read":
        return notes.get(argument, "<none>")
    if name == "count":
        return str(len(notes))
    return f"Failed to execute {name}"


class NotesEnv:
    """A blocking env, as the release's ``ImmutableToolCallExecutor`` drives them."""

    def __init__(self, env_id: str | None = None, task_name: str = "default_task") -> None:
        self.task_name = task_name
        if env_id is None:
            self.env_id = f"{task_name}_{uuid.uuid4().hex}"
            with SERVER.lock:
                SERVER.states[self.env_id] = {}
        else:
            self.env_id = env_id

    def _state(self) -> dict[str, str]:
        if self.env_id in SERVER.stopped:
            raise RuntimeError(f"env {self.env_id} was stopped")
        return SERVER.states[self.env_id]

    def execute(self, tool_call: NoteCall, **kwargs: Any) -> str:
        with SERVER.lock:
            SERVER.executed[tool_call.function_name] += 1
            return apply(self._state(), tool_call)

    def fork(self, **kwargs: Any) -> NotesEnv:
        with SERVER.lock:
            child = f"{self.task_name}_{uuid.uuid4().hex}"
            SERVER.states[child] = dict(self._state())
            SERVER.forks += 1
        return NotesEnv(env_id=child, task_name=self.task_name)

    def stop(self, **kwargs: Any) -> None:
        with SERVER.lock:
            SERVER.stopped.add(self.env_id)

    def test(self) -> str:
        with SERVER.lock:
            SERVER.tests += 1
            return "PASS" if "answer" in self._state() else "FAIL"

    def get_id(self, **kwargs: Any) -> str:
        return self.env_id

    def get_state(self, **kwargs: Any) -> dict[str, str]:
        return dict(self._state())

    def hash(self) -> str:
        return "0000"


class AsyncNotesEnv(NotesEnv):
    """The guide's shape: ``async`` execute, fork and stop."""

    async def execute(self, tool_call: NoteCall, **kwargs: Any) -> str:  # type: ignore[override]
        return NotesEnv.execute(self, tool_call)

    async def fork(self, **kwargs: Any) -> AsyncNotesEnv:  # type: ignore[override]
        child = NotesEnv.fork(self)
        return AsyncNotesEnv(env_id=child.env_id, task_name=self.task_name)

    async def stop(self, **kwargs: Any) -> None:  # type: ignore[override]
        NotesEnv.stop(self)


def uncached(calls: list[NoteCall]) -> list[str]:
    notes: dict[str, str] = {}
    return [apply(notes, call) for call in calls]


_tasks = itertools.count()


@pytest.fixture
def task() -> str:
    return f"video-{next(_tasks)}"


@pytest.fixture(autouse=True)
def counts() -> Iterator[None]:
    SERVER.executed.clear()
    SERVER.forks = SERVER.tests = 0
    return


async def rollout(
    env_class: Any, task: str, cache: Any, calls: list[NoteCall], *, deterministic: bool | None = True
) -> tuple[list[str], Any]:
    executor = ToolCallEnvExecutor(env_class, NoteCall, task, cache=cache, deterministic=deterministic)
    history: list[NoteCall] = []
    results = []
    try:
        for call in calls:
            history.append(call)
            results.append(await executor.execute(history))
        verdict = await executor.test(history)
    finally:
        await executor.close()
    return results, verdict


W = NoteCall("write", "answer=42")
R = NoteCall("read", "answer")
N = NoteCall("count")
X = NoteCall("write", "extra=1")


def test_a_repeated_rollout_executes_nothing_and_answers_exactly(task: str) -> None:
    asyncio.run(_a_repeated_rollout_executes_nothing_and_answers_exactly(task))


async def _a_repeated_rollout_executes_nothing_and_answers_exactly(task: str) -> None:
    with Cache() as cache:
        calls = [W, R, X, N]
        first, verdict = await rollout(NotesEnv, task, cache, calls)
        assert first == uncached(calls)
        assert verdict == "PASS"
        executed = sum(SERVER.executed.values())
        second, again = await rollout(NotesEnv, task, cache, calls)
        assert (second, again) == (first, verdict)
        assert sum(SERVER.executed.values()) == executed  # every call and the test served from the cache
        assert SERVER.tests == 1


def test_read_only_calls_are_keyed_by_the_state_they_read(task: str) -> None:
    asyncio.run(_read_only_calls_are_keyed_by_the_state_they_read(task))


async def _read_only_calls_are_keyed_by_the_state_they_read(task: str) -> None:
    with Cache() as cache:
        await rollout(NotesEnv, task, cache, [W, R, X])
        # The same writes without the read in between reach the same states: X is a hit.
        executor = ToolCallEnvExecutor(NotesEnv, NoteCall, task, cache=cache, deterministic=True)
        try:
            assert await executor.execute([W]) == "wrote answer"
            assert await executor.execute([W, X]) == "wrote extra"
            assert executor.session.stats.hits == 2
            assert executor.session.stats.misses == 0
        finally:
            await executor.close()
        graph = cache.graph(task)
        reads = [node for node in graph.nodes() if node.read_only]
        assert [node.call.arguments for node in reads if node.call] == [R.to_dict()]  # hanging off W's state
        assert len(graph) == 4  # root, W, R (a read), X


def test_a_miss_after_hits_continues_from_a_frozen_env(task: str) -> None:
    asyncio.run(_a_miss_after_hits_continues_from_a_frozen_env(task))


async def _a_miss_after_hits_continues_from_a_frozen_env(task: str) -> None:
    with Cache(snapshot_policy=AlwaysSnapshot()) as cache:
        await rollout(NotesEnv, task, cache, [W, X])
        forks = SERVER.forks
        executed = Counter(SERVER.executed)
        results, verdict = await rollout(NotesEnv, task, cache, [W, X, NoteCall("clear"), N])
        assert results == uncached([W, X, NoteCall("clear"), N])
        assert verdict == "FAIL"
        assert SERVER.forks > forks  # a frozen env was forked ...
        assert SERVER.executed["write"] == executed["write"]  # ... so nothing before the miss ran again


def test_evicted_frozen_envs_are_stopped(task: str) -> None:
    asyncio.run(_evicted_frozen_envs_are_stopped(task))


async def _evicted_frozen_envs_are_stopped(task: str) -> None:
    with Cache(budget=Budget(max_snapshots_per_task=1), snapshot_policy=AlwaysSnapshot()) as cache:
        for value in range(3):
            await rollout(NotesEnv, task, cache, [NoteCall("write", f"k={value}"), X, N])
        frozen = [node.snapshot.meta["env_id"] for node in cache.graph(task).snapshot_nodes.values() if node.snapshot]
        assert len(frozen) <= 1
        assert SERVER.stopped  # evicted envs were stopped ...
        assert not set(frozen) & SERVER.stopped  # ... and never one the graph still holds


def test_async_envs_through_tvcache_serve(task: str) -> None:
    asyncio.run(_async_envs_through_tvcache_serve(task))


async def _async_envs_through_tvcache_serve(task: str) -> None:
    service = CacheService()
    try:
        with ServerThread(service) as server:
            calls = [W, R, X, N]
            first, verdict = await rollout(AsyncNotesEnv, task, server.url, calls)
            assert first == uncached(calls)
            executed = sum(SERVER.executed.values())
            second, again = await rollout(AsyncNotesEnv, task, server.url, calls)
            assert (second, again) == (first, verdict)
            assert sum(SERVER.executed.values()) == executed
    finally:
        service.close()


def test_undeclared_determinism_is_checked_on_the_first_hit(task: str) -> None:
    asyncio.run(_undeclared_determinism_is_checked_on_the_first_hit(task))


async def _undeclared_determinism_is_checked_on_the_first_hit(task: str) -> None:
    with Cache() as cache:
        await rollout(NotesEnv, task, cache, [W, R], deterministic=None)
        executed = sum(SERVER.executed.values())
        results, _ = await rollout(NotesEnv, task, cache, [W, R], deterministic=None)
        assert results == uncached([W, R])
        assert sum(SERVER.executed.values()) > executed  # executed once more and compared, not trusted blindly


def test_a_history_must_extend_the_previous_one(task: str) -> None:
    asyncio.run(_a_history_must_extend_the_previous_one(task))


async def _a_history_must_extend_the_previous_one(task: str) -> None:
    with Cache() as cache:
        executor = ToolCallEnvExecutor(NotesEnv, NoteCall, task, cache=cache)
        try:
            await executor.execute([W])
            with pytest.raises(InvalidInput, match="extend"):
                await executor.execute([X, R])
            with pytest.raises(InvalidInput, match="already"):
                await executor.execute([W])
        finally:
            await executor.close()
