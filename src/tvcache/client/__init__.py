"""Clients of ``tvcache serve``: ``RemoteCache`` (one server) and ``ShardedCache`` (tasks partitioned over
several). Both need the ``server`` extra's ``httpx``: ``pip install 'tvcache[server]'``."""

from __future__ import annotations

try:
    import httpx  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("tvcache.client needs the 'server' extra (httpx): pip install 'tvcache[server]'") from error

from .remote import ClaimLost, RemoteCache, ServerError
from .sharding import ShardedCache, rendezvous

__all__ = ["ClaimLost", "RemoteCache", "ServerError", "ShardedCache", "rendezvous"]
