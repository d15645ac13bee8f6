"""The journal's records, typed. Each is one line of ``journal.jsonl``; the keys on disk are short because
there are many lines, and they never change (every journal ever written keeps loading):

========  ==============================================  =====================================================
``t``     keys                                            record
========  ==============================================  =====================================================
``n``     task id p name a o e s r                        ``NodeRecord``: a call inserted below node ``p``
``s``     task id snap                                    ``SnapshotRecord``: a snapshot attached to a node
``x``     task id                                         ``DetachRecord``: a node's snapshot forgotten
``test``  task id k v                                     ``TestRecord``: an end-of-rollout check's value
``rm``    task id                                         ``RemoveRecord``: a node and its subtree removed
nondet    tool why [task]                                 ``MarkRecord``: a tool marked non-deterministic
det       tool task                                       ``ClearRecord``: a mark lifted (task null: tool-wide)
checked   task tool                                       ``CheckedRecord``: a first-hit check that agreed
========  ==============================================  =====================================================

``parse`` reads a record (KeyError, TypeError or ValueError for one that does not have the shape of its kind);
``to_json`` writes exactly the keys above, in that order. What damaged lines may have held is read from the raw
dicts by ``tvcache.recovery``, not from these.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..protocol import Snapshot

__all__ = [
    "CheckedRecord",
    "ClearRecord",
    "DetachRecord",
    "MarkRecord",
    "NodeRecord",
    "Record",
    "RemoveRecord",
    "SnapshotRecord",
    "TestRecord",
    "parse",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeRecord:
    task_id: str
    node_id: int
    parent_id: int
    name: str
    arguments: str  # the call's canonical arguments, JSON text
    output: str
    is_error: bool
    seconds: float
    read_only: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "t": "n",
            "task": self.task_id,
            "id": self.node_id,
            "p": self.parent_id,
            "name": self.name,
            "a": self.arguments,
            "o": self.output,
            "e": self.is_error,
            "s": self.seconds,
            "r": self.read_only,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NodeRecord:
        return cls(
            task_id=data["task"],
            node_id=int(data["id"]),
            parent_id=data["p"],
            name=data["name"],
            arguments=data["a"],
            output=data["o"],
            is_error=bool(data["e"]),
            seconds=float(data["s"]),
            read_only=bool(data["r"]),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class SnapshotRecord:
    task_id: str
    node_id: int
    snapshot: Snapshot

    def to_json(self) -> dict[str, Any]:
        return {"t": "s", "task": self.task_id, "id": self.node_id, "snap": self.snapshot.to_json()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SnapshotRecord:
        return cls(task_id=data["task"], node_id=data["id"], snapshot=Snapshot.from_json(data["snap"]))


@dataclass(frozen=True, kw_only=True, slots=True)
class DetachRecord:
    task_id: str
    node_id: int

    def to_json(self) -> dict[str, Any]:
        return {"t": "x", "task": self.task_id, "id": self.node_id}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DetachRecord:
        return cls(task_id=data["task"], node_id=data["id"])


@dataclass(frozen=True, kw_only=True, slots=True)
class TestRecord:
    __test__ = False  # not a pytest test class

    task_id: str
    node_id: int
    key: str
    value: Any

    def to_json(self) -> dict[str, Any]:
        return {"t": "test", "task": self.task_id, "id": self.node_id, "k": self.key, "v": self.value}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TestRecord:
        return cls(task_id=data["task"], node_id=data["id"], key=data["k"], value=data["v"])


@dataclass(frozen=True, kw_only=True, slots=True)
class RemoveRecord:
    task_id: str
    node_id: int

    def to_json(self) -> dict[str, Any]:
        return {"t": "rm", "task": self.task_id, "id": self.node_id}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RemoveRecord:
        return cls(task_id=data["task"], node_id=data["id"])


@dataclass(frozen=True, kw_only=True, slots=True)
class MarkRecord:
    """A non-determinism mark. Without a task it marks the tool everywhere: records written before marks were
    scoped keep that meaning (executing more is never wrong)."""

    tool: str
    reason: str
    task_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"t": "nondet", "tool": self.tool, "why": self.reason}
        return record if self.task_id is None else {**record, "task": self.task_id}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MarkRecord:
        return cls(tool=str(data["tool"]), reason=str(data["why"]), task_id=data.get("task"))


@dataclass(frozen=True, kw_only=True, slots=True)
class ClearRecord:
    tool: str
    task_id: str | None  # None: the tool-wide mark

    def to_json(self) -> dict[str, Any]:
        return {"t": "det", "tool": self.tool, "task": self.task_id}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ClearRecord:
        return cls(tool=str(data["tool"]), task_id=data.get("task"))


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckedRecord:
    task_id: str
    tool: str

    def to_json(self) -> dict[str, Any]:
        return {"t": "checked", "task": self.task_id, "tool": self.tool}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CheckedRecord:
        return cls(task_id=data["task"], tool=str(data["tool"]))


Record = (
    NodeRecord | SnapshotRecord | DetachRecord | TestRecord | RemoveRecord | MarkRecord | ClearRecord | CheckedRecord
)

_KINDS: dict[str, Any] = {
    "n": NodeRecord,
    "s": SnapshotRecord,
    "x": DetachRecord,
    "test": TestRecord,
    "rm": RemoveRecord,
    "nondet": MarkRecord,
    "det": ClearRecord,
    "checked": CheckedRecord,
}


def parse(data: Mapping[str, Any]) -> Record:
    """The typed record of one journal line's JSON object."""
    kind = data["t"]
    parser = _KINDS.get(kind) if isinstance(kind, str) else None
    if parser is None:
        raise ValueError(f"unknown record type {kind!r}")
    record: Record = parser.from_json(data)
    return record
