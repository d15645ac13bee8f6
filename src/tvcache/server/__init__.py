"""``tvcache serve``: the cache behind HTTP for many rollout worker processes (optional extra ``server``).

    pip install 'tvcache[server]'
    tvcache serve --data-dir /var/lib/tvcache --port 8000

The native API lives under ``/v1`` (OpenAPI at ``/openapi.json``); the original TVCache routes (``/put``,
``/get``, ``/prefix_match``, ...) are answered too, see docs/wire-compat.md. Clients: ``tvcache.RemoteCache``
and ``tvcache.ShardedCache``.
"""

from __future__ import annotations

try:
    import pydantic  # noqa: F401
    import starlette  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"tvcache.server needs the 'server' extra ({error.name} is missing): pip install 'tvcache[server]'"
    ) from error

from .app import ServerSettings, create_app
from .runner import ServerThread, serve
from .service import CacheService

__all__ = ["CacheService", "ServerSettings", "ServerThread", "create_app", "serve"]
