"""The original TVCache server's wire format, answered from the same cache.

The reference client names a tool call by an opaque string (its ``json.dumps(tool_call.to_dict())``) and a
sandbox by an opaque ``env_id``. Here the string ``s`` becomes ``ToolCall("tvcache.wire", {"call": s})`` — the
string itself, byte for byte, is the key (two strings that differ only in key order or whitespace are two calls,
exactly as in the reference), and it is recovered unchanged for ``/prefix_match`` and ``/visualize``. A stored
``value`` may be any JSON value: it is kept as canonical JSON text in the node's output and decoded on the way
out. An ``env_id`` becomes a client-owned snapshot ``Snapshot(kind="tvcache.wire-env", path=env_id)``, so it is
journaled, counted by the snapshot budget and pinned by leases like any snapshot.

**References are leases**, taken so that the released executors' normal request sequences end with none held
(docs/wire-compat.md, "Leases"): ``/prefix_match`` takes one on the env it names, ``/should_fork`` confirms the
caller's (it takes a new one only when no unconfirmed one is held on that env), ``/can_extend`` gives one back,
``/unref`` releases one. **The budget is kept under wire load**: a ``PUT /put`` past the budget evicts the
lowest-reuse unleased envs and returns them in ``removed_env_ids``; what stays over the budget because it is
leased is reported (``over_budget_leased``, and in ``/metrics``), and evicted as soon as a lease on the task goes,
its env id handed to the next ``PUT /put`` of the task. The differences from the reference server (its bugs,
fixed here) are listed in docs/wire-compat.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field

from ..api.params import Param
from ..calls import MAX_TASK_ID, ToolCall, canonical_json
from ..errors import InvalidInput, InvalidToolCall
from ..graph import Node, ToolCallGraph
from ..protocol import Outcome, Snapshot
from . import models as m
from .service import CacheService, HeldLease, NotFound
from .wire_compat import WIRE_TOOL, check_wire_insert, decode_value

__all__ = [
    "ENV_KIND",
    "TEST_KEY",
    "WIRE_ROUTES",
    "WIRE_TOOL",
    "WireCompat",
    "WireRoute",
    "check_wire_insert",
    "decode_value",
    "wire_call",
]

ENV_KIND = "tvcache.wire-env"
TEST_KEY = "tvcache.wire.test_result"
STATELESS_KEY = "tvcache.wire.stateless"
ADMIN_TASK = "__admin__"  # the reference client's X-Task-Name for requests that name no task

WireKey = Annotated[str, Field(max_length=1_000_000)]
History = Annotated[list[WireKey], Field(max_length=100_000)]
NonEmptyHistory = Annotated[list[WireKey], Field(min_length=1, max_length=100_000)]
TaskName = Annotated[str, Field(min_length=1, max_length=MAX_TASK_ID)]
EnvId = Annotated[str, Field(min_length=1, max_length=4096)]


class PutIn(m.Request):
    task_name: TaskName
    history: NonEmptyHistory
    env_id: EnvId | None = None
    values: list[Any] | None = None
    tool_exec_times: list[float | None] | None = None
    start_idx: Annotated[int, Field(ge=0)] = 0


class PrefixMatchIn(m.Request):
    task_name: TaskName
    tool_calls: NonEmptyHistory


class UnrefIn(m.Request):
    env_id: EnvId
    task_name: TaskName | None = None


class MarkStatelessIn(m.Request):
    task_name: TaskName
    history: NonEmptyHistory
    env_id: Annotated[str, Field(max_length=4096)] | None = None


class StoreTestResultIn(m.Request):
    task_name: TaskName
    history: NonEmptyHistory
    test_result: Any


class ShouldForkIn(m.Request):
    task_name: TaskName
    history: NonEmptyHistory


class CanExtendIn(m.Request):
    task_name: TaskName
    history: NonEmptyHistory
    suffix: History | None = None


class RemoveIn(m.Request):
    task_name: TaskName
    history: NonEmptyHistory


# Calls of short keys are kept (at most ~20 MB): every /get of a history builds each of its calls again, and
# building one (canonical JSON and a digest) was a tenth of a hit (py-spy). A ToolCall is immutable.
_KEPT_CALLS = 16_384
_KEPT_KEY_CHARS = 1024


@functools.lru_cache(maxsize=_KEPT_CALLS)
def _kept_call(key: str) -> ToolCall:
    return ToolCall(WIRE_TOOL, {"call": key})


def wire_call(key: str) -> ToolCall:
    if len(key) <= _KEPT_KEY_CHARS:
        return _kept_call(key)
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
        return decode_value(node.output)
    return node.output


def _env_id(node: Node) -> str | None:
    snapshot = node.snapshot
    return snapshot.path if snapshot is not None and snapshot.kind == ENV_KIND else None


def _task(task_name: str | None, header: str | None) -> str | None:
    """The request's task: ``task_name``, checked against the ``X-Task-Name`` header the released client sends
    for a sharding proxy (a proxy routed the request by the header, so a disagreement means a wrong shard)."""
    if header is None or header == ADMIN_TASK or header == "":
        return task_name
    if task_name is None:
        return header
    if header != task_name:
        raise InvalidInput(
            f"the X-Task-Name header ({header!r:.100}) and task_name ({task_name!r:.100}) disagree; a sharding "
            "proxy routes by the header, so both must name the same task"
        )
    return task_name


class WireCompat:
    """The reference routes' semantics over a ``CacheService``."""

    def __init__(self, service: CacheService) -> None:
        self.service = service
        self._confirmed: set[str] = set()  # lease ids a /should_fork has confirmed
        self._pending: dict[str, list[str]] = {}  # task -> env ids evicted when a lease went, for the next PUT
        service.release_hooks.add(self._released)

    # ------------------------------------------------------------------ helpers

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

    def _cached(self, task_name: str, keys: list[str]) -> Node:
        """The node at exactly ``keys``, or NotFound saying how much of the history is cached."""
        graph = self.service.existing_graph(task_name)
        if graph is None:
            raise NotFound(f"no task {task_name!r:.200}: nothing was put for it")
        chain = self._walk(graph, keys)
        if len(chain) < len(keys):
            raise NotFound(
                f"task {task_name!r:.200} has only the first {len(chain)} of these {len(keys)} calls cached; "
                "name a history that /prefix_match or /get found"
            )
        return chain[-1]

    def _leases_on(self, task_id: str | None, env_id: str) -> list[HeldLease]:
        return [
            held
            for held in self.service.leases.values()
            if held.tag == env_id and (task_id is None or held.task_id == task_id)
        ]

    def _lease_env(self, graph: ToolCallGraph, node: Node, env_id: str) -> HeldLease:
        lease = self.service.store.lease_snapshot(node, ENV_KIND)
        assert lease is not None and lease.node is node
        return self.service.hold(lease, graph.task_id, tag=env_id)

    def _released(self, held: HeldLease) -> None:
        """A lease went (``/unref``, expiry, shutdown): what the budget kept only because it was leased goes now."""
        self._confirmed.discard(held.id)
        self._enforce(held.task_id)

    def _budget(self) -> int | None:
        return self.service.store.budget.max_snapshots_per_task

    def _enforce(self, task_id: str, *, keep: Node | None = None) -> None:
        """Evict unleased envs, lowest expected reuse first, while the task is over its snapshot budget. Only wire
        envs: a native client learns of its evicted snapshots from its own attach responses. ``keep``: the env
        just put, which the put's own answer must not hand back."""
        budget = self._budget()
        graph = self.service.existing_graph(task_id)
        if budget is None or graph is None or len(graph.snapshot_nodes) <= budget:
            return
        store = self.service.store
        now = store.clock()
        candidates = sorted(
            (
                node
                for node in graph.snapshot_nodes.values()
                if node.leases == 0 and node is not keep and _env_id(node) is not None
            ),
            key=lambda node: store.eviction.priority(node, now),
        )
        for node in candidates:
            if len(graph.snapshot_nodes) <= budget:
                break
            snapshot = store.detach_snapshot(graph, node)
            self._pending.setdefault(task_id, []).append(snapshot.path)
            self.service.counters["snapshots_evicted"] += 1

    def _over_budget(self, graph: ToolCallGraph) -> int:
        budget = self._budget()
        return 0 if budget is None else max(0, len(graph.snapshot_nodes) - budget)

    def stats(self) -> dict[str, int]:
        """Gauges for ``/metrics`` and ``/v1/stats``."""
        graphs = self.service.store.graphs()
        return {
            "wire_envs": sum(1 for g in graphs for node in g.snapshot_nodes.values() if _env_id(node) is not None),
            "wire_envs_over_budget_leased": sum(self._over_budget(g) for g in graphs),
            "wire_envs_pending_removal": sum(len(ids) for ids in self._pending.values()),
            "wire_leases": sum(1 for held in self.service.leases.values() if held.tag is not None),
        }

    # ------------------------------------------------------------------ lookups

    def get(self, task_name: str, keys: list[str], header: str | None = None) -> dict[str, Any]:
        task_name = _task(task_name, header) or task_name
        if not keys:
            raise InvalidInput("tool_calls is required: the history to look up, one tool_calls parameter per call")
        service = self.service
        service.counters["lookups"] += 1
        node = self._exact(task_name, keys)
        if node is None:
            # Not tallied as a miss: like a native /v1/lookup miss, the execution is counted when it is put.
            return {"found": False, "env_id": None, "value": None, "tool_exec_time": None}
        graph = service.graph(task_name)
        service.store.touch(graph, node)
        service.counters["lookup_hits"] += 1
        service.activity.hit(task_name, None, seconds_saved=node.seconds)
        return {"found": True, "env_id": _env_id(node), "value": _value(node), "tool_exec_time": node.seconds}

    def _prefix(self, task_name: str, keys: list[str]) -> tuple[Node | None, int]:
        """The deepest node along ``keys`` holding an env, and its depth (0: none); leased unless it is at the
        whole history."""
        service = self.service
        service.counters["lookups"] += 1
        graph = service.existing_graph(task_name)
        chain = self._walk(graph, keys)
        depth = 0
        for index, node in enumerate(chain):
            if _env_id(node) is not None:
                depth = index + 1
        if graph is None or depth == 0:
            return None, 0
        node = chain[depth - 1]
        env_id = _env_id(node)
        assert env_id is not None
        # At the whole history the released executors read the value with /get and never /unref: no lease.
        if depth < len(keys):
            self._lease_env(graph, node, env_id)
        return node, depth

    def prefix_match(self, body: PrefixMatchIn, header: str | None = None) -> dict[str, Any]:
        task = _task(body.task_name, header) or body.task_name
        node, depth = self._prefix(task, body.tool_calls)
        if node is None:
            return {"found": False, "env_id": None, "history": None}
        return {"found": True, "env_id": _env_id(node), "history": body.tool_calls[:depth]}

    def intel_prefix_match(self, body: PrefixMatchIn, header: str | None = None) -> dict[str, Any]:
        """``/prefix_match`` plus the calls still to execute after the env (``suffix``). The reference never
        implemented its "intelligent" variant (NotImplementedError); this is what its executor needs."""
        task = _task(body.task_name, header) or body.task_name
        node, depth = self._prefix(task, body.tool_calls)
        if node is None:
            return {"found": False, "env_id": None, "history": None, "suffix": None}
        return {
            "found": True,
            "env_id": _env_id(node),
            "history": body.tool_calls[:depth],
            "suffix": body.tool_calls[depth:],
        }

    def get_test_result(self, task_name: str, keys: list[str], header: str | None = None) -> dict[str, Any]:
        task_name = _task(task_name, header) or task_name
        node = self._exact(task_name, keys)
        if node is None or node.tests is None or TEST_KEY not in node.tests:
            return {"found": False, "test_result": None}
        return {"found": True, "test_result": node.tests[TEST_KEY]}

    def check_env_marked(self, env_id: str, header: str | None = None) -> dict[str, Any]:
        """Whether a node holds ``env_id`` now (in the header's task, or in any task)."""
        task = _task(None, header)
        cache = self.service.cache
        tasks = [task] if task is not None else cache.tasks()
        for task_id in tasks:
            graph = self.service.existing_graph(task_id)
            if graph is not None and any(_env_id(node) == env_id for node in graph.snapshot_nodes.values()):
                return {"marked": True}
        return {"marked": False}

    def get_hot_nodes(self, k: int) -> dict[str, Any]:
        """Per task, the histories of the nodes with more than ``k`` cached calls after them."""
        cache = self.service.cache
        hot: dict[str, list[list[str]]] = {}
        for task_id in cache.tasks():
            graph = cache.graph(task_id)
            paths = []
            for node in sorted(graph.nodes(), key=lambda node: node.id):
                if node.call is None:
                    continue
                fanout = len(node.children or ()) + len(node.reads or ())
                if fanout > k:
                    paths.append([wire_key(step) for step in node.path()])
            hot[task_id] = paths
        return {"hot_nodes": hot}

    # ------------------------------------------------------------------ writes

    def put(self, body: PutIn, header: str | None = None) -> dict[str, Any]:
        service = self.service
        task = _task(body.task_name, header) or body.task_name
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
        # Check everything before writing anything, so a bad request changes nothing.
        existing = service.existing_graph(task)
        cursor: Node | None = None if existing is None else existing.root
        plan: list[tuple[ToolCall, Node | None, str | None, float]] = []
        for index, key in enumerate(history):
            call = wire_call(key)
            node = cursor.step(call) if cursor is not None else None
            if node is not None and node.read_only:
                raise InvalidInput(f"history[{index}] is a read-only call of a native client, not a state")
            if node is None and index < start:
                raise InvalidInput(
                    f"history[{index}] is not cached and has no value (it is before start_idx={start}); "
                    "put the values of every call that is not cached yet"
                )
            output: str | None = None
            seconds = 0.0
            if node is None:
                assert values is not None
                try:
                    output = canonical_json(values[index - start]).decode()
                except InvalidToolCall as error:
                    raise InvalidInput(f"values[{index - start}] cannot be stored: {error}") from None
                seconds = float((times[index - start] if times is not None else None) or 0.0)
            plan.append((call, node, output, seconds))
            cursor = node
        graph = service.graph(task)
        state = graph.root
        for call, planned, output, seconds in plan:
            node = planned
            if node is None:
                assert output is not None
                node = service.store.record(
                    graph, state, call, Outcome(output=output), seconds=seconds, read_only=False
                )
                service.counters["inserts"] += 1
                service.activity.miss(task, None, seconds_executed=seconds)
            state = node
        removed: list[str] = []
        if body.env_id is not None:
            # The env now holds the leaf's state: it no longer represents any ancestor it was recorded at.
            ancestor: Node | None = state.parent
            while ancestor is not None:
                if _env_id(ancestor) == body.env_id and ancestor.leases == 0:
                    service.store.detach_snapshot(graph, ancestor)
                ancestor = ancestor.parent
            snapshot = Snapshot(kind=ENV_KIND, path=body.env_id, bytes=0)
            attached = service.attach_snapshot(graph, state, snapshot)
            removed = [old.path for old in attached.evicted if old.kind == ENV_KIND]
        self._enforce(task, keep=state)
        removed += self._pending.pop(task, [])
        return {"success": True, "removed_env_ids": removed, "over_budget_leased": self._over_budget(graph)}

    def should_fork(self, body: ShouldForkIn, header: str | None = None) -> dict[str, Any]:
        """The env to fork at exactly ``history``. The released executor calls it right after ``/prefix_match``
        and releases one reference afterwards, so it confirms the lease ``/prefix_match`` took instead of taking
        a second one."""
        task = _task(body.task_name, header) or body.task_name
        node = self._cached(task, body.history)
        env_id = _env_id(node)
        if env_id is None:
            raise NotFound(
                f"no env is stored at this history of task {task!r:.200} (it was evicted or never put); "
                "ask /prefix_match again"
            )
        unconfirmed = [held for held in self._leases_on(task, env_id) if held.id not in self._confirmed]
        if unconfirmed:
            held = unconfirmed[0]
        else:
            graph = self.service.graph(task)
            held = self._lease_env(graph, node, env_id)
        self._confirmed.add(held.id)
        return {"should_fork": True, "env_id": env_id}

    def can_extend(self, body: CanExtendIn, header: str | None = None) -> dict[str, Any]:
        """Always false: an env in the graph is a frozen state here, never extended in place (the reference's
        mutable tree handed it to the first caller to mutate). The empty suffix sends the released
        ``ToolCallExecutor`` to fork or to its own env, and since it never ``/unref``s after a false, the
        reference ``/prefix_match`` took on this env is given back."""
        task = _task(body.task_name, header) or body.task_name
        node = self._cached(task, body.history)
        env_id = _env_id(node)
        if env_id is not None:
            unconfirmed = [held for held in self._leases_on(task, env_id) if held.id not in self._confirmed]
            if unconfirmed:
                self.service.release_lease(unconfirmed[0].id)
        return {"can_extend": False, "suffix": []}

    def unref(self, body: UnrefIn, header: str | None = None) -> dict[str, Any]:
        task = _task(body.task_name, header)
        held = self._leases_on(task, body.env_id)
        if not held:
            raise NotFound(
                f"no reference is held on env {body.env_id!r:.200}" + (f" in task {task!r:.200}" if task else "")
            )
        # A confirmed reference is one a fork is using right now; either kind pins the same env.
        held.sort(key=lambda lease: lease.id not in self._confirmed)
        self.service.release_lease(held[0].id)
        return {"success": True}

    def remove(self, body: RemoveIn, header: str | None = None) -> dict[str, Any]:
        """Forget the node at ``history`` and everything cached after it (their values were computed in states
        that followed it). Its envs are handed back in the next ``PUT /put``'s ``removed_env_ids``."""
        task = _task(body.task_name, header) or body.task_name
        node = self._cached(task, body.history)
        graph = self.service.graph(task)
        subtree = graph.subtree(node)
        leased = [n for n in subtree if n.leases]
        if leased:
            raise InvalidInput(
                f"{len(leased)} env(s) below this history are referenced (a fork is using them); /unref them first"
            )
        native = [n for n in subtree if n.snapshot is not None and _env_id(n) is None]
        if native:
            raise InvalidInput(f"{len(native)} node(s) below this history hold native clients' snapshots")
        for snapshot in self.service.store.remove(graph, node):
            self._pending.setdefault(task, []).append(snapshot.path)
        return {"success": True}

    def mark_stateless(self, body: MarkStatelessIn, header: str | None = None) -> tuple[int, dict[str, Any]]:
        task = _task(body.task_name, header) or body.task_name
        node = self._exact(task, body.history)
        if node is None:
            return 400, {"success": False, "error": "this history is not cached"}
        if _env_id(node) != body.env_id:
            return 400, {
                "success": False,
                "error": f"the env at this history is {_env_id(node)!r}, not {body.env_id!r}",
            }
        graph = self.service.graph(task)
        self.service.store.record_test(graph, node.state, STATELESS_KEY, True)
        return 200, {"success": True}

    def store_test_result(self, body: StoreTestResultIn, header: str | None = None) -> dict[str, Any]:
        task = _task(body.task_name, header) or body.task_name
        if body.test_result is None:
            raise InvalidInput("task_name, history, and test_result are required")
        node = self._cached(task, body.history)
        graph = self.service.graph(task)
        self.service.store.record_test(graph, node.state, TEST_KEY, body.test_result)
        return {"success": True}

    def get_all_envs(self, task_name: str, header: str | None = None) -> dict[str, Any]:
        """Every env of the task, each referenced once (the fork bank ``/unref``s each after forking it)."""
        task_name = _task(task_name, header) or task_name
        graph = self.service.existing_graph(task_name)
        env_ids: list[str] = []
        if graph is None:
            return {"env_ids": env_ids}
        for node in sorted(graph.snapshot_nodes.values(), key=lambda node: node.id):
            env_id = _env_id(node)
            if env_id is None:
                continue
            self._lease_env(graph, node, env_id)
            env_ids.append(env_id)
        return {"env_ids": env_ids}

    def visualize(self, path: str | None = None) -> dict[str, Any]:
        if path is not None and path.strip():
            raise InvalidInput("reading saved runs from the server's disk is not supported; use GET /v1/graph")
        cache = self.service.cache
        return {task: _serialize(cache.graph(task)) for task in cache.tasks()}


