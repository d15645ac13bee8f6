"""Persistent shell sandboxes: one long-lived, confined bash per sandbox (``ShellSandbox.factory(tree,
persistent=True)``), as the harnesses that keep a terminal per rollout drive it (Terminus/tmux, SWE-ReX,
OpenHands). The working directory, variables, functions, aliases, options, umask, traps and background jobs
persist from one ``sh`` call to the next; the files live on the same overlay layers as one-shot shell sandboxes.

Confinement is the one-shot flavour's: the zygote starts bash as PID 1 of fresh namespaces (read-only host,
private /tmp, own loopback, minimal /dev, dropped capabilities), here with a pty as its terminal (``pty_shell``
has the protocol). Every call's outcome reports ``changed_state=True``: in a persistent shell even ``cat`` moves
``$LINENO`` and ``$_``, so no call can be proved read-only.

Snapshots go by the route ``shell_state.choose_route`` picks (counted in ``ShellSandboxFactory.route_counts``):

* **shell state** (bash alone in its namespace): its state is captured by a trap, a shell is restored from the
  capture beside the live one and checked against it (a capture or a restore that fails declines the snapshot,
  and the live shell goes on untouched), then the old shell ends, the files freeze as usual, and the sandbox goes
  on in the restored shell (the checked one when no file changed, else one restored anew), exactly as every fork
  of the snapshot will: the sandbox and its forks cannot differ.
  The restored shell is a *warm* one when the factory has one ready (``warm``: started ahead, it only takes
  the tree and the state), else a cold one; ``factory.warm_shells = 0`` turns them off;
* **CRIU** (``criu_route``) when processes live beside the shell (a background server, a REPL, a tmux server),
  or it holds what the shell-state route cannot carry (``exec 3>file``, ``$!``), and a working CRIU exists: the
  process tree is dumped next to the snapshot (``<dest>.criu``) and ends, the files freeze, and the sandbox
  goes on in a copy restored over its new upper layer, as every fork does (each restore checked against the
  state captured before the dump);
* **declined** otherwise (no CRIU, a dump that fails, a socket to the outside, ...): ``SnapshotDeclined``, the
  shell goes on untouched (unless a failed dump took it down: then it ended, as below), and later states of
  the rollout are rebuilt by replay.

The routes are tried in the order of ``factory.snapshot_routes`` (default ``routes.ROUTES``: shell state, then CRIU);
narrow it (``(ShellStateRoute(),)``) to never use CRIU. Forks find the route that made a snapshot by its name.

If a shell is ever replaced (a CRIU restore that fails after the dump, a capture that never finished), the
sandbox is no longer trusted and the next call starts a new shell and says so (``NEW_SHELL_NOTE``).

When the shell ends (``exit``, ``exec false``, a kill), the call returns what it printed and a note, with
``is_error`` and ``deterministic=False``. The sandbox is no longer trusted: the *next* call starts a new shell in
the same files (its output begins with a note saying so), as a harness restarting its session would, and every
outcome from then on is non-deterministic, so nothing it does is cached, and it is never snapshotted.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from ...calls import ToolCall
from ...errors import SandboxError, SnapshotDeclined
from ...protocol import Outcome, Snapshot, require_new_destination
from ..commands import render_shell
from ..threads import Steps, finish_in_thread, run_briefly_then_in_worker
from .cgroups import HitReader
from .layers import Layer
from .overlay import OverlaySandbox, ShellHost
from .process import describe_hit
from .pty_shell import PtyResult, PtyShell
from .routes import PERSISTENT_KIND, ROUTES, discard_process_state
from .session import NEW_SHELL_NOTE, PersistentShellCalls, persistent_command
from .shell_state import (
    ShellLaunch,
    ShellState,
    SnapshotPlace,
    SnapshotRoute,
    SnapshotStrategy,
    choose_route,
    route_of,
)
from .zygote import Spawned

# PERSISTENT_KIND, ROUTES and discard_process_state live in ``routes`` (with the route table, beside the routes'
# own modules); they stay importable from here.
__all__ = ["NEW_SHELL_NOTE", "PERSISTENT_KIND", "ROUTES", "PersistentShellSandbox", "discard_process_state"]

# A command's first millisecond runs on the caller's event loop (``run_briefly_then_in_worker``): most commands of an
# agent are done by then, and the hop to a worker thread and back (~0.1 ms, more on a busy machine) would cost more
# than they do. A longer one goes on in a thread, as every command did before.
INLINE_BUDGET = 0.001


class PersistentShellSandbox(PersistentShellCalls, OverlaySandbox):
    """One overlay sandbox with one long-lived shell. Calls are serialised; blocking work runs in threads."""

    def __init__(self, factory: ShellHost, layers: list[Layer], image: dict[str, Any] | None) -> None:
        self._shell: PtyShell | None = None
        self._untrusted: str | None = None
        self._hits: tuple[Spawned, HitReader] | None = None  # the live shell's limit counters
        super().__init__(factory, layers)
        try:
            self._shell = self._start_shell(image)
        except BaseException:
            self._teardown()
            raise

    def _start_shell(self, image: dict[str, Any] | None) -> PtyShell:
        factory = self._factory
        mount_fd = self._require_open()

        def cold(boot: str, last_pid: int | None) -> PtyShell:
            return PtyShell(
                factory.zygote,
                bash=factory.bash,
                env=factory.environment,
                mount_fd=mount_fd,
                boot=boot,
                last_pid=last_pid,
            )

        def restored(boot: str, last_pid: int | None) -> PtyShell:
            # A restored shell: a warm one when the factory has one ready (see ``warm``), else a cold one. A new
            # shell stays cold: its first directory and PWD come from its start, not from a captured state.
            pool = factory.warm_pool()
            warm = pool.take() if pool is not None else None
            if pool is not None and warm is not None and pool.resumed(warm, mount_fd, boot, last_pid) is not None:
                return warm
            return cold(boot, last_pid)

        if image is None:
            return cold("", None)
        launch = ShellLaunch(fresh=restored, mount_fd=mount_fd, cgroups=factory.cgroups, keepers=factory.criu_keepers())
        return route_of(image, ROUTES).restore(launch, image)

    # ---------------------------------------------------------- execute

    async def execute(self, call: ToolCall) -> Outcome:
        command, timeout = persistent_command(call, self._factory.tools, self._factory.timeout)
        async with self._lock:
            self._require_open()
            self._note_limit_hit()  # a background process may have hit a limit after the last call returned
            self._require_within_limits()

            def steps(abandon: threading.Event) -> Steps[tuple[PtyResult, bool, int | None, bool]]:
                result, restarted, code = yield from self._command_steps(command, timeout, "", abandon)
                return result, restarted, code, self._hit_during_call(result)

            try:
                result, restarted, code, hit = await run_briefly_then_in_worker(steps, self._kill_shell, INLINE_BUDGET)
            except OSError as error:
                raise SandboxError(f"cannot run a command in the persistent shell: {error}") from error
            if hit:
                return self._render_limit_hit(result, timeout)
        return self._render(result, restarted, code, timeout)

    def _hit_during_call(self, result: PtyResult) -> bool:
        """Whether the shell's tree hit a limit during the call that gave ``result`` (in its worker thread). The
        watcher kills a tree at its first hit, but that may come a moment after the call's end: the counters
        are read here too (two reads), and a tree over a limit is ended now."""
        if result.died:
            return self._note_limit_hit()
        shell = self._shell
        spawned = shell.spawned if shell is not None else None
        cgroups = self._factory.cgroups
        if shell is None or spawned is None or spawned.cgroup is None or cgroups is None:
            return False
        if self._hits is None or self._hits[0] is not spawned:
            self._close_hits()
            try:
                self._hits = (spawned, HitReader(cgroups, spawned.cgroup))
            except OSError:  # the tree just ended: its exit says if it hit a limit
                return self._note_limit_hit()
        kind = self._hits[1].hit()
        if kind is None:
            return False
        self._limit_hit = describe_hit(kind, self._factory.limits)
        shell.close()  # the watcher kills it too; nothing more runs in this sandbox
        return True

    def _close_hits(self) -> None:
        hits, self._hits = self._hits, None
        if hits is not None:
            hits[1].close()

    def _note_limit_hit(self) -> bool:
        """Whether the shell's tree was killed at a limit (the zygote or the CRIU keeper reports it with its
        exit); the sandbox is then no longer trusted."""
        shell = self._shell
        spawned = shell.spawned if shell is not None else None
        if self._limit_hit is None and spawned is not None and spawned.exited and spawned.limit is not None:
            self._limit_hit = describe_hit(spawned.limit, self._factory.limits)
        return self._limit_hit is not None

    def _render_limit_hit(self, result: PtyResult, timeout: float) -> Outcome:
        plain = result.as_shell_result(limit=self._limit_hit)
        outcome = render_shell(plain, self._factory.max_output_bytes, timeout)
        return Outcome(output=outcome.output, is_error=True, changed_state=True, deterministic=False)

    def _new_shell(self, what: str) -> PtyShell:
        return self._start_shell(None)

    def _ended_code(self, shell: PtyShell) -> int | None:
        return shell.spawned.returncode if shell.spawned is not None else None

    def _ended_note(self, code: int | None) -> str:
        how = "" if code is None else (f" with code {code}" if code >= 0 else f" (killed by signal {-code})")
        return (
            f"[the shell ended{how}; the next call starts a new shell in the same files, "
            "and nothing this sandbox does is cached from now on]"
        )

    # --------------------------------------------------------- snapshots

    async def snapshot(self, dest: Path) -> Snapshot:
        dest = Path(dest)
        async with self._lock:
            self._require_open()
            self._note_limit_hit()
            self._require_within_limits(SnapshotDeclined)
            require_new_destination(dest)
            # Cancelled (once or again), the snapshot still ends before the lock goes, and a process image it made
            # for a snapshot no one will record is deleted.
            route, image, stack, new_bytes = await finish_in_thread(
                functools.partial(self._snapshot, dest), undo=lambda made: discard_process_state({"shell": made[1]})
            )
            self._store.acquire(stack)  # the snapshot's own references
            layers = [str(layer.path) for layer in stack]
            meta = {"layers": layers, "route": route.value, "shell": image}
            dest.parent.mkdir(parents=True, exist_ok=True)
            partial = dest.with_name(dest.name + ".partial")
            partial.write_text(json.dumps({"kind": PERSISTENT_KIND, "base": str(self._factory.base), **meta}))
            os.replace(partial, dest)
        return Snapshot(kind=PERSISTENT_KIND, path=str(dest), bytes=new_bytes, meta=meta)

    def _snapshot(self, dest: Path) -> tuple[SnapshotRoute, dict[str, Any], list[Layer], int]:
        factory = self._factory
        shell = self._shell
        place = SnapshotPlace(
            images=dest.with_name(dest.name + ".criu"),
            tree=None if factory.rootfs else str(factory.base),
            confinement=factory.confinement,
        )
        try:
            untrusted = self._untrusted
            if shell is None or not shell.alive:
                untrusted = untrusted or "its shell ended"
            assert shell is not None or untrusted is not None
            self._refuse_hard_links()
            strategy, image = choose_route(shell, untrusted, factory.snapshot_routes, place)  # type: ignore[arg-type]
            image["route"] = strategy.route.value
        except SnapshotDeclined:
            if shell is not None and not shell.alive and self._untrusted is None:
                # A process dump that failed late took the tree down: the next call starts a new shell.
                self._untrusted = "its shell ended during a failed snapshot"
            factory.count_route(SnapshotRoute.DECLINED)
            raise
        assert shell is not None
        # Shell state: the restore is tried first, on the sandbox's mount beside the live shell (a fresh bash
        # that only boots), so that a restore that fails declines the snapshot and the live shell goes on
        # untouched. The old shell then ends (it writes through the mount the freeze turns into a read-only
        # layer; a CRIU dump ended it already), and the sandbox goes on in a restored shell, exactly as every
        # fork of the snapshot will: the checked copy itself when the files did not change, else a new one.
        trial = self._trial_restore(strategy, image) if strategy.route is SnapshotRoute.SHELL_STATE else None
        upper = self._upper
        shell.close()
        self._shell = None
        try:
            stack, new_bytes = self._freeze()
        except SnapshotDeclined:
            # Hard links appeared since the check (a background process): the files stay as they were, and the
            # shell comes back from its capture on the same mount.
            if trial is not None and self._upper is upper:
                self._shell = trial
            else:
                if trial is not None:
                    trial.close()
                self._resume(strategy, image)
            factory.count_route(SnapshotRoute.DECLINED)
            raise
        except BaseException:
            if trial is not None:
                trial.close()
            strategy.discard(image)
            raise
        if trial is not None and self._upper is upper:
            self._shell = trial
        else:
            if trial is not None:
                trial.close()
            try:
                self._shell = self._start_shell(image)
            except SandboxError as error:
                strategy.discard(image)
                self._replaced(f"its shell could not be restored after a snapshot ({error})")
                factory.count_route(SnapshotRoute.DECLINED)
                raise SnapshotDeclined(f"the restored shell did not match the captured one: {error}") from error
        if strategy.route is SnapshotRoute.CRIU:
            self._adopt_reference(image)
        factory.count_route(strategy.route)
        return strategy.route, image, stack, new_bytes + int(image.get("image_bytes", 0))

    def _trial_restore(self, strategy: SnapshotStrategy, image: dict[str, Any]) -> PtyShell:
        """A shell restored from ``image`` on the current mount and checked against it; SnapshotDeclined (counted)
        when it cannot be, and the live shell goes on as it was."""
        try:
            return self._start_shell(image)
        except SandboxError as error:
            strategy.discard(image)
            self._factory.count_route(SnapshotRoute.DECLINED)
            raise SnapshotDeclined(
                f"a shell restored from the capture did not match the live one ({error}); "
                "not snapshotting this state, the shell goes on untouched"
            ) from error

    def _replaced(self, why: str) -> None:
        """The live shell is gone and could not be brought back: the sandbox is no longer trusted, and the next
        call starts a new shell and says so (``NEW_SHELL_NOTE``)."""
        self._untrusted = why
        self._shell = None

    def _adopt_reference(self, image: dict[str, Any]) -> None:
        """The state forks of a CRIU snapshot are checked against: this sandbox's own restored copy's, the first
        restore of the image (its live processes may have moved it on since the capture before the dump)."""
        data = self._shell.capture() if self._shell is not None else None
        if data is not None:
            state = ShellState.parse(data)
            image["state"] = data.decode("utf-8", errors="surrogateescape")
            last_pid = state.lines("last-pid")
            if last_pid and last_pid[0].isdigit():
                image["last_pid"] = int(last_pid[0])

    def _resume(self, strategy: SnapshotStrategy, image: dict[str, Any]) -> None:
        """Bring the shell back from a capture that no snapshot keeps; a new shell (untrusted) if that fails."""
        try:
            self._shell = self._start_shell(image)
        except SandboxError as error:
            self._replaced(f"its shell could not be restored after a declined snapshot ({error})")
        finally:
            strategy.discard(image)

    async def state_digest(self) -> str:
        """The files' digest and the shell's captured state (its line count included): equal for a sandbox and
        its forks. A shell that does not answer the capture digests as unique."""
        async with self._lock:
            self._require_open()
            # Cancelled, the capture still ends before the lock goes: a call let in meanwhile would type into it.
            return await finish_in_thread(self._digest)

    def _digest(self) -> str:
        files = self._state_digest()
        shell = self._shell
        data = shell.capture() if shell is not None and shell.alive else None
        if data is None:
            return hashlib.blake2b(os.urandom(16), digest_size=16).hexdigest()
        state = ShellState.parse(data).canonical() + f"\n[lineno]\n{shell.lineno if shell else 0}"
        return hashlib.blake2b(f"{files}\n{state}".encode(errors="surrogateescape"), digest_size=16).hexdigest()

    # -------------------------------------------------------------- stop

    def _teardown(self) -> None:
        shell, self._shell = self._shell, None
        if shell is not None:
            shell.close()
        self._close_hits()
        super()._teardown()
