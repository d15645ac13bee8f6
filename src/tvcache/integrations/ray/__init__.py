"""tvcache on Ray (``pip install 'tvcache[ray]'``): graph shards as named actors, snapshots any node can fork.

Start the shards once per cluster (or ``tvcache ray up --shards 4 --data-dir /shared/tvcache``)::

    import ray
    from tvcache.integrations.ray import start_shards
    ray.init(address="auto")
    start_shards(4, data_dir="/shared/tvcache")      # detached, restartable, journaled, spread over the nodes

then, in any rollout worker of the cluster (a Ray task or actor on any node)::

    from tvcache.integrations.ray import PublishedSnapshots, RayCache, RayObjectStore
    cache = RayCache()                               # finds the shards; routes tasks like ShardedCache
    factory = PublishedSnapshots(SQLiteSandbox.factory("app.db"), RayObjectStore())
    async with cache.session("task-1", sandbox=factory) as s:
        r = await s.call("sql", {"query": "SELECT 1"})

``RayCache`` has the session API of ``Cache``, ``RemoteCache`` and ``ShardedCache``; replacing a
``ShardedCache([urls])`` by a ``RayCache()`` is the only change a worker needs (``shards``: the same shards
behind the HTTP server's code, see ``shards``). ``PublishedSnapshots`` lets a rollout on one node fork a snapshot
made on another (``snapshots``: ``RayObjectStore`` and the Ray node identity; the rest is Ray-free core, re-exported
here: ``tvcache.snapshots``, ``tvcache.sandboxes.published``). ``serve_dashboard`` (``tvcache ray dashboard``)
serves the dashboard and Prometheus ``/metrics`` of ``tvcache serve`` for the shards, merged over them
(``dashboard``).
"""

from __future__ import annotations

from ..optional_imports import require

require("ray", "ray")

from .dashboard import create_dashboard_app, serve_dashboard  # noqa: E402
from .shards import (  # noqa: E402
    DEFAULT_NAMESPACE,
    RayCache,
    RayTransport,
    ShardActor,
    find_shards,
    start_shards,
    stop_shards,
)
from .snapshots import (  # noqa: E402
    BlobStore,
    DirectoryStore,
    NodeCache,
    PublishedSnapshots,
    RayObjectStore,
    blob_digest,
)

__all__ = [
    "DEFAULT_NAMESPACE",
    "BlobStore",
    "DirectoryStore",
    "NodeCache",
    "PublishedSnapshots",
    "RayCache",
    "RayObjectStore",
    "RayTransport",
    "ShardActor",
    "blob_digest",
    "create_dashboard_app",
    "find_shards",
    "serve_dashboard",
    "start_shards",
    "stop_shards",
]
