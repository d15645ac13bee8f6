"""Values returned to users: results of calls, audit findings, non-determinism marks and cache statistics."""

from __future__ import annotations

from dataclasses import dataclass

from .calls import ToolCall

__all__ = ["AuditFinding", "CacheStats", "NondeterminismMark", "ToolResult"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolResult:
    """The answer to one ``session.call``.

    ``hit``: served from the cache (or from a concurrent session's execution of the same call) without
    executing it here. ``seconds``: wall time this call took in this session, including any sandbox work to
    reach the state. ``seconds_saved``: for a hit, the measured execution time it avoided, less what the hit
    cost; 0 for a miss. ``cached``: the result is now in the graph (False for non-deterministic tools and
    after a rollout left the cached paths). ``verified``: the cached result was re-checked by executing the call
    once more (the first-hit check of a tool whose determinism nobody declared), so nothing was saved; ``output``
    is what that execution returned.
    """

    call: ToolCall
    output: str
    is_error: bool
    hit: bool
    seconds: float
    seconds_saved: float
    cached: bool
    coalesced: bool = False
    verified: bool = False
    node_id: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class AuditFinding:
    """A cached result re-checked by real execution: an audit (in a fresh sandbox), a replay, or the first-hit
    check of an undeclared tool (``source``: "audit", "replay", "first-hit" or "record")."""

    task_id: str
    node_id: int
    call: ToolCall
    cached_output: str
    fresh_output: str
    source: str = "audit"

    @property
    def agrees(self) -> bool:
        return self.cached_output == self.fresh_output


@dataclass(frozen=True, kw_only=True, slots=True)
class NondeterminismMark:
    """A tool the cache no longer serves from cache, and why. ``task_id`` None: in every task (declared by
    ``Cache.mark_nondeterministic``, or a journal record written before marks were scoped); otherwise only in
    that task, where the evidence was seen (a replay, an audit or a first-hit check that disagreed)."""

    tool: str
    task_id: str | None
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheStats:
    """Counters since the cache was opened (graph sizes include what was reloaded from disk)."""

    tasks: int
    nodes: int
    snapshots: int
    snapshot_bytes: int
    hits: int
    misses: int
    coalesced: int
    uncacheable: int
    seconds_executed: float
    seconds_saved: float
    sandboxes_started: int
    sandboxes_forked: int
    forks_failed: int  # forks that failed; the state was rebuilt from an earlier snapshot or a fresh start
    snapshots_taken: int
    snapshots_declined: int  # states a backend could not freeze exactly (e.g. hard links in an overlay)
    snapshots_evicted: int
    calls_replayed: int
    audits: int
    audit_disagreements: int
    replay_divergences: int
    verified: int = 0  # cached results re-checked by executing the call (first hits of undeclared tools)
    nondeterministic: tuple[NondeterminismMark, ...] = ()  # every mark, tool-wide ones first

    @property
    def hit_rate(self) -> float:
        """Hits over every call answered; a verified call was executed, so it counts against the rate."""
        total = self.hits + self.misses + self.uncacheable + self.verified
        return self.hits / total if total else 0.0
