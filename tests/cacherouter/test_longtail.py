"""The long-tail evaluation workload: a generated 211-tool repository and queries that need tools outside the core."""

from pathlib import Path

from cacherouter.evaluation.longtail import DOMAINS, LONGTAIL, generate_repository, generated_tools
from cacherouter.evaluation.runner import EVAL_REPO, run_workload
from cacherouter.evaluation.suite import CORE_PACKAGES
from cacherouter.tools.registry import build_registry


def test_generated_repository_registers_every_tool_statically(tmp_path: Path) -> None:
    root = generate_repository(EVAL_REPO, tmp_path / "repo")
    registry = build_registry(root)
    assert registry.problems == ()
    generated = generated_tools()
    assert len(generated) == 200
    assert len(registry) == len(build_registry(EVAL_REPO)) + 200
    assert set(DOMAINS) <= set(registry.packages)
    spec = registry.get(generated[0].name)
    assert spec is not None
    assert spec.schema.source == "static"  # read by the AST extraction, never by running the script
    assert spec.input_schema()["required"] == ["target"]


def test_queries_need_tools_outside_the_core_view() -> None:
    names = {t.name: t for t in generated_tools()}
    assert len({q.text for q in LONGTAIL}) == len(LONGTAIL) == 40
    routed = [a for q in LONGTAIL for r in q.rounds for a in r if a.routed]
    assert len(routed) >= len(LONGTAIL)
    assert all(a.tool in names and names[a.tool].package not in CORE_PACKAGES for a in routed)


def test_cacherouter_keeps_one_main_segment_on_the_long_tail(tmp_path: Path) -> None:
    root = generate_repository(EVAL_REPO, tmp_path / "repo")
    queries = LONGTAIL[:6]
    ours = run_workload("cacherouter", "longtail", queries, repo=root)
    everything = run_workload("all-tools", "longtail", queries, repo=root)
    assert ours.main_tool_segments == 1
    assert ours.router_calls == sum(1 for q in queries for r in q.rounds for a in r if a.routed)
    assert ours.paths == {"tools": len(queries)}
    # the main view carries the core tools only; all-tools carries 211 definitions in every request
    assert ours.by_channel["main"].prompt_tokens < everything.summary.prompt_tokens / 2
