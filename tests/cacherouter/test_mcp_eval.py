"""The real-registry workload: the tools of five real MCP servers (npm and PyPI), joining and leaving mid-run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from mcp_support import install_npm_servers  # noqa: E402

from cacherouter.cli import main  # noqa: E402
from cacherouter.evaluation.mcp_workload import MCP_QUERIES, SCHEDULE, unavailable  # noqa: E402
from cacherouter.evaluation.runner import ARCHITECTURES, run_workload  # noqa: E402


@pytest.fixture(scope="module")
def servers(monkeypatch_module: pytest.MonkeyPatch) -> None:
    monkeypatch_module.setenv("MCP_SERVERS_DIR", str(install_npm_servers()))
    reason = unavailable()
    if reason is not None:
        pytest.fail(f"the mcp workload cannot run: {reason}")


@pytest.fixture(scope="module")
def monkeypatch_module() -> pytest.MonkeyPatch:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_cacherouter_costs_least_and_keeps_one_main_segment_over_real_servers_coming_and_going(servers: None) -> None:
    assert any(e.startswith("join:") for e in sum(SCHEDULE.values(), ())), "servers join mid-run"
    assert any(e.startswith("leave:") for e in sum(SCHEDULE.values(), ())), "servers leave mid-run"
    runs = {a: run_workload(a, "mcp", MCP_QUERIES, mcp_servers=True) for a in ARCHITECTURES}
    cost = {
        a: r.summary.prompt_tokens - r.summary.cached_tokens + r.summary.cached_tokens / 30 for a, r in runs.items()
    }
    assert cost["cacherouter"] < cost["all-tools"]
    assert cost["cacherouter"] < cost["dynamic"]
    assert runs["cacherouter"].main_tool_segments == 1  # byte-identical across every upstream change
    assert runs["all-tools"].main_tool_segments == 1 + len(SCHEDULE)  # each change re-lists every tool
    assert runs["cacherouter"].paths == {"tools": len(MCP_QUERIES)}
    assert runs["cacherouter"].problems == ()
    assert set(runs["cacherouter"].misses) >= {"first request", "main", "router"}


def test_cacherouter_eval_reports_the_mcp_workload(
    servers: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "figures.json"
    assert main(["eval", "--workloads", "mcp", "--architectures", "cacherouter", "--json", str(out)]) == 0
    assert "SCRIPTED" in capsys.readouterr().out
    run = json.loads(out.read_text())["runs"][0]
    assert run["workload"] == "mcp"
    assert run["main_tool_segments"] == 1
