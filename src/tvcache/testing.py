"""Check a sandbox backend against tvcache's backend contract: ``check_sandbox(factory, probe)``.

The cache trusts every backend with the same promises: a started sandbox is the task's initial state, a fork is
an independent copy of a frozen snapshot, a read proved read-only changed nothing, a stopped sandbox refuses
work, a discarded snapshot is gone, and a tool's failure is an ``Outcome`` while a bad call raises. These are
the checks tvcache's own backends pass (``tests/test_sandboxes.py`` runs them); run them on yours::

    from tvcache.testing import SandboxProbe, check_sandbox

    check_sandbox(
        MyFactory(base),
        SandboxProbe(
            read=ToolCall("sh", {"cmd": "ls items"}),
            write=lambda name: ToolCall("sh", {"cmd": f"touch items/{name}"}),
            failing=ToolCall("sh", {"cmd": "exit 3"}),
            bad_arguments=ToolCall("sh", {"command": "ls"}),
            items=lambda outcome: set(outcome.output.split()),
            initial={"apple", "pear"},
        ),
    )

A failed check raises ``SandboxCheckFailed`` naming the check and the property it found broken. The probe says
how to exercise the backend: a read that lists the items of the state, a write that adds one, a call whose tool
fails, and a call with arguments the tool's schema refuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .calls import ToolCall
from .confinement import CONFINEMENT_CHECKS, ConfinementCheckFailed, ConfinementProbe, check_confinement
from .errors import InvalidToolCall, SandboxError, TVCacheError, UnknownTool
from .protocol import Outcome, Sandbox, SandboxFactory, Snapshot, cost_hints, state_digest

__all__ = [
    "CHECKS",
    "CONFINEMENT_CHECKS",
    "ConfinementCheckFailed",
    "ConfinementProbe",
    "SandboxCheckFailed",
    "SandboxProbe",
    "check_confinement",
    "check_sandbox",
    "run_check",
]

COST_HINTS = frozenset({"start", "fork", "snapshot"})


class SandboxCheckFailed(TVCacheError, AssertionError):
    """A backend broke a property of the sandbox contract. ``check`` is the check's name (a key of ``CHECKS``),
    ``property`` the promise it tests; the message says what was seen instead."""

    def __init__(self, check: str, detail: str) -> None:
        self.check = check
        self.property = CHECKS[check].property if check in CHECKS else check
        super().__init__(f"sandbox check {check!r} failed: {self.property}: {detail}")


@dataclass(frozen=True, kw_only=True)
class SandboxProbe:
    """How ``check_sandbox`` exercises a backend.

    ``read``: a call that lists the state's items and, where the backend can prove it, changes nothing.
    ``write(name)``: a call that adds the item ``name``. ``items(outcome)``: the items a ``read`` outcome lists.
    ``initial``: the items of a fresh sandbox. ``failing``: a call whose tool runs and fails (an ``Outcome``
    with ``is_error``). ``bad_arguments``: a call to one of the factory's tools with arguments it refuses
    (``InvalidToolCall``). ``reads_keep_state``: False for a live shell, where every call moves ``$LINENO``
    and no read is proved read-only. ``has_state_digest``: whether the sandboxes offer ``state_digest()``
    (optional in the protocol; when True the digest must track the state).
    """

    read: ToolCall
    write: Callable[[str], ToolCall]
    failing: ToolCall
    bad_arguments: ToolCall
    items: Callable[[Outcome], Collection[str]]
    initial: Collection[str]
    reads_keep_state: bool = True
    has_state_digest: bool = True


CheckBody = Callable[["_Run"], Awaitable[None]]


@dataclass(frozen=True, kw_only=True)
class Check:
    """One property of the contract and the coroutine that tests it."""

    name: str
    property: str
    body: CheckBody


class _Run:
    """One check's run: the factory, the probe, a scratch directory, and the sandboxes to stop at the end."""

    def __init__(self, name: str, factory: SandboxFactory, probe: SandboxProbe, scratch: Path) -> None:
        self.name = name
        self.factory = factory
        self.probe = probe
        self.scratch = scratch
        self._live: list[Sandbox] = []

    def expect(self, condition: bool, detail: str) -> None:
        if not condition:
            raise SandboxCheckFailed(self.name, detail)

    async def start(self) -> Sandbox:
        sandbox = await self.factory.start()
        self._live.append(sandbox)
        return sandbox

    async def fork(self, snapshot: Snapshot) -> Sandbox:
        sandbox = await self.factory.fork(snapshot)
        self._live.append(sandbox)
        return sandbox

    async def items(self, sandbox: Sandbox) -> set[str]:
        outcome = await sandbox.execute(self.probe.read)
        self.expect(not outcome.is_error, f"the read {self.probe.read} failed: {outcome.output!r:.500}")
        return set(self.probe.items(outcome))

    async def digest(self, sandbox: Sandbox) -> str:
        value = await state_digest(sandbox)
        if value is None:
            raise SandboxCheckFailed(self.name, "the backend offers no state_digest() (set has_state_digest=False)")
        return value

    async def raises(self, error: type[BaseException], match: str, operation: Awaitable[object], what: str) -> None:
        """``operation`` must raise ``error`` with ``match`` in its message."""
        try:
            await operation
        except error as raised:
            self.expect(match in str(raised), f"{what} raised {raised!r}, whose message does not say {match!r}")
            return
        self.expect(False, f"{what} did not raise {error.__name__}")

    async def close(self) -> None:
        for sandbox in self._live:  # stop is idempotent: sandboxes the check stopped itself are stopped again
            with contextlib.suppress(Exception):
                await sandbox.stop()


