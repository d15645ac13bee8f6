"""``ShardedCache``: tasks partitioned over several servers by rendezvous (highest random weight) hashing.

Each task goes to the shard whose ``stable_digest(shard + NUL + task)`` is largest. The hash is portable (never
Python's salted ``hash()``), so every client process routes a task to the same shard, and adding a shard moves
only the tasks the new shard now wins: about 1/N of them, all to the new shard.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Generic, Self, TypeVar

from ..calls import ToolSpec, stable_digest
from ..protocol import SandboxFactory
from ..session import Session, SyncSession
from .remote import RemoteCache

__all__ = ["ShardRouter", "ShardedCache", "rendezvous"]

ShardT = TypeVar("ShardT", bound=RemoteCache)


def rendezvous(key: str, shards: Sequence[str]) -> str:
    """The shard (by name) that owns ``key``."""
    if not shards:
        raise ValueError("rendezvous hashing needs at least one shard")
    encoded = key.encode()
    return max(shards, key=lambda shard: stable_digest(shard.encode() + b"\x00" + encoded))


class ShardRouter(Generic[ShardT]):
    """Sessions routed by task id to one client cache per shard (``shards``: name -> client), with the rendezvous
    hash. ``ShardedCache`` (HTTP servers) and ``tvcache.integrations.ray.RayCache`` (Ray actors) build on it."""

    shards: dict[str, ShardT]

    @property
    def epoch(self) -> int | None:
        """The epoch every shard's client tags its calls with (see ``RemoteCache``)."""
        return next(iter(self.shards.values())).epoch

    @epoch.setter
    def epoch(self, epoch: int | None) -> None:
        for cache in self.shards.values():
            cache.epoch = epoch

    def shard_name(self, task_id: str) -> str:
        """The name of the shard that holds ``task_id``."""
        return rendezvous(task_id, list(self.shards))

    def shard(self, task_id: str) -> ShardT:
        """The client of the shard that holds ``task_id``."""
        return self.shards[self.shard_name(task_id)]

    def session(self, task_id: str, *, sandbox: SandboxFactory) -> Session:
        return self.shard(task_id).session(task_id, sandbox=sandbox)

    def session_sync(self, task_id: str, *, sandbox: SandboxFactory) -> SyncSession:
        return self.shard(task_id).session_sync(task_id, sandbox=sandbox)

    def server_stats(self) -> dict[str, dict[str, Any]]:
        """Each shard's counters, as ``GET /v1/stats`` of a server."""
        return {name: cache.server_stats() for name, cache in self.shards.items()}

    def close(self) -> None:
        for cache in self.shards.values():
            cache.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ShardedCache(ShardRouter[RemoteCache]):
    """Sessions routed to one ``RemoteCache`` per shard URL by the task id. Same session API as ``Cache``."""

    def __init__(
        self, urls: Iterable[str], *, token: str | None = None, tools: Iterable[ToolSpec] = (), **options: Any
    ) -> None:
        names = [url.rstrip("/") for url in urls]
        if not names:
            raise ValueError("ShardedCache needs at least one server URL")
        if len(set(names)) != len(names):
            raise ValueError("ShardedCache got the same server URL twice")
        specs = list(tools)
        self.shards = {name: RemoteCache(name, token=token, tools=specs, **options) for name in names}
