"""The graph store: the named contract between sessions and shared state (``protocol``), its local
implementation (``local``), the in-flight table (``inflight``) and the journal's records (``records``). See
``tvcache.store.protocol`` for who implements the contract."""

from .inflight import ClaimKey, Inflight
from .local import LocalStore
from .protocol import Attached, Claim, Dropped, GraphStore, StoreStats, TestLookup

__all__ = [
    "Attached",
    "Claim",
    "ClaimKey",
    "Dropped",
    "GraphStore",
    "Inflight",
    "LocalStore",
    "StoreStats",
    "TestLookup",
]