async def _protocol(run: _Run) -> None:
    factory = run.factory
    run.expect(isinstance(factory, SandboxFactory), f"{factory!r} lacks kind, tools, start, fork or discard")
    hints = cost_hints(factory)
    run.expect(isinstance(hints, Mapping), f"cost_hints is a {type(hints).__name__}, not a mapping")
    run.expect(set(hints) <= COST_HINTS, f"cost_hints has keys {sorted(set(hints) - COST_HINTS)} (known: start, "
               "fork, snapshot)")  # fmt: skip
    run.expect(run.probe.read.name in factory.tools, f"the factory's tools {sorted(factory.tools)} lack the read's")
    sandbox = await run.start()
    run.expect(isinstance(sandbox, Sandbox), f"start() returned {sandbox!r}, which lacks execute, snapshot or stop")
    await sandbox.stop()


async def _reads_and_writes(run: _Run) -> None:
    probe = run.probe
    sandbox = await run.start()
    read = await sandbox.execute(probe.read)
    # A live shell says a read changed its state (it did: $LINENO moved) rather than claim a proof it has not.
    expected = Outcome(output=read.output, changed_state=not probe.reads_keep_state)
    run.expect(read == expected, f"a read in a fresh sandbox returned {read!r}, expected {expected!r}")
    run.expect(set(probe.items(read)) == set(probe.initial), f"a fresh sandbox lists {set(probe.items(read))}, "
               f"expected {set(probe.initial)}")  # fmt: skip
    write = await sandbox.execute(probe.write("fig"))
    run.expect(not write.is_error, f"the write failed: {write.output!r:.500}")
    run.expect(write.changed_state is True, f"a write returned changed_state={write.changed_state}, expected True")
    run.expect(write.deterministic, "a plain write was reported non-deterministic")
    after = await run.items(sandbox)
    run.expect(after == set(probe.initial) | {"fig"}, f"after writing 'fig' the sandbox lists {after}")
    await sandbox.stop()


async def _forks(run: _Run) -> None:
    probe = run.probe
    origin = await run.start()
    await origin.execute(probe.write("fig"))
    snapshot = await origin.snapshot(run.scratch / "snap")
    run.expect(snapshot.kind == run.factory.kind, f"the snapshot's kind {snapshot.kind!r} is not the factory's")
    run.expect(snapshot.exists(), f"the snapshot {snapshot.path} does not exist after snapshot()")
    run.expect(snapshot.bytes > 0, f"the snapshot reports {snapshot.bytes} bytes")
    await origin.execute(probe.write("after"))
    first, second = await run.fork(snapshot), await run.fork(snapshot)
    await first.execute(probe.write("first"))
    await second.execute(probe.write("second"))
    base = set(probe.initial) | {"fig"}
    for sandbox, extra, what in ((first, "first", "a fork"), (second, "second", "a second fork"),
                                 (origin, "after", "the snapshotted sandbox")):  # fmt: skip
        seen = await run.items(sandbox)
        run.expect(seen == base | {extra}, f"{what} lists {seen}, expected {base | {extra}}")
    third = await run.fork(snapshot)  # the snapshot saw none of the later writes
    seen = await run.items(third)
    run.expect(seen == base, f"a fork made after later writes lists {seen}, expected {base}: the snapshot changed")
    for sandbox in (origin, first, second, third):
        await sandbox.stop()


async def _state_digest(run: _Run) -> None:
    probe = run.probe
    if not probe.has_state_digest:
        return
    one, two = await run.start(), await run.start()
    initial = await run.digest(one)
    run.expect(initial == await run.digest(two), "two fresh sandboxes have different digests")
    await one.execute(probe.read)
    if probe.reads_keep_state:
        run.expect(await run.digest(one) == initial, "a read changed the digest")
    else:  # a live shell after a read is another state ($LINENO moved): its digest must say so
        run.expect(await run.digest(one) != initial, "a read left a live shell's digest as it was")
        await two.execute(probe.read)
        run.expect(await run.digest(two) == await run.digest(one), "the same history gave different digests")
    await one.execute(probe.write("fig"))
    changed = await run.digest(one)
    run.expect(changed != initial, "a write left the digest as it was")
    fork = await run.fork(await one.snapshot(run.scratch / "snap"))
    run.expect(await run.digest(fork) == changed, "a fork's digest differs from its snapshotted sandbox's")
    for sandbox in (one, two, fork):
        await sandbox.stop()


async def _stop(run: _Run) -> None:
    sandbox = await run.start()
    await sandbox.stop()
    await sandbox.stop()
    await run.raises(SandboxError, "stopped", sandbox.execute(run.probe.read), "execute() after stop()")
    await run.raises(SandboxError, "stopped", sandbox.snapshot(run.scratch / "snap"), "snapshot() after stop()")


