"""``tvcache bench reopen``: how long ``Cache(dir)`` takes to open a large durable cache, and to answer its first
lookup, from a checkpoint next to the journal alone, measured side by side in one run.

1. A journal of ``--calls`` recorded calls over ``--tasks`` tasks is written with the journal's own writer (no
   sandbox runs): per task, rollouts of up to 16 SQL calls branching off earlier rollouts, a quarter of them
   read-only, outputs of 32-512 characters. Less the tail (below).
2. A cache opens it, replaying the whole journal, and compacts, writing the checkpoint (what closing does by
   itself once ``CHECKPOINT_TAIL`` records are not in one). Both are timed.
3. ``--tail`` more calls (default 1 %, spread over every task) are appended after the checkpoint, as a process
   that kept running after it would have.
4. Fresh processes open the directory in turn, with the checkpoint and with it moved aside (the journal-only
   path), each timing ``Cache(dir)``, the first lookup (a session's first call, which hits: its task is read
   from the checkpoint then), a second lookup, and reading every task; with RSS after each and the bytes per node
   in memory (RSS growth over the nodes). ``compact_on_open=False`` there, so that measuring leaves the
   directory as it is.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..calls import canonical_json
from . import HitsOnly, write_figures

DEPTH = 16
ROUNDS = 3
_OUTPUTS = ["r" * size for size in range(32, 513, 16)]


@dataclass(eq=False)
class _Task:
    """What the generator keeps of one task: its rollouts' stateful node ids, and the next id."""

    name: str
    paths: list[list[int]] = field(default_factory=list)
    next_id: int = 1


def _query(task: str, node_id: int) -> str:
    return f"SELECT name, total FROM orders WHERE customer = '{task}' AND id = {node_id} ORDER BY total"


def _node_record(rng: random.Random, task: _Task, parent: int, *, read_only: bool) -> dict[str, Any]:
    node_id = task.next_id
    task.next_id += 1
    return {
        "t": "n",
        "task": task.name,
        "id": node_id,
        "p": parent,
        "name": "sql",
        "a": canonical_json({"query": _query(task.name, node_id)}).decode(),
        "o": rng.choice(_OUTPUTS),
        "e": False,
        "s": rng.random(),
        "r": read_only,
    }


def _rollouts(rng: random.Random, task: _Task, calls: int) -> Iterator[dict[str, Any]]:
    """``calls`` records of rollouts of one task, each branching off a random prefix of an earlier one."""
    written = 0
    while written < calls:
        base = rng.choice(task.paths) if task.paths else []
        path = base[: rng.randrange(0, len(base) + 1)]
        while len(path) < DEPTH and written < calls:
            read_only = rng.random() < 0.25
            record = _node_record(rng, task, path[-1] if path else 0, read_only=read_only)
            if not read_only:
                path.append(record["id"])
            written += 1
            yield record
        task.paths.append(path)


