"""The one ``cache`` setting every adapter takes, and ``open_cache``, which turns it into a cache: in memory, a
directory, a ``tvcache serve`` URL or several, Ray shard actors, or a cache already open."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..cache import Cache
from ..calls import ToolSpec
from ..errors import InvalidInput
from ..session import Session

__all__ = ["CacheLike", "CacheLocation", "open_cache"]


class CacheLike(Protocol):
    """What adapters need of a cache: ``Cache``, ``RemoteCache`` and ``ShardedCache`` all fit."""

    def session(self, task_id: str, *, sandbox: Any) -> Session: ...

    def close(self) -> None: ...


CacheLocation = CacheLike | str | os.PathLike[str] | Sequence[str] | None
"""The one setting that picks a deployment: None (in memory — or, inside a Ray cluster running tvcache shard
actors in the driver's namespace, those shards), a directory (durable, embedded), an ``http(s)://`` URL
(``tvcache serve``), a list of URLs (sharded servers), ``ray://[namespace]`` (Ray shard actors), or an already
open cache."""


def open_cache(
    where: CacheLocation,
    *,
    token: str | None = None,
    tools: Iterable[ToolSpec] = (),
    audit_rate: float = 0.0,
    verify_undeclared: bool = True,
) -> CacheLike:
    """Open the cache ``where`` names (see ``CacheLocation``). An open cache is returned as it is (it keeps the
    settings it was made with). ``audit_rate``: the fraction of hits re-executed in a fresh sandbox and compared;
    ``verify_undeclared``: check the first hit of each undeclared tool per task (see ``tvcache.Cache``)."""
    if not 0.0 <= audit_rate <= 1.0:
        raise InvalidInput(f"audit_rate must be between 0 and 1, got {audit_rate}")
    checks: dict[str, Any] = {"audit_rate": audit_rate}
    if where is None:
        # Inside a Ray cluster whose namespace runs tvcache shard actors (veRL and SkyRL run on Ray), use them.
        cluster = _ray_cluster_cache(None, tools, checks)
        return _checking(cluster or Cache(tools=tools, **checks), verify_undeclared)
    if isinstance(where, str) and where.startswith("ray://"):
        cache = _ray_cluster_cache(where.removeprefix("ray://") or None, tools, checks, required=True)
        assert cache is not None
        return _checking(cache, verify_undeclared)
    if isinstance(where, str) and where.startswith(("http://", "https://")):
        return _checking(_remote([where], token=token, tools=tools, checks=checks), verify_undeclared)
    if isinstance(where, str | os.PathLike):
        return _checking(Cache(Path(where), tools=tools, **checks), verify_undeclared)
    if isinstance(where, Sequence):
        urls = list(where)
        if not urls or not all(isinstance(url, str) and url.startswith(("http://", "https://")) for url in urls):
            raise InvalidInput(
                f"cache location {where!r:.200} is not understood; give None (in memory), a directory, an "
                "http(s):// URL of `tvcache serve`, or a non-empty list of such URLs (sharded servers)"
            )
        return _checking(_remote(urls, token=token, tools=tools, checks=checks), verify_undeclared)
    return where  # an open cache


def _checking(cache: CacheLike, verify_undeclared: bool) -> CacheLike:
    """Set the first-hit check on ``cache``, or on each shard's cache behind a router (checks run where the
    sessions run: in this process)."""
    shards = getattr(cache, "shards", None)
    for each in [cache, *(shards.values() if isinstance(shards, Mapping) else ())]:
        if isinstance(each, Cache):
            each.verify_undeclared = verify_undeclared
    return cache


def _ray_cluster_cache(
    namespace: str | None, tools: Iterable[ToolSpec], checks: Mapping[str, Any], *, required: bool = False
) -> CacheLike | None:
    """A RayCache over the shard actors of ``namespace`` (default: the driver's current namespace), or None when
    Ray is not running here or no shards run there (an error instead when ``required``)."""
    ray = sys.modules.get("ray")  # never import Ray just to look: it is already there when the trainer uses it
    if not required and (ray is None or not ray.is_initialized()):
        return None
    from .ray import RayCache, find_shards

    ray = sys.modules["ray"]  # imported by .ray if it was not yet
    if not ray.is_initialized():
        raise InvalidInput("cache location ray://... needs a running Ray cluster: call ray.init() first")
    namespace = namespace or ray.get_runtime_context().namespace
    if not find_shards(namespace):
        if required:
            raise InvalidInput(
                f"no tvcache shard actors in Ray namespace {namespace!r}: start them with `tvcache ray up`"
            )
        return None
    return RayCache(namespace=namespace, tools=tools, **checks)


def _remote(urls: list[str], *, token: str | None, tools: Iterable[ToolSpec], checks: Mapping[str, Any]) -> CacheLike:
    try:
        from ..client import RemoteCache, ShardedCache
    except ImportError as error:
        raise ImportError(
            f"a cache at {', '.join(urls)} needs the 'server' extra: pip install 'tvcache[server]'"
        ) from error
    if len(urls) == 1:
        return RemoteCache(urls[0], token=token, tools=tools, **checks)
    return ShardedCache(urls, token=token, tools=tools, **checks)
