"""What the server does, independent of HTTP: a ``Cache`` plus the state only a shared server needs.

* **Claims** coalesce executions across clients: the first client missing a call at a state owns it, the others
  wait (long-poll) for its insert. A claim has a TTL the owner renews by heartbeat; a claim whose owner stopped
  renewing (it died) expires, its waiters are told so, and the next client to claim takes over.
* **Leases** pin snapshots against eviction while a client forks them, also with a TTL, so a client that dies
  holding one cannot pin it forever.
* **Snapshots belong to clients.** The server records them and never opens, checks or deletes their paths:
  snapshots the budget evicts are handed back in the response for their owner to free.

Everything here runs on the server's event loop thread; the cache journals every insert before it returns, so
a response is only sent for a durable insert. Claims and leases are not journaled: after a restart clients
simply claim again.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cache import Cache
from ..calls import ToolCall, check_task_id
from ..defaults import CLAIM_TTL, LEASE_TTL
from ..errors import InvalidInput, NotFound, ServerBusy
from ..graph import Lease, Node, ToolCallGraph, snapshot_key
from ..policies import Budget
from ..protocol import Outcome, Snapshot
from ..store.inflight import ClaimKey, Inflight
from ..store.local import LocalStore
from ..store.protocol import Attached
from . import models as m
from .activity import Activity, Tally
from .wire_compat import WIRE_TOOL, ReleaseHooks, check_wire_insert

__all__ = ["CacheService", "NotFound", "ServerBusy"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ClaimEnd:
    """How a claim ended: ``done`` (with the node inserted, or None: not cacheable, waiters execute it
    themselves), ``failed`` (the owner's error) or ``expired`` (its owner stopped renewing it)."""

    status: str
    node_id: int | None = None
    error: str | None = None


@dataclass(kw_only=True)
class HeldClaim:
    """A claim a client owns, on top of the in-flight table's entry: an id, and a TTL it renews."""

    id: str
    key: ClaimKey
    expires: float
    ready: Future[ClaimEnd]


@dataclass(kw_only=True)
class HeldLease:
    id: str
    lease: Lease
    task_id: str
    expires: float
    tag: str | None = None  # the wire format's env id, for /unref (``wire_compat``)


def to_call(call: m.CallIn) -> ToolCall:
    return ToolCall(call.name, call.arguments)


def node_out(node: Node, *, hits: bool = False) -> m.NodeOut:
    snapshot = node.snapshot
    call = node.call
    return m.NodeOut(
        id=node.id,
        parent=None if node.parent is None else node.parent.id,
        name=None if call is None else call.name,
        arguments=None if call is None else call.arguments,
        digest=None if call is None else call.hexdigest,
        output=node.output,
        is_error=node.is_error,
        seconds=node.seconds,
        read_only=node.read_only,
        snapshot=None
        if snapshot is None
        else m.SnapshotOut(kind=snapshot.kind, path=snapshot.path, bytes=snapshot.bytes, meta=dict(snapshot.meta)),
        hits=node.hits if hits else 0,
    )


def snapshot_out(snapshot: Snapshot) -> m.SnapshotOut:
    return m.SnapshotOut(kind=snapshot.kind, path=snapshot.path, bytes=snapshot.bytes, meta=dict(snapshot.meta))


class CacheService:
    """The shared state behind ``tvcache serve``."""

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        budget: Budget | None = None,
        fsync: bool = False,
        claim_ttl: float = CLAIM_TTL,
        lease_ttl: float = LEASE_TTL,
        max_held: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # Evicted records go back to the clients that own them (``Attached.evicted``): the server frees nothing.
        self.store = LocalStore(
            data_dir, budget=budget, fsync=fsync, discard=_handed_back, verify_snapshots=False, clock=clock
        )
        self.cache = Cache(store=self.store)
        # Which server process the node ids in answers belong to. Random per start, even with a data directory: a
        # restarted server (in memory, or one whose journal lost records) hands out ids again for other states, so
        # clients drop what they hold of an earlier instance (HTTP header ``X-TVCache-Instance``, see app.py).
        self.instance = secrets.token_hex(8)
        self.claim_ttl = claim_ttl
        self.lease_ttl = lease_ttl
        # Claims and leases live up to their TTL (clients may ask for a day): without a bound, any client could
        # grow the server's memory by asking for many.
        self.max_held = max_held
        self._clock = clock
        self._inflight: Inflight[ClaimEnd] = Inflight()
        self._claims: dict[ClaimKey, HeldClaim] = {}
        self._claims_by_id: dict[str, HeldClaim] = {}
        self.leases: dict[str, HeldLease] = {}
        # Run after each lease is released (expiry included): the wire format evicts what only a lease kept.
        self.release_hooks: ReleaseHooks[HeldLease] = ReleaseHooks()
        self.activity = Activity(tracked=self.cache.__contains__)
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "lookups",
                "lookup_hits",
                "claims",
                "claims_owned",
                "claims_taken_over",
                "waits",
                "coalesced",
                "inserts",
                "inserts_existing",
                "snapshots_attached",
                "snapshots_evicted",
                "leases",
                "leases_expired",
                "tests_stored",
            ),
            0,
        )

    # ------------------------------------------------------------------ lookup helpers

    def graph(self, task_id: str) -> ToolCallGraph:
        """The task's graph, created on first use (a write creates a task; lookups never do)."""
        return self.cache.graph(task_id)

    def write_target(self, task_id: str, node_id: int) -> tuple[ToolCallGraph, Node]:
        """The graph and state a write goes to. A task is created by its first write, which can only go to its
        root: a write naming another node of a task that does not exist is refused before a graph is created
        (an empty graph would stay in memory forever)."""
        if node_id != 0 and task_id not in self.cache:
            raise NotFound(f"task {task_id!r} has no node {node_id}; look the history up again")
        graph = self.graph(task_id)
        return graph, self.state_node(graph, node_id)

    def existing_graph(self, task_id: str) -> ToolCallGraph | None:
        return self.cache.graph(task_id) if task_id in self.cache else None

    def state_node(self, graph: ToolCallGraph, node_id: int) -> Node:
        node = graph.get(node_id)
        if node is None:
            raise NotFound(f"task {graph.task_id!r} has no node {node_id}; look the history up again")
        if node.read_only:
            raise InvalidInput(f"node {node_id} is a read-only call, not a state; pass the id of its parent state")
        return node

    def node(self, task_id: str, node_id: int) -> Node:
        graph = self.existing_graph(task_id)
        node = None if graph is None else graph.get(node_id)
        if node is None:
            raise NotFound(f"task {task_id!r} has no node {node_id}")
        return node

    # ------------------------------------------------------------------ native operations

    def lookup(self, body: m.LookupIn) -> m.LookupOut:
        self.counters["lookups"] += 1
        if body.history is not None:
            if body.state is not None or body.call is not None:
                raise InvalidInput("give either history, or state and call, not both")
            history = [to_call(call) for call in body.history]
            graph = self.existing_graph(body.task_id)
            if graph is None:
                return m.LookupOut(hit=False, node=None, state=0, matched=0, snapshot=None)
            read_only = set(body.read_only_tools)
            match = self.store.match(
                graph, history, is_read_only=(lambda call: call.name in read_only) if read_only else None
            )
            if match.hit:
                self.counters["lookup_hits"] += 1
            if match.hit and match.node is not None:
                self.activity.hit(body.task_id, body.epoch, seconds_saved=match.node.seconds)
            return m.LookupOut(
                hit=match.hit,
                node=None if match.node is None else node_out(match.node),
                state=match.state.id,
                matched=match.matched,
                snapshot=None if match.snapshot is None else match.snapshot.id,
            )
        if body.state is None or body.call is None:
            raise InvalidInput("give either history, or state and call")
        call = to_call(body.call)
        graph = self.existing_graph(body.task_id)
        if graph is None:
            if body.state != 0:
                raise NotFound(f"task {body.task_id!r} has no node {body.state}")
            return m.LookupOut(hit=False, node=None, state=0, matched=0, snapshot=None)
        state = self.state_node(graph, body.state)
        node = self.store.lookup(graph, state, call)
        if node is not None:
            self.counters["lookup_hits"] += 1
            self.activity.hit(body.task_id, body.epoch, seconds_saved=node.seconds)
        return m.LookupOut(
            hit=node is not None,
            node=None if node is None else node_out(node),
            state=state.id,
            matched=1 if node is not None else 0,
            snapshot=None,
        )

    def touch(self, body: m.TouchIn) -> m.OkOut:
        graph = self.existing_graph(body.task_id)
        if graph is not None:
            for node_id in body.node_ids:
                node = graph.get(node_id)
                if node is not None:
                    self.store.touch(graph, node)
                    self.activity.hit(body.task_id, body.epoch, seconds_saved=node.seconds)
        return m.OkOut(ok=True)

    def insert(self, body: m.InsertIn) -> m.InsertOut:
        call = to_call(body.call)
        if call.name == WIRE_TOOL:  # wire readers serve this node: it must be what PUT /put would store
            check_wire_insert(call.name, call.arguments, body.output)
        graph, parent = self.write_target(body.task_id, body.parent)
        existing = parent.step(call)
        outcome = Outcome(output=body.output, is_error=body.is_error)
        node = self.store.record(graph, parent, call, outcome, seconds=body.seconds, read_only=body.read_only)
        self.counters["inserts" if existing is None else "inserts_existing"] += 1
        self.activity.miss(graph.task_id, body.epoch, seconds_executed=body.seconds)
        self._finish_claim((graph.task_id, parent.id, call.digest), node_id=node.id)
        return m.InsertOut(created=existing is None, node=node_out(node))

    def path(self, task_id: str, node_id: int) -> m.PathOut:
        node: Node | None = self.node(task_id, node_id)
        nodes: list[m.NodeOut] = []
        while node is not None and node.parent is not None:
            nodes.append(node_out(node))
            node = node.parent
        nodes.reverse()
        return m.PathOut(nodes=nodes)

    # ------------------------------------------------------------------ claims

    def claim(self, body: m.ClaimIn) -> m.ClaimOut:
        self.counters["claims"] += 1
        call = to_call(body.call)
        # A claim on a task nobody recorded yet creates nothing: the owner's insert creates the task (claims
        # are kept for their TTL only; a graph would be kept forever, even when the owner never inserts).
        graph = self.existing_graph(body.task_id)
        if graph is None:
            check_task_id(body.task_id)
            if body.state != 0:
                raise NotFound(f"task {body.task_id!r} has no node {body.state}; look the history up again")
        else:
            node = self.store.lookup(graph, self.state_node(graph, body.state), call)
            if node is not None:
                return m.ClaimOut(status="hit", node=node_out(node))
        key = (body.task_id, body.state, call.digest)
        current = self._live_claim(key)
        if current is not None:
            return m.ClaimOut(status="wait", claim_id=None)
        self._make_room(self._claims, "claims")
        ttl = body.ttl or self.claim_ttl
        entry = self._inflight.claim(key)
        assert entry.owner  # no live claim on the key: nobody else holds it
        claim = HeldClaim(id=secrets.token_hex(12), key=key, expires=self._clock() + ttl, ready=entry.ready)
        self._claims[key] = claim
        self._claims_by_id[claim.id] = claim
        self.counters["claims_owned"] += 1
        return m.ClaimOut(status="owner", claim_id=claim.id, ttl=ttl)

    def _live_claim(self, key: ClaimKey) -> HeldClaim | None:
        """The pending claim on ``key``, expiring it first if its owner stopped renewing it."""
        claim = self._claims.get(key)
        if claim is None:
            return None
        if claim.expires <= self._clock():
            self._end_claim(claim, "expired")
            self.counters["claims_taken_over"] += 1
            return None
        return claim

    def _end_claim(
        self, claim: HeldClaim, status: str, *, node_id: int | None = None, error: str | None = None
    ) -> None:
        self._inflight.settle(claim.key, ClaimEnd(status=status, node_id=node_id, error=error), only=claim.ready)
        if self._claims.get(claim.key) is claim:
            del self._claims[claim.key]
        self._claims_by_id.pop(claim.id, None)

    def _finish_claim(self, key: ClaimKey, *, node_id: int) -> None:
        claim = self._claims.get(key)
        if claim is not None:
            self._end_claim(claim, "done", node_id=node_id)

    def heartbeat(self, body: m.HeartbeatIn) -> m.ClaimOut:
        claim = self._claims_by_id.get(body.claim_id)
        if claim is None or self._live_claim(claim.key) is not claim:
            raise NotFound(f"claim {body.claim_id} is no longer held (it finished, or expired and was taken over)")
        ttl = body.ttl or self.claim_ttl
        claim.expires = self._clock() + ttl
        return m.ClaimOut(status="owner", claim_id=claim.id, ttl=ttl)

    def resolve(self, body: m.ResolveIn) -> m.OkOut:
        claim = self._claims_by_id.get(body.claim_id)
        if claim is None:
            return m.OkOut(ok=False)
        if body.error is not None:
            self._end_claim(claim, "failed", error=body.error)
        else:  # executed but not cacheable here: waiters execute it themselves, uncached
            self._end_claim(claim, "done", node_id=None)
        return m.OkOut(ok=True)

    async def wait(self, body: m.WaitIn) -> m.WaitOut:
        """Long-poll until the claim on (state, call) finishes, fails, expires, or ``timeout`` passes."""
        self.counters["waits"] += 1
        call = to_call(body.call)
        deadline = time.monotonic() + body.timeout
        while True:
            # Looked up on every round: the claimed call may be the first of its task, whose insert creates it.
            graph = self.existing_graph(body.task_id)
            if graph is not None:
                node = self.state_node(graph, body.state).step(call)
                if node is not None:
                    self.counters["coalesced"] += 1
                    return m.WaitOut(status="done", node=node_out(node))
            claim = self._live_claim((body.task_id, body.state, call.digest))
            if claim is None:
                return m.WaitOut(status="none")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return m.WaitOut(status="pending")
            # Wake at the claim's expiry too, so a dead owner is noticed without a sweeper.
            until_expiry = max(0.0, claim.expires - self._clock()) + 0.001
            try:
                end = await asyncio.wait_for(
                    asyncio.shield(asyncio.wrap_future(claim.ready)), timeout=min(remaining, until_expiry)
                )
            except TimeoutError:
                continue
            if end.status == "done":
                if end.node_id is None:
                    return m.WaitOut(status="done", node=None)
                continue  # the node is in the graph now: answered at the top of the loop
            if end.status == "failed":
                return m.WaitOut(status="failed", error=end.error)
            return m.WaitOut(status="expired")

    # ------------------------------------------------------------------ snapshots

    def attach(self, body: m.AttachIn) -> m.AttachOut:
        graph, node = self.write_target(body.task_id, body.node_id)
        snapshot = Snapshot(
            kind=body.snapshot.kind, path=body.snapshot.path, bytes=body.snapshot.bytes, meta=body.snapshot.meta
        )
        key = snapshot_key(snapshot)
        if graph.snapshot_paths.get(key) == node.id:
            # The node holds this very storage already (a retried attach): handing the record back to be freed
            # would delete the snapshot the node still holds.
            return m.AttachOut(attached=False, evicted=[])
        if any(key in other.snapshot_paths for other in self.store.graphs()):
            # A record is only a client's claim about a path, and evicted records go back to clients to free:
            # a second record of storage another node holds would let evicting it free that node's data.
            raise InvalidInput(
                f"snapshot path {snapshot.path!r:.300} is attached to another node already; "
                "each snapshot needs storage of its own"
            )
        result = self.attach_snapshot(graph, node, snapshot)
        return m.AttachOut(attached=result.attached, evicted=[snapshot_out(old) for old in result.evicted])

    def attach_snapshot(self, graph: ToolCallGraph, node: Node, snapshot: Snapshot) -> Attached:
        """Attach, counted; ``evicted`` holds the snapshots whose owners must now free them (the new one itself
        when the node already had a snapshot)."""
        result = self.store.attach_snapshot(graph, node, snapshot)
        if result.attached:
            self.counters["snapshots_attached"] += 1
            self.counters["snapshots_evicted"] += len(result.evicted)
        return result

    def lease(self, body: m.LeaseIn) -> m.LeaseOut:
        graph = self.existing_graph(body.task_id)
        if graph is None:
            return m.LeaseOut(lease_id=None, node=None, ttl=None)
        state = self.state_node(graph, body.state)
        lease = self.store.lease_snapshot(state, body.kind, skip=frozenset(body.skip))
        if lease is None:
            return m.LeaseOut(lease_id=None, node=None, ttl=None)
        held = self.hold(lease, graph.task_id, ttl=body.ttl)
        return m.LeaseOut(lease_id=held.id, node=node_out(lease.node), ttl=held.expires - self._clock())

    def drop(self, body: m.DropIn) -> m.DropOut:
        graph = self.existing_graph(body.task_id)
        node = None if graph is None else graph.get(body.node_id)
        if graph is None or node is None or node.snapshot is None or node.snapshot.path != body.path:
            return m.DropOut(dropped=False, evicted=[])  # gone already, or the node has another snapshot now
        dropped = self.store.drop_snapshot(graph, node)
        self.counters["snapshots_evicted"] += len(dropped.evicted)
        return m.DropOut(dropped=dropped.dropped, evicted=[snapshot_out(old) for old in dropped.evicted])

    def _make_room(self, held: Mapping[Any, Any], what: str) -> None:
        if len(held) >= self.max_held:
            self.sweep()
            if len(held) >= self.max_held:
                raise ServerBusy(
                    f"the server holds {len(held)} {what}, its limit (max_held); retry once some have ended"
                )

    def hold(self, lease: Lease, task_id: str, *, ttl: float | None = None, tag: str | None = None) -> HeldLease:
        try:
            self._make_room(self.leases, "leases")
        except ServerBusy:
            self.store.release(lease)
            raise
        expires = self._clock() + (ttl or self.lease_ttl)
        held = HeldLease(id=secrets.token_hex(12), lease=lease, task_id=task_id, expires=expires, tag=tag)
        self.leases[held.id] = held
        self.counters["leases"] += 1
        return held

    def release(self, body: m.ReleaseIn) -> m.OkOut:
        return m.OkOut(ok=self.release_lease(body.lease_id))

    def release_lease(self, lease_id: str) -> bool:
        held = self.leases.pop(lease_id, None)
        if held is None:
            return False
        self.store.release(held.lease)
        self.release_hooks.run(held)
        return True

    def sweep(self) -> int:
        """Release expired leases and expire abandoned claims; returns how many were ended."""
        now = self._clock()
        ended = 0
        for held in [held for held in self.leases.values() if held.expires <= now]:
            self.release_lease(held.id)
            self.counters["leases_expired"] += 1
            ended += 1
        for claim in [claim for claim in self._claims.values() if claim.expires <= now]:
            self._end_claim(claim, "expired")
            self.counters["claims_taken_over"] += 1
            ended += 1
        return ended

    # ------------------------------------------------------------------ tests, tools

    def test_get(self, body: m.TestGetIn) -> m.TestOut:
        graph = self.existing_graph(body.task_id)
        node = None if graph is None else graph.get(body.node_id)
        if graph is None or node is None:
            return m.TestOut(found=False)
        found = self.store.lookup_test(graph, node, body.key)
        return m.TestOut(found=found.found, value=found.value)

    def test_put(self, body: m.TestPutIn) -> m.OkOut:
        graph, node = self.write_target(body.task_id, body.node_id)
        self.store.record_test(graph, node, body.key, body.value)
        self.counters["tests_stored"] += 1
        return m.OkOut(ok=True)

    def mark_nondeterministic(self, body: m.NondeterministicIn) -> m.NondeterministicOut:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if body.task_id is None:
                self.cache.mark_nondeterministic(body.tool, body.reason)
            elif body.task_id not in self.cache:
                # marks are evidence seen in a task's calls: one naming a task never recorded would be kept
                # (journaled) forever, for nothing
                raise NotFound(f"task {body.task_id!r:.300} is not in the cache; mark tools in tasks it holds")
            else:
                self.store.mark_nondeterministic(body.tool, body.reason, task_id=body.task_id)
        return self.nondeterministic()

    def clear_nondeterministic(self, body: m.ClearNondeterministicIn) -> m.ClearedOut:
        return m.ClearedOut(cleared=self.cache.clear_nondeterministic(body.tool, task_id=body.task_id))

    def nondeterministic(self) -> m.NondeterministicOut:
        marks = self.cache.nondeterministic_marks()
        return m.NondeterministicOut(
            tools={mark.tool: mark.reason for mark in marks if mark.task_id is None},
            marks=[m.MarkOut(tool=mark.tool, task_id=mark.task_id, reason=mark.reason) for mark in marks],
        )

    # ------------------------------------------------------------------ inspection

    def stats(self) -> dict[str, Any]:
        stats = self.cache.stats()
        total = self.activity.total()
        return {
            "tasks": stats.tasks,
            "nodes": stats.nodes,
            "snapshots": stats.snapshots,
            "snapshot_bytes": stats.snapshot_bytes,
            "claims_active": len(self._claims),
            "leases_active": len(self.leases),
            "nondeterministic_tools": len(self.cache.nondeterministic_tools),
            "lookup_misses": self.counters["lookups"] - self.counters["lookup_hits"],
            **self.counters,
            # Calls answered from the cache (replica hits included) and calls executed: see ``activity``.
            "hits": total.hits,
            "misses": total.misses,
            "seconds_saved": total.seconds_saved,
            "seconds_executed": total.seconds_executed,
        }

    def tasks(self) -> m.TasksOut:
        out = []
        for task_id in self.cache.tasks():
            graph = self.cache.graph(task_id)
            stats = graph.stats()
            out.append(
                m.TaskOut(task_id=task_id, nodes=stats["nodes"], snapshots=stats["snapshots"], hits=stats["hits"])
            )
        return m.TasksOut(tasks=out)

    def export(self, task_id: str) -> m.GraphOut:
        graph = self.existing_graph(task_id)
        if graph is None:
            raise NotFound(f"no task {task_id!r}")
        nodes = sorted(graph.nodes(), key=lambda node: node.id)
        return m.GraphOut(task_id=task_id, nodes=[node_out(node, hits=True) for node in nodes])

    def activity_report(self) -> m.ActivityOut:
        """Hits, misses and time by task and epoch (tasks with a graph or with tallied traffic)."""
        task_ids = list(dict.fromkeys([*self.cache.tasks(), *self.activity.tasks()]))
        tasks = []
        for task_id in task_ids:
            graph = self.existing_graph(task_id)
            tasks.append(
                m.TaskActivityOut(
                    task_id=task_id,
                    nodes=0 if graph is None else len(graph) - 1,
                    snapshots=0 if graph is None else len(graph.snapshot_nodes),
                    total=_epoch_out(None, self.activity.total(task_id)),
                    epochs=[_epoch_out(epoch, tally) for epoch, tally in self.activity.epochs(task_id)],
                )
            )
        return m.ActivityOut(since=self.activity.started, total=_epoch_out(None, self.activity.total()), tasks=tasks)

    def outline(self, task_id: str, limit: int) -> m.OutlineOut:
        """The first ``limit`` nodes by id, without results. Parents are inserted before their children, so
        any prefix by id is a tree hanging from the root."""
        graph = self.existing_graph(task_id)
        if graph is None:
            raise NotFound(f"no task {task_id!r}")
        nodes = sorted(graph.nodes(), key=lambda node: node.id)[:limit]
        return m.OutlineOut(
            task_id=task_id,
            total=len(graph),
            truncated=len(graph) > limit,
            nodes=[
                m.OutlineNodeOut(
                    id=node.id,
                    parent=None if node.parent is None else node.parent.id,
                    name=None if node.call is None else node.call.name,
                    label=_label(node),
                    read_only=node.read_only,
                    is_error=node.is_error,
                    seconds=node.seconds,
                    hits=node.hits,
                    snapshot=node.snapshot is not None,
                )
                for node in nodes
            ],
        )

    def node_detail(self, task_id: str, node_id: int) -> m.NodeOut:
        return node_out(self.node(task_id, node_id), hits=True)

    def close(self) -> None:
        self.release_hooks.clear()  # shutting down is not a lease going: nothing is evicted for it
        for lease_id in list(self.leases):
            self.release_lease(lease_id)
        for claim in list(self._claims.values()):
            self._end_claim(claim, "expired")
        self.cache.close()


def _handed_back(snapshot: Snapshot) -> None:
    """The server's free policy for evicted records: none. They belong to clients, to whom the answer to the
    attach (or drop) that evicted them hands them back."""


def _epoch_out(epoch: int | None, tally: Tally) -> m.EpochOut:
    return m.EpochOut(
        epoch=epoch,
        hits=tally.hits,
        misses=tally.misses,
        hit_rate=tally.hit_rate,
        seconds_saved=tally.seconds_saved,
        seconds_executed=tally.seconds_executed,
    )


def _label(node: Node, limit: int = 60) -> str:
    """A one-line preview of a call's arguments: a lone string argument as is, else ``key=value`` pairs."""
    if node.call is None:
        return "root"
    arguments = node.call.arguments
    values = list(arguments.values())
    if len(values) == 1 and isinstance(values[0], str):
        text = values[0]
    else:
        text = " ".join(f"{key}={json.dumps(value, ensure_ascii=False)}" for key, value in arguments.items())
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
