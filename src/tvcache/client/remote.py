"""``RemoteCache``: the embedded cache's session API, with the shared state on a ``tvcache serve`` server.

A ``RemoteCache`` is a ``Cache`` over an ``HttpStore`` (``tvcache.store.http``): the graphs, claims, leases and
non-determinism marks are the server's, reached through the store, which keeps a replica of each graph it has
seen; everything else stays in this process: sandboxes, snapshots (files on this machine), cost models, tool
specs and counters. See ``tvcache.store.http`` for the replica, server instances, claims and snapshot ownership.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Unpack

from ..cache import Cache
from ..calls import ToolSpec
from ..errors import ClaimLost, ReplicaDropped, ServerError
from ..policies import SnapshotPolicy
from ..protocol import SandboxFactory
from ..session import Session
from ..store.http import INSTANCE_HEADER, HttpStore, HttpStoreOptions, RemoteLease

__all__ = ["INSTANCE_HEADER", "ClaimLost", "RemoteCache", "RemoteLease", "ReplicaDropped", "ServerError"]


class RemoteCache(Cache):
    """A cache whose graphs live on ``url`` (``tvcache serve``). Use like ``Cache``::

        cache = RemoteCache("http://127.0.0.1:8000", token=None)
        async with cache.session("task-1", sandbox=factory) as s:
            await s.call("sh", {"cmd": "make"})

    The options of its store are ``HttpStore``'s (``HttpStoreOptions``, with their defaults there): ``token``,
    ``timeout``, ``wait_timeout`` and these.
    ``snapshot_dir``: where this client's sandboxes write snapshots (default: a private temporary directory;
    point all clients on a machine at one shared directory so they can fork each other's snapshots).
    ``claim_ttl``: how long the server waits for this client's heartbeat before letting another client take
    over a call it is executing. ``transport``, ``async_transport``: the httpx transports of the blocking and the
    background requests (default: HTTP over the network; a transport implementing both serves both, as
    ``tvcache.integrations.ray``'s does; tests run the real app in-process).
    ``epoch``: the training epoch (or step) this client's calls belong to, for the server's per-epoch hit rates
    (``/v1/activity``, the dashboard); set ``cache.epoch = n`` as the run advances. ``None`` leaves calls untagged.
    """

    def __init__(
        self,
        url: str,
        *,
        tools: Iterable[ToolSpec] = (),
        snapshot_policy: SnapshotPolicy | None = None,
        audit_rate: float = 0.0,
        audit_seed: int | None = 0,
        **options: Unpack[HttpStoreOptions],
    ) -> None:
        self.http = HttpStore(url, **options)
        super().__init__(
            store=self.http, tools=tools, snapshot_policy=snapshot_policy, audit_rate=audit_rate, audit_seed=audit_seed
        )

    @property
    def url(self) -> str:
        return self.http.url

    @property
    def epoch(self) -> int | None:
        return self.http.epoch

    @epoch.setter
    def epoch(self, epoch: int | None) -> None:
        self.http.epoch = epoch

    @property
    def claim_ttl(self) -> float:
        return self.http.claim_ttl

    @property
    def wait_timeout(self) -> float:
        return self.http.wait_timeout

    def session(self, task_id: str, *, sandbox: SandboxFactory) -> Session:
        self.http.refresh_marks()  # the server's marks replace ours: each session starts from every client's
        return super().session(task_id, sandbox=sandbox)

    def server_stats(self) -> dict[str, Any]:
        """The server's counters (all clients), as ``GET /v1/stats``."""
        return self.http.server_stats()

    def __enter__(self) -> RemoteCache:
        return self

    def __repr__(self) -> str:
        return f"<RemoteCache {self.url} tasks={len(self.tasks())}>"
