"""``tvcache demo``: small but real RL post-training runs through the cache, side by side with no cache.

For each workload (SQL, shell, files/media, and a terminal driven through one persistent shell per rollout), a
learnable policy — standing in for the LLM, see ``workloads.policy`` — samples groups of rollouts per task over
several epochs and is updated GRPO-style. The sandboxes, tools, outputs and rewards are real. Four runs use the
same seeds:

* ``uncached``: every rollout executes every call in a fresh sandbox (the ground truth);
* ``naive``: a dict keyed by the call alone, the failure the paper is about; its wrong results are counted
  against a shadow execution of every call;
* ``tvcache-nosnap``: the tool call graph without snapshots (misses replay from a fresh sandbox);
* ``tvcache``: the full design.

A cache that returns exactly what execution returns reproduces the uncached run call for call, reward for
reward — the demo checks it and says so, then writes ``report.json``, ``report.md``, plots and traces.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cache import Cache
from .calls import ToolCall
from .policies import NeverSnapshot
from .protocol import Sandbox
from .session import Session
from .workloads.base import Task, Workload
from .workloads.policy import GroupPolicy, Trajectory

MODES = ("uncached", "naive", "tvcache-nosnap", "tvcache")
WORKLOADS = ("sql", "shell", "media", "terminal", "dockerfile", "dockerfile-docker")


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
        from .calls import stable_digest

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


class Runner:
    """One mode of one workload: all epochs, all tasks, groups of concurrent rollouts."""

    def __init__(self, mode: str, workload: Workload, args: argparse.Namespace, work: Path, progress: Any) -> None:
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


class _Progress:
    """Live progress with rich when it is installed, a plain line per run otherwise."""

    def __init__(self, total: int, label: str, bar: Any) -> None:
        self._bar = bar
        self._task = bar.add_task(label, total=total) if bar is not None else None

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)


def load_workload(name: str, data_dir: Path, args: argparse.Namespace) -> Workload:
    if name == "sql":
        from .workloads.sql import sql_workload

        return sql_workload(data_dir, delay_seconds=args.delay)
    if name == "shell":
        from .workloads.shell import shell_workload

        return shell_workload(data_dir)
    if name == "media":
        from .workloads.media import media_workload

        return media_workload(data_dir)
    if name == "terminal":
        from .workloads.terminal import terminal_workload

        return terminal_workload(data_dir)
    if name in ("dockerfile", "dockerfile-docker"):
        from .workloads.dockerfile import dockerfile_workload

        return dockerfile_workload(data_dir, backend="image" if name == "dockerfile" else "docker")
    raise SystemExit(f"tvcache demo: unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def unavailable(name: str) -> str | None:
    """Why a workload cannot run on this machine, or None: ``terminal``'s persistent shells need overlay mounts,
    and have no copying fallback; the Dockerfile workloads need a Docker engine and the local base image."""
    if name == "terminal":
        from .workloads.terminal import unavailable_reason

        return unavailable_reason()
    if name in ("dockerfile", "dockerfile-docker"):
        from .workloads import dockerfile

        return dockerfile.unavailable_reason("image" if name == "dockerfile" else "docker")
    return None


def main(args: argparse.Namespace) -> int:
    from . import report

    if args.epochs is None:
        args.epochs = 3 if args.quick else 6
    if args.epochs < 1 or args.rollouts < 1:
        raise SystemExit("tvcache demo: --epochs and --rollouts must be at least 1")
    names = [name.strip() for name in (args.workloads or ",".join(WORKLOADS)).split(",") if name.strip()]
    for name in list(names):
        reason = unavailable(name)
        if reason is not None and args.workloads is not None:
            raise SystemExit(f"tvcache demo: workload {name!r} cannot run here: {reason}")
        if reason is not None:  # a default workload that cannot run here is left out, and said so
            print(f"tvcache demo: leaving out the {name} workload: {reason}")
            names.remove(name)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar: Any = Progress(
            TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
        )
    except ImportError:
        bar = None
    print(f"tvcache demo: workloads {', '.join(names)}; {args.rollouts} rollouts per group, {args.epochs} epochs")
    print("the policy is a small learnable model standing in for the LLM; sandboxes, tools and rewards are real\n")
    runs: dict[str, dict[str, RunResult]] = {}
    workloads: dict[str, Workload] = {}
    with tempfile.TemporaryDirectory(prefix="tvcache-demo-") as scratch:
        work = Path(scratch)
        if bar is not None:
            bar.start()
        try:
            for name in names:
                workload = workloads[name] = load_workload(name, work / "data", args)
                if args.quick:
                    workload.tasks = workload.tasks[:2]
                rollouts = args.epochs * len(workload.tasks) * args.rollouts
                runs[name] = {}
                for mode in MODES:
                    progress = _Progress(rollouts, f"{name} / {mode}", bar)
                    runs[name][mode] = asyncio.run(Runner(mode, workload, args, work, progress).run())
                workload.close()
        finally:
            if bar is not None:
                bar.stop()
    summary = report.build(runs, workloads, args)
    report.write(out, summary, runs)
    report.print_summary(summary)
    print(f"\nreport: {out / 'report.md'} (and report.json, plots, traces/)")
    exact = all(row["mismatches"] == 0 for w in summary["workloads"].values() for row in w["epochs"])
    return 0 if exact else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="2 tasks per workload and 3 epochs (under 2 minutes)")
    parser.add_argument("--epochs", type=int, default=None, help="training epochs (default 6; 3 with --quick)")
    parser.add_argument("--rollouts", type=int, default=8, help="rollouts per task group (default 8)")
    parser.add_argument("--workloads", default=None, help="comma-separated, from "
                        f"{','.join(WORKLOADS)} (default: all that can run here; terminal needs overlay mounts, i.e. "
                        "root; dockerfile and dockerfile-docker a Docker engine)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the policies' sampling (same in every run)")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds added per SQL query (remote database)")
    parser.add_argument("--out", default="tvcache-demo", help="report directory (default ./tvcache-demo)")
    parser.add_argument("--audit-rate", type=audit_rate, default=0.0, metavar="FLOAT", help="fraction of hits "
                        "re-executed in a fresh sandbox and compared (default 0)")  # fmt: skip


def audit_rate(text: str) -> float:
    """``--audit-rate``'s type: a fraction between 0 and 1 (shared by the commands that build a cache)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {value}")
    return value
