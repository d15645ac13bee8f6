"""The demo's runs: one ``Runner`` per workload and mode executes every epoch's groups of rollouts."""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path
from typing import Any

from ..cache import Cache
from ..calls import ToolCall
from ..policies import NeverSnapshot
from ..protocol import Sandbox
from ..session import Session
from ..workloads.base import Task, Workload
from ..workloads.policy import GroupPolicy, Trajectory
from .records import CallRecord, RunResult


class Runner:
    """One mode of one workload: all epochs, all tasks, groups of concurrent rollouts."""

    def __init__(
        self, mode: str, workload: Workload, args: argparse.Namespace, work: Path, progress: RunProgress
    ) -> None:
        self.mode = mode
        self.workload = workload
        self.args = args
        self.policy = GroupPolicy()
        self.progress = progress
        self.cache: Cache | None = None
        if mode.startswith("tvcache"):
            policy = NeverSnapshot() if mode == "tvcache-nosnap" else None
            self.cache = Cache(work / f"{workload.name}-{mode}", snapshot_policy=policy, audit_rate=args.audit_rate)
        self.naive: dict[tuple[str, bytes], str] = {}
        self.result = RunResult(mode=mode)
        self.sandboxes_started = 0

    def _record(self, **fields: Any) -> None:
        self.result.records.append(CallRecord(workload=self.workload.name, **fields))

    async def _call(
        self, task: Task, session: Session | None, sandbox: Sandbox | None, call: ToolCall
    ) -> dict[str, Any]:
        if session is not None:
            result = await session.call(call.name, call.arguments)
            node = session.graph.get(result.node_id) if result.node_id is not None else None
            read_only = node.read_only if node is not None else None
            return {"output": result.output, "hit": result.hit, "seconds": result.seconds, "read_only": read_only,
                    "cached": result.cached}  # fmt: skip
        assert sandbox is not None
        began = time.perf_counter()
        outcome = await sandbox.execute(call)
        fields = {"output": outcome.output, "hit": False, "seconds": time.perf_counter() - began}
        if self.mode == "naive":
            key = (task.id, call.digest)
            cached = self.naive.get(key)
            if cached is None:
                self.naive[key] = outcome.output
            else:  # a hit: the naive cache answers without looking at state; the shadow run tells the truth
                fields.update(output=cached, hit=True, seconds=0.0, wrong=cached != outcome.output)
        return fields

    async def _check(self, task: Task, session: Session | None, sandbox: Sandbox | None) -> dict[str, Any]:
        assert task.check is not None
        check = task.check
        if session is not None:

            async def run_check(live: Sandbox) -> str:
                return (await live.execute(check)).output

            result = await session.test(run_check, key=f"check:{check.hexdigest}")
            return {"output": result.value, "hit": result.hit, "seconds": result.seconds, "read_only": True}
        return await self._call(task, None, sandbox, check)

    async def rollout(self, epoch: int, task_index: int, task: Task, index: int) -> Trajectory:
        rng = random.Random(f"{self.args.seed}:{self.workload.name}:{epoch}:{task.id}:{index}")
        trajectory = Trajectory()
        group = epoch * len(self.workload.tasks) + task_index
        session: Session | None = None
        sandbox: Sandbox | None = None
        began = time.perf_counter()
        if self.cache is not None:
            session = self.cache.session(task.id, sandbox=task.factory)
        else:
            sandbox = await task.factory.start()
            self.sandboxes_started += 1
        start_seconds = time.perf_counter() - began  # an uncached rollout pays for its sandbox up front
        final: str | None = None
        try:
            previous = -1
            for step in range(task.horizon):
                choice = self.policy.choose(task.id, step, previous, len(task.actions), rng)
                trajectory.choices.append(((step, previous), choice))
                previous = choice
                action = task.actions[choice]
                fields = await self._call(task, session, sandbox, action.call)
                if step == 0:
                    fields["seconds"] += start_seconds
                self._record(
                    epoch=epoch, task=task.id, group=group, rollout=index, step=step, call=action.call, **fields
                )
                final = fields["output"]
                if action.terminal:
                    break
            if task.check is not None:
                fields = await self._check(task, session, sandbox)
                self._record(epoch=epoch, task=task.id, group=group, rollout=index, step=-1, call=task.check, **fields)
                final = fields["output"]
        finally:
            if session is not None:
                await session.close()
            elif sandbox is not None:
                await sandbox.stop()
        trajectory.reward = task.reward(final)
        self.progress.advance()
        return trajectory

    async def run(self) -> RunResult:
        began = time.perf_counter()
        for epoch in range(self.args.epochs):
            rewards: list[float] = []
            for task_index, task in enumerate(self.workload.tasks):
                rollouts = (self.rollout(epoch, task_index, task, i) for i in range(self.args.rollouts))
                group = await asyncio.gather(*rollouts)
                self.policy.update(task.id, group, len(task.actions))
                rewards.extend(trajectory.reward for trajectory in group)
            self.result.rewards[epoch] = rewards
            if self.cache is not None:
                stats = self.cache.stats()
                self.result.sandboxes[epoch] = stats.sandboxes_started + stats.sandboxes_forked
                self.result.snapshot_bytes[epoch] = stats.snapshot_bytes
            else:
                self.result.sandboxes[epoch] = self.sandboxes_started
                self.result.snapshot_bytes[epoch] = 0
        self.result.wall_seconds = time.perf_counter() - began
        if self.cache is not None:
            self.cache.close()
        return self.result


class RunProgress:
    """Live progress with rich when it is installed, a plain line per run otherwise."""

    def __init__(self, total: int, label: str, bar: Any) -> None:
        self._bar = bar
        self._task = bar.add_task(label, total=total) if bar is not None else None

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)
