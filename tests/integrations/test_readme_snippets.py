"""Every snippet of the README's "Integrations" section, run as written (names it leaves to the reader are bound
to the test's real objects; hosts and paths are pointed at the test's own server and directories)."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
README = HERE.parent.parent / "README.md"


def snippet(name: str) -> str:
    text = README.read_text()
    match = re.search(rf"<!-- snippet: {name} -->\n```\w+\n(.*?)```", text, re.S)
    assert match is not None, f"README has no snippet {name!r}"
    return match.group(1)


def server_modules() -> None:
    for module in ("httpx", "starlette", "uvicorn"):
        pytest.importorskip(module, reason="the 'server' extra is not installed: pip install 'tvcache[server]'")


def test_mcp_snippet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mcp", reason="the 'mcp' extra is not installed: pip install 'tvcache[mcp]'")
    server_modules()
    from mcp import Client, StdioServerParameters

    from tvcache.server import CacheService, ServerThread

    monkeypatch.setenv("NOTES_LOG", str(tmp_path / "log"))
    line = snippet("mcp").strip()
    words = line.split()
    assert words[:2] == ["tvcache", "mcp-proxy"]

    async def rollout(url: str) -> tuple[str, int]:
        argv = [w.replace('"$TASK_ID"', "task-1").replace("http://127.0.0.1:8000", url) for w in words[2:]]
        argv = [sys.executable if w == "python" else str(HERE / w) if w == "notes_server.py" else w for w in argv]
        argv = [str(HERE / "mcp_notes_server.py") if w.endswith("notes_server.py") else w for w in argv]
        command = [sys.executable, "-c", "from tvcache.cli import main; raise SystemExit(main())", "mcp-proxy", *argv]
        parameters = StdioServerParameters(command=command[0], args=command[1:], env=dict(os.environ))
        async with Client(parameters, cache=None) as client:
            await client.call_tool("write", {"name": "a", "text": "x"})
            result = await client.call_tool("read", {"name": "a"})
            stats = await client.read_resource("tvcache://stats")
            import json

            return result.content[0].text, json.loads(stats.contents[0].text)["session"]["misses"]  # type: ignore[union-attr]

    service = CacheService()
    with ServerThread(service) as server:
        text, misses = asyncio.run(rollout(server.url))
        assert text == "x"
        assert misses >= 2  # the write, the read (and the listing the SDK client makes)
        assert asyncio.run(rollout(server.url)) == ("x", 0)  # a second proxy process: all hits
    service.close()


def test_skyrl_snippet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("skyrl_gym", reason="the 'skyrl' extra is not installed")
    import sqlite3

    from skyrl_gym.envs.sql.env import Text2SQLEnvConfig

    folder = tmp_path / "SynSQL-2.5M" / "databases" / "db"
    folder.mkdir(parents=True)
    with sqlite3.connect(folder / "db.sqlite") as db:
        db.execute("CREATE TABLE t (x)")
    monkeypatch.chdir(tmp_path)
    code = snippet("skyrl").replace('"text2sql-tvcache"', f'"text2sql-readme-{uuid.uuid4().hex[:8]}"')
    namespace: dict[str, Any] = {
        "env_config": Text2SQLEnvConfig(db_path=str(tmp_path)),
        "extras": {"db_id": "db", "data": "synsql", "reward_spec": {"ground_truth": "SELECT 1"}},
        "trajectory_id": {"instance_id": "0", "repetition_id": 0},
    }
    exec(code, namespace)
    env = namespace["env"]
    env.init([{"role": "user", "content": "q"}])
    assert (
        "<observation>" in env.step("<think>t</think><sql>SELECT count(*) FROM t</sql>")["observations"][0]["content"]
    )
    env.close()
    namespace["cache"].close()
    assert (tmp_path / "tvcache-dir" / "journal.log").exists()


def test_tinker_snippet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tinker_cookbook.recipes.harbor_rl.harbor_tools", reason="the 'tinker' extra is not installed")
    import overlay_sandbox

    if not overlay_sandbox.overlay_available():
        pytest.skip("the local sandbox needs root")
    from tinker_cookbook.recipes.harbor_rl.harbor_tools import HarborReward

    task_dir = tmp_path / "task"
    (task_dir / "environment").mkdir(parents=True)
    (task_dir / "tests").mkdir()
    (task_dir / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    monkeypatch.chdir(tmp_path)
    body = textwrap.indent(snippet("tinker"), "    ")
    namespace: dict[str, Any] = {
        "default_sandbox_factory": overlay_sandbox.overlay_sandbox_factory,
        "HarborReward": HarborReward,
        "task_dir": task_dir,
        "history": [],
    }
    exec(f"async def main():\n{body}\n    return reward, sandbox_factory\n", namespace)
    reward, factory = asyncio.run(namespace["main"]())
    assert reward == 1.0
    factory.cache.close()


def test_verl_snippet(tmp_path: Path) -> None:
    pytest.importorskip("verl.experimental.agent_loop.tool_agent_loop", reason="the 'verl' extra is not installed")
    server_modules()
    import yaml
    from verl.tools.tool_registry import initialize_tools_from_config

    from tvcache.integrations.verl import CachedTool
    from tvcache.server import CacheService, ServerThread

    service = CacheService()
    with ServerThread(service) as server:
        text = snippet("verl").replace("my_tools.KVTool", "verl_kv_tool.KVTool")
        text = text.replace("http://127.0.0.1:8000", server.url)
        path = tmp_path / "tools.yaml"
        path.write_text(text)
        (tool,) = initialize_tools_from_config(str(path))
        assert isinstance(tool, CachedTool)
        assert yaml.safe_load(text)["tools"][0]["config"]["cache"] == server.url
    service.close()


# ---- agent harnesses: snippets of docs/harnesses.md (linked from the README)

HARNESSES = HERE.parent.parent / "docs" / "harnesses.md"


def harness_snippet(name: str) -> str:
    match = re.search(rf"<!-- snippet: {name} -->\n```\w+\n(.*?)```", HARNESSES.read_text(), re.S)
    assert match is not None, f"docs/harnesses.md has no snippet {name!r}"
    return match.group(1)


def run_snippet(code: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """Run a snippet as written; one with top-level ``await`` runs as the body of a coroutine."""
    if "await " not in code:
        exec(compile(code, "<snippet>", "exec"), namespace)
        return namespace
    body = textwrap.indent(code, "    ") + "\n    return locals()\n"
    exec(compile(f"async def __snippet__():\n{body}", "<snippet>", "exec"), namespace)
    return {**namespace, **asyncio.run(namespace["__snippet__"]())}


def test_harbor_snippet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip(
        "harbor", reason="the 'harbor' extra is not installed (Python >= 3.12): pip install 'tvcache[harbor]'"
    )
    from harbor_task import ENVIRONMENT, make_rootfs, make_task

    from tvcache.sandboxes.shell import linux

    if not linux.overlay_supported():
        pytest.skip("overlay shell sandboxes need root")
    code = harness_snippet("harbor").replace("/data/tvcache", str(tmp_path / "cache"))
    code = code.replace(
        '{"rootfs": rootfs}', '{"rootfs": rootfs, "environment": ENVIRONMENT}'
    )  # a tiny rootfs: no locales
    monkeypatch.chdir(tmp_path)  # trials land in ./trials
    names = {
        "rootfs": str(make_rootfs(tmp_path / "rootfs")),
        "task_dir": make_task(tmp_path),
        "ENVIRONMENT": ENVIRONMENT,
    }
    first = run_snippet(code, dict(names))
    second = run_snippet(code, dict(names))
    for ran in (first, second):
        assert ran["result"].exception_info is None
        assert ran["result"].verifier_result.rewards == {"reward": 1.0}
    assert first["trial"].agent_environment.session.stats.hits == 0
    assert second["trial"].agent_environment.session.stats.hits > 0


def test_mini_swe_agent_snippet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MSWEA_SILENT_STARTUP", "1")
    pytest.importorskip("minisweagent", reason="the 'mini-swe-agent' extra is not installed")
    from minisweagent.models.test_models import DeterministicModel, make_output

    code = harness_snippet("mini-swe-agent").replace("/data/tvcache", str(tmp_path / "cache"))
    (tmp_path / "repo").mkdir()
    commands = ["echo hi > a.txt", "cat a.txt", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat a.txt"]
    config = {
        "environment": {"environment_class": "local", "cwd": str(tmp_path / "repo")},
        "agent": {"system_template": "Solve it.", "instance_template": "{{task}}", "step_limit": 10},
    }
    runs = []
    for _ in range(2):
        model = DeterministicModel(outputs=[make_output("", [{"command": c}]) for c in commands])
        names = {"config": config, "model": model, "instance_id": "task-1", "task": "write a.txt"}
        runs.append(run_snippet(code, names))
    assert runs[0]["info"] == runs[1]["info"] == {"exit_status": "Submitted", "submission": "hi\n"}
    assert runs[0]["env"].session.stats.misses == 3
    assert runs[1]["env"].session.stats.misses == 0  # the first hit is checked; the rest hit


def test_swerex_snippet(tmp_path: Path) -> None:
    pytest.importorskip("swerex", reason="the 'swe-rex' extra is not installed: pip install 'tvcache[swe-rex]'")
    from swerex.deployment.local import LocalDeployment

    code = harness_snippet("swe-rex").replace("/data/tvcache", str(tmp_path / "cache"))
    started: list[int] = []

    class CountedDeployment(LocalDeployment):
        async def start(self) -> None:
            started.append(1)
            await super().start()

    runs = [run_snippet(code, {"new_deployment": CountedDeployment, "instance_id": "task-1"}) for _ in range(3)]
    # SWE-ReX's bash output varies in blank lines run to run (pexpect timing); the listing itself does not.
    outputs = [ran["observation"].output.split() for ran in runs]
    assert outputs[0] == outputs[1] == outputs[2]
    from tvcache.integrations._harness import shared_cache

    stats = shared_cache(str(tmp_path / "cache")).stats()  # type: ignore[attr-defined]
    if any(mark.task_id == "task-1" for mark in stats.nondeterministic):
        assert len(started) == 3  # the first-hit check caught output that varied: the rest ran uncached
    else:
        assert len(started) == 2  # the first run, and the second's first-hit check; the third hits throughout
