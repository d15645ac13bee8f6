"""Open-loop load generation shared by the server and Ray benchmarks.

Requests are dispatched at their due times whatever the answers do (open loop), and each latency is measured from
the request's *due* time, so a server that falls behind is charged for the queue it builds (no coordinated
omission).
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

__all__ = ["LoadFigures", "measure", "offer", "percentile"]


async def offer(send: Callable[[int], Awaitable[bool]], count: int, rate: int) -> tuple[list[float], int, float]:
    """Send requests 0..count-1 at ``rate`` per second; returns latencies (s), errors and the span from the
    first due time to the last answer."""
    latencies: list[float] = []
    errors = 0
    last = 0.0
    tasks: set[asyncio.Task[None]] = set()

    async def one(index: int, due: float) -> None:
        nonlocal errors, last
        ok = await send(index)
        done = time.perf_counter()
        latencies.append(done - due)
        last = max(last, done)
        if not ok:
            errors += 1

    start = time.perf_counter() + 0.01
    index = 0
    while index < count:
        now = time.perf_counter()
        due = start + index / rate
        if due > now:
            await asyncio.sleep(due - now)
            continue
        while index < count and start + index / rate <= now:  # dispatch everything that is due
            task = asyncio.create_task(one(index, start + index / rate))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            index += 1
    while tasks:
        await asyncio.gather(*list(tasks))
    return latencies, errors, last - start


def percentile(sorted_values: list[float], fraction: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(fraction * len(sorted_values)))]


@dataclass(frozen=True, kw_only=True)
class LoadFigures:
    sent: int
    errors: int
    achieved: float  # requests per second actually answered
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float


async def measure(send: Callable[[int], Awaitable[bool]], count: int, rate: int) -> LoadFigures:
    """``offer`` with the generator's own garbage collector paused (its pauses would count against the server),
    summarised."""
    gc.collect()
    gc.disable()
    try:
        latencies, errors, span = await offer(send, count, rate)
    finally:
        gc.enable()
    latencies.sort()
    return LoadFigures(
        sent=len(latencies),
        errors=errors,
        achieved=len(latencies) / span if span > 0 else 0.0,
        p50_ms=1000 * percentile(latencies, 0.50),
        p95_ms=1000 * percentile(latencies, 0.95),
        p99_ms=1000 * percentile(latencies, 0.99),
        max_ms=1000 * latencies[-1] if latencies else float("nan"),
    )
