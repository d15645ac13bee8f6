"""Tinker cookbook: its Harbor bash tool and grader (HarborBashTool, HarborReward) over caching sandboxes from
CachingSandboxFactory, with a real local sandbox (overlay + chroot) as the factory being wrapped."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "tinker_cookbook.recipes.harbor_rl.harbor_tools",
    reason="the 'tinker' extra is not installed (tinker-cookbook needs torch, ~1.5 GB): pip install 'tvcache[tinker]'",
)

import overlay_sandbox  # noqa: E402
from tinker_cookbook.recipes.harbor_rl.harbor_tools import HarborBashTool, HarborReward  # noqa: E402
from tinker_cookbook.sandbox import SandboxInterface  # noqa: E402
from tinker_cookbook.tool_use import ToolInput  # noqa: E402

from tvcache import Cache  # noqa: E402
from tvcache.integrations.tinker import CachedSandbox, CachingSandboxFactory  # noqa: E402

pytestmark = pytest.mark.skipif(not overlay_sandbox.overlay_available(), reason="the local sandbox needs root")

TEST_SH = 'if [ "$(cat /app/hello.txt)" = "Hello, world!" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n'
GOOD = ["mkdir -p /app", "ls /app", "printf 'Hello, world!' > /app/hello.txt", "cat /app/hello.txt"]
BAD = ["mkdir -p /app", "ls /app", "printf 'Hello!' > /app/hello.txt", "cat /app/hello.txt"]


@pytest.fixture
def task(tmp_path: Path) -> Path:
    """A Harbor task directory: instruction, environment/Dockerfile, tests/test.sh."""
    root = tmp_path / "hello-world"
    (root / "environment").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "instruction.md").write_text('Create /app/hello.txt with "Hello, world!" as the content.\n')
    (root / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\n")
    (root / "tests" / "test.sh").write_text(TEST_SH)
    return root


async def episode(sandbox: Any, commands: list[str], tests_dir: Path) -> tuple[list[Any], tuple[float, dict]]:
    """The tool path of a Harbor episode: the recipe's bash tool for each command, then its grader."""
    bash = HarborBashTool(sandbox).bash
    outputs = []
    for command in commands:
        result = await bash.run(ToolInput(arguments={"command": command}, call_id="c"))
        outputs.append([message["content"] for message in result.messages])
    if isinstance(sandbox, CachedSandbox):
        reward = await sandbox.cached_reward(lambda real: HarborReward(tests_dir=tests_dir, sandbox=real), [])
    else:
        reward = await HarborReward(tests_dir=tests_dir, sandbox=sandbox)([])
    await sandbox.cleanup()
    return outputs, reward


def test_group_of_harbor_rollouts_hits_and_matches_uncached(task: Path) -> None:
    async def scenario() -> None:
        env_dir = task / "environment"
        expected_good = await episode(await overlay_sandbox.overlay_sandbox_factory(env_dir, 60), GOOD, task / "tests")
        expected_bad = await episode(await overlay_sandbox.overlay_sandbox_factory(env_dir, 60), BAD, task / "tests")
        assert expected_good[1][0] == 1.0
        assert expected_bad[1][0] == 0.0
        assert json.loads(expected_good[0][3][0])["stdout"] == "Hello, world!"

        # These commands are deterministic; the first-hit check of the (undeclared) tinker tools would start a
        # real sandbox for the all-hit rollout, which this test pins as never created: turn it off.
        cache = Cache(verify_undeclared=False)
        factory = CachingSandboxFactory(inner=overlay_sandbox.overlay_sandbox_factory, cache=cache)
        started = len(overlay_sandbox.STARTED)
        sandboxes = [await factory(env_dir, 60) for _ in range(3)]
        assert all(isinstance(s, SandboxInterface) for s in sandboxes)
        first = await episode(sandboxes[0], GOOD, task / "tests")
        second = await episode(sandboxes[1], GOOD, task / "tests")
        third = await episode(sandboxes[2], BAD, task / "tests")
        assert (first, second, third) == (expected_good, expected_good, expected_bad)

        stats = [s.session.stats for s in sandboxes]
        assert (stats[0].hits, stats[0].misses) == (0, 4)
        assert (stats[1].hits, stats[1].misses) == (4, 0)  # and the grader's verdict came from the cache
        assert (stats[2].hits, stats[2].misses) == (2, 2)  # diverged at the third command
        assert stats[1].sandboxes_started == 0
        # A new real sandbox replays mkdir and ls (a command is state-changing unless proved otherwise; this
        # backend cannot prove it), then runs the two new commands.
        assert stats[2].calls_replayed == 2
        assert len(overlay_sandbox.STARTED) - started == 2  # the all-hit rollout never created a real sandbox
        assert sandboxes[0].session.graph.task_id == "tinker:hello-world"
        cache.close()

    asyncio.run(scenario())


def test_against_a_server_with_one_setting(task: Path) -> None:
    for module in ("httpx", "starlette", "uvicorn"):
        pytest.importorskip(module, reason="the 'server' extra is not installed: pip install 'tvcache[server]'")
    from tvcache.server import CacheService, ServerThread

    async def scenario(url: str) -> None:
        expected = await episode(await overlay_sandbox.overlay_sandbox_factory(task, 60), GOOD, task / "tests")
        for round in range(2):
            factory = CachingSandboxFactory.open(  # checks off: the hits are counted (see above)
                inner=overlay_sandbox.overlay_sandbox_factory, cache=url, verify_undeclared=False
            )
            sandbox = await factory(task / "environment", 60)
            assert await episode(sandbox, GOOD, task / "tests") == expected
            assert sandbox.session.stats.hits == (4 if round else 0)
            factory.cache.close()

    service = CacheService()
    with ServerThread(service) as server:
        asyncio.run(scenario(server.url))
    service.close()
