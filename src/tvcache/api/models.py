"""The request and response bodies of the native ``/v1`` API, validated strictly by pydantic.

The server validates requests with them and answers with them; the HTTP store (``tvcache.store.http``) builds its
requests and reads its answers with the same classes. ``tvcache.server.models`` re-exports them.

Every request model forbids unknown fields, so a misspelt field is a 422 naming it rather than a silently
ignored value. Calls travel as ``{"name": ..., "arguments": {...}}``; responses also carry the call's hex
digest so a client can check that it rebuilt exactly the call the server keyed.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from ..calls import MAX_TASK_ID

__all__ = [
    "ActivityOut",
    "AttachIn",
    "AttachOut",
    "CallIn",
    "ClaimIn",
    "ClaimOut",
    "ClearNondeterministicIn",
    "ClearedOut",
    "DropIn",
    "DropOut",
    "Epoch",
    "EpochOut",
    "ErrorOut",
    "FiniteJson",
    "GraphOut",
    "HeartbeatIn",
    "InsertIn",
    "InsertOut",
    "Key",
    "LeaseIn",
    "LeaseOut",
    "LookupIn",
    "LookupOut",
    "MarkOut",
    "NodeId",
    "NodeOut",
    "NondeterministicIn",
    "NondeterministicOut",
    "OkOut",
    "OutlineNodeOut",
    "OutlineOut",
    "PathOut",
    "ReleaseIn",
    "Request",
    "ResolveIn",
    "Response",
    "Seconds",
    "SnapshotIn",
    "SnapshotOut",
    "SnapshotPath",
    "TaskActivityOut",
    "TaskId",
    "TaskOut",
    "TasksOut",
    "TestGetIn",
    "TestOut",
    "TestPutIn",
    "TouchIn",
    "Ttl",
    "WaitIn",
    "WaitOut",
]

TaskId = Annotated[str, Field(min_length=1, max_length=MAX_TASK_ID, description="the task (prompt) id; no NUL")]
NodeId = Annotated[int, Field(ge=0, le=2**53, description="a node id within the task (0 is the root)")]
Seconds = Annotated[float, Field(ge=0.0, le=1e9, allow_inf_nan=False)]
Ttl = Annotated[float, Field(gt=0.0, le=86_400.0, allow_inf_nan=False)]
Key = Annotated[str, Field(min_length=1, max_length=1024)]
Epoch = Annotated[
    int | None,
    Field(ge=0, le=2**31, description="the client's training epoch (or step), tallied for the dashboard; optional"),
]


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class CallIn(Request):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    arguments: dict[str, Any] = Field(default_factory=dict)


def _finite(value: Any) -> Any:
    """``value`` unchanged if every number in it is finite. The JSON parser accepts ``NaN``, ``Infinity`` and
    overflowing literals such as ``1e400``, but the journal (strict JSON) cannot store them: refused here, before
    anything is changed, rather than failing half-way through a write."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{item!r} is not a JSON number; send a finite number, or the value as a string")
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return value


# Free-form JSON the server stores as it is (snapshot meta): finite numbers only, like the journal.
FiniteJson = Annotated[Any, AfterValidator(_finite)]
SnapshotPath = Annotated[str, Field(min_length=1, max_length=4096)]


class SnapshotIn(Request):
    """A snapshot owned by a client: the server records it and never touches ``path``."""

    kind: Annotated[str, Field(min_length=1, max_length=128)]
    path: SnapshotPath
    bytes: Annotated[int, Field(ge=0, le=2**62)]
    meta: dict[str, FiniteJson] = Field(default_factory=dict)


class LookupIn(Request):
    """Either ``history`` (a longest-prefix match of a whole rollout) or ``state`` + ``call`` (one step)."""

    task_id: TaskId
    history: list[CallIn] | None = Field(default=None, max_length=100_000)
    read_only_tools: list[str] = Field(default_factory=list, max_length=10_000)
    state: NodeId | None = None
    call: CallIn | None = None
    epoch: Epoch = None


class ClaimIn(Request):
    task_id: TaskId
    state: NodeId
    call: CallIn
    ttl: Ttl | None = None


class HeartbeatIn(Request):
    claim_id: Annotated[str, Field(min_length=1, max_length=64)]
    ttl: Ttl | None = None


class ResolveIn(Request):
    """Give up a claim: ``error`` set when execution failed (waiters retry), else the call was uncacheable."""

    claim_id: Annotated[str, Field(min_length=1, max_length=64)]
    error: Annotated[str, Field(max_length=10_000)] | None = None


class WaitIn(Request):
    task_id: TaskId
    state: NodeId
    call: CallIn
    timeout: Annotated[float, Field(ge=0.0, le=60.0, allow_inf_nan=False)] = 10.0


class InsertIn(Request):
    task_id: TaskId
    parent: NodeId
    call: CallIn
    output: str
    is_error: bool = False
    seconds: Seconds
    read_only: bool = False
    epoch: Epoch = None


