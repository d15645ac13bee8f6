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
    """Run a snippet as written; one with top-level ``await`` (on a line of its own, not in a def) runs as the body
    of a coroutine."""
    if not re.search(r"^\S.*\bawait\b", code, re.M):
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


@pytest.mark.filterwarnings("ignore:.*is deprecated and will be removed in v6:FutureWarning")  # TRL's own calls
def test_trl_snippet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("trl", reason="the 'trl' extra is not installed: pip install 'tvcache[trl]'")
    from tvcache.sandboxes.shell import linux

    if not linux.overlay_supported():
        pytest.skip("overlay shell sandboxes need root")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOConfig
    from trl_tiny import scripted_policy, tiny_tokenizer

    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "README").write_text("hello\n")
    code = harness_snippet("trl").replace("/data/tvcache", str(tmp_path / "cache"))
    code = code.replace("trainer.train()", "trainer.remove_callback(PrinterCallback)\ntrainer.train()")  # quiet
    plans = [[[("bash", {"command": "ls"})], [("read_file", {"path": "README"})]], [[("bash", {"command": "ls"})]]]
    runs = []
    for run in range(2):  # two processes-alike over one durable cache
        tokenizer = tiny_tokenizer()
        names = {
            "PrinterCallback": PrinterCallback,
            "checkout": checkout,
            "model": scripted_policy(tokenizer, {"repo": plans}),
            "tokenizer": tokenizer,
            "reward": lambda completions, **_: [float(len(c)) for c in completions],
            "dataset": Dataset.from_list(
                [{"prompt": [{"role": "user", "content": "[task repo] Read it."}], "task_id": "repo"}]
            ),  # fmt: skip
            "args": GRPOConfig(
                output_dir=str(tmp_path / f"out-{run}"),
                use_cpu=True,
                per_device_train_batch_size=2,
                num_generations=2,
                max_steps=1,
                max_completion_length=512,
                report_to=[],
                save_strategy="no",
                disable_tqdm=True,
            ),  # fmt: skip
        }
        ran = run_snippet(code, names)
        ran["shell"].close()
        runs.append(ran)
    assert sorted(tool.__name__ for tool in runs[0]["trainer"].tools) == ["bash", "read_file"]
    assert [ran["trainer"].state.global_step for ran in runs] == [1, 1]
    contexts = [ran["model"].contexts for ran in runs]
    assert contexts[0] == contexts[1]
    assert any("hello" in context for context in contexts[0])  # read_file's result reached the policy
    stats = [ran["environments"].cache.stats() for ran in runs]
    assert (stats[0].hits, stats[1].misses) == (1, 0)  # the sibling's ls; then the second run hits throughout
    assert stats[1].hits == stats[0].hits + stats[0].misses


def test_openhands_snippet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM would fetch its price list at import
    monkeypatch.setenv("OPENHANDS_SUPPRESS_BANNER", "1")
    pytest.importorskip(
        "openhands.sdk", reason="the 'openhands' extra is not installed: pip install 'tvcache[openhands]'"
    )
    import json
    import subprocess

    from openhands.sdk.llm import Message, MessageToolCall, TextContent
    from openhands.sdk.testing import TestLLM  # the SDK's own scripted LLM: the one test double here

    from tvcache.sandboxes.shell import linux

    if not linux.overlay_supported():
        pytest.skip("persistent shell sandboxes need root")
    checkout = tmp_path / "checkout"
    (checkout / "src").mkdir(parents=True)
    (checkout / "src" / "app.py").write_text("print('hi')\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    for command in (["git", "init", "-q"], [*git, "add", "."], [*git, "commit", "-qm", "start"]):
        subprocess.run(command, cwd=checkout, check=True)

    def step(index: int, name: str, **arguments: Any) -> Message:
        call = MessageToolCall(id=f"c{index}", name=name, arguments=json.dumps(arguments), origin="completion")
        return Message(role="assistant", content=[TextContent(text="")], tool_calls=[call])

    code = harness_snippet("openhands").replace("/data/tvcache", str(tmp_path / "cache"))
    runs = []
    for _ in range(2):
        script = [
            step(0, "workspace_command", command="sed -i 's/hi/hello/' src/app.py && cat src/app.py"),
            step(1, "finish", message="done"),
        ]
        names = {
            "checkout": checkout,
            "instance_id": "app-1",
            "task": "Say hello.",
            "llm": TestLLM.from_messages(script),
        }
        ran = run_snippet(code, names)
        ran["shell"].close()
        runs.append(ran)
    assert [(ran["patch"].original, ran["patch"].modified) for ran in runs] == [("print('hi')", "print('hello')")] * 2
    first, second = (ran["workspace"].session.stats for ran in runs)
    assert (first.hits, first.misses) == (0, 2)
    # execute_command's first hit in the task is checked by running it once more (its determinism is undeclared)
    assert (second.hits, second.verified, second.misses) == (1, 1, 0)
    assert (checkout / "src" / "app.py").read_text() == "print('hi')\n"  # the checkout itself never changes


def test_nemo_gym_snippet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("nemo_gym", reason="the 'nemo-gym' extra is not installed: pip install 'tvcache[nemo-gym]'")
    from fastapi.testclient import TestClient
    from nemo_gym.base_resources_server import BaseResourcesServerConfig
    from nemo_gym.server_utils import BaseServerConfig, ServerClient
    from omegaconf import OmegaConf

    from tvcache.sandboxes.shell import linux

    if not linux.overlay_supported():
        pytest.skip("persistent shell sandboxes need root")
    monkeypatch.setenv("NEMO_GYM_CONFIG_DICT", "{}")  # what NeMo-Gym gives a server process it starts
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "notes.txt").write_text("one\n")
    code = harness_snippet("nemo-gym").replace("/data/tvcache", str(tmp_path / "cache"))
    ran = run_snippet(code, {"repo": repo})
    client = ServerClient(
        head_server_config=BaseServerConfig(host="127.0.0.1", port=1), global_config_dict=OmegaConf.create({})
    )
    server = ran["ShellServer"](
        config=BaseResourcesServerConfig(host="127.0.0.1", port=0, entrypoint="", name="shell"), server_client=client
    )
    app = server.setup_webserver()
    row = {"responses_create_params": {"input": "Add two."}, "task_id": "notes"}
    response = {
        "id": "r", "created_at": 0.0, "model": "m", "object": "response", "output": [],
        "parallel_tool_calls": False, "tool_choice": "auto", "tools": [],
    }  # fmt: skip
    outputs = []
    for _ in range(2):  # two rollouts of the task, each with its own session cookie
        with TestClient(app) as rollout:
            seeded = rollout.post("/seed_session", json=row)
            assert seeded.status_code == 200, seeded.text
            outputs.append(
                rollout.post("/run_command", json={"command": "echo two >> notes.txt; cat notes.txt"}).json()
            )
            assert rollout.post("/verify", json={**row, "response": response}).json()["reward"] == 1.0
    assert outputs == [{"output": "one\ntwo\n", "is_error": False}] * 2
    first, second = ran["rollouts"].finished
    assert (first.misses, second.hits, second.misses) == (1, 1, 0)
    ran["rollouts"].sandbox.close()