def generate(directory: Path, *, calls: int, tasks: list[_Task], seed: int) -> float:
    """Write a journal of ``calls`` records with ``Journal.rewrite`` (one buffered pass), printing progress;
    returns the seconds it took."""
    from ..journal import Journal

    rng = random.Random(seed)
    per_task = [calls // len(tasks) + (1 if index < calls % len(tasks) else 0) for index in range(len(tasks))]
    began = time.perf_counter()
    step = max(1, calls // 10)

    def records() -> Iterator[dict[str, Any]]:
        written = 0
        for task, count in zip(tasks, per_task, strict=True):
            for record in _rollouts(rng, task, count):
                written += 1
                if written % step == 0:
                    rate = written / (time.perf_counter() - began)
                    print(f"  generating: {written:,} / {calls:,} calls ({rate:,.0f}/s)", flush=True)
                yield record

    journal = Journal(directory)
    try:
        for _ in journal.load():
            pass
        journal.rewrite(records())
    finally:
        journal.close()
    return time.perf_counter() - began


def append_tail(directory: Path, *, calls: int, tasks: list[_Task], seed: int) -> float:
    """Append ``calls`` records after the checkpoint, round-robin over the tasks, each extending one of the
    task's rollouts (``Journal.append``, as a running cache writes them)."""
    from ..journal import Journal
    from ..store.checkpoint import Checkpoint

    checkpoint = Checkpoint.open(directory)
    if checkpoint is None:
        raise RuntimeError("benchmark bug: closing the cache wrote no checkpoint")
    prefix = checkpoint.prefix
    checkpoint.close()
    rng = random.Random(seed)
    began = time.perf_counter()
    journal = Journal(directory)
    try:
        for _ in journal.load(after=prefix):
            pass
        for index in range(calls):
            task = tasks[index % len(tasks)]
            path = rng.choice(task.paths)
            journal.append(_node_record(rng, task, path[-1] if path else 0, read_only=False))
    finally:
        journal.close()
    return time.perf_counter() - began


# ------------------------------------------------------------------------------------- the measuring child


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(directory: str, task: str, history: list[dict[str, Any]]) -> dict[str, Any]:
    """Open ``directory`` in this (fresh) process and time it; ``history``: a stored rollout of ``task``."""
    from ..cache import Cache

    rss_before = _rss_mib()
    began = time.perf_counter()
    cache = Cache(directory, compact_on_open=False)
    opened = time.perf_counter() - began
    rss_open = _rss_mib()

    async def lookups() -> list[float]:
        """The first lookup from the session's start (which finds the task's graph), then the next one."""
        seconds = []
        began = time.perf_counter()
        async with cache.session(task, sandbox=HitsOnly("sql")) as session:
            for call in history[:2]:
                result = await session.call(call["name"], call["arguments"])
                seconds.append(time.perf_counter() - began)
                if not result.hit:
                    raise RuntimeError("benchmark bug: a stored call did not hit")
                began = time.perf_counter()
        return seconds

    first, second = asyncio.run(lookups())
    rss_first = _rss_mib()
    began = time.perf_counter()
    nodes = sum(len(cache.graph(task_id)) - 1 for task_id in cache.tasks())
    load_all = time.perf_counter() - began
    rss_all = _rss_mib()
    recovery = cache.recovery
    figures = {
        "open_s": opened,
        "first_lookup_s": first,
        "second_lookup_s": second,
        "load_all_s": load_all,
        "rss_open_mib": rss_open,
        "rss_first_mib": rss_first,
        "rss_all_mib": rss_all,
        "bytes_per_node_memory": (rss_all - rss_before) * 2**20 / nodes,
        "nodes": nodes,
        "from_checkpoint": recovery.from_checkpoint if recovery is not None else 0,
    }
    cache.close()
    return figures


def _measure_in_child(directory: Path, task: str, history: list[dict[str, Any]]) -> dict[str, Any]:
    code = (
        "import json, sys\n"
        "from tvcache.bench.reopen import measure\n"
        "print(json.dumps(measure(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(directory), task, json.dumps(history)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the measuring process failed:\n{done.stderr}")
    figures: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return figures


# ------------------------------------------------------------------------------------------------ the run


def run(*, calls: int, tasks: int = 64, tail: int | None = None, seed: int = 0, json_path: str | None = None) -> int:
    from ..cache import Cache
    from ..store import checkpoint

    tail = max(0, calls // 100 if tail is None else min(tail, calls))
    print(f"tvcache bench reopen: {calls:,} recorded calls over {tasks} tasks, {tail:,} of them after the checkpoint")
    states = [_Task(name=f"task-{index:04d}") for index in range(tasks)]
    with tempfile.TemporaryDirectory(prefix="tvcache-bench-reopen-", dir=os.environ.get("TVCACHE_BENCH_DIR")) as tmp:
        directory = Path(tmp) / "cache"
        generated = generate(directory, calls=calls - tail, tasks=states, seed=seed)
        print(f"journal of {calls - tail:,} calls written in {generated:.1f} s")
        began = time.perf_counter()
        cache = Cache(directory)
        replayed = time.perf_counter() - began
        began = time.perf_counter()
        cache.compact()  # writes the checkpoint
        checkpointed = time.perf_counter() - began
        cache.close()
        del cache
        print(f"first open (replaying the journal) {replayed:.1f} s; compaction with checkpoint {checkpointed:.1f} s")
        appended = append_tail(directory, calls=tail, tasks=states, seed=seed + 1)
        print(f"{tail:,} calls appended after the checkpoint in {appended:.1f} s")
        journal_bytes = (directory / "journal.log").stat().st_size
        checkpoint_bytes = (directory / checkpoint.FILE).stat().st_size
        aside = directory / "checkpoint-moved-aside"
        task = max(states, key=lambda state: max(len(path) for path in state.paths))
        path = max(task.paths, key=len)
        history = [{"name": "sql", "arguments": {"query": _query(task.name, node_id)}} for node_id in path]

        rows: dict[str, list[dict[str, Any]]] = {"checkpoint": [], "journal only": []}
        for round_ in range(ROUNDS):
            for route in rows:
                if route == "journal only":
                    os.replace(directory / checkpoint.FILE, aside)
                try:
                    figures = _measure_in_child(directory, task.name, history)
                finally:
                    if route == "journal only":
                        os.replace(aside, directory / checkpoint.FILE)
                expected = calls - tail if route == "checkpoint" else 0
                if figures["from_checkpoint"] != expected or figures["nodes"] != calls:
                    raise RuntimeError(f"benchmark bug: {route} opened {figures} (expected {calls:,} nodes)")
                rows[route].append(figures)
                print(f"  round {round_ + 1}/{ROUNDS} {route}: open {figures['open_s']:.3f} s", flush=True)
        shutil.rmtree(directory)

    median = {route: {key: statistics.median(f[key] for f in runs) for key in runs[0]} for route, runs in rows.items()}
    fast, slow = median["checkpoint"], median["journal only"]
    print(f"\nmedians of {ROUNDS} interleaved rounds, each a fresh process ({calls:,} nodes):")
    for figures in (fast, slow):
        figures["ready_s"] = figures["open_s"] + figures["first_lookup_s"]
    print(f"{'':>22} | {'checkpoint':>12} | {'journal only':>12} | journal only / checkpoint")
    for label, key, unit, scale in (
        ("Cache(dir)", "open_s", "ms", 1000),
        ("first lookup", "first_lookup_s", "ms", 1000),
        ("open + first lookup", "ready_s", "ms", 1000),
        ("second lookup", "second_lookup_s", "us", 1e6),
        ("read every task", "load_all_s", "ms", 1000),
        ("RSS after open", "rss_open_mib", "MiB", 1),
        ("RSS after 1st lookup", "rss_first_mib", "MiB", 1),
        ("RSS, every task read", "rss_all_mib", "MiB", 1),
        ("memory per node", "bytes_per_node_memory", "B", 1),
    ):
        ratio = slow[key] / fast[key] if fast[key] else float("nan")
        print(
            f"{label:>22} | {fast[key] * scale:>8,.1f} {unit:<3} | {slow[key] * scale:>8,.1f} {unit:<3} | {ratio:,.2f}x"
        )
    print(
        f"on disk per node: journal {journal_bytes / calls:,.0f} B ({journal_bytes / 2**20:,.0f} MiB), checkpoint "
        f"{checkpoint_bytes / (calls - tail):,.0f} B ({checkpoint_bytes / 2**20:,.0f} MiB)"
    )
    figures = {
        "calls": calls,
        "tasks": tasks,
        "tail": tail,
        "generate_s": generated,
        "first_open_replay_s": replayed,
        "compaction_writing_checkpoint_s": checkpointed,
        "journal_bytes": journal_bytes,
        "checkpoint_bytes": checkpoint_bytes,
        "rounds": rows,
        "median": median,
        "python": sys.version.split()[0],
    }
    write_figures(figures, json_path, blank_line=True)
    return 0