# ---------------------------------------------------------------------- the route table

Answer = dict[str, Any] | tuple[int, dict[str, Any]]


@dataclass(frozen=True, kw_only=True)
class WireRoute:
    """One reference route: the app, its OpenAPI document and the tests are built from ``WIRE_ROUTES``.
    ``call(wire, request, header)`` gets the validated body (``body`` routes) or the parsed query (a dict)."""

    method: str
    path: str
    summary: str
    call: Callable[[WireCompat, Any, str | None], Answer]
    body: type[m.Request] | None = None
    query: tuple[Param, ...] = ()
    timed: bool = False  # observed in the lookup latency histogram


MAX_K = 1_000_000_000


def _query(name: str, **options: Any) -> Param:
    """A parameter read as the original release reads it (``tvcache.api.params``)."""
    return Param(name=name, reference=True, **options)


_TASK = _query("task_name")
_CALLS = _query("tool_calls", repeated=True)

WIRE_ROUTES: tuple[WireRoute, ...] = (
    WireRoute(
        method="GET", path="/get", summary="exact match of a history", query=(_TASK, _CALLS), timed=True,
        call=lambda w, q, h: w.get(q["task_name"], q["tool_calls"], h),
    ),
    WireRoute(method="PUT", path="/put", summary="store a history, its values and its env", body=PutIn,
              call=lambda w, b, h: w.put(b, h)),
    WireRoute(method="POST", path="/prefix_match", summary="longest prefix with an env (leases it)",
              body=PrefixMatchIn, call=lambda w, b, h: w.prefix_match(b, h)),
    WireRoute(method="POST", path="/intel_prefix_match", summary="prefix_match plus the suffix to execute",
              body=PrefixMatchIn, call=lambda w, b, h: w.intel_prefix_match(b, h)),
    WireRoute(method="POST", path="/should_fork", summary="the env to fork at a history (confirms the lease)",
              body=ShouldForkIn, call=lambda w, b, h: w.should_fork(b, h)),
    WireRoute(method="POST", path="/can_extend", summary="never: envs are not extended in place",
              body=CanExtendIn, call=lambda w, b, h: w.can_extend(b, h)),
    WireRoute(method="POST", path="/unref", summary="release an env reference", body=UnrefIn,
              call=lambda w, b, h: w.unref(b, h)),
    WireRoute(method="DELETE", path="/remove", summary="forget a history and what was cached after it",
              body=RemoveIn, call=lambda w, b, h: w.remove(b, h)),
    WireRoute(method="POST", path="/mark_stateless", summary="flag a node stateless", body=MarkStatelessIn,
              call=lambda w, b, h: w.mark_stateless(b, h)),
    WireRoute(method="POST", path="/store_test_result", summary="store a test result", body=StoreTestResultIn,
              call=lambda w, b, h: w.store_test_result(b, h)),
    WireRoute(
        method="GET", path="/get_test_result", summary="a stored test result", query=(_TASK, _CALLS),
        call=lambda w, q, h: w.get_test_result(q["task_name"], q["tool_calls"], h),
    ),
    WireRoute(method="GET", path="/get_all_envs", summary="every env of a task (each referenced)", query=(_TASK,),
              call=lambda w, q, h: w.get_all_envs(q["task_name"], h)),
    WireRoute(
        method="GET", path="/get_hot_nodes", summary="histories with more than k cached calls after them",
        query=(_query("k", required=False, integer=True, default=1, high=MAX_K),),
        call=lambda w, q, h: w.get_hot_nodes(q["k"]),
    ),
    WireRoute(method="GET", path="/check_env_marked", summary="whether a node holds an env",
              query=(_query("env_id"),), call=lambda w, q, h: w.check_env_marked(q["env_id"], h)),
    WireRoute(method="GET", path="/visualize", summary="the trees as nested JSON",
              query=(_query("path", required=False),), call=lambda w, q, h: w.visualize(q["path"])),
)  # fmt: skip


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
