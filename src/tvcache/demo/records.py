"""What a demo run records: one ``CallRecord`` per tool call, gathered in a ``RunResult`` per mode.

The runner writes these and the report reads them; neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..calls import ToolCall, stable_digest

MODES = ("uncached", "naive", "tvcache-nosnap", "tvcache")


@dataclass(kw_only=True)
class CallRecord:
    workload: str
    epoch: int
    task: str
    group: int
    rollout: int
    step: int  # -1 for the end-of-rollout check
    call: ToolCall
    output: str
    seconds: float
    hit: bool
    read_only: bool | None = None
    cached: bool = True
    wrong: bool = False

    def trace(self) -> dict[str, Any]:
        """The record as one line of a JSONL trace (``tvcache replay`` reads these)."""
        return {
            "workload": self.workload,
            "task": self.task,
            "epoch": self.epoch,
            "group": self.group,
            "rollout": self.rollout,
            "step": self.step,
            "call": {"name": self.call.name, "arguments": self.call.arguments},
            "output_digest": stable_digest(self.output.encode()).hex(),
            "seconds": self.seconds,
            "hit": self.hit,
            "read_only": self.read_only,
            "cached": self.cached,
        }


@dataclass(kw_only=True)
class RunResult:
    mode: str
    records: list[CallRecord] = field(default_factory=list)
    rewards: dict[int, list[float]] = field(default_factory=dict)
    sandboxes: dict[int, int] = field(default_factory=dict)
    snapshot_bytes: dict[int, int] = field(default_factory=dict)
    wall_seconds: float = 0.0
