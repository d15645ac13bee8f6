"""``tvcache ray up|status|down|dashboard``: manage the shard actors of a running Ray cluster from a shell, and
serve their dashboard and Prometheus metrics."""

from __future__ import annotations

import json
import sys
from typing import Any

import ray

from ...errors import TVCacheError
from .dashboard import DEFAULT_PORT, serve_dashboard
from .shards import DEFAULT_NAMESPACE, ensure_ray, find_shards, start_shards, stop_shards

__all__ = ["run"]


def run(
    action: str,
    *,
    shards: int = 1,
    data_dir: str | None = None,
    namespace: str = DEFAULT_NAMESPACE,
    address: str | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    token: str | None = None,
) -> int:
    """``up``: start (or find) ``shards`` detached shard actors; ``status``: where each runs and its counters;
    ``down``: kill them for good (their journals stay in ``data_dir``); ``dashboard``: serve the dashboard and
    ``/metrics`` of the shards on ``host:port`` until interrupted (``token`` required off loopback)."""
    if action == "dashboard":
        try:
            serve_dashboard(namespace=namespace, host=host, port=port or DEFAULT_PORT, token=token, address=address)
        except TVCacheError as error:
            print(f"tvcache ray dashboard: {error}", file=sys.stderr)
            return 2
        return 0
    ensure_ray(address, namespace=namespace)
    if action == "up":
        if data_dir is None:
            print(
                "tvcache ray up: pass --data-dir DIR (on a filesystem every node mounts) so that a restarted shard "
                "recovers its graphs; shards without one keep everything in memory",
                file=sys.stderr,
            )
            return 2
        names = start_shards(shards, data_dir=data_dir, namespace=namespace)
        print(f"tvcache ray: {len(names)} shard(s) up in namespace {namespace!r}: {' '.join(names)}")
        print(f"clients: RayCache(namespace={namespace!r})")
        return 0
    if action == "status":
        names = find_shards(namespace)
        if not names:
            print(f"tvcache ray: no shards in namespace {namespace!r}; start them with `tvcache ray up`")
            return 1
        actors: list[Any] = [ray.get_actor(name, namespace=namespace) for name in names]  # Any: see shards.py
        infos = ray.get([actor.info.remote() for actor in actors], timeout=60)
        for info in infos:
            print(json.dumps(info, sort_keys=True))
        return 0
    if action == "down":
        names = stop_shards(namespace)
        print(f"tvcache ray: stopped {len(names)} shard(s) in namespace {namespace!r}")
        return 0
    raise ValueError(f"unknown action {action!r}; expected up, status, down or dashboard")
