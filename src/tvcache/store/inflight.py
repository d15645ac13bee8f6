"""In-flight coalescing: the first caller missing a key executes, everyone else waits for its result.

One table serves the embedded cache (``LocalStore``'s claims on calls and end-of-rollout checks) and the server,
which puts ids, TTLs and heartbeats on top (``tvcache.server.service``). A key names one execution: the task, the
state's node id, and a digest of what runs there (a call's digest, or a check's key).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Generic, TypeVar

from .protocol import Claim

__all__ = ["ClaimKey", "Inflight", "check_key"]

V = TypeVar("V")

ClaimKey = tuple[str, int, bytes]
"""(task id, state node id, what runs there: a call's digest or ``check_key``'s bytes)."""


def check_key(key: str) -> bytes:
    """The last part of a ``ClaimKey`` for the end-of-rollout check ``key`` (never a call digest, which is
    exactly 32 bytes)."""
    return b"test\x00" + key.encode()


class Inflight(Generic[V]):
    """The pending executions, each a future its waiters share. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[ClaimKey, Future[V]] = {}

    def claim(self, key: ClaimKey) -> Claim[V]:
        """Own ``key``'s execution (``owner=True``, a new future) or join the one pending."""
        with self._lock:
            future = self._pending.get(key)
            if future is not None:
                return Claim(owner=False, ready=future)
            future = self._pending[key] = Future()
        # Running futures cannot be cancelled: one waiter giving up must not cancel the call for everyone.
        future.set_running_or_notify_cancel()
        return Claim(owner=True, ready=future)

    @staticmethod
    def done(value: V) -> Claim[V]:
        """A claim that is over before it began: the result was there by the time of the claim."""
        future: Future[V] = Future()
        future.set_result(value)
        return Claim(owner=False, ready=future)

    def pending(self, key: ClaimKey) -> Future[V] | None:
        with self._lock:
            return self._pending.get(key)

    def settle(
        self, key: ClaimKey, value: V, error: BaseException | None = None, *, only: Future[V] | None = None
    ) -> bool:
        """End ``key``'s execution: its waiters get ``value`` (or ``error``). ``only``: end it only if that is
        the pending future (a newer execution of the key is left alone). Returns whether one was ended."""
        with self._lock:
            future = self._pending.get(key)
            if future is None or (only is not None and future is not only):
                return False
            del self._pending[key]
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
        return True

    def keys(self) -> list[ClaimKey]:
        with self._lock:
            return list(self._pending)

    def __len__(self) -> int:
        return len(self._pending)

    def __bool__(self) -> bool:
        return bool(self._pending)
