"""What a persistent shell sandbox's factory knows of its snapshots without knowing the sandbox class: their
kind, the routes they can take (``ROUTES``, tried in order), and how to delete the process state a route kept.

``sandbox`` (the factory) and ``persistent`` (the sandbox) both import this module; ``sandbox`` never imports
``persistent``, which subclasses its ``ShellSandbox``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .criu_route import CriuRoute
from .shell_state import ShellStateRoute, SnapshotStrategy, route_of

__all__ = ["PERSISTENT_KIND", "ROUTES", "discard_process_state"]

# Every route a persistent shell snapshot can take, the cheapest first; forks look a snapshot's route up here.
ROUTES: tuple[SnapshotStrategy, ...] = (ShellStateRoute(), CriuRoute())

PERSISTENT_KIND = "shell-persistent"


def discard_process_state(meta: Mapping[str, Any]) -> None:
    """Delete what a persistent shell snapshot keeps besides its layers (a CRIU image); for factory.discard."""
    image = meta.get("shell")
    if isinstance(image, Mapping) and image.get("route") is not None:
        route_of(image, ROUTES).discard(image)
