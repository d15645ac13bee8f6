"""The demo's report: per workload and epoch figures, a Markdown summary, plots and JSONL traces."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .records import CallRecord, RunResult

if TYPE_CHECKING:
    from ..workloads.base import Workload

MODE_LABELS = {"uncached": "no cache", "naive": "naive call-keyed cache", "tvcache-nosnap": "tvcache, no snapshots",
               "tvcache": "tvcache"}  # fmt: skip


def _epoch_rows(run: RunResult, epochs: int) -> list[dict[str, Any]]:
    rows = []
    for epoch in range(epochs):
        records = [r for r in run.records if r.epoch == epoch]
        seconds = [r.seconds for r in records]
        rows.append(
            {
                "calls": len(records),
                "hit_rate": sum(r.hit for r in records) / max(1, len(records)),
                "tool_seconds": sum(seconds),
                "median_call_seconds": statistics.median(seconds) if seconds else 0.0,
                "reward": statistics.fmean(run.rewards[epoch]) if run.rewards.get(epoch) else 0.0,
                "wrong": sum(r.wrong for r in records),
                "sandboxes": run.sandboxes.get(epoch, 0) - run.sandboxes.get(epoch - 1, 0),
                "snapshot_bytes": run.snapshot_bytes.get(epoch, 0),
            }
        )
    return rows


def _key(record: CallRecord) -> tuple[int, str, int, int]:
    return (record.epoch, record.task, record.rollout, record.step)


def mismatches(reference: RunResult, other: RunResult, epoch: int) -> int:
    """Positions (epoch, task, rollout, step) where the call or its output differs from the uncached run,
    plus rollouts whose reward differs."""
    expected = {_key(r): (r.call, r.output) for r in reference.records if r.epoch == epoch}
    actual = {_key(r): (r.call, r.output) for r in other.records if r.epoch == epoch}
    calls = sum(1 for key in expected.keys() | actual.keys() if expected.get(key) != actual.get(key))
    rewards = sum(a != b for a, b in zip(reference.rewards[epoch], other.rewards[epoch], strict=True))
    return calls + rewards


def build(
    runs: dict[str, dict[str, RunResult]], workloads: dict[str, Workload], args: argparse.Namespace
) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "epochs": args.epochs,
        "rollouts_per_group": args.rollouts,
        "seed": args.seed,
        "policy": "a small learnable model over tool-call actions, standing in for the LLM",
        "workloads": {},
    }
    for name, by_mode in runs.items():
        rows = {mode: _epoch_rows(run, args.epochs) for mode, run in by_mode.items()}
        epochs = []
        for e in range(args.epochs):
            full, nosnap, plain, naive = (
                rows["tvcache"][e],
                rows["tvcache-nosnap"][e],
                rows["uncached"][e],
                rows["naive"][e],
            )
            epochs.append(
                {
                    "epoch": e,
                    "hit_rate": full["hit_rate"],
                    "hit_rate_no_snapshots": nosnap["hit_rate"],
                    "tool_seconds_cached": full["tool_seconds"],
                    "tool_seconds_cached_no_snapshots": nosnap["tool_seconds"],
                    "tool_seconds_uncached": plain["tool_seconds"],
                    "median_call_seconds_cached": full["median_call_seconds"],
                    "median_call_seconds_uncached": plain["median_call_seconds"],
                    "mismatches": mismatches(by_mode["uncached"], by_mode["tvcache"], e)
                    + mismatches(by_mode["uncached"], by_mode["tvcache-nosnap"], e),
                    "naive_wrong_results": naive["wrong"],
                    "reward_uncached": plain["reward"],
                    "reward_cached": full["reward"],
                    "reward_naive": naive["reward"],
                    "sandboxes_started": full["sandboxes"],
                    "sandboxes_started_no_snapshots": nosnap["sandboxes"],
                    "sandboxes_started_uncached": plain["sandboxes"],
                    "snapshot_bytes": full["snapshot_bytes"],
                }
            )
        workload = workloads[name]
        summary["workloads"][name] = {
            "description": workload.description,
            "tasks": [task.id for task in workload.tasks],
            "notes": workload.notes,
            "wall_seconds": {mode: run.wall_seconds for mode, run in by_mode.items()},
            "epochs": epochs,
        }
    return summary


def _speedup(row: dict[str, Any]) -> float:
    cached, uncached = row["median_call_seconds_cached"], row["median_call_seconds_uncached"]
    return uncached / cached if cached > 0 else float("inf")


def _format_speedup(value: float) -> str:
    return f"{value:.1f}x" if value < 10 else f"{value:,.0f}x"


def print_summary(summary: dict[str, Any]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table

        have_rich = True
    except ImportError:
        have_rich = False
    for name, data in summary["workloads"].items():
        rows = data["epochs"]
        if have_rich:
            table = Table(title=f"{name}: {data['description']}")
            # Short headers: the table fits an 80-column terminal.
            for column in ("epoch", "hits", "no snap", "tool s", "uncached", "median x", "mismatch", "naive bad",
                           "reward"):  # fmt: skip
                table.add_column(column, justify="right")
            for row in rows:
                speedup = _format_speedup(_speedup(row))
                table.add_row(
                    str(row["epoch"]), f"{row['hit_rate']:.1%}", f"{row['hit_rate_no_snapshots']:.1%}",
                    f"{row['tool_seconds_cached']:.2f}", f"{row['tool_seconds_uncached']:.2f}", speedup,
                    str(row["mismatches"]), str(row["naive_wrong_results"]), f"{row['reward_cached']:.2f}",
                )  # fmt: skip
            console = Console()
            Console(width=max(console.width, 100)).print(table)  # never squeeze the figures into "…"
        saved = sum(r["tool_seconds_uncached"] - r["tool_seconds_cached"] for r in rows)
        total = sum(r["mismatches"] for r in rows)
        wrong = sum(r["naive_wrong_results"] for r in rows)
        verdict = "identical to" if total == 0 else f"DIFFERENT from ({total} mismatches)"
        print(f"{name}: tool time saved {saved:.2f} s; final-epoch median call speedup {_speedup(rows[-1]):,.1f}x")
        print(f"{name}: tvcache outputs and rewards are {verdict} the uncached run; naive cache: {wrong} wrong results")
        for note in data["notes"]:
            print(f"{name}: note: {note}")


def write(out: Path, summary: dict[str, Any], runs: dict[str, dict[str, RunResult]]) -> None:
    (out / "report.json").write_text(json.dumps(summary, indent=2))
    traces = out / "traces"
    traces.mkdir(exist_ok=True)
    for name, by_mode in runs.items():
        for mode, run in by_mode.items():
            with open(traces / f"{name}-{mode}.jsonl", "w") as handle:
                for record in run.records:
                    handle.write(json.dumps(record.trace(), sort_keys=True) + "\n")
    plots = _plots(out, summary, runs)
    (out / "report.md").write_text(_markdown(summary, plots))


def _markdown(summary: dict[str, Any], plots: list[str]) -> str:
    lines = [
        "# tvcache demo report",
        "",
        f"Policy: {summary['policy']}. {summary['rollouts_per_group']} rollouts per group, "
        f"{summary['epochs']} epochs, seed {summary['seed']}. Sandboxes, tools, outputs and rewards are real.",
        "",
    ]
    for name, data in summary["workloads"].items():
        rows = data["epochs"]
        lines += [f"## {name}", "", data["description"], ""]
        lines += [f"*Note: {note}*" for note in data["notes"]]
        lines += [
            "| epoch | hit rate | no snapshots | tool s cached | tool s uncached | median speedup | mismatches "
            "| naive wrong | reward (cached / uncached) | sandboxes (cached / uncached) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in rows:
            lines.append(
                f"| {row['epoch']} | {row['hit_rate']:.1%} | {row['hit_rate_no_snapshots']:.1%} "
                f"| {row['tool_seconds_cached']:.2f} | {row['tool_seconds_uncached']:.2f} | {_speedup(row):,.1f}x "
                f"| {row['mismatches']} | {row['naive_wrong_results']} "
                f"| {row['reward_cached']:.2f} / {row['reward_uncached']:.2f} "
                f"| {row['sandboxes_started']} / {row['sandboxes_started_uncached']} |"
            )
        saved = sum(r["tool_seconds_uncached"] - r["tool_seconds_cached"] for r in rows)
        walls = ", ".join(f"{mode} {seconds:.1f}" for mode, seconds in data["wall_seconds"].items())
        lines += ["", f"Tool time saved: {saved:.2f} s. Wall seconds per run: {walls}.", ""]
    lines += [f"![{Path(plot).stem}]({plot})" for plot in plots]
    return "\n".join(lines) + "\n"


def _plots(out: Path, summary: dict[str, Any], runs: dict[str, dict[str, RunResult]]) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    names = list(summary["workloads"])
    figure, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.6), squeeze=False)
    for axis, name in zip(axes[0], names, strict=True):
        rows = summary["workloads"][name]["epochs"]
        epochs = [row["epoch"] for row in rows]
        axis.plot(epochs, [100 * row["hit_rate"] for row in rows], marker="o", label="tvcache")
        axis.plot(epochs, [100 * row["hit_rate_no_snapshots"] for row in rows], marker="x", ls="--",
                  label="tvcache, no snapshots")  # fmt: skip
        axis.set(title=f"{name}: hit rate by epoch", xlabel="epoch", ylabel="hit rate (%)", ylim=(0, 100))
        axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(out / "hit_rate.png", dpi=110)
    written.append("hit_rate.png")

    figure, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.6), squeeze=False)
    for axis, name in zip(axes[0], names, strict=True):
        final = summary["epochs"] - 1
        for mode, color in (("uncached", "tab:red"), ("tvcache", "tab:blue")):
            seconds = [max(r.seconds, 1e-6) * 1000 for r in runs[name][mode].records if r.epoch == final]
            axis.hist(seconds, bins=_log_bins(), alpha=0.6, color=color, label=MODE_LABELS[mode])
        axis.set_xscale("log")
        axis.set(title=f"{name}: tool-call time, epoch {final}", xlabel="milliseconds per call (log)", ylabel="calls")
        axis.legend()
    figure.tight_layout()
    figure.savefig(out / "call_time.png", dpi=110)
    written.append("call_time.png")

    figure, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.6), squeeze=False)
    for axis, name in zip(axes[0], names, strict=True):
        rows = summary["workloads"][name]["epochs"]
        epochs = [row["epoch"] for row in rows]
        axis.plot(epochs, [row["reward_uncached"] for row in rows], lw=4, alpha=0.4, color="tab:red", label="no cache")
        axis.plot(epochs, [row["reward_cached"] for row in rows], marker="o", color="tab:blue", label="tvcache")
        axis.plot(epochs, [row["reward_naive"] for row in rows], ls=":", color="tab:gray", label="naive cache")
        axis.set(title=f"{name}: mean reward", xlabel="epoch", ylabel="reward", ylim=(-0.05, 1.05))
        axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(out / "reward.png", dpi=110)
    written.append("reward.png")
    plt.close("all")
    return written


def _log_bins() -> list[float]:
    return [10 ** (exponent / 4) for exponent in range(-12, 17)]  # 1 microsecond .. 10 s, in milliseconds