async def _discard(run: _Run) -> None:
    sandbox = await run.start()
    snapshot = await sandbox.snapshot(run.scratch / "snap")
    await sandbox.stop()
    run.factory.discard(snapshot)
    run.expect(not snapshot.exists(), f"the snapshot {snapshot.path} still exists after discard()")
    await run.raises(SandboxError, "missing", run.fork(snapshot), "fork() of a discarded snapshot")
    wrong_kind = Snapshot(kind="other", path=snapshot.path, bytes=0)
    await run.raises(SandboxError, "'other'", run.fork(wrong_kind), "fork() of another backend's snapshot")


async def _snapshot_destination(run: _Run) -> None:
    sandbox = await run.start()
    (run.scratch / "taken").mkdir()
    await run.raises(
        SandboxError, "already exists", sandbox.snapshot(run.scratch / "taken"), "snapshot() into an existing path"
    )
    # A dangling link is a destination too: a snapshot written through it would land wherever it points.
    (run.scratch / "link").symlink_to(run.scratch / "elsewhere")
    await run.raises(
        SandboxError, "already exists", sandbox.snapshot(run.scratch / "link"), "snapshot() into a dangling link"
    )
    run.expect(not (run.scratch / "elsewhere").exists(), "a snapshot was written through a dangling link")
    await sandbox.stop()


async def _bad_input(run: _Run) -> None:
    probe = run.probe
    sandbox = await run.start()
    failed = await sandbox.execute(probe.failing)
    run.expect(failed.is_error, f"the failing call returned {failed!r} without is_error")
    await run.raises(UnknownTool, "nope", sandbox.execute(ToolCall("nope", {})), "a call to an unknown tool")
    await run.raises(InvalidToolCall, "", sandbox.execute(probe.bad_arguments), "a call with bad arguments")
    seen = await run.items(sandbox)
    run.expect(seen == set(probe.initial), f"after the failing and refused calls the sandbox lists {seen}")
    await sandbox.stop()


CHECKS: Mapping[str, Check] = {
    check.name: check
    for check in (
        Check(name="protocol", property="the factory and its sandboxes satisfy the protocol", body=_protocol),
        Check(name="reads-and-writes", property="reads do not change state and writes do", body=_reads_and_writes),
        Check(name="fork-isolation", property="forks are independent and snapshots frozen", body=_forks),
        Check(name="state-digest", property="the state digest tracks the content", body=_state_digest),
        Check(name="stop", property="stop is idempotent and a stopped sandbox refuses work", body=_stop),
        Check(name="discard", property="discard removes the snapshot and forking it then fails", body=_discard),
        Check(
            name="snapshot-destination",
            property="snapshot refuses an existing destination, a dangling link too",
            body=_snapshot_destination,
        ),
        Check(name="bad-input", property="tool failures are outcomes and bad calls raise", body=_bad_input),
    )
}


async def run_check(name: str, factory: SandboxFactory, probe: SandboxProbe, scratch: Path) -> None:
    """Run the check ``name`` (a key of ``CHECKS``) with ``scratch`` as an empty directory of its own. Raises
    ``SandboxCheckFailed``, also when the backend raised something else on the way."""
    check = CHECKS.get(name)
    if check is None:
        raise ValueError(f"no sandbox check {name!r}; the checks are {', '.join(CHECKS)}")
    run = _Run(name, factory, probe, scratch)
    try:
        await check.body(run)
    except SandboxCheckFailed:
        raise
    except Exception as error:
        raise SandboxCheckFailed(name, f"the backend raised {error!r}") from error
    finally:
        await run.close()


@contextlib.asynccontextmanager
async def _scratch(scratch: Path | None) -> AsyncIterator[Path]:
    if scratch is not None:
        yield Path(scratch)
        return
    with tempfile.TemporaryDirectory(prefix="tvcache-check-") as made:
        yield Path(made)


async def _check_all(factory: SandboxFactory, probe: SandboxProbe, scratch: Path | None, names: Iterable[str]) -> None:
    async with _scratch(scratch) as root:
        for name in names:
            directory = root / name
            directory.mkdir(parents=True)
            await run_check(name, factory, probe, directory)


def check_sandbox(
    factory: SandboxFactory,
    probe: SandboxProbe,
    *,
    scratch: Path | None = None,
    checks: Iterable[str] | None = None,
) -> None:
    """Run the contract's checks (all of ``CHECKS``, in order, or the ones named in ``checks``) against
    ``factory``, on its own event loop; call it where no loop is running (a plain test function).

    Snapshots go under ``scratch`` (one subdirectory per check, which must not exist yet; default: a temporary
    directory removed afterwards). The factory is left open: close it yourself. Raises ``SandboxCheckFailed``
    for the first broken property."""
    names = list(CHECKS if checks is None else checks)
    for name in names:
        if name not in CHECKS:
            raise ValueError(f"no sandbox check {name!r}; the checks are {', '.join(CHECKS)}")
    asyncio.run(_check_all(factory, probe, scratch, names))
