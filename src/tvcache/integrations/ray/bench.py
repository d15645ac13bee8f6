"""``tvcache bench ray``: Ray shard actors next to HTTP shard servers on this machine, under the same load.

Both deployments get ``--shards`` shards holding the same keys (three-call histories over 16 tasks, as in
``tvcache bench server``) and are offered the same open-loop load of exact-match lookups (``POST /v1/lookup`` with
a history): request *i* is due at ``t0 + i / rate`` and its latency counts from then. HTTP requests go over
keep-alive connections to ``tvcache serve`` processes; Ray requests are actor calls awaited from this process's
event loop (what a ``RayCache`` replica miss costs). It prints achieved lookups/s and P50/P95/P99 per rate and
the Ray/HTTP ratios; nothing here is asserted.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray

from ...api import routes
from ...bench.load import LoadFigures, measure, offer
from ...bench.server import Pool, bench_keys, free_port, native_request, populate, start_server, wait_healthy
from ...client.sharding import rendezvous
from ...server.wire import WIRE_TOOL
from .shards import start_shards

Send = Callable[[int], Awaitable[bool]]


@dataclass(frozen=True, kw_only=True)
class Row(LoadFigures):
    deployment: str
    rate: int


def _lookup_body(task: str, history: list[str]) -> bytes:
    calls = [{"name": WIRE_TOOL, "arguments": {"call": call}} for call in history]
    return json.dumps({"task_id": task, "history": calls}).encode()


async def _populate_ray(actors: list[Any], names: list[str], keys: list[tuple[str, list[str]]]) -> None:
    semaphore = asyncio.Semaphore(64)

    async def put(task: str, history: list[str]) -> None:
        actor = actors[names.index(rendezvous(task, names))]
        parent = 0
        async with semaphore:
            for call in history:
                body = {
                    "task_id": task,
                    "parent": parent,
                    "call": {"name": WIRE_TOOL, "arguments": {"call": call}},
                    "output": json.dumps(f"out:{call}"),  # a wire value is JSON text, as /put stores it
                    "seconds": 1.0,
                    "read_only": False,
                }
                status, answer = await actor.request.remote(
                    routes.INSERT.method, routes.INSERT.path, json.dumps(body).encode(), None
                )
                if status != 200:
                    raise RuntimeError(f"populating {task} failed: {answer!r}")
                parent = json.loads(answer)["node"]["id"]

    await asyncio.gather(*(put(task, history) for task, history in keys))


async def _measure(name: str, send: Send, rates: list[int], duration: float) -> list[Row]:
    await offer(send, 256, 256)  # warm up connections, workers and code paths
    rows = []
    for rate in rates:
        figures = await measure(send, max(1, int(rate * duration)), rate)
        row = Row(deployment=name, rate=rate, **asdict(figures))
        rows.append(row)
        print(
            f"{name:<5} {rate:>6} lookups/s offered  achieved {row.achieved:>7.0f}  p50 {row.p50_ms:7.2f} ms  "
            f"p95 {row.p95_ms:7.2f} ms  p99 {row.p99_ms:7.2f} ms  errors {row.errors}",
            flush=True,
        )
    return rows


async def _bench(ports: list[int], actors: list[Any], names: list[str], args: dict[str, Any]) -> list[Row]:
    population = bench_keys(args["keys"], args["seed"])
    http_names = [f"shard-{port}" for port in ports]
    pools = [Pool(port) for port in ports]
    await populate(pools, http_names, population)
    for pool in pools:
        await pool.open(64)
    await _populate_ray(actors, names, population)

    http_requests = [
        (http_names.index(rendezvous(task, http_names)), native_request(task, history)) for task, history in population
    ]
    ray_requests = [(names.index(rendezvous(task, names)), _lookup_body(task, history)) for task, history in population]

    async def send_http(index: int) -> bool:
        shard, data = http_requests[index % len(http_requests)]
        return await pools[shard].request(data)

    async def send_ray(index: int) -> bool:
        shard, body = ray_requests[index % len(ray_requests)]
        status, answer = await actors[shard].request.remote(routes.LOOKUP.method, routes.LOOKUP.path, body, None)
        return status == 200 and bool(json.loads(answer)["hit"])

    rows = await _measure("http", send_http, args["rates"], args["duration"])
    rows += await _measure("ray", send_ray, args["rates"], args["duration"])
    for pool in pools:
        pool.close()
    return rows


def run(
    *, rates: list[int], duration: float, keys: int, shards: int = 1, seed: int = 0, json_path: str | None = None
) -> int:
    """Start both deployments on this machine, measure, print, tear down."""
    namespace = f"tvcache-bench-{uuid.uuid4().hex[:8]}"
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(namespace=namespace, include_dashboard=False, object_store_memory=100 * 1024**2, log_to_driver=False)
    ports = [free_port() for _ in range(shards)]
    processes = [start_server(port) for port in ports]
    try:
        for port, process in zip(ports, processes, strict=True):
            wait_healthy(port, process)
        names = start_shards(shards, data_dir=None, namespace=namespace, detached=False)
        actors = [ray.get_actor(name, namespace=namespace) for name in names]
        print(
            f"tvcache bench ray: {shards} shard(s) each way, {keys} keys over 16 tasks, {duration:g} s per rate, "
            "open loop, POST /v1/lookup with a three-call history, latency from each request's due time",
            flush=True,
        )
        settings = {"rates": rates, "duration": duration, "keys": keys, "seed": seed}
        rows = asyncio.run(_bench(ports, actors, names, settings))
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(10)
        if started_ray:
            ray.shutdown()
    print("\nratios (Ray shard actors / HTTP shard servers):")
    by_rate: dict[int, dict[str, Row]] = {}
    for row in rows:
        by_rate.setdefault(row.rate, {})[row.deployment] = row
    for rate, pair in sorted(by_rate.items()):
        http, via_ray = pair.get("http"), pair.get("ray")
        if http and via_ray and http.p95_ms > 0:
            print(
                f"  {rate:>6} lookups/s  p95 ray/http {via_ray.p95_ms / http.p95_ms:6.2f}  "
                f"achieved ray/http {via_ray.achieved / max(http.achieved, 1e-9):5.2f}"
            )
    for deployment in ("http", "ray"):
        ok = [r.rate for r in rows if r.deployment == deployment and r.p95_ms <= 5.0 and r.achieved >= 0.95 * r.rate]
        print(f"highest rate with p95 <= 5 ms and >= 95% achieved, {deployment}: {max(ok, default=0) or 'none'}")
    if json_path is not None:
        payload = {"shards": shards, "keys": keys, "duration": duration, "results": [asdict(row) for row in rows]}
        Path(json_path).write_text(json.dumps(payload, indent=2))
    return 0
