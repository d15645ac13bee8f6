"""The main job end to end, small: every workload, every mode, exactness, report files, traces and replay."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tvcache import demo, replay
from tvcache.calls import ToolCall
from tvcache.sandboxes import ShellSandbox
from tvcache.sandboxes.shell.linux import overlay_supported
from tvcache.workloads.terminal import terminal_workload


def test_demo_runs_exactly_and_replay_reproduces_its_hit_rate(tmp_path: Path) -> None:
    out = tmp_path / "report"
    command = [sys.executable, "-m", "tvcache.cli", "demo", "--quick", "--epochs", "2", "--rollouts", "4"]
    result = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "identical to the uncached run" in result.stdout
    report = json.loads((out / "report.json").read_text())
    # Some workloads need more than Python (terminal: overlay mounts; others: a Docker engine); where one cannot
    # run, the demo leaves it out and says so. sql, shell and media run everywhere.
    available = {name for name in demo.WORKLOADS if demo.unavailable(name) is None}
    assert {"sql", "shell", "media"} <= available
    assert set(report["workloads"]) == available
    for name in set(demo.WORKLOADS) - available:
        assert f"leaving out the {name} workload" in result.stdout
    assert ("terminal" in available) == overlay_supported()
    if "terminal" in available:  # its live shells were snapshotted by the shell-state route
        assert any("shell-state" in note for note in report["workloads"]["terminal"]["notes"])
    fields = {
        "hit_rate", "tool_seconds_cached", "tool_seconds_uncached", "median_call_seconds_cached",
        "median_call_seconds_uncached", "mismatches", "naive_wrong_results", "sandboxes_started", "snapshot_bytes",
    }  # fmt: skip
    for name, data in report["workloads"].items():
        assert len(data["epochs"]) == 2
        for row in data["epochs"]:
            assert fields <= row.keys()
            assert row["mismatches"] == 0, name
        assert any(row["hit_rate"] > 0 for row in data["epochs"]), name
    assert sum(row["naive_wrong_results"] for data in report["workloads"].values() for row in data["epochs"]) > 0
    for plot in ("hit_rate.png", "call_time.png", "reward.png"):
        assert (out / plot).stat().st_size > 10_000
    assert "## shell" in (out / "report.md").read_text()

    for name in report["workloads"]:
        trace = out / "traces" / f"{name}-tvcache.jsonl"
        (replayed,) = replay.replay([trace]).values()
        assert replayed.recorded_hits is not None
        assert replayed.hits == replayed.recorded_hits, name
        assert replayed.divergent_outputs == 0


# Per terminal task: commands from its menu that solve it when the shell's state carries over between calls.
SOLUTIONS = {
    "cd-fix-mean": ["cd packages/stats", "sed -i 's|NR + 1|NR|' mean.awk 2>&1"],
    "venv-codegen": ["source .venv/bin/activate", "sed -i 's/range(1, 5)/range(1, 6)/' gen.py"],
    "export-precision": ["export PRECISION=2"],
}


@pytest.mark.skipif(not overlay_supported(), reason="persistent shell sandboxes need overlay mounts (root)")
def test_terminal_tasks_are_solved_only_where_the_shell_state_persists(tmp_path: Path) -> None:
    """Each terminal task's solution earns the reward in a persistent shell and none when every call is a fresh
    `bash -c` over the same files: the tasks really depend on cwd, exported variables and the venv."""
    workload = terminal_workload(tmp_path / "data")
    assert sorted(task.id for task in workload.tasks) == sorted(SOLUTIONS)

    async def final_output(factory: object, commands: list[str], check: ToolCall) -> tuple[list[str], str]:
        """The commands that failed, and the check's output after all of them."""
        sandbox = await factory.start()  # type: ignore[attr-defined]
        try:
            failed = [cmd for cmd in commands if (await sandbox.execute(ToolCall("sh", {"cmd": cmd}))).is_error]
            return failed, str((await sandbox.execute(check)).output)
        finally:
            await sandbox.stop()

    rewards = {}
    try:
        for task in workload.tasks:
            menu = {action.arguments["cmd"] for action in task.actions}
            assert set(SOLUTIONS[task.id]) <= menu
            assert task.check is not None
            failed, persistent = asyncio.run(final_output(task.factory, SOLUTIONS[task.id], task.check))
            assert failed == [], task.id
            one_shot_factory = ShellSandbox.factory(task.factory.base, fallback=False)  # type: ignore[attr-defined]
            try:
                # There the sed of cd-fix-mean runs in the repository root, which has no mean.awk: it fails.
                _, one_shot = asyncio.run(final_output(one_shot_factory, SOLUTIONS[task.id], task.check))
            finally:
                one_shot_factory.close()
            rewards[task.id] = (task.reward(persistent), task.reward(one_shot))
    finally:
        workload.close()
    assert rewards == {task: (1.0, 0.0) for task in SOLUTIONS}, rewards


def test_replay_of_a_hand_written_trace(tmp_path: Path) -> None:
    lines = [
        {"task": "t", "rollout": 0, "step": 0, "call": {"name": "sh", "arguments": {"cmd": "make"}}, "seconds": 2.0},
        {"task": "t", "rollout": 0, "step": 1, "call": {"name": "sh", "arguments": {"cmd": "cat f"}}, "seconds": 0.1,
         "read_only": True},
        {"task": "t", "rollout": 1, "step": 0, "call": {"name": "sh", "arguments": {"cmd": "make"}}, "seconds": 2.1},
        {"task": "t", "rollout": 1, "step": 1, "call": {"name": "sh", "arguments": {"cmd": "cat f"}}, "seconds": 0.1,
         "read_only": True},
        {"task": "t", "rollout": 2, "step": 0, "call": {"name": "sh", "arguments": {"cmd": "cat f"}}, "seconds": 0.1,
         "read_only": True},
    ]  # fmt: skip
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    (result,) = replay.replay([trace]).values()
    assert (result.calls, result.hits) == (5, 2)  # `cat f` at the root is another state than after `make`
    assert abs(result.seconds_saved - 2.1) < 1e-9
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task": "t"}\n')
    completed = subprocess.run(
        [sys.executable, "-m", "tvcache.cli", "replay", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert completed.returncode != 0
    assert "not a trace record" in completed.stderr


def test_replay_refuses_malformed_records_with_their_line(tmp_path: Path) -> None:
    good = {"task": "t", "rollout": 0, "step": 0, "call": {"name": "sh", "arguments": {}}, "seconds": 1.0}
    for broken in ({**good, "seconds": "fast"}, {**good, "step": "0"}, {**good, "call": "ls"}):
        trace = tmp_path / "trace.jsonl"
        trace.write_text(json.dumps(good) + "\n" + json.dumps(broken) + "\n")
        completed = subprocess.run(
            [sys.executable, "-m", "tvcache.cli", "replay", str(trace)], capture_output=True, text=True, timeout=60
        )
        assert completed.returncode != 0
        assert f"{trace}:2: not a trace record" in completed.stderr
        assert "Traceback" not in completed.stderr
