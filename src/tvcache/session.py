"""Rollout sessions: how one rollout's tool calls go through the cache.

A session follows its rollout through the task's graph. A call cached at the current state is a hit and runs
nothing. A miss needs a sandbox in the current state, which the session gets lazily, by the cheapest of three
routes (measured costs): keep its live sandbox and replay the calls it lags behind, fork the nearest snapshot
and replay from there, or start fresh and replay everything. Two sessions missing on the same call in the same
state execute it once. A call that may change state but is not deterministic takes the rollout off the cached
paths: from then on it runs live and uncached, since no later state can be reproduced.

Every re-execution of a cached call is also a check of it. A replay that meets a call giving another result
than the cached one reports it and still applies every remaining call, so the sandbox ends where an uncached
rollout with the same calls would be. The first hit of a tool whose determinism nobody declared in a task is
executed once more, in the live sandbox brought to the state the call was made in, and compared: exact for
state-changing calls too, since executing the call there is exactly what uncached execution does.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .calls import ToolCall, ToolSpec
from .errors import InvalidInput, ReplayError, SandboxError, SessionClosed, SnapshotDeclined, SnapshotUnusable
from .graph import Lease, Node, ToolCallGraph
from .policies import CostModel, SnapshotPolicy
from .protocol import ForksLocally, Outcome, Sandbox, SandboxFactory, Snapshot
from .results import AuditFinding, CacheStats, ToolResult
from .store.protocol import GraphStore

__all__ = ["Session", "SessionCache", "SessionStats", "SyncSession", "TestResult"]

TestFunction = Callable[[Sandbox], Any] | Callable[[Sandbox], Awaitable[Any]]


class SessionCache(Protocol):
    """What a session needs of its cache (``tvcache.cache.Cache`` is the one there is): the store it shares,
    the policy deciding what may be cached, and where its telemetry and findings go."""

    snapshot_policy: SnapshotPolicy

    @property
    def store(self) -> GraphStore: ...

    def graph(self, task_id: str) -> ToolCallGraph: ...

    def spec(self, name: str, factory: SandboxFactory | None = None) -> ToolSpec: ...

    def is_deterministic(self, spec: ToolSpec, task_id: str | None = None) -> bool: ...

    def costs(self, factory: SandboxFactory) -> CostModel: ...

    def count(self, counter: str, amount: int = 1) -> None: ...

    def account(self, *, executed: float = 0.0, saved: float = 0.0) -> None: ...

    def should_audit(self) -> bool: ...

    def claim_check(self, task_id: str, spec: ToolSpec) -> bool: ...

    def pass_check(self, task_id: str, tool: str) -> None: ...

    def release_check(self, task_id: str, tool: str) -> None: ...

    def report_audit(self, finding: AuditFinding) -> None: ...

    def report_divergence(self, task_id: str, node: Node, output: str, *, source: str = "replay") -> None: ...

    def stats(self) -> CacheStats: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class TestResult:
    """The value of an end-of-rollout check (reward, test verdict) and whether it came from the cache."""

    __test__ = False  # not a pytest test class

    key: str
    value: Any
    hit: bool
    seconds: float


@dataclass(kw_only=True, slots=True)
class SessionStats:
    hits: int = 0
    misses: int = 0
    uncached: int = 0
    seconds: float = 0.0
    seconds_saved: float = 0.0
    sandboxes_started: int = 0
    sandboxes_forked: int = 0
    forks_failed: int = 0
    calls_replayed: int = 0
    verified: int = 0  # hits re-checked by executing the call (first hits of undeclared tools)


class Session:
    """One rollout of one task. Use as ``async with cache.session(task, sandbox=factory) as s``."""

    def __init__(self, cache: SessionCache, task_id: str, factory: SandboxFactory) -> None:
        self.cache = cache
        self.task_id = task_id
        self.factory = factory
        self.store = cache.store
        self.graph = cache.graph(task_id)
        self._costs = cache.costs(factory)
        # Where the rollout is in the graph; None once it has left the cached paths.
        self.state: Node | None = self.graph.root
        self._sandbox: Sandbox | None = None
        # The state the live sandbox is in (it may lag behind self.state after hits); None when off-graph.
        self._sandbox_state: Node | None = None
        self.history: list[ToolCall] = []
        self.stats = SessionStats()
        self._audits: set[asyncio.Task[None]] = set()
        self.closed = False

    # ------------------------------------------------------------- public

    @property
    def on_cached_path(self) -> bool:
        return self.state is not None

    async def call(self, name: str, arguments: dict[str, Any] | None = None) -> ToolResult:
        """Run one tool call through the cache and return exactly what executing it would return."""
        if self.closed:
            raise SessionClosed(f"session of task {self.task_id!r} is closed; open a new one")
        call = ToolCall(name, arguments)
        spec = self.cache.spec(name, self.factory)
        spec.validate(call)
        self.history.append(call)
        started = time.perf_counter()
        if self.state is None or not self.cache.is_deterministic(spec, self.task_id):
            return await self._execute_uncached(call, spec, started)
        while True:
            state = self.state
            node = self.store.lookup(self.graph, state, call)
            if node is not None:
                if self.cache.claim_check(self.task_id, spec):
                    return await self._verify_hit(node, spec, started)
                return self._hit(node, started, coalesced=False)
            claim = self.store.claim(self.graph, state, call)
            if claim.owner:
                return await self._execute_and_record(call, spec, state, started)
            try:
                node = await asyncio.wrap_future(claim.ready)
            except Exception:  # the executing session failed: try again ourselves
                continue
            if node is None:  # it turned out not cacheable in this state
                return await self._execute_uncached(call, spec, started)
            self.store.touch(self.graph, node)
            self.cache.count("coalesced")
            return self._hit(node, started, coalesced=True)

    async def test(self, fn: TestFunction, *, key: str | None = None, mutates: bool = True) -> TestResult:
        """Run an end-of-rollout check ``fn(sandbox)`` in the current state, cached per state and ``key``
        (default: the function's qualified name). The value must be JSON-representable.

        A check may change the sandbox (build, write reports), so by default the live sandbox is not trusted
        afterwards: a later miss re-creates the state instead. Pass ``mutates=False`` for a read-only check."""
        if self.closed:
            raise SessionClosed(f"session of task {self.task_id!r} is closed; open a new one")
        if key is None:
            key = getattr(fn, "__qualname__", "") or ""
            if not key or "<lambda>" in key or "<locals>" in key:
                raise InvalidInput(
                    f"pass key=... to session.test(): the default key, the function's name ({key or repr(fn)}), "
                    "cannot tell lambdas and closures apart, so different checks would share cached values"
                )
        started = time.perf_counter()
        state = self.state
        if state is None:  # off the cached paths: run it live, uncached
            value = await _call_test(fn, self._live())
            return TestResult(key=key, value=value, hit=False, seconds=time.perf_counter() - started)
        while True:
            cached = self.store.lookup_test(self.graph, state, key)
            if cached.found:
                return TestResult(key=key, value=cached.value, hit=True, seconds=time.perf_counter() - started)
            claim = self.store.claim_test(self.graph, state, key)
            if claim.owner:
                break
            with contextlib.suppress(Exception):  # the owner failed: look again, and maybe run it ourselves
                await asyncio.wrap_future(claim.ready)
        try:
            sandbox = await self._ensure_sandbox(state)
            if mutates:
                self._sandbox_state = None  # the check may change it (even if it fails): no longer a known state
            value = await _call_test(fn, sandbox)
            if self.state is not None:  # None: the replay diverged, so the value belongs to no cached state
                self.store.record_test(self.graph, state, key, value)
        except BaseException as error:
            self.store.resolve_test(self.graph, state, key, error=_for_waiters(error))
            raise
        self.store.resolve_test(self.graph, state, key, error=None)
        return TestResult(key=key, value=value, hit=False, seconds=time.perf_counter() - started)

    async def close(self) -> None:
        """Wait for audits, then stop the sandbox. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            if self._audits:
                await asyncio.gather(*self._audits, return_exceptions=True)
        finally:
            await self._stop_sandbox()

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ------------------------------------------------------------ hits

    def _hit(self, node: Node, started: float, *, coalesced: bool) -> ToolResult:
        if not node.read_only:
            self.state = node
        seconds = time.perf_counter() - started
        saved = max(0.0, node.seconds - seconds)
        self.stats.hits += 1
        self.stats.seconds += seconds
        self.stats.seconds_saved += saved
        self.cache.count("hits")
        self.cache.account(saved=saved)
        if self.cache.should_audit():
            task = asyncio.get_running_loop().create_task(self._audit(node))
            self._audits.add(task)
            task.add_done_callback(self._audits.discard)
        assert node.call is not None
        return ToolResult(
            call=node.call,
            output=node.output,
            is_error=node.is_error,
            hit=True,
            seconds=seconds,
            seconds_saved=saved,
            cached=True,
            coalesced=coalesced,
            node_id=node.id,
        )

    async def _verify_hit(self, node: Node, spec: ToolSpec, started: float) -> ToolResult:
        """The first hit of an undeclared tool in this task: execute the call in the live sandbox at the state
        it was made in and compare. Agreeing, the cached result is returned (and a state-changing call has moved
        the sandbox on with the rollout); disagreeing, the tool is marked non-deterministic in this task and the
        fresh result is returned uncached, the sandbox holding what that execution did."""
        call, state = node.call, node.parent
        assert call is not None
        assert state is not None
        try:
            sandbox = await self._ensure_sandbox(state)
            if self.state is None:  # reaching that state diverged: the rollout runs uncached from here on
                self.cache.release_check(self.task_id, spec.name)
                return await self._execute_uncached(call, spec, started)
            outcome, _ = await self._execute(sandbox, call)
        except Exception as error:
            # The check could not run (the sandbox failed and was stopped): the rollout is still at this state,
            # so the hit is served as it would have been without the check, which a later hit retries.
            self.cache.release_check(self.task_id, spec.name)
            warnings.warn(
                f"task {self.task_id!r}: the first-hit check of node {node.id} could not run: {error!r}",
                RuntimeWarning,
                stacklevel=3,
            )
            return self._hit(node, started, coalesced=False)
        except BaseException:
            self.cache.release_check(self.task_id, spec.name)
            raise
        read_only = _left_state_unchanged(spec, outcome)
        agrees = (
            outcome.output == node.output
            and outcome.is_error == node.is_error
            and outcome.deterministic
            and read_only == node.read_only
        )
        if not agrees:
            self.cache.report_divergence(self.task_id, node, outcome.output, source="first-hit")
            return self._uncached_result(call, outcome, read_only, started)
        self.cache.pass_check(self.task_id, spec.name)
        if not node.read_only:
            self.state = node
            self._sandbox_state = node
        self.store.touch(self.graph, node)
        seconds = time.perf_counter() - started
        self.stats.verified += 1
        self.stats.seconds += seconds
        self.cache.count("verified")
        return ToolResult(
            call=call,
            output=node.output,
            is_error=node.is_error,
            hit=False,
            seconds=seconds,
            seconds_saved=0.0,
            cached=True,
            verified=True,
            node_id=node.id,
        )

    # ---------------------------------------------------------- misses

    async def _execute_and_record(self, call: ToolCall, spec: ToolSpec, state: Node, started: float) -> ToolResult:
        """Execute a missed call we claimed, record it, publish it to waiting sessions, maybe snapshot."""
        try:
            sandbox = await self._ensure_sandbox(state)
            if self.state is None:  # the replay diverged: this rollout now runs uncached
                self.store.resolve(self.graph, state, call, node=None, error=None)
                return await self._execute_uncached(call, spec, started)
            outcome, spent = await self._execute(sandbox, call)
            read_only = _left_state_unchanged(spec, outcome)
            if not outcome.deterministic:
                self.store.resolve(self.graph, state, call, node=None, error=None)
                return self._uncached_result(call, outcome, read_only, started)
            node = self.store.record(self.graph, state, call, outcome, seconds=spent, read_only=read_only)
        except BaseException as error:
            # The call may have run without being recorded (a journal that refused the write, a cancellation):
            # the sandbox is at no state of the graph, and the call counts as not made, as for a cancelled one.
            self._sandbox_state = None
            self.store.resolve(self.graph, state, call, node=None, error=_for_waiters(error))
            raise
        self.store.resolve(self.graph, state, call, node=node, error=None)
        if node.output != outcome.output or node.is_error != outcome.is_error or node.read_only != read_only:
            # Someone recorded this call in this state earlier with another result (a claim lost to a TTL, another
            # server's worker): the tool is not deterministic, and this sandbox holds what *this* execution did,
            # which no cached state describes, so the rollout leaves the cached paths with it.
            self.cache.report_divergence(self.task_id, node, outcome.output, source="record")
            return self._uncached_result(call, outcome, read_only, started)
        self.stats.misses += 1
        self.cache.count("misses")
        if not node.read_only:
            self.state = node
            self._sandbox_state = node
            await self._maybe_snapshot(sandbox, node)
        return self._executed(call, outcome, started, node)

    async def _execute_uncached(self, call: ToolCall, spec: ToolSpec, started: float) -> ToolResult:
        sandbox = await self._ensure_sandbox(self.state) if self.state is not None else self._live()
        outcome, _ = await self._execute(sandbox, call)
        return self._uncached_result(call, outcome, _left_state_unchanged(spec, outcome), started)

    def _uncached_result(self, call: ToolCall, outcome: Outcome, read_only: bool, started: float) -> ToolResult:
        if not read_only and self.state is not None:
            # A state we cannot reproduce: every later call must run live, uncached.
            self.state = None
            self._sandbox_state = None
        self.stats.uncached += 1
        self.cache.count("uncacheable")
        return self._executed(call, outcome, started, None)

    def _executed(self, call: ToolCall, outcome: Outcome, started: float, node: Node | None) -> ToolResult:
        """The answer to a call executed here: recorded at ``node``, or left uncached (None)."""
        seconds = time.perf_counter() - started
        self.stats.seconds += seconds
        return ToolResult(
            call=call,
            output=outcome.output,
            is_error=outcome.is_error,
            hit=False,
            seconds=seconds,
            seconds_saved=0.0,
            cached=node is not None,
            node_id=None if node is None else node.id,
        )

    async def _execute(self, sandbox: Sandbox, call: ToolCall) -> tuple[Outcome, float]:
        began = time.perf_counter()
        try:
            outcome = await sandbox.execute(call)
        except InvalidInput:
            raise  # refused before anything ran: the sandbox is as it was
        except SandboxError:
            await self._stop_sandbox()
            raise
        except Exception as error:
            await self._stop_sandbox()
            raise SandboxError(f"task {self.task_id!r}: sandbox failed executing {call}: {error!r}") from error
        except BaseException:
            # Cancelled mid-call: whatever it did so far is in the sandbox, at no state of the graph.
            self._sandbox_state = None
            raise
        spent = time.perf_counter() - began
        self.cache.account(executed=spent)
        return outcome, spent

    def _live(self) -> Sandbox:
        if self._sandbox is None:
            raise SandboxError(
                f"task {self.task_id!r}: the rollout left the cached paths and its sandbox is gone "
                "(it failed earlier); start a new rollout"
            )
        return self._sandbox

    # ------------------------------------------------------- sandboxes

    async def _ensure_sandbox(self, target: Node) -> Sandbox:
        """Return the live sandbox in state ``target``, creating or catching it up by the cheapest route.

        If replaying cached calls gives other results, the sandbox is not in ``target`` at all: the rollout then
        leaves the cached paths (``self.state`` becomes None) and the caller runs the call uncached.
        """
        if self._sandbox is not None and self._sandbox_state is target:
            return self._sandbox
        live, base = self._sandbox, self._sandbox_state
        if live is not None and base is not None and _is_ancestor(base, target):
            catch_up = self.graph.replay_seconds(target, since=base)
            if catch_up <= self._fresh_cost(target):
                await self._replay_live(live, base, target)
                return live
        await self._stop_sandbox()
        sandbox, base = await self._fresh_sandbox(target)
        self._sandbox, self._sandbox_state = sandbox, base
        await self._replay_live(sandbox, base, target)
        return sandbox

    async def _replay_live(self, sandbox: Sandbox, base: Node, target: Node) -> None:
        if not await self._replay(sandbox, base, target, live=True):
            self.state = None
            self._sandbox_state = None

    def _fresh_cost(self, target: Node) -> float:
        """Expected seconds to reach ``target`` in a new sandbox (fork the nearest snapshot, or start)."""
        return self._costs.rebuild_seconds(self.graph, target)

    async def _fresh_sandbox(self, target: Node) -> tuple[Sandbox, Node]:
        """A new sandbox at ``target`` or an ancestor of it (returned as the base to replay from)."""
        graph = self.graph
        while (lease := self.store.lease_snapshot(target, self.factory.kind)) is not None:
            try:
                assert lease.node.snapshot is not None
                local = self._fork_is_local(lease.node.snapshot)
                fork_cost = self._costs.fork_seconds(local=local) + graph.replay_seconds(target, since=lease.node)
                start_cost = self._costs.start + graph.replay_seconds(target, since=graph.root)
                if fork_cost > start_cost:
                    break
                sandbox = await self._fork(lease, local=local)
                if sandbox is not None:
                    return sandbox, lease.node
            finally:
                self.store.release(lease)
            # that fork failed: the next snapshot up, if any, may still beat a fresh start
        return await self._start(), graph.root

    async def _start(self) -> Sandbox:
        began = time.perf_counter()
        try:
            sandbox = await self.factory.start()
        except SandboxError:
            raise
        except Exception as error:
            raise SandboxError(
                f"task {self.task_id!r}: starting a {self.factory.kind} sandbox failed: {error!r}"
            ) from error
        self._costs.observe("start", time.perf_counter() - began)
        self.stats.sandboxes_started += 1
        self.cache.count("sandboxes_started")
        return sandbox

    def _fork_is_local(self, snapshot: Snapshot) -> bool:
        return self.factory.fork_is_local(snapshot) if isinstance(self.factory, ForksLocally) else True

    async def _fork(self, lease: Lease, *, local: bool = True) -> Sandbox | None:
        """Fork the leased snapshot; None if that failed. A snapshot no process can fork any more
        (:class:`SnapshotUnusable`) is dropped; after any other failure only this process leaves it alone, since
        the fault may be its own (a full disk, another base tree) while other workers fork it fine."""
        node = lease.node
        snapshot = node.snapshot
        assert snapshot is not None
        began = time.perf_counter()
        try:
            sandbox = await self.factory.fork(snapshot)
        except Exception as error:
            everywhere = isinstance(error, SnapshotUnusable)
            warnings.warn(
                f"task {self.task_id!r}: forking the snapshot of node {node.id} failed ({error!r}); "
                + ("dropping it" if everywhere else "not forking it in this process again")
                + ", and rebuilding the state from an earlier snapshot or a fresh start instead",
                RuntimeWarning,
                stacklevel=2,
            )
            self.stats.forks_failed += 1
            self.cache.count("forks_failed")
            self.store.release(lease)
            if everywhere:
                self.store.drop_snapshot(self.graph, node)
            else:
                self.store.mark_unforkable(snapshot)
            return None
        self._costs.observe("fork" if local else "fetching_fork", time.perf_counter() - began)
        self.stats.sandboxes_forked += 1
        self.cache.count("sandboxes_forked")
        return sandbox

    async def _replay(self, sandbox: Sandbox, base: Node, target: Node, *, live: bool) -> bool:
        """Re-execute the stateful calls from ``base`` (exclusive) to ``target`` (inclusive), checking each
        against its cached result. Returns False if one differed, which proves its tool non-deterministic and
        leaves the sandbox in a state the graph does not describe. A live replay still applies every call after
        the difference, so the sandbox holds the effects of the rollout's whole history, as uncached execution
        of it would; an audit's sandbox (``live=False``) is thrown away, so it stops there."""
        path: list[Node] = []
        node: Node | None = target
        while node is not None and node is not base:
            path.append(node)
            node = node.parent
        diverged = False
        for step in reversed(path):
            assert step.call is not None
            try:
                outcome = await sandbox.execute(step.call)
            except Exception as error:
                if live:
                    await self._stop_sandbox()
                raise ReplayError(step.call, self.task_id, error) from error
            except BaseException:
                if live:
                    self._sandbox_state = None
                raise
            self.stats.calls_replayed += 1
            self.cache.count("calls_replayed")
            if diverged:
                continue  # applying the rest of the history: its results belong to no cached state
            if outcome.output != step.output or outcome.is_error != step.is_error:
                self.cache.report_divergence(self.task_id, step, outcome.output)
                if not live:
                    return False
                diverged = True
                self._sandbox_state = None
                continue
            if live:
                self._sandbox_state = step
        return not diverged

    async def _maybe_snapshot(self, sandbox: Sandbox, node: Node) -> None:
        if not self.store.wants_snapshot(self.graph, node, policy=self.cache.snapshot_policy, costs=self._costs):
            return
        dest = self.store.snapshot_path(self.task_id, node)
        began = time.perf_counter()
        try:
            snapshot = await sandbox.snapshot(dest)
        except SnapshotDeclined:
            self.cache.count("snapshots_declined")  # this state is rebuilt by replay when needed
            return
        except Exception as error:  # a failed snapshot costs reuse, never correctness
            warnings.warn(
                f"task {self.task_id!r}: snapshot of node {node.id} failed: {error!r}",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        self._costs.observe("snapshot", time.perf_counter() - began)
        self.store.attach_snapshot(self.graph, node, snapshot, made_by=self.factory)

    async def _stop_sandbox(self) -> None:
        sandbox, self._sandbox, self._sandbox_state = self._sandbox, None, None
        if sandbox is not None:
            await sandbox.stop()

    # ----------------------------------------------------------- audit

    async def _audit(self, node: Node) -> None:
        """Re-execute a cached call in a fresh sandbox at the state it was made in and compare."""
        state, call = node.parent, node.call
        assert state is not None
        assert call is not None
        try:
            sandbox, base = await self._fresh_sandbox(state)
        except Exception as error:
            warnings.warn(
                f"task {self.task_id!r}: audit of node {node.id} could not start: {error!r}",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        try:
            if not await self._replay(sandbox, base, state, live=False):
                return  # the replay itself disagreed with the cache: already reported
            outcome = await sandbox.execute(call)
        except Exception as error:
            warnings.warn(
                f"task {self.task_id!r}: audit of node {node.id} could not run: {error!r}",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        finally:
            await sandbox.stop()
        finding = AuditFinding(
            task_id=self.task_id,
            node_id=node.id,
            call=call,
            cached_output=node.output,
            fresh_output=outcome.output,
        )
        self.cache.report_audit(finding)


def _left_state_unchanged(spec: ToolSpec, outcome: Outcome) -> bool:
    """Read-only when proved so, or declared so and not contradicted by the backend (a tool mis-declared
    read-only that visibly changed the state is treated as changing it)."""
    if outcome.changed_state is True and spec.read_only:
        warnings.warn(
            f"tool {spec.name!r} is declared read-only but changed the sandbox's state; treating this call as "
            "state-changing",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return spec.read_only or outcome.changed_state is False


def _for_waiters(error: BaseException) -> Exception:
    """What sessions waiting on a failed execution see: an ordinary error they retry after — never the owner's
    own cancellation, which would cancel them too."""
    if isinstance(error, Exception):
        return error
    return SandboxError(f"the session executing this call stopped ({type(error).__name__}); retrying")


async def _call_test(fn: TestFunction, sandbox: Sandbox) -> Any:
    value = fn(sandbox)
    if inspect.isawaitable(value):
        value = await value
    return value


def _is_ancestor(ancestor: Node, node: Node) -> bool:
    current: Node | None = node
    while current is not None:
        if current is ancestor:
            return True
        current = current.parent
    return False


class SyncSession:
    """The blocking twin of ``Session``, with its own event loop. Use as ``with cache.session_sync(...) as s``."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._runner = asyncio.Runner()

    @property
    def state(self) -> Node | None:
        return self.session.state

    @property
    def stats(self) -> SessionStats:
        return self.session.stats

    def call(self, name: str, arguments: dict[str, Any] | None = None) -> ToolResult:
        return self._runner.run(self.session.call(name, arguments))

    def test(self, fn: TestFunction, *, key: str | None = None, mutates: bool = True) -> TestResult:
        return self._runner.run(self.session.test(fn, key=key, mutates=mutates))

    def close(self) -> None:
        try:
            if not self.session.closed:
                self._runner.run(self.session.close())
        finally:
            self._runner.close()

    def __enter__(self) -> SyncSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
