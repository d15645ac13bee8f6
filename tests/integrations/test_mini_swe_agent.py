"""mini-swe-agent: its own ``DefaultAgent`` loop, driven by its deterministic test model, over a
``CachingEnvironment`` — several rollouts of one task, compared with the same rollouts on the real environment."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
pytest.importorskip(
    "minisweagent", reason="the 'mini-swe-agent' extra is not installed: pip install 'tvcache[mini-swe-agent]'"
)

from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.environments.local import LocalEnvironment  # noqa: E402
from minisweagent.models.test_models import DeterministicModel, make_output  # noqa: E402

from tvcache import Cache  # noqa: E402
from tvcache.integrations.mini_swe_agent import CachingEnvironment  # noqa: E402

TEMPLATE: Path | None = None
BUILT: list[str] = []  # every real environment built, for tests to count
SCRATCH: Path | None = None  # where environments copy the task (pytest's own temporary tree, cleaned by it)


@pytest.fixture(autouse=True, scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> None:
    global SCRATCH
    SCRATCH = tmp_path_factory.mktemp("mswea")


class FreshCopyEnvironment(LocalEnvironment):
    """A real mini-swe-agent environment that, like a container from an image, starts in the task's initial
    state each time it is built: its first action makes a fresh copy of the task's directory."""

    workdir: str = ""

    def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        if not self.workdir:
            assert TEMPLATE is not None
            self.workdir = str(Path(tempfile.mkdtemp(prefix="mswea-", dir=SCRATCH)) / "repo")
            shutil.copytree(TEMPLATE, self.workdir)
            BUILT.append(self.workdir)
        return super().execute(action, cwd or self.workdir, timeout=timeout)


CONFIG = {"environment_class": f"{__name__}.FreshCopyEnvironment", "timeout": 30}
AGENT = {
    "system_template": "You fix bugs on {{system}}; commands time out after {{timeout}} s.",
    "instance_template": "Task: {{task}}",
    "step_limit": 20,
    "cost_limit": 100.0,
}
FIX = "sed -i 's/a - b/a + b/' calc.py"
WRONG = "sed -i 's/a - b/b - a/' calc.py"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat calc.py"


def rollout(fix: str) -> list[str]:
    return ["ls", "cat calc.py", fix, "python3 -c 'import calc; print(calc.add(2, 3))'", SUBMIT]


@pytest.fixture(autouse=True)
def task(tmp_path: Path) -> Path:
    global TEMPLATE
    TEMPLATE = tmp_path / "template"
    TEMPLATE.mkdir()
    (TEMPLATE / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    BUILT.clear()
    return TEMPLATE


def run_agent(env: Any, commands: list[str]) -> tuple[dict[str, Any], list[Any]]:
    """One rollout of the real agent loop; returns its exit info and the observations it saw."""
    outputs = [make_output(f"step {i}", [{"command": command}]) for i, command in enumerate(commands)]
    agent = DefaultAgent(DeterministicModel(outputs=outputs), env, **AGENT)
    info = agent.run("make add() add")
    observations = [_strip_times(m) for m in agent.messages if m["role"] in ("user", "exit")]
    return info, observations


def _strip_times(message: dict[str, Any]) -> dict[str, Any]:
    extra = {k: v for k, v in message.get("extra", {}).items() if k != "timestamp"}
    return {**message, "extra": extra}


def test_repeated_and_divergent_rollouts_hit_and_match_uncached() -> None:
    cache = Cache()
    uncached = [run_agent(FreshCopyEnvironment(timeout=30), rollout(fix)) for fix in (FIX, FIX, WRONG)]
    built_uncached = len(BUILT)
    assert uncached[0][0]["exit_status"] == "Submitted"
    assert "\n5\n" in uncached[0][1][4]["content"]
    assert "\n1\n" in uncached[2][1][4]["content"]

    cached = []
    stats = []
    for fix in (FIX, FIX, WRONG):
        before = len(BUILT)
        env = CachingEnvironment(CONFIG, cache=cache, task_id="calc", deterministic=True)
        cached.append(run_agent(env, rollout(fix)))
        env.close()
        stats.append((env.session.stats.hits, env.session.stats.misses, len(BUILT) - before))

    # Observations (the workdir differs per copy: compare with it masked) and exit info equal uncached runs.
    def masked(results: list[Any]) -> list[Any]:
        return [_mask(result) for result in results]

    assert masked(cached) == masked(uncached)
    assert stats[0] == (0, 5, 1)
    assert stats[1] == (5, 0, 0)  # rollout 2: every action a hit, no environment built
    assert stats[2] == (2, 3, 1)  # the divergent rollout hits on its shared prefix (ls, cat), then runs
    assert built_uncached == 3


def _mask(value: Any) -> Any:
    text = repr(value)
    for path in BUILT:
        text = text.replace(path, "<workdir>")
    return text


def test_the_first_hit_of_an_undeclared_command_is_checked_once() -> None:
    cache = Cache()
    for expected_built in (1, 1):
        before = len(BUILT)
        env = CachingEnvironment(CONFIG, cache=cache, task_id="calc")  # deterministic=None: checked
        info, _ = run_agent(env, rollout(FIX))
        env.close()
        assert info["exit_status"] == "Submitted"
        assert len(BUILT) - before == expected_built
    assert env.session.stats.verified == 1
    assert env.session.stats.hits == 4


def test_an_action_that_is_not_json_passes_through_uncached_once_logged(caplog: pytest.LogCaptureFixture) -> None:
    env = CachingEnvironment(CONFIG, cache=Cache(), task_id="calc", deterministic=True)
    marker = object()
    with caplog.at_level("WARNING", logger="tvcache.integrations"):
        first = env.execute({"command": "echo one", "handle": marker})
        second = env.execute({"command": "echo two", "handle": marker})
    env.close()
    assert (first["output"], second["output"]) == ("one\n", "two\n")
    assert env.pass_throughs.counts["execute"] == 2
    assert sum("passes through uncached" in record.message for record in caplog.records) == 1
    assert env.session.stats.uncached == 2
    assert env.session.stats.hits == 0


def test_a_timed_out_action_is_never_cached() -> None:
    cache = Cache()
    outputs = []
    for _ in range(2):
        env = CachingEnvironment({**CONFIG, "timeout": 1}, cache=cache, task_id="slow", deterministic=True)
        outputs.append(env.execute({"command": "sleep 5"}))
        env.close()
        assert env.session.stats.hits == 0
    assert all(output["returncode"] == -1 for output in outputs)


def test_no_environment_is_built_for_template_variables() -> None:
    env = CachingEnvironment(CONFIG, cache=Cache(), task_id="calc")
    variables = env.get_template_vars()
    serialized = env.serialize()
    env.close()
    assert BUILT == []
    assert variables["timeout"] == 30
    assert serialized["info"]["config"]["environment_type"] == f"{__name__}.FreshCopyEnvironment"