def test_verifiers_v0_snippet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    vf = pytest.importorskip("verifiers", reason="the 'verifiers-v0' extra is not installed")
    pytest.importorskip(
        "verifiers.legacy", reason="this verifiers has no v0 stack: pip install 'tvcache[verifiers-v0]'"
    )
    datasets = pytest.importorskip("datasets")
    from verifiers_scripted_model import FINAL_ANSWER, ScriptedModel

    from tvcache.sandboxes.shell import linux

    if not linux.overlay_supported():
        pytest.skip("overlay shell sandboxes need root")
    (tmp_path / "checkout").mkdir()
    (tmp_path / "checkout" / "README").write_text("hello\n")
    monkeypatch.setenv("TVCACHE_SCRIPTED_KEY", "scripted")
    code = harness_snippet("verifiers-v0").replace("/data/tvcache", str(tmp_path / "cache"))
    rows = [{"prompt": [{"role": "user", "content": "Read the README."}]}]
    runs = []
    with ScriptedModel([[[("bash", {"command": "cat README"})]]]) as model:
        for _ in range(2):
            names = {
                "dataset": datasets.Dataset.from_list(rows),
                "rubric": vf.Rubric(funcs=[lambda completion, **_: 1.0]),
                "checkout": tmp_path / "checkout",
                "client": vf.ClientConfig(api_base_url=model.base_url, api_key_var="TVCACHE_SCRIPTED_KEY"),
                "model": "scripted",
            }
            runs.append(run_snippet(code, names))

    def field(message: Any, name: str) -> Any:  # verifiers hands messages back as dicts or as its models
        return message[name] if isinstance(message, dict) else getattr(message, name)

    for ran in runs:
        completions = [output["completion"] for output in ran["results"]["outputs"]]
        assert len(completions) == 4
        for completion in completions:
            assert [field(m, "content") for m in completion if field(m, "role") == "tool"] == ["hello\n"]
            assert field(completion[-1], "content") == FINAL_ANSWER
    stats = runs[1]["env"].tvcache.stats()
    assert stats.misses == 1  # one execution for both runs' eight rollouts
    assert stats.hits == 7


def test_verifiers_v1_snippet(monkeypatch: pytest.MonkeyPatch) -> None:
    vf = pytest.importorskip("verifiers.v1", reason="the 'verifiers' extra is not installed")
    if not hasattr(vf, "Toolset"):
        pytest.skip("this verifiers has no v1 Toolset (verifiers >= 0.4 has)")
    server_modules()
    import types

    from verifiers_scripted_model import ScriptedModel
    from verifiers_v1_rollouts import make_env, prepare, run_epoch, tool_results

    from tvcache.server import CacheService, ServerThread

    prepare(monkeypatch)
    service = CacheService()
    scripts = [[[("notes_write", {"name": "a", "text": "x"})], [("notes_read", {"name": "a"})]]]
    with ServerThread(service) as server, ScriptedModel(scripts) as model:
        code = harness_snippet("verifiers").replace("my_tools:NotesToolset", "verifiers_notes_toolset:NotesToolset")
        ran = run_snippet(code.replace("http://127.0.0.1:8000", server.url), {})
        task_class = ran["NotesTask"]

        class SnippetTaskset(vf.Taskset[task_class, vf.TasksetConfig]):  # type: ignore[valid-type, misc]
            def load(self) -> list[Any]:
                return [task_class(vf.TaskData(id="snippet", prompt="Keep notes."))]

        module = types.ModuleType("verifiers_snippet_taskset")
        module.SnippetTaskset = SnippetTaskset  # type: ignore[attr-defined]
        module.__all__ = ["SnippetTaskset"]  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, module.__name__, module)
        env = make_env({"id": module.__name__})
        epochs = [[tool_results(episode) for episode in run_epoch(env, model.base_url, 2)] for _ in range(2)]
        stats = service.stats()
    service.close()
    expected = (0, [("call-0-0-0", "wrote a (1 notes)"), ("call-0-1-0", "x")])
    assert epochs == [[expected, expected]] * 2
    assert stats["hits"] > 0
