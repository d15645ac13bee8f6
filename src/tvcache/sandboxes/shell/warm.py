"""Warm shells: a few confined bash processes per factory, started ahead of the forks that will need them.

Why: a shell-state fork starts a fresh confined bash and restores the captured state in it; starting bash (exec,
dynamic linking, its interactive setup, the confinement of its namespace) is most of the fork. A warm shell has
done all of that already and waits in its boot script (``PtyShell.warm``): a fork only attaches its overlay and
sends the state (``PtyShell.resume``); the restore is then checked against the capture as for a cold shell.

A warm shell is indistinguishable from a cold one to every later command (``pty_shell`` says why, and what the
one exception is: the process start time ``ps`` shows); a resume that fails closes the shell, and the caller
starts a cold one instead (counted in ``failures``). The pool refills in a background thread, never on the
caller's path; each warm shell is keyed by what it was started with (bash and the environment), so a factory
whose environment changed gets no stale one. ``close`` ends every warm shell; none outlives its factory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable

from ...errors import SandboxError
from .pty_shell import PtyShell

__all__ = ["WarmShells"]

RETRY_SECONDS = 1.0  # after a warm shell failed to start: the zygote or the machine is in trouble
# A refill starts this long after the first take since the last one: starting a shell (bash, and the zygote's
# next spare) while the fork that took one resumes it would slow that fork down by about as much as it saves, on a
# small machine. Later takes do not postpone it, so a steady stream of forks still gets warm shells.
REFILL_DELAY_SECONDS = 0.02


class WarmShells:
    """Up to ``size`` warm shells, each made by ``make()`` and tagged with ``key()`` at the time. Thread-safe."""

    def __init__(self, make: Callable[[], PtyShell], key: Callable[[], Hashable], *, size: int) -> None:
        self._make = make
        self._key = key
        self._size = size
        self._ready: list[tuple[Hashable, PtyShell]] = []
        self._condition = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._taken_at = 0.0
        self.failures = 0  # warm shells that failed to start or to resume (a cold shell served instead)
        self.served = 0

    def take(self) -> PtyShell | None:
        """A warm shell for the current key, or None (the pool is empty, or closed); the pool refills behind."""
        stale = []
        taken = None
        with self._condition:
            if self._closed:
                return None
            key = self._key()
            while self._ready and taken is None:
                tag, shell = self._ready.pop(0)
                if tag == key and shell.alive:
                    taken = shell
                else:
                    stale.append(shell)
            if not self._taken_at:
                self._taken_at = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._fill, name="tvcache-warm-shells", daemon=True)
                self._thread.start()
            self._condition.notify_all()  # the filler waits out the quiet delay, then refills
        for shell in stale:
            shell.close()
        if taken is not None:
            self.served += 1
        return taken

    def resumed(self, shell: PtyShell, mount_fd: int, boot: str, last_pid: int | None) -> PtyShell | None:
        """``shell`` resumed on ``mount_fd``, or None when that failed (it closed itself)."""
        try:
            shell.resume(mount_fd, boot, last_pid)
        except SandboxError:
            self.failures += 1
            return None
        return shell

    def _fill(self) -> None:
        while True:
            with self._condition:
                while not self._closed:
                    quiet = self._taken_at + REFILL_DELAY_SECONDS - time.monotonic()
                    if len(self._ready) < self._size and quiet <= 0:
                        break
                    self._condition.wait(quiet if len(self._ready) < self._size else None)
                if self._closed:
                    return
                self._taken_at = 0.0
                key = self._key()
            try:
                shell = self._make()
            except (SandboxError, OSError):
                self.failures += 1
                with self._condition:
                    self._condition.wait(RETRY_SECONDS)
                continue
            if not self._offer(key, shell):
                shell.close()
                return

    def _offer(self, key: Hashable, shell: PtyShell) -> bool:
        """Add a new warm shell; False once the pool is closed (the caller ends the shell)."""
        with self._condition:
            if self._closed:
                return False
            self._ready.append((key, shell))
            self._condition.notify_all()  # wait_ready
            return True

    def wait_ready(self, count: int | None = None, timeout: float = 10.0) -> bool:
        """Wait until ``count`` warm shells (default: the pool's size) are ready, or the pool closed; False at the
        timeout. For benchmarks and tests, which must not time a refill that overlaps what they measure. A pool
        never taken from has no refill going on (it fills on first use): nothing to wait for."""
        wanted = self._size if count is None else count
        with self._condition:
            return self._condition.wait_for(
                lambda: self._closed or self._thread is None or len(self._ready) >= wanted, timeout
            )

    def __len__(self) -> int:
        with self._condition:
            return len(self._ready)

    def close(self, timeout: float = 15.0) -> None:
        """End every warm shell (idempotent); a shell being started meanwhile is ended as soon as it is up."""
        with self._condition:
            self._closed = True
            ready, self._ready = self._ready, []
            thread = self._thread
            self._condition.notify_all()
        for _, shell in ready:
            shell.close()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
