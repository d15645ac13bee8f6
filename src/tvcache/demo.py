"""``tvcache demo``: a small, real RL post-training loop on SQL tasks, run side by side without and with caches.

The policy is a small learnable model standing in for the LLM (see ``workloads.policy``); the SQLite databases,
the queries, their outputs and the rewards are real. Every run uses the same seeds, so a cache that returns
exactly what execution returns reproduces the uncached run call for call — which the demo checks.

Runs: ``uncached`` (every rollout in a fresh sandbox), ``naive`` (a dict keyed by the call alone, the failure
mode the paper is about: its wrong results are counted against a shadow execution), ``tvcache-nosnap`` (the
graph without snapshots) and ``tvcache`` (the full design).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cache import Cache
from .calls import ToolCall
from .policies import NeverSnapshot
from .sandboxes import SQLiteSandbox
from .workloads.policy import GroupPolicy, Trajectory
from .workloads.sql import SqlTask, sql_tasks

MODES = ("uncached", "naive", "tvcache-nosnap", "tvcache")
HORIZON = 5


@dataclass(kw_only=True)
class CallRecord:
    epoch: int
    task: str
    rollout: int
    step: int
    call: ToolCall
    output: str
    seconds: float
    hit: bool
    wrong: bool = False


@dataclass(kw_only=True)
class RunResult:
    mode: str
    records: list[CallRecord] = field(default_factory=list)
    rewards: dict[int, list[float]] = field(default_factory=dict)
    sandboxes: dict[int, int] = field(default_factory=dict)
    snapshot_bytes: dict[int, int] = field(default_factory=dict)
    wall_seconds: float = 0.0


class Runner:
    def __init__(self, mode: str, tasks: list[SqlTask], args: argparse.Namespace, work: Path) -> None:
        self.mode = mode
        self.tasks = tasks
        self.args = args
        self.factories = {t.id: SQLiteSandbox.factory(t.database, delay_seconds=args.delay) for t in tasks}
        self.policy = GroupPolicy()
        self.cache: Cache | None = None
        if mode.startswith("tvcache"):
            policy = NeverSnapshot() if mode == "tvcache-nosnap" else None
            self.cache = Cache(work / mode, snapshot_policy=policy)
        self.naive: dict[tuple[str, bytes], str] = {}
        self.result = RunResult(mode=mode)
        self.sandboxes_started = 0

    async def rollout(self, epoch: int, task: SqlTask, index: int) -> Trajectory:
        rng = random.Random(f"{self.args.seed}:{epoch}:{task.id}:{index}")
        trajectory = Trajectory()
        factory = self.factories[task.id]
        previous = -1
        answer_output: str | None = None
        answer_ok = False
        if self.cache is not None:
            session = self.cache.session(task.id, sandbox=factory)
        else:
            sandbox = await factory.start()
            self.sandboxes_started += 1
        try:
            for step in range(HORIZON):
                choice = self.policy.choose(task.id, step, previous, len(task.actions), rng)
                trajectory.choices.append(((step, previous), choice))
                previous = choice
                action = task.actions[choice]
                call = ToolCall("sql", {"query": action.query})
                began = time.perf_counter()
                wrong = False
                if self.cache is not None:
                    result = await session.call("sql", {"query": action.query})
                    output, hit, seconds = result.output, result.hit, result.seconds
                else:
                    outcome = await sandbox.execute(call)
                    seconds = time.perf_counter() - began
                    output, hit = outcome.output, False
                    if self.mode == "naive":
                        key = (task.id, call.digest)
                        cached = self.naive.get(key)
                        if cached is None:
                            self.naive[key] = output
                        else:  # the naive cache answers without looking at state; the shadow run tells truth
                            hit, wrong, output, seconds = True, cached != output, cached, 0.0
                self.result.records.append(
                    CallRecord(
                        epoch=epoch, task=task.id, rollout=index, step=step, call=call, output=output,
                        seconds=seconds, hit=hit, wrong=wrong,
                    )
                )  # fmt: skip
                if action.answer:
                    answer_output = output
                    break
            if answer_output is not None:
                answer_ok = answer_output == self.gold[task.id]
        finally:
            if self.cache is not None:
                await session.close()
            else:
                await sandbox.stop()
        trajectory.reward = 1.0 if answer_ok else 0.0
        return trajectory

    async def run(self, gold: dict[str, str]) -> RunResult:
        self.gold = gold
        began = time.perf_counter()
        for epoch in range(self.args.epochs):
            rewards: list[float] = []
            for task in self.tasks:
                group = await asyncio.gather(*(self.rollout(epoch, task, i) for i in range(self.args.rollouts)))
                self.policy.update(task.id, group, len(task.actions))
                rewards.extend(t.reward for t in group)
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


async def compute_gold(tasks: list[SqlTask]) -> dict[str, str]:
    """Execute each task's reference solution in a fresh sandbox: the gold answer is real output."""
    gold = {}
    for task in tasks:
        sandbox = await SQLiteSandbox.factory(task.database).start()
        try:
            output = ""
            for query in task.solution:
                output = (await sandbox.execute(ToolCall("sql", {"query": query}))).output
            gold[task.id] = output
        finally:
            await sandbox.stop()
    return gold


def _per_epoch(run: RunResult, epochs: int) -> list[dict[str, Any]]:
    rows = []
    for epoch in range(epochs):
        records = [r for r in run.records if r.epoch == epoch]
        seconds = [r.seconds for r in records]
        rows.append(
            {
                "epoch": epoch,
                "calls": len(records),
                "hit_rate": sum(r.hit for r in records) / max(1, len(records)),
                "tool_seconds": sum(seconds),
                "median_call_seconds": statistics.median(seconds) if seconds else 0.0,
                "reward": statistics.fmean(run.rewards[epoch]) if run.rewards.get(epoch) else 0.0,
                "wrong_results": sum(r.wrong for r in records),
                "sandboxes": run.sandboxes.get(epoch, 0) - run.sandboxes.get(epoch - 1, 0),
                "snapshot_bytes": run.snapshot_bytes.get(epoch, 0),
            }
        )
    return rows


