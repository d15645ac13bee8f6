"""Open-loop load generation shared by the server and Ray benchmarks, and the static server that calibrates it.

Requests are dispatched at their due times whatever the answers do (open loop), and each latency is measured from
the request's *due* time, so a server that falls behind is charged for the queue it builds (no coordinated
omission). The generator is itself a Python process: ``serve_static`` answers every request with fixed bytes and
no work, so the figures it gets are the generator's own ceiling, printed next to a real server's.

Two ways to send: ``offer`` awaits a coroutine per request (any client, a Ray actor call); ``offer_started``
starts a request and is called back when it is answered, which lets ``Connections`` write raw HTTP/1.1 bytes on
asyncio protocols with no task or coroutine per request (about a fifth of the cost, measured by ``tvcache bench
server``: the generator must stay well under the rates it offers).
"""

from __future__ import annotations

import asyncio
import gc
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import cast

__all__ = [
    "Connections",
    "LoadFigures",
    "measure",
    "measure_started",
    "offer",
    "offer_started",
    "percentile",
    "serve_static",
]

Done = Callable[[bool], None]
Start = Callable[[int, Done], None]  # start request ``index``; call ``done(ok)`` once it is answered

# The event loop's timers are millisecond-coarse (uvloop rounds a delay to whole ms): sleep this far short of a
# due time, then yield to the loop until it comes, so requests leave on time rather than up to 0.5 ms late.
_TIMER_SLACK = 0.0015


async def offer_started(start: Start, count: int, rate: int) -> tuple[list[float], int, float]:
    """Start requests 0..count-1 at ``rate`` per second; returns latencies (s), errors and the span from the
    first due time to the last answer."""
    latencies: list[float] = []
    errors = 0
    last = 0.0
    answered = 0
    all_answered = asyncio.get_running_loop().create_future()
    clock = time.perf_counter

    def answer(due: float) -> Done:
        def done(ok: bool) -> None:
            nonlocal errors, last, answered
            now = clock()
            latencies.append(now - due)
            last = now if now > last else last
            errors += not ok
            answered += 1
            if answered == count and not all_answered.done():
                all_answered.set_result(None)

        return done

    begin = clock() + 0.01
    index = 0
    while index < count:
        now = clock()
        due = begin + index / rate
        if due > now:
            await asyncio.sleep(max(0.0, due - now - _TIMER_SLACK))  # sleep(0): one turn of the loop
            continue
        while index < count and due <= now:  # start everything that is due
            start(index, answer(due))
            index += 1
            due = begin + index / rate
    if count:
        await all_answered
    return latencies, errors, last - begin


async def offer(send: Callable[[int], Awaitable[bool]], count: int, rate: int) -> tuple[list[float], int, float]:
    """``offer_started`` for a coroutine per request (a task each)."""
    tasks: set[asyncio.Task[bool]] = set()
    raised: list[BaseException] = []

    def start(index: int, done: Done) -> None:
        task = asyncio.ensure_future(send(index))
        tasks.add(task)

        def finished(task: asyncio.Task[bool]) -> None:
            tasks.discard(task)
            error = None if task.cancelled() else task.exception()
            if error is not None:
                raised.append(error)  # raised once every request is answered: a sender's bug is not an error count
            done(error is None and not task.cancelled() and task.result())

        task.add_done_callback(finished)

    figures = await offer_started(start, count, rate)
    if raised:
        raise raised[0]
    return figures


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


def _summary(latencies: list[float], errors: int, span: float) -> LoadFigures:
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


async def measure_started(start: Start, count: int, rate: int) -> LoadFigures:
    """``offer_started`` with the generator's own garbage collector paused (its pauses would count against the
    server), summarised."""
    gc.collect()
    gc.disable()
    try:
        latencies, errors, span = await offer_started(start, count, rate)
    finally:
        gc.enable()
    return _summary(latencies, errors, span)


async def measure(send: Callable[[int], Awaitable[bool]], count: int, rate: int) -> LoadFigures:
    """``measure_started`` for a coroutine per request."""
    gc.collect()
    gc.disable()
    try:
        latencies, errors, span = await offer(send, count, rate)
    finally:
        gc.enable()
    return _summary(latencies, errors, span)


