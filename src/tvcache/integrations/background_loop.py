"""An event loop on a daemon thread, for frameworks whose environment API is synchronous."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["BackgroundLoop", "shared_loop"]

T = TypeVar("T")


class BackgroundLoop:
    """An event loop on a daemon thread, for frameworks whose environment API is synchronous: ``run`` blocks the
    calling thread (whether or not it is itself running a loop) until the coroutine finishes there."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._get()).result()

    def _get(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="tvcache-integration", daemon=True).start()
                self._loop = loop
            return self._loop


_SHARED_LOOP = BackgroundLoop()


def shared_loop() -> BackgroundLoop:
    """The process-wide background loop of the synchronous adapters."""
    return _SHARED_LOOP
