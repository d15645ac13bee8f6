"""The original TVCache server's wire format, answered from the same cache.

The reference client names a tool call by an opaque string (its ``json.dumps(tool_call.to_dict())``) and a
sandbox by an opaque ``env_id``. Here the string ``s`` becomes ``ToolCall("tvcache.wire", {"call": s})`` — the
string itself, byte for byte, is the key (two strings that differ only in key order or whitespace are two calls,
exactly as in the reference), and it is recovered unchanged for ``/prefix_match`` and ``/visualize``. A stored
``value`` may be any JSON value: it is kept as canonical JSON text in the node's output and decoded on the way
out. An ``env_id`` becomes a client-owned snapshot ``Snapshot(kind="tvcache.wire-env", path=env_id)``, so it is
journaled, counted by the snapshot budget and pinned by leases like any snapshot. The differences from the
reference server (its bugs, fixed here) are listed in docs/wire-compat.md.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import Field

from ..cache import MAX_TASK_ID
from ..calls import ToolCall, canonical_json
from ..errors import InvalidInput
from ..graph import Node, ToolCallGraph
from ..protocol import Outcome, Snapshot
from . import models as m
from .service import CacheService

__all__ = ["ENV_KIND", "TEST_KEY", "WIRE_TOOL", "WireCompat", "wire_call"]

WIRE_TOOL = "tvcache.wire"
ENV_KIND = "tvcache.wire-env"
TEST_KEY = "tvcache.wire.test_result"
STATELESS_KEY = "tvcache.wire.stateless"

WireKey = Annotated[str, Field(max_length=1_000_000)]
History = Annotated[list[WireKey], Field(max_length=100_000)]
TaskName = Annotated[str, Field(min_length=1, max_length=1024)]


class PutIn(m.Request):
    task_name: TaskName
    history: History
    env_id: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    values: list[Any] | None = None
    tool_exec_times: list[float | None] | None = None
    start_idx: Annotated[int, Field(ge=0)] = 0


class PrefixMatchIn(m.Request):
    task_name: TaskName
    tool_calls: History


class UnrefIn(m.Request):
    env_id: Annotated[str, Field(min_length=1, max_length=4096)]
    task_name: TaskName | None = None


class MarkStatelessIn(m.Request):
    task_name: TaskName
    history: History
    env_id: Annotated[str, Field(max_length=4096)] | None = None


class StoreTestResultIn(m.Request):
    task_name: TaskName
    history: Annotated[list[WireKey], Field(min_length=1, max_length=100_000)]
    test_result: Any


def wire_call(key: str) -> ToolCall:
    return ToolCall(WIRE_TOOL, {"call": key})


def wire_key(node: Node) -> str:
    """The reference's string for a node's call (the canonical JSON of native calls)."""
    call = node.call
    assert call is not None
    if call.name == WIRE_TOOL:
        key = call.arguments.get("call")
        if isinstance(key, str):
            return key
    return call.canonical().decode()


def _value(node: Node) -> Any:
    if node.call is not None and node.call.name == WIRE_TOOL:
        return json.loads(node.output)
    return node.output


def _env_id(node: Node) -> str | None:
    snapshot = node.snapshot
    return snapshot.path if snapshot is not None and snapshot.kind == ENV_KIND else None


class WireCompat:
    """The reference routes' semantics over a ``CacheService``."""

    def __init__(self, service: CacheService) -> None:
        self.service = service

    def _walk(self, graph: ToolCallGraph | None, keys: list[str]) -> list[Node]:
        """The nodes along ``keys`` from the root, stopping at the first key not cached."""
        chain: list[Node] = []
        if graph is None:
            return chain
        state = graph.root
        for key in keys:
            node = state.step(wire_call(key))
            if node is None or node.read_only:
                if node is not None:
                    chain.append(node)
                break
            chain.append(node)
            state = node
        return chain

    def _exact(self, task_name: str, keys: list[str]) -> Node | None:
        chain = self._walk(self.service.existing_graph(task_name), keys)
        return chain[-1] if keys and len(chain) == len(keys) else None

    # ------------------------------------------------------------------ routes

    def get(self, task_name: str, keys: list[str]) -> dict[str, Any]:
        service = self.service
        service.counters["lookups"] += 1
        node = self._exact(task_name, keys)
        if node is None:
            if len(task_name) <= MAX_TASK_ID:  # the reference client executes the call next
                service.activity.miss(task_name, None)
            return {"found": False, "env_id": None, "value": None, "tool_exec_time": None}
        graph = service.graph(task_name)
        service.cache._touch(graph, node)
        service.counters["lookup_hits"] += 1
        service.activity.hit(task_name, None, seconds_saved=node.seconds)
        return {"found": True, "env_id": _env_id(node), "value": _value(node), "tool_exec_time": node.seconds}

    def put(self, body: PutIn) -> dict[str, Any]:
        service = self.service
        graph = service.graph(body.task_name)
        history, start = body.history, body.start_idx
        values, times = body.values, body.tool_exec_times
        new = len(history) - start
        if new > 0 and (values is None or len(values) < new):
            raise InvalidInput(
                f"values must hold one value per call from start_idx={start}: {new} expected, "
                f"got {0 if values is None else len(values)}"
            )
        if times is not None and new > 0 and len(times) < new:
            raise InvalidInput(f"tool_exec_times must hold {new} entries from start_idx={start}, got {len(times)}")
        # Check before writing anything, so a bad request changes nothing.
        cursor: Node | None = graph.root
        plan: list[tuple[ToolCall, Node | None]] = []
        for index, key in enumerate(history):
            call = wire_call(key)
            node = cursor.step(call) if cursor is not None else None
            if node is None and index < start:
                raise InvalidInput(
                    f"history[{index}] is not cached and has no value (it is before start_idx={start}); "
                    "put the values of every call that is not cached yet"
                )
            plan.append((call, node))
            cursor = node
        state = graph.root
        for index, (call, node) in enumerate(plan):
            if node is None:
                assert values is not None
                value, seconds = values[index - start], (times[index - start] if times is not None else None)
                output = canonical_json(value).decode()
                node = service.cache._record(
                    graph,
                    state,
                    call,
                    Outcome(output=output),
                    float(seconds or 0.0),
                    read_only=False,
                )
                service.counters["inserts"] += 1
            state = node
        removed: list[str] = []
        if body.env_id is not None and history:
            # The env now holds the leaf's state: it no longer represents any ancestor it was recorded at.
            ancestor: Node | None = state.parent
            while ancestor is not None:
                if _env_id(ancestor) == body.env_id and ancestor.leases == 0:
                    service.cache._detach_snapshot(graph, ancestor)
                ancestor = ancestor.parent
            snapshot = Snapshot(kind=ENV_KIND, path=body.env_id, bytes=0)
            _, evicted = service.attach_snapshot(graph, state, snapshot)
            removed = [old.path for old in evicted if old.kind == ENV_KIND]
        return {"success": True, "removed_env_ids": removed}

    def prefix_match(self, body: PrefixMatchIn) -> dict[str, Any]:
        service = self.service
        service.counters["lookups"] += 1
        chain = self._walk(service.existing_graph(body.task_name), body.tool_calls)
        depth = 0
        for index, node in enumerate(chain):
            if _env_id(node) is not None:
                depth = index + 1
        if depth == 0:
            return {"found": False, "env_id": None, "history": None}
        node = chain[depth - 1]
        env_id = _env_id(node)
        graph = service.graph(body.task_name)
        lease = service.cache._lease_snapshot(node, ENV_KIND)
        assert lease is not None and lease.node is node
        service.hold(lease, graph.task_id, tag=env_id)
        return {"found": True, "env_id": env_id, "history": [wire_key(n) for n in chain[:depth]]}

    def unref(self, body: UnrefIn) -> dict[str, Any]:
        for held in list(self.service.leases.values()):
            if held.tag == body.env_id and (body.task_name is None or held.task_id == body.task_name):
                self.service.release_lease(held.id)
                return {"success": True}
        return {"success": False, "error": f"no reference is held on env {body.env_id!r}"}

    def mark_stateless(self, body: MarkStatelessIn) -> tuple[int, dict[str, Any]]:
        node = self._exact(body.task_name, body.history)
        if node is None or _env_id(node) != body.env_id:
            return 400, {"success": False}
        graph = self.service.graph(body.task_name)
        self.service.cache._record_test(graph, node.state, STATELESS_KEY, True)
        return 200, {"success": True}

    def store_test_result(self, body: StoreTestResultIn) -> dict[str, Any]:
        if not body.history or body.test_result is None:
            raise InvalidInput("task_name, history, and test_result are required")
        node = self._exact(body.task_name, body.history)
        if node is None:
            return {"success": False}
        graph = self.service.graph(body.task_name)
        self.service.cache._record_test(graph, node.state, TEST_KEY, body.test_result)
        return {"success": True}

    def get_test_result(self, task_name: str, keys: list[str]) -> dict[str, Any]:
        node = self._exact(task_name, keys)
        if node is None or node.tests is None or TEST_KEY not in node.tests:
            return {"found": False, "test_result": None}
        return {"found": True, "test_result": node.tests[TEST_KEY]}

    def get_all_envs(self, task_name: str) -> dict[str, Any]:
        graph = self.service.existing_graph(task_name)
        env_ids: list[str] = []
        if graph is None:
            return {"env_ids": env_ids}
        for node in sorted(graph.snapshot_nodes.values(), key=lambda node: node.id):
            env_id = _env_id(node)
            if env_id is None:
                continue
            lease = self.service.cache._lease_snapshot(node, ENV_KIND)
            assert lease is not None
            self.service.hold(lease, graph.task_id, tag=env_id)
            env_ids.append(env_id)
        return {"env_ids": env_ids}

    def visualize(self) -> dict[str, Any]:
        cache = self.service.cache
        return {task: _serialize(cache.graph(task)) for task in cache.tasks()}


def _serialize(graph: ToolCallGraph) -> dict[str, Any]:
    """The reference's nested tree: each node's fields and ``children`` keyed by the call's string."""

    def fields(node: Node) -> dict[str, Any]:
        tests = node.tests or {}
        return {
            "env_id": _env_id(node),
            "value": None if node.call is None else _value(node),
            "tool_exec_time": None if node.call is None else node.seconds,
            "init_time": None,
            "ttl": None,
            "test_result": tests.get(TEST_KEY),
            "cache_hits": node.hits,
            "prefix_hits": 0,
            "stateless": node.read_only or bool(tests.get(STATELESS_KEY)),
            "children": {},
        }

    root = fields(graph.root)
    stack = [(graph.root, root)]
    while stack:  # iterative: histories can be deeper than Python's recursion limit
        node, out = stack.pop()
        for table in (node.children, node.reads):
            for child in (table or {}).values():
                child_out = fields(child)
                out["children"][wire_key(child)] = child_out
                stack.append((child, child_out))
    return root
