"""``tvcache bench server``: the paper's server microbenchmark, open loop, on this machine.

Starts ``tvcache serve`` (``--shards N`` processes), populates ``--keys`` histories (three calls each, spread over
16 tasks, through the wire format's ``PUT /put``), then offers load at fixed rates for ``--duration`` seconds
each. Open loop: request *i* is due at ``t0 + i / rate`` whether or not earlier ones have answered, and its
latency is measured from that due time, so a server that falls behind shows it (no coordinated omission).
Requests go out over persistent HTTP/1.1 connections (a new one is opened whenever none is idle), written as
raw bytes so that the load generator stays cheap. Two routes are measured, both exact-match lookups of the
same keys: the original wire format's ``GET /get`` and the native ``POST /v1/lookup``. It prints achieved rate
and P50/P95/P99 per rate, and the ratios between the routes; nothing here is asserted.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..client.sharding import rendezvous
from ..server.wire import WIRE_TOOL
from .load import LoadFigures, measure, offer

TASKS = 16
MAX_CONNECTIONS = 512


@dataclass(frozen=True, kw_only=True)
class RateResult(LoadFigures):
    route: str
    rate: int


def bench_keys(count: int, seed: int) -> list[tuple[str, list[str]]]:
    rng = random.Random(seed)
    keys = [
        (f"task-{index % TASKS}", ["git clone repo", f"make -j{index // 256}", f"pytest -k case{index}"])
        for index in range(count)
    ]
    rng.shuffle(keys)
    return keys


def _wire_request(task: str, history: list[str]) -> bytes:
    query = urllib.parse.urlencode({"task_name": task, "tool_calls": history}, doseq=True)
    return f"GET /get?{query} HTTP/1.1\r\nHost: bench\r\n\r\n".encode()


def native_request(task: str, history: list[str]) -> bytes:
    body = json.dumps(
        {"task_id": task, "history": [{"name": WIRE_TOOL, "arguments": {"call": call}} for call in history]}
    ).encode()
    return _post("POST", "/v1/lookup", body)


def _post(method: str, path: str, body: bytes) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


class Pool:
    """Idle keep-alive connections to one server."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.opened = 0
        self.failures: dict[str, int] = {}

    async def open(self, count: int) -> None:
        """Pre-open ``count`` connections, so the measured run does not pay for connection setup."""
        while self.opened < count:
            self.opened += 1
            self.idle.append(await self._connect())

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer

    async def request(self, data: bytes) -> bool:
        if self.idle:
            reader, writer = self.idle.pop()
        else:
            if self.opened >= MAX_CONNECTIONS:  # the server is this far behind: count it as failed, not queued
                self.failures["connection limit"] = self.failures.get("connection limit", 0) + 1
                return False
            self.opened += 1
            reader, writer = await self._connect()
        try:
            writer.write(data)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as error:
            writer.close()
            self.opened -= 1
            self.failures[type(error).__name__] = self.failures.get(type(error).__name__, 0) + 1
            return False
        self.idle.append((reader, writer))
        if not head.startswith(b"HTTP/1.1 200"):
            status = head[9:12].decode(errors="replace")
            self.failures[status] = self.failures.get(status, 0) + 1
            return False
        return True

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


def _sender(pools: list[Pool], requests: list[tuple[int, bytes]]) -> Callable[[int], Awaitable[bool]]:
    """Request ``index`` of the load: the requests cycled, each to its shard's connection pool."""

    def send(index: int) -> Awaitable[bool]:
        shard, data = requests[index % len(requests)]
        return pools[shard].request(data)

    return send