def _mismatches(reference: RunResult, other: RunResult, epoch: int) -> int:
    """Calls whose output (or whose very call) differs from the uncached run at the same position."""

    def key(record: CallRecord) -> tuple[int, str, int, int]:
        return (record.epoch, record.task, record.rollout, record.step)

    expected = {key(r): (r.call, r.output) for r in reference.records if r.epoch == epoch}
    actual = {key(r): (r.call, r.output) for r in other.records if r.epoch == epoch}
    return sum(1 for k in expected.keys() | actual.keys() if expected.get(k) != actual.get(k))


def main(args: argparse.Namespace) -> int:
    if args.epochs is None:
        args.epochs = 3 if args.quick else 6
    if args.epochs < 1 or args.rollouts < 1:
        raise SystemExit("tvcache demo: --epochs and --rollouts must be at least 1")
    with tempfile.TemporaryDirectory(prefix="tvcache-demo-") as scratch:
        work = Path(scratch)
        tasks = sql_tasks(work)
        if args.quick:
            tasks = tasks[:3]
        gold = asyncio.run(compute_gold(tasks))
        print(f"tvcache demo: {len(tasks)} SQL tasks x {args.rollouts} rollouts x {args.epochs} epochs")
        print("policy: a small learnable model standing in for the LLM; tools, databases and rewards are real\n")
        runs: dict[str, RunResult] = {}
        for mode in MODES:
            print(f"  running {mode:<15}", end="", flush=True)
            runs[mode] = asyncio.run(Runner(mode, tasks, args, work).run(gold))
            print(f" {runs[mode].wall_seconds:6.2f} s, {len(runs[mode].records)} tool calls")
    report = _report(runs, args)
    _print(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(report, indent=2))
        print(f"\nwrote {out / 'report.json'}")
    exact = all(row["mismatches"] == 0 for row in report["epochs"])
    return 0 if exact else 1


def _report(runs: dict[str, RunResult], args: argparse.Namespace) -> dict[str, Any]:
    uncached = _per_epoch(runs["uncached"], args.epochs)
    naive = _per_epoch(runs["naive"], args.epochs)
    nosnap = _per_epoch(runs["tvcache-nosnap"], args.epochs)
    full = _per_epoch(runs["tvcache"], args.epochs)
    epochs = []
    for e in range(args.epochs):
        epochs.append(
            {
                "epoch": e,
                "hit_rate": full[e]["hit_rate"],
                "hit_rate_nosnap": nosnap[e]["hit_rate"],
                "tool_seconds_cached": full[e]["tool_seconds"],
                "tool_seconds_cached_nosnap": nosnap[e]["tool_seconds"],
                "tool_seconds_uncached": uncached[e]["tool_seconds"],
                "median_call_seconds_cached": full[e]["median_call_seconds"],
                "median_call_seconds_uncached": uncached[e]["median_call_seconds"],
                "mismatches": _mismatches(runs["uncached"], runs["tvcache"], e)
                + _mismatches(runs["uncached"], runs["tvcache-nosnap"], e),
                "naive_wrong_results": naive[e]["wrong_results"],
                "reward_uncached": uncached[e]["reward"],
                "reward_cached": full[e]["reward"],
                "reward_naive": naive[e]["reward"],
                "sandboxes_started": full[e]["sandboxes"],
                "sandboxes_started_uncached": uncached[e]["sandboxes"],
                "snapshot_bytes": full[e]["snapshot_bytes"],
            }
        )
    return {
        "workload": "sql",
        "delay_seconds_per_query": args.delay,
        "rollouts": args.rollouts,
        "seed": args.seed,
        "epochs": epochs,
        "wall_seconds": {mode: run.wall_seconds for mode, run in runs.items()},
    }


def _print(report: dict[str, Any]) -> None:
    print(
        f"\n{'epoch':>5} {'hit rate':>9} {'(no snap)':>9} {'tool s cached':>14} {'uncached':>9} "
        f"{'median speedup':>15} {'mismatches':>11} {'naive wrong':>12} {'reward':>7}"
    )
    for row in report["epochs"]:
        median_c, median_u = row["median_call_seconds_cached"], row["median_call_seconds_uncached"]
        speedup = f"{median_u / median_c:.1f}x" if median_c > 0 else "inf"
        print(
            f"{row['epoch']:>5} {row['hit_rate']:>9.1%} {row['hit_rate_nosnap']:>9.1%} "
            f"{row['tool_seconds_cached']:>14.3f} {row['tool_seconds_uncached']:>9.3f} {speedup:>15} "
            f"{row['mismatches']:>11} {row['naive_wrong_results']:>12} {row['reward_cached']:>7.2f}"
        )
    saved = sum(r["tool_seconds_uncached"] - r["tool_seconds_cached"] for r in report["epochs"])
    mismatches = sum(r["mismatches"] for r in report["epochs"])
    wrong = sum(r["naive_wrong_results"] for r in report["epochs"])
    print(f"\ntool time saved by tvcache: {saved:.3f} s")
    verdict = "identical to" if mismatches == 0 else f"DIFFERENT from ({mismatches} mismatches)"
    print(f"tvcache outputs and rewards: {verdict} the uncached run")
    print(f"naive call-keyed cache: {wrong} wrong results served")
