"""The main job end to end, small: every workload, every mode, exactness, report files, traces and replay."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tvcache import replay


def test_demo_runs_exactly_and_replay_reproduces_its_hit_rate(tmp_path: Path) -> None:
    out = tmp_path / "report"
    command = [sys.executable, "-m", "tvcache.cli", "demo", "--quick", "--epochs", "2", "--rollouts", "4"]
    result = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "identical to the uncached run" in result.stdout
    report = json.loads((out / "report.json").read_text())
    assert set(report["workloads"]) == {"sql", "shell", "media"}
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
