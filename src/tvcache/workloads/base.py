"""What a workload is: tasks, each a menu of tool-call actions for the policy, a reward, and a sandbox factory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..calls import ToolCall
from ..protocol import SandboxFactory

__all__ = ["Action", "Task", "Workload"]


@dataclass(frozen=True, kw_only=True)
class Action:
    """One choice on a task's menu: a tool call, and whether it ends the rollout (an answer or a submit)."""

    name: str
    arguments: dict[str, Any]
    terminal: bool = False

    @property
    def call(self) -> ToolCall:
        return ToolCall(self.name, self.arguments)


@dataclass(frozen=True, kw_only=True)
class Task:
    """A prompt of the RL dataset: the policy picks actions from ``actions`` for at most ``horizon`` steps.

    The reward is computed from real outputs: ``reward(final_output)``, where ``final_output`` is the output of
    ``check`` run at the end of the rollout (tests, a verifier) when there is one, else of the last action.
    """

    id: str
    prompt: str
    actions: tuple[Action, ...]
    reward: Callable[[str | None], float]
    factory: SandboxFactory
    check: ToolCall | None = None
    horizon: int = 5


@dataclass(kw_only=True)
class Workload:
    name: str
    tasks: list[Task]
    description: str = ""
    notes: list[str] = field(default_factory=list)
    close: Callable[[], None] = lambda: None
