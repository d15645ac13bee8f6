"""A small learnable policy over tool-call actions, trained with a GRPO-style update.

It stands in for the LLM of a real post-training run: it picks the next tool call from a task's action menu,
conditioned on the history (the step and the previous action), and learns from group-normalised advantages.
Like an LLM under RL, it starts diverse and sharpens, so rollouts of a group repeat each other more over time.
The tools it calls, their outputs and the rewards are all real.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["GroupPolicy", "Trajectory"]


@dataclass(kw_only=True)
class Trajectory:
    """One rollout's choices: (context, action) per step, and its reward once known."""

    choices: list[tuple[tuple[int, int], int]] = field(default_factory=list)
    reward: float = 0.0


class GroupPolicy:
    """Tabular softmax policy: logits[task][(step, previous action)][action]."""

    def __init__(self, *, learning_rate: float = 4.0, temperature: float = 1.0) -> None:
        self.learning_rate = learning_rate
        self.temperature = temperature
        self._logits: dict[str, dict[tuple[int, int], list[float]]] = {}

    def _row(self, task: str, context: tuple[int, int], actions: int) -> list[float]:
        table = self._logits.setdefault(task, {})
        row = table.get(context)
        if row is None:
            row = table[context] = [0.0] * actions
        return row

    def probabilities(self, task: str, context: tuple[int, int], actions: int) -> list[float]:
        row = self._row(task, context, actions)
        top = max(row)
        weights = [math.exp((value - top) / self.temperature) for value in row]
        total = sum(weights)
        return [weight / total for weight in weights]

    def choose(self, task: str, step: int, previous: int, actions: int, rng: random.Random) -> int:
        context = (step, previous)
        probabilities = self.probabilities(task, context, actions)
        return rng.choices(range(actions), weights=probabilities)[0]

    def update(self, task: str, group: Sequence[Trajectory], actions: int) -> None:
        """GRPO: advantage = (reward - group mean) / group std; ascend the log-probability of each choice."""
        rewards = [trajectory.reward for trajectory in group]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        if std < 1e-9:
            return  # a group with one outcome carries no signal
        for trajectory in group:
            advantage = (trajectory.reward - mean) / std
            for context, action in trajectory.choices:
                probabilities = self.probabilities(task, context, actions)
                row = self._row(task, context, actions)
                for index in range(actions):
                    indicator = 1.0 if index == action else 0.0
                    row[index] += self.learning_rate * advantage * (indicator - probabilities[index]) / len(group)