async def populate(pools: list[Pool], shards: list[str], keys: list[tuple[str, list[str]]]) -> None:
    semaphore = asyncio.Semaphore(64)

    async def put(task: str, history: list[str]) -> None:
        body = json.dumps(
            {"task_name": task, "history": history, "env_id": None, "values": [f"out:{c}" for c in history],
             "tool_exec_times": [1.0] * len(history)}
        ).encode()  # fmt: skip
        head = (
            f"PUT /put HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        async with semaphore:
            if not await pools[shards.index(rendezvous(task, shards))].request(head.encode() + body):
                raise RuntimeError(f"populating {task} failed")

    await asyncio.gather(*(put(task, history) for task, history in keys))


def start_server(port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tvcache.cli", "serve", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_healthy(port: int, process: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tvcache serve on port {port} exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
                if sock.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"tvcache serve on port {port} did not become healthy within {timeout} s")


async def _bench(ports: list[int], rates: list[int], duration: float, keys: int, seed: int) -> list[RateResult]:
    shards = [f"shard-{port}" for port in ports]
    pools = [Pool(port) for port in ports]
    population = bench_keys(keys, seed)
    await populate(pools, shards, population)
    for pool in pools:
        await pool.open(64)
    results: list[RateResult] = []
    for route, build in (("GET /get", _wire_request), ("POST /v1/lookup", native_request)):
        requests = [(shards.index(rendezvous(task, shards)), build(task, history)) for task, history in population]
        await offer(_sender(pools, requests[:256]), 128, 256)  # warm up connections and code paths
        for rate in rates:
            figures = await measure(_sender(pools, requests), max(1, int(rate * duration)), rate)
            result = RateResult(route=route, rate=rate, **asdict(figures))
            results.append(result)
            print(
                f"{route:<16} {rate:>6} req/s  achieved {result.achieved:>7.0f}  p50 {result.p50_ms:7.2f} ms  "
                f"p95 {result.p95_ms:7.2f} ms  p99 {result.p99_ms:7.2f} ms  errors {result.errors}  "
                f"connections {sum(pool.opened for pool in pools)}",
                flush=True,
            )
    for pool in pools:
        if pool.failures:
            print(f"failures on port {pool.port}: {pool.failures}")
        pool.close()
    return results


def run(
    *, rates: list[int], duration: float, keys: int, shards: int = 1, seed: int = 0, json_path: str | None = None
) -> int:
    ports = [free_port() for _ in range(shards)]
    processes = [start_server(port) for port in ports]
    try:
        for port, process in zip(ports, processes, strict=True):
            wait_healthy(port, process)
        print(
            f"tvcache bench server: {shards} server process(es), {keys} keys over {TASKS} tasks, "
            f"{duration:g} s per rate, open loop, latency from each request's due time",
            flush=True,
        )
        try:
            import uvloop

            loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
        except ImportError:
            loop_factory = None
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            results = runner.run(_bench(ports, rates, duration, keys, seed))
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(10)
    by_rate: dict[int, dict[str, RateResult]] = {}
    for result in results:
        by_rate.setdefault(result.rate, {})[result.route] = result
    print("\nratios (native POST /v1/lookup vs wire GET /get):")
    for rate, routes in sorted(by_rate.items()):
        wire, native = routes.get("GET /get"), routes.get("POST /v1/lookup")
        if wire and native and wire.p95_ms > 0:
            print(
                f"  {rate:>6} req/s  p95 native/wire {native.p95_ms / wire.p95_ms:5.2f}  "
                f"achieved native/wire {native.achieved / max(wire.achieved, 1e-9):5.2f}"
            )
    sustained = [r for r in results if r.p95_ms <= 5.0 and r.achieved >= 0.95 * r.rate and not r.errors]
    for route in ("GET /get", "POST /v1/lookup"):
        best = max((r.rate for r in sustained if r.route == route), default=None)
        print(f"highest rate with p95 <= 5 ms, >= 95% achieved, no errors, {route}: {best or 'none'} req/s")
    if json_path is not None:
        payload: dict[str, Any] = {
            "shards": shards,
            "keys": keys,
            "duration": duration,
            "results": [asdict(r) for r in results],
        }
        Path(json_path).write_text(json.dumps(payload, indent=2))
    return 0
