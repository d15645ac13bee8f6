"""``tvcache bench server``: the paper's server microbenchmark, open loop, on this machine.

Starts ``tvcache serve`` (``--shards N`` processes), populates ``--keys`` histories (three calls each, spread over
16 tasks, through the wire format's ``PUT /put``), then offers load at fixed rates for ``--duration`` seconds
each. Open loop: request *i* is due at ``t0 + i / rate`` whether or not earlier ones have answered, and its
latency is measured from that due time, so a server that falls behind shows it (no coordinated omission).
Requests go out over persistent HTTP/1.1 connections (a new one is opened whenever none is idle) as raw bytes on
asyncio protocols (``load.Connections``), so the generator stays cheap. Two routes are measured, both
exact-match lookups of the same keys: the original wire format's ``GET /get`` and the native ``POST /v1/lookup``.

Next to the server, at every rate, in the same run:

- **calibration**: a static server (``load.serve_static``) answering every request with fixed bytes and no work.
  What it gets is the generator's own ceiling on this machine; a server's figures mean something only below it.
- **baseline** (``--baseline SRC``): ``tvcache serve`` of another checkout, run from its ``src`` directory with
  this venv (``git worktree add /tmp/base COMMIT``, then ``--baseline /tmp/base/src``), populated and loaded the
  same way, rate by rate interleaved with ours so both see the same machine.

Each line gives the achieved rate, P50/P95/P99, errors, connections, and the server processes' CPU time per
request (from ``/proc``: what the server spends, whatever else the machine runs). Then the ratios: ours against
the baseline, and native against wire. Nothing here is asserted.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..client.sharding import rendezvous
from ..server.wire import WIRE_TOOL
from .load import Connections, LoadFigures, measure_started

__all__ = ["Pool", "bench_keys", "free_port", "native_request", "populate", "run", "start_server", "wait_healthy"]

TASKS = 16
CONNECTIONS = 64  # opened before the load; more are opened while none is idle, up to load.Connections' limit
P95_GOAL_MS = 2.0
GOAL_RATE = 8192

Pool = Connections  # the name the Ray benchmark (tvcache.integrations.ray.bench) imports


@dataclass(frozen=True, kw_only=True)
class RateResult(LoadFigures):
    target: str  # "calibration", "ours" or "baseline"
    route: str
    rate: int
    connections: int
    server_us_per_request: float  # CPU time of the target's processes per request sent (nan: not measurable)


def bench_keys(count: int, seed: int) -> list[tuple[str, list[str]]]:
    rng = random.Random(seed)
    keys = [
        (f"task-{index % TASKS}", ["git clone repo", f"make -j{index // 256}", f"pytest -k case{index}"])
        for index in range(count)
    ]
    rng.shuffle(keys)
    return keys


def wire_request(task: str, history: list[str]) -> bytes:
    query = urllib.parse.urlencode({"task_name": task, "tool_calls": history}, doseq=True)
    return f"GET /get?{query} HTTP/1.1\r\nHost: bench\r\n\r\n".encode()


def native_request(task: str, history: list[str]) -> bytes:
    body = json.dumps(
        {"task_id": task, "history": [{"name": WIRE_TOOL, "arguments": {"call": call}} for call in history]}
    ).encode()
    return _with_body("POST", "/v1/lookup", body)


def _with_body(method: str, path: str, body: bytes) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


ROUTES: tuple[tuple[str, Callable[[str, list[str]], bytes]], ...] = (
    ("GET /get", wire_request),
    ("POST /v1/lookup", native_request),
)


async def populate(pools: Sequence[Connections], shards: list[str], keys: list[tuple[str, list[str]]]) -> None:
    """``PUT /put`` every history, each to its task's shard (``shards``: the pools' names, in order)."""
    semaphore = asyncio.Semaphore(64)

    async def put(task: str, history: list[str]) -> None:
        body = json.dumps(
            {"task_name": task, "history": history, "env_id": None, "values": [f"out:{c}" for c in history],
             "tool_exec_times": [1.0] * len(history)}
        ).encode()  # fmt: skip
        async with semaphore:
            if not await pools[shards.index(rendezvous(task, shards))].request(_with_body("PUT", "/put", body)):
                raise RuntimeError(f"populating {task} failed")

    await asyncio.gather(*(put(task, history) for task, history in keys))


def start_server(port: int, *, source: str | None = None) -> subprocess.Popen[bytes]:
    """``tvcache serve`` on ``port``, in memory; ``source``: the ``src`` directory of another checkout to run."""
    env = None
    if source is not None:
        paths = [source, *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    return subprocess.Popen(
        [sys.executable, "-m", "tvcache.cli", "serve", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )


def start_static(port: int) -> subprocess.Popen[bytes]:
    code = f"from tvcache.bench.load import serve_static; serve_static({port})"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


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
    raise RuntimeError(f"the server on port {port} did not become healthy within {timeout} s")


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid`` so far (nan where ``/proc`` is not there)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Target:
    """A set of server processes under load, and the connections to them (one pool per shard)."""

    name: str
    processes: list[subprocess.Popen[bytes]]
    pools: list[Connections]

    def cpu(self) -> float:
        return sum(cpu_seconds(process.pid) for process in self.processes)

    async def measure(self, requests: list[tuple[int, bytes]], count: int, rate: int) -> tuple[LoadFigures, float]:
        pools = self.pools

        def start(index: int, done: Callable[[bool], None]) -> None:
            shard, data = requests[index % len(requests)]
            pools[shard].start(data, done)

        before = self.cpu()
        figures = await measure_started(start, count, rate)
        return figures, 1e6 * (self.cpu() - before) / max(1, figures.sent)


def _line(result: RateResult) -> str:
    return (
        f"{result.target:<11} {result.route:<16} {result.rate:>6} req/s  achieved {result.achieved:>7.0f}  "
        f"p50 {result.p50_ms:7.2f} ms  p95 {result.p95_ms:7.2f} ms  p99 {result.p99_ms:7.2f} ms  "
        f"errors {result.errors}  connections {result.connections}  server {result.server_us_per_request:6.1f} us/req"
    )


async def _bench(targets: list[Target], rates: list[int], duration: float, keys: int, seed: int) -> list[RateResult]:
    population = bench_keys(keys, seed)
    for target in targets:
        shards = [f"shard-{index}" for index in range(len(target.pools))]
        if target.name != "calibration":
            await populate(target.pools, shards, population)
        for pool in target.pools:
            await pool.open(CONNECTIONS)
    results: list[RateResult] = []
    for route, build in ROUTES:
        plans = {}
        for target in targets:
            shards = [f"shard-{index}" for index in range(len(target.pools))]
            plans[target.name] = [
                (shards.index(rendezvous(task, shards)), build(task, history)) for task, history in population
            ]
            await target.measure(plans[target.name][:256], 256, 256)  # warm up connections and code paths
        for rate in rates:
            for target in targets:  # interleaved: every target meets the machine as it is at this rate
                figures, cpu = await target.measure(plans[target.name], max(1, int(rate * duration)), rate)
                result = RateResult(
                    target=target.name,
                    route=route,
                    rate=rate,
                    connections=sum(pool.opened for pool in target.pools),
                    server_us_per_request=cpu,
                    **asdict(figures),
                )
                results.append(result)
                print(_line(result), flush=True)
    for target in targets:
        for pool in target.pools:
            if pool.failures:
                print(f"failures, {target.name} on port {pool.port}: {pool.failures}")
            pool.close()
    return results


def _sustained(results: list[RateResult], target: str, route: str, p95_ms: float) -> int | None:
    held = [
        r.rate
        for r in results
        if r.target == target and r.route == route and r.p95_ms <= p95_ms and r.achieved >= 0.95 * r.rate
        and not r.errors
    ]  # fmt: skip
    return max(held, default=None)


def _summary(results: list[RateResult], names: list[str]) -> None:
    found = {(r.target, r.route, r.rate): r for r in results}
    rates = sorted({r.rate for r in results})
    if "baseline" in names:
        print("\nratios (ours vs baseline, same run, same rate):")
        for route, _ in ROUTES:
            for rate in rates:
                ours, base = found.get(("ours", route, rate)), found.get(("baseline", route, rate))
                if ours is None or base is None:
                    continue
                print(
                    f"  {route:<16} {rate:>6} req/s  p95 ours/baseline {ours.p95_ms / max(base.p95_ms, 1e-9):7.3f}  "
                    f"achieved ours/baseline {ours.achieved / max(base.achieved, 1e-9):5.2f}  "
                    f"server CPU per request ours/baseline "
                    f"{ours.server_us_per_request / max(base.server_us_per_request, 1e-9):5.2f}"
                )
    print("\nratios (native POST /v1/lookup vs wire GET /get, ours):")
    for rate in rates:
        wire, native = found.get(("ours", "GET /get", rate)), found.get(("ours", "POST /v1/lookup", rate))
        if wire and native and wire.p95_ms > 0:
            print(
                f"  {rate:>6} req/s  p95 native/wire {native.p95_ms / wire.p95_ms:5.2f}  "
                f"achieved native/wire {native.achieved / max(wire.achieved, 1e-9):5.2f}"
            )
    print(f"\nhighest rate with p95 <= {P95_GOAL_MS:g} ms, >= 95% achieved, no errors:")
    for route, _ in ROUTES:
        for name in names:
            best = _sustained(results, name, route, P95_GOAL_MS)
            print(f"  {name:<11} {route:<16} {best or 'none'} req/s")
    goal = found.get(("ours", "GET /get", GOAL_RATE))
    if goal is not None:
        calibration = found.get(("calibration", "GET /get", GOAL_RATE))
        ceiling = "" if calibration is None else f" (the generator alone: {calibration.p95_ms:.2f} ms)"
        print(
            f"GET /get at {GOAL_RATE} req/s: p95 {goal.p95_ms:.2f} ms (goal <= {P95_GOAL_MS:g} ms){ceiling}, "
            f"errors {goal.errors}"
        )


def _commit(source: str) -> str:
    try:
        done = subprocess.run(
            ["git", "-C", source, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except OSError:
        return "?"
    return done.stdout.strip() or "?"


def run(
    *,
    rates: list[int],
    duration: float,
    keys: int,
    shards: int = 1,
    seed: int = 0,
    json_path: str | None = None,
    baseline: str | None = None,
) -> int:
    plan: list[tuple[str, int, Callable[[int], subprocess.Popen[bytes]]]] = [("calibration", 1, start_static)]
    plan.append(("ours", shards, start_server))
    if baseline is not None:
        plan.append(("baseline", shards, lambda port: start_server(port, source=baseline)))
    targets: list[Target] = []
    try:
        for name, count, start in plan:
            ports = [free_port() for _ in range(count)]
            processes = [start(port) for port in ports]
            targets.append(Target(name, processes, [Connections(port) for port in ports]))
            for port, process in zip(ports, processes, strict=True):
                wait_healthy(port, process)
        print(
            f"tvcache bench server: {shards} server process(es), {keys} keys over {TASKS} tasks, "
            f"{duration:g} s per rate, open loop, latency from each request's due time; calibration: a static "
            "server answering fixed bytes (the generator's own ceiling)"
            + ("" if baseline is None else f"; baseline: {baseline} (commit {_commit(baseline)})"),
            flush=True,
        )
        try:
            import uvloop

            loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
        except ImportError:
            loop_factory = None
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            results = runner.run(_bench(targets, rates, duration, keys, seed))
    finally:
        for target in targets:
            for process in target.processes:
                process.terminate()
        for target in targets:
            for process in target.processes:
                process.wait(10)
    _summary(results, [target.name for target in targets])
    if json_path is not None:
        payload: dict[str, Any] = {
            "shards": shards,
            "keys": keys,
            "duration": duration,
            "baseline": baseline,
            "results": [asdict(r) for r in results],
        }
        Path(json_path).write_text(json.dumps(payload, indent=2))
    return 0
