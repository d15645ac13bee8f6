"""``HttpStore``: the graph store over a ``tvcache serve`` server's native API, in three parts:

- ``operations``: ``HttpStore`` itself, each store operation as requests to the routes it names;
- ``replica``: ``Replicas``, the copy of each task's graph this client has seen, under one server instance's ids;
- ``transport``: ``ServerConnection``, the round trips (blocking, and on a background loop) and their refusals.
"""

from .operations import HttpStore, HttpStoreOptions, RemoteLease
from .replica import Replicas
from .transport import INSTANCE_HEADER, ServerConnection

__all__ = ["INSTANCE_HEADER", "HttpStore", "HttpStoreOptions", "RemoteLease", "Replicas", "ServerConnection"]
