"""``tvcache bench server`` with its calibration and a baseline checkout, as the issue's closing run uses it
(here the baseline is this very checkout, at a low rate: the command's shape, not its figures)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tvcache.cli import main

SRC = Path(__file__).resolve().parents[1] / "src"


def test_bench_server_loads_calibration_ours_and_a_baseline_rate_by_rate(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    report = tmp_path / "bench.json"
    argv = ["bench", "server", "--rates", "150,300", "--duration", "0.2", "--keys", "64", "--baseline", str(SRC)]
    assert main([*argv, "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert f"baseline: {SRC}" in out
    lines = [line for line in out.splitlines() if re.match(r"(calibration|ours|baseline) ", line)]
    order = [(line.split()[0], " ".join(line.split()[1:3]), int(line.split()[3])) for line in lines]
    expected = [
        (target, route, rate)
        for route in ("GET /get", "POST /v1/lookup")
        for rate in (150, 300)
        for target in ("calibration", "ours", "baseline")
    ]
    assert order == expected  # interleaved: each rate meets every target before the next rate
    assert all(re.search(r"server\s+[\d.]+ us/req$", line) for line in lines)
    assert "ratios (ours vs baseline" in out
    assert "GET /get at 8192 req/s" not in out  # not offered: no goal line
    results = json.loads(report.read_text())["results"]
    assert len(results) == len(expected)
    assert {result["sent"] for result in results if result["rate"] == 150} == {30}
    assert {result["sent"] for result in results if result["rate"] == 300} == {60}
