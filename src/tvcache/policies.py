"""Small pluggable strategies: when to snapshot, what to evict first, and the measured costs they weigh.

A snapshot policy answers one question after a stateful call executed: keep a snapshot of this state? An
eviction policy gives each snapshot a sort key; the lowest keys are evicted first. Both read costs from a
``CostModel`` that the cache keeps up to date with what each backend actually took.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .defaults import SNAPSHOT_BYTES, SNAPSHOTS_PER_TASK
from .graph import Node, ToolCallGraph

__all__ = [
    "AlwaysSnapshot",
    "Budget",
    "CostAwareSnapshots",
    "CostModel",
    "EvictionPolicy",
    "LowReuseFirst",
    "NeverSnapshot",
    "SnapshotPolicy",
]


class CostModel:
    """Exponential moving averages of one backend's start, fork and snapshot seconds.

    Until an operation has been measured, its prior is used; priors are deliberately pessimistic about
    snapshots (so nothing is snapshotted on a guess) and neutral about starts.
    """

    __slots__ = ("_alpha", "fetching_fork", "fork", "samples", "snapshot", "start")

    def __init__(self, *, start: float = 0.0, fork: float = 0.0, snapshot: float = 0.0, alpha: float = 0.2) -> None:
        self.start = start
        self.fork = fork
        # A fork whose snapshot data must first come from a shared store (see ``fork_is_local`` on factories
        # such as PublishedSnapshots): measured apart, as it can cost far more than a local fork.
        self.fetching_fork = fork
        self.snapshot = snapshot
        self._alpha = alpha
        self.samples = {"start": 0, "fork": 0, "fetching_fork": 0, "snapshot": 0}

    def observe(self, operation: str, seconds: float) -> None:
        if operation not in self.samples:
            raise ValueError(f"unknown operation {operation!r}; expected one of {sorted(self.samples)}")
        count = self.samples[operation]
        previous = getattr(self, operation)
        value = seconds if count == 0 else previous + self._alpha * (seconds - previous)
        setattr(self, operation, value)
        self.samples[operation] = count + 1

    def fork_seconds(self, *, local: bool) -> float:
        """Expected seconds of one fork; until a fetching fork has been measured, a local one's estimate."""
        if local or not self.samples["fetching_fork"]:
            return self.fork
        return self.fetching_fork

    def rebuild_seconds(self, graph: ToolCallGraph, state: Node) -> float:
        """Expected seconds to re-create ``state`` without a snapshot of it: fork the nearest snapshotted
        ancestor (or start fresh) and replay the calls in between."""
        ancestor = graph.snapshot_ancestor(state)
        base = self.start if ancestor is None else self.fork
        return base + graph.replay_seconds(state, since=ancestor or graph.root)


class SnapshotPolicy(Protocol):
    @property
    def name(self) -> str: ...

    def should_snapshot(self, graph: ToolCallGraph, node: Node, costs: CostModel) -> bool: ...


@dataclass(frozen=True, kw_only=True)
class CostAwareSnapshots:
    """Snapshot when re-creating the state by replay would cost more than snapshotting it and forking it back.

    The replay cost is cumulative from the nearest snapshotted ancestor, not just the last call: ten 1-second
    builds in a row earn a snapshot even if each alone is cheap. ``margin`` > 1 demands a clearer win.
    """

    margin: float = 1.0
    name: str = "cost-aware"

    def should_snapshot(self, graph: ToolCallGraph, node: Node, costs: CostModel) -> bool:
        if node.read_only or node.snapshot is not None:
            return False
        overhead = costs.snapshot + costs.fork
        return costs.rebuild_seconds(graph, node) > self.margin * overhead


@dataclass(frozen=True)
class AlwaysSnapshot:
    """Snapshot after every stateful call (for experiments: the memory-hungry extreme)."""

    name: str = "always"

    def should_snapshot(self, graph: ToolCallGraph, node: Node, costs: CostModel) -> bool:
        return not node.read_only and node.snapshot is None


@dataclass(frozen=True)
class NeverSnapshot:
    """Never snapshot: every miss replays from a fresh sandbox (for experiments and for backends without
    snapshots)."""

    name: str = "never"

    def should_snapshot(self, graph: ToolCallGraph, node: Node, costs: CostModel) -> bool:
        return False


class EvictionPolicy(Protocol):
    @property
    def name(self) -> str: ...

    def priority(self, node: Node, now: float) -> tuple[float, ...]:
        """Sort key of a snapshotted node; the lowest is evicted first."""
        ...


@dataclass(frozen=True)
class LowReuseFirst:
    """Evict the snapshots least likely to be forked again: few hits beneath them, leaves before inner
    nodes (an inner snapshot serves every branch below it), deep before shallow, then least recently used."""

    name: str = "low-reuse-first"

    def priority(self, node: Node, now: float) -> tuple[float, ...]:
        has_children = 1.0 if node.children else 0.0
        return (float(node.subtree_hits), has_children, -float(node.depth), node.last_used)


@dataclass(frozen=True, kw_only=True)
class Budget:
    """Limits on snapshots kept: per task and across the cache. None means unlimited."""

    max_snapshots_per_task: int | None = SNAPSHOTS_PER_TASK
    max_bytes_per_task: int | None = None
    max_snapshots: int | None = None
    max_bytes: int | None = SNAPSHOT_BYTES

    def __post_init__(self) -> None:
        for name in ("max_snapshots_per_task", "max_bytes_per_task", "max_snapshots", "max_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"Budget.{name} must be >= 0 or None, got {value}")
