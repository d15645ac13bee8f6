"""Per-task, per-epoch tallies of what the cache did for its clients: the numbers behind the dashboard.

The server has no notion of epochs; clients tag their requests with one (``RemoteCache.epoch = n``; the optional
``epoch`` field of ``/v1/lookup``, ``/v1/touch`` and ``/v1/insert``). Untagged traffic -- the reference wire
format, clients that never set an epoch -- is tallied under epoch ``None``. We deliberately do not bucket by
time: an epoch of a GRPO run is a span of rollouts, not of wall-clock time, and a time bucket would be a guess.

* a **hit** is a call answered from the cache: a ``/v1/lookup`` hit, each node id of a ``/v1/touch`` (hits a
  ``RemoteCache`` served from its replica, including calls it waited for while another client executed them),
  and a ``GET /get`` hit; it saves the call's recorded execution time (``node.seconds``).
* a **miss** is a call a client executed: each ``/v1/insert``, and each call a ``PUT /put`` records (the
  reference client executes after a ``GET /get`` miss, then puts). Lookup misses (``/v1/lookup``, ``GET /get``)
  are not counted: the client goes on to execute the call (an insert, a put) or to run it uncached (a
  non-deterministic tool), which the cache never sees.

Tallies live in memory: like ``/metrics`` counters they start at zero when the server starts. They are kept per
task only for tasks the cache holds (``tracked``): traffic naming a task nobody recorded anything for counts in
the totals but gets no row, so a client cannot grow the server's memory (and the dashboard's ``/v1/activity``,
fetched every few seconds) by inventing task names.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["Activity", "Tally"]


@dataclass(kw_only=True, slots=True)
class Tally:
    hits: int = 0
    misses: int = 0
    seconds_saved: float = 0.0
    seconds_executed: float = 0.0

    @property
    def hit_rate(self) -> float | None:
        total = self.hits + self.misses
        return None if total == 0 else self.hits / total

    def add(self, other: Tally) -> None:
        self.hits += other.hits
        self.misses += other.misses
        self.seconds_saved += other.seconds_saved
        self.seconds_executed += other.seconds_executed


class Activity:
    """Tallies by task and epoch. Runs on the server's event loop thread, like the rest of the service."""

    def __init__(
        self, *, clock: Callable[[], float] = time.time, tracked: Callable[[str], bool] = lambda task_id: True
    ) -> None:
        self.started = clock()
        self._tracked = tracked
        self._tallies: dict[str, dict[int | None, Tally]] = {}
        self._untracked = Tally()  # traffic of tasks without a row, in the totals only

    def _tally(self, task_id: str, epoch: int | None) -> Tally:
        epochs = self._tallies.get(task_id)
        if epochs is None:
            if not self._tracked(task_id):
                return self._untracked
            epochs = self._tallies[task_id] = {}
        tally = epochs.get(epoch)
        if tally is None:
            tally = epochs[epoch] = Tally()
        return tally

    def hit(self, task_id: str, epoch: int | None, *, seconds_saved: float) -> None:
        tally = self._tally(task_id, epoch)
        tally.hits += 1
        tally.seconds_saved += seconds_saved

    def miss(self, task_id: str, epoch: int | None, *, seconds_executed: float = 0.0) -> None:
        tally = self._tally(task_id, epoch)
        tally.misses += 1
        tally.seconds_executed += seconds_executed

    def tasks(self) -> list[str]:
        return list(self._tallies)

    def epochs(self, task_id: str) -> Iterator[tuple[int | None, Tally]]:
        """The task's tallies, tagged epochs in order, then the untagged one."""
        epochs = self._tallies.get(task_id, {})
        for epoch in sorted(key for key in epochs if key is not None):
            yield epoch, epochs[epoch]
        if None in epochs:
            yield None, epochs[None]

    def total(self, task_id: str | None = None) -> Tally:
        """The sum over one task's epochs, or over everything."""
        total = Tally()
        if task_id is None:
            total.add(self._untracked)
        tasks = self._tallies.values() if task_id is None else [self._tallies.get(task_id, {})]
        for epochs in tasks:
            for tally in epochs.values():
                total.add(tally)
        return total
