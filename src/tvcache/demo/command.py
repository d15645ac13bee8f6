"""``tvcache demo``'s command line: which workloads run here, the arguments, and ``main``."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any

from ..workloads.base import Workload
from . import report
from .records import MODES, RunResult
from .runner import Runner, RunProgress

WORKLOADS = ("sql", "shell", "media", "terminal", "dockerfile", "dockerfile-docker")


def load_workload(name: str, data_dir: Path, args: argparse.Namespace) -> Workload:
    if name == "sql":
        from ..workloads.sql import sql_workload

        return sql_workload(data_dir, delay_seconds=args.delay)
    if name == "shell":
        from ..workloads.shell import shell_workload

        return shell_workload(data_dir)
    if name == "media":
        from ..workloads.media import media_workload

        return media_workload(data_dir)
    if name == "terminal":
        from ..workloads.terminal import terminal_workload

        return terminal_workload(data_dir)
    if name in ("dockerfile", "dockerfile-docker"):
        from ..workloads.dockerfile import dockerfile_workload

        return dockerfile_workload(data_dir, backend="image" if name == "dockerfile" else "docker")
    raise SystemExit(f"tvcache demo: unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def unavailable(name: str) -> str | None:
    """Why a workload cannot run on this machine, or None: ``terminal``'s persistent shells need overlay mounts,
    and have no copying fallback; the Dockerfile workloads need a Docker engine and the local base image."""
    if name == "terminal":
        from ..workloads.terminal import unavailable_reason

        return unavailable_reason()
    if name in ("dockerfile", "dockerfile-docker"):
        from ..workloads import dockerfile

        return dockerfile.unavailable_reason("image" if name == "dockerfile" else "docker")
    return None


def main(args: argparse.Namespace) -> int:
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
                    progress = RunProgress(rollouts, f"{name} / {mode}", bar)
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
