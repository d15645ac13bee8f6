"""The defaults the server, its clients and the command line share, each defined once (standard library only:
the command line reads them before any extra is imported).

``CLAIM_TTL``: seconds a claim lives without its owner's heartbeat before another client takes the call over.
``LEASE_TTL``: seconds a snapshot lease (or a wire-format env reference) lives without release. ``MAX_BODY_BYTES``:
the largest request body a server reads. ``SNAPSHOTS_PER_TASK``, ``SNAPSHOT_BYTES``: the snapshot budget
(``tvcache.policies.Budget``). ``TOKEN_ENV``: the environment variable a bearer token is read from when none is
given (``env_token``).
"""

from __future__ import annotations

import os

__all__ = [
    "CLAIM_TTL",
    "LEASE_TTL",
    "MAX_BODY_BYTES",
    "SNAPSHOTS_PER_TASK",
    "SNAPSHOT_BYTES",
    "TOKEN_ENV",
    "env_token",
]

CLAIM_TTL = 30.0
LEASE_TTL = 600.0
MAX_BODY_BYTES = 16 * 1024 * 1024
SNAPSHOTS_PER_TASK = 64
SNAPSHOT_BYTES = 8 * 1024**3
TOKEN_ENV = "TVCACHE_TOKEN"


def env_token(token: str | None = None) -> str | None:
    """``token``, else ``$TVCACHE_TOKEN``; None for neither (an empty one counts as none)."""
    return token or os.environ.get(TOKEN_ENV) or None