# ---------------------------------------------------------------------- raw HTTP/1.1 connections


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            return int(line[15:])
    return 0


class _Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time; it reads the answer's head and as many body
    bytes as its content-length says, then goes back to its pool."""

    def __init__(self, pool: Connections) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.done: Done | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, data: bytes, done: Done) -> None:
        assert self.transport is not None
        self.done = done
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer + data
        end = buffer.find(b"\r\n\r\n")
        if end < 0 or len(buffer) < end + 4 + _content_length(buffer[:end]):
            self.buffer = buffer
            return
        self.buffer = b""
        done, self.done = self.done, None
        ok = buffer.startswith(b"HTTP/1.1 200")
        if not ok:
            self.pool.failed(buffer[9:12].decode(errors="replace"))
        self.pool.idle.append(self)
        if done is not None:
            done(ok)

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool.lost(self, type(exc).__name__ if exc is not None else "connection closed")


class Connections:
    """Keep-alive connections to one server, at most ``limit`` (a server that far behind counts as failing,
    not as queued). ``start(data, done)`` writes a whole request's bytes on an idle connection, or on a new one
    when none is idle."""

    def __init__(self, port: int, *, limit: int = 512) -> None:
        self.port = port
        self.limit = limit
        self.idle: list[_Connection] = []
        self.opened = 0
        self.failures: dict[str, int] = {}
        self._opening: deque[tuple[bytes, Done]] = deque()  # requests waiting for a connection being opened
        self._tasks: set[asyncio.Task[None]] = set()

    def failed(self, reason: str) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + 1

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        _, connection = await loop.create_connection(lambda: _Connection(self), "127.0.0.1", self.port)
        return connection

    async def open(self, count: int) -> None:
        """Pre-open ``count`` connections, so the measured run does not pay for connection setup."""
        while self.opened < count:
            self.opened += 1
            self.idle.append(await self._connect())

    def start(self, data: bytes, done: Done) -> None:
        if self.idle:
            self.idle.pop().send(data, done)
            return
        if self.opened >= self.limit:
            self.failed("connection limit")
            done(False)
            return
        self.opened += 1
        self._opening.append((data, done))
        task = asyncio.ensure_future(self._open_for_waiting())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _open_for_waiting(self) -> None:
        try:
            connection = await self._connect()
        except OSError as error:
            self.opened -= 1
            self.failed(type(error).__name__)
            data, done = self._opening.popleft()
            done(False)
            return
        data, done = self._opening.popleft()
        connection.send(data, done)

    def lost(self, connection: _Connection, reason: str) -> None:
        self.opened -= 1
        if connection in self.idle:
            self.idle.remove(connection)
        done, connection.done = connection.done, None
        if done is not None:
            self.failed(reason)
            done(False)

    async def request(self, data: bytes) -> bool:
        """One request, awaited: whether it was answered with 200."""
        answered: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.start(data, answered.set_result)
        return await answered

    def close(self) -> None:
        for connection in self.idle:
            if connection.transport is not None:
                connection.transport.close()
        self.idle.clear()


# ---------------------------------------------------------------------- the calibration server


class _Static(asyncio.Protocol):
    """Answers every request with ``reply``: it finds each request's end (its head, and a body as long as its
    content-length) and nothing more."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer + data
        answers = 0
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                break
            size = end + 4 + _content_length(buffer[:end])
            if len(buffer) < size:
                break
            buffer = buffer[size:]
            answers += 1
        self.buffer = buffer
        if answers and self.transport is not None:
            self.transport.write(self.reply * answers)


STATIC_BODY = b'{"found":false,"env_id":null,"value":null,"tool_exec_time":null}'
STATIC_REPLY = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\ncontent-type: application/json\r\n\r\n%s" % (
    len(STATIC_BODY),
    STATIC_BODY,
)


def serve_static(port: int) -> None:
    """Serve ``STATIC_REPLY`` to every request on 127.0.0.1:``port`` until killed (uvloop when installed)."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Static(STATIC_REPLY), "127.0.0.1", port)
        await server.serve_forever()

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