class AttachIn(Request):
    task_id: TaskId
    node_id: NodeId
    snapshot: SnapshotIn


class LeaseIn(Request):
    task_id: TaskId
    state: NodeId
    kind: Annotated[str, Field(min_length=1, max_length=128)]
    ttl: Ttl | None = None
    # Snapshots (by path) the client failed to fork: the next one up is leased instead.
    skip: list[SnapshotPath] = Field(default_factory=list, max_length=1024)


class DropIn(Request):
    """Forget a snapshot no process can fork any more (its data is gone or corrupt), if the node still has it."""

    task_id: TaskId
    node_id: NodeId
    path: SnapshotPath


class ReleaseIn(Request):
    lease_id: Annotated[str, Field(min_length=1, max_length=64)]


class TestGetIn(Request):
    task_id: TaskId
    node_id: NodeId
    key: Key


class TestPutIn(Request):
    task_id: TaskId
    node_id: NodeId
    key: Key
    value: Any


class NondeterministicIn(Request):
    """Mark ``tool`` non-deterministic: in task ``task_id`` only (the scope of the evidence a client saw), or in
    every task when ``task_id`` is null."""

    tool: Annotated[str, Field(min_length=1, max_length=256)]
    reason: Annotated[str, Field(min_length=1, max_length=10_000)]
    task_id: TaskId | None = None


class TouchIn(Request):
    task_id: TaskId
    node_ids: list[NodeId] = Field(max_length=10_000)
    epoch: Epoch = None


# --------------------------------------------------------------------------------------------- responses


class Response(BaseModel):
    model_config = ConfigDict(frozen=True)


class SnapshotOut(Response):
    kind: str
    path: str
    bytes: int
    meta: dict[str, Any]


class NodeOut(Response):
    id: int
    parent: int | None
    name: str | None
    arguments: dict[str, Any] | None
    digest: str | None
    output: str
    is_error: bool
    seconds: float
    read_only: bool
    snapshot: SnapshotOut | None = None
    hits: int = 0


class LookupOut(Response):
    hit: bool
    node: NodeOut | None
    state: int
    matched: int
    snapshot: int | None


class ClaimOut(Response):
    status: Literal["hit", "owner", "wait"]
    node: NodeOut | None = None
    claim_id: str | None = None
    ttl: float | None = None


class WaitOut(Response):
    status: Literal["done", "pending", "failed", "expired", "none"]
    node: NodeOut | None = None
    error: str | None = None


class InsertOut(Response):
    created: bool
    node: NodeOut


class AttachOut(Response):
    attached: bool
    evicted: list[SnapshotOut]


class DropOut(Response):
    dropped: bool
    evicted: list[SnapshotOut]  # what the client must now free (the dropped snapshot)


class LeaseOut(Response):
    lease_id: str | None
    node: NodeOut | None
    ttl: float | None


class OkOut(Response):
    ok: bool


class TestOut(Response):
    found: bool
    value: Any = None


class PathOut(Response):
    nodes: list[NodeOut]


class GraphOut(Response):
    task_id: str
    nodes: list[NodeOut]


class TaskOut(Response):
    task_id: str
    nodes: int
    snapshots: int
    hits: int


class TasksOut(Response):
    tasks: list[TaskOut]


class ClearNondeterministicIn(Request):
    """Lift the marks of ``tool`` (null: every tool) in task ``task_id`` (null: every task, tool-wide marks
    included; a tool-wide mark is lifted only then)."""

    tool: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    task_id: TaskId | None = None


class ClearedOut(Response):
    cleared: int


class MarkOut(Response):
    tool: str
    task_id: str | None  # null: every task
    reason: str


class NondeterministicOut(Response):
    """``tools``: the marks that hold in every task (tool -> evidence); ``marks``: every mark, with its scope."""

    tools: dict[str, str]
    marks: list[MarkOut] = []


class ErrorOut(Response):
    error: dict[str, Any]


class EpochOut(Response):
    """What the cache did for one task in one epoch (``epoch`` null: untagged requests); see ``activity``."""

    epoch: int | None
    hits: int
    misses: int
    hit_rate: float | None
    seconds_saved: float
    seconds_executed: float


class TaskActivityOut(Response):
    task_id: str
    nodes: int
    snapshots: int
    total: EpochOut
    epochs: list[EpochOut]


class ActivityOut(Response):
    since: float = Field(description="Unix time the tallies started (they are kept in memory)")
    total: EpochOut
    tasks: list[TaskActivityOut]


class OutlineNodeOut(Response):
    """A node without its result, for drawing: ``label`` is a short preview of the call's arguments."""

    id: int
    parent: int | None
    name: str | None
    label: str
    read_only: bool
    is_error: bool
    seconds: float
    hits: int
    snapshot: bool


class OutlineOut(Response):
    task_id: str
    total: int = Field(description="nodes in the graph (the root included)")
    truncated: bool
    nodes: list[OutlineNodeOut]
