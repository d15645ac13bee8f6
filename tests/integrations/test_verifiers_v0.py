"""verifiers v0 (``vf.StatefulToolEnv``; verifiers 0.3.1, the last release with the v0 stack) with tvcache
sandboxes, through verifiers' own ``evaluate`` and ``run_group``.

The model is the one test double: ``ScriptedModel``, a local OpenAI-compatible HTTP server of our own that replays
scripted tool calls (verifiers' real OpenAI client talks to it over real HTTP). Everything else is real: the
environments, their rollout loop and rubric, tvcache's overlay shell sandboxes. The uncached reference is a plain
``vf.StatefulToolEnv`` that runs every command in a fresh sandbox of the same backend, no cache involved.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

vf = pytest.importorskip("verifiers", reason="the 'verifiers-v0' extra is not installed")
pytest.importorskip("verifiers.legacy", reason="this verifiers has no v0 stack: pip install 'tvcache[verifiers-v0]'")
datasets = pytest.importorskip("datasets")

from verifiers_scripted_model import FINAL_ANSWER, ScriptedModel  # noqa: E402

from tvcache import Cache, ToolCall  # noqa: E402
from tvcache.integrations.verifiers import RolloutSandbox, TVCacheSandboxEnv, row_task_id  # noqa: E402
from tvcache.sandboxes import ShellSandbox  # noqa: E402
from tvcache.sandboxes.shell import linux  # noqa: E402

SLOW = "sleep 0.3; "  # a command that takes time, so the time a hit saves shows
SCRIPTS = [
    [
        [("bash", {"command": "cat notes.txt"})],
        [("bash", {"command": SLOW + "echo step >> notes.txt"})],
        [("count_lines", {"path": "notes.txt"}), ("bash", {"command": "ls"})],
    ],
    [
        [("bash", {"command": "cat notes.txt"})],
        [("bash", {"command": SLOW + "echo step >> notes.txt"})],
        [("bash", {"command": "echo other >> notes.txt; cat notes.txt"})],
        [("count_lines", {"path": "notes.txt"})],
    ],
    [
        [("bash", {"command": "cat notes.txt"})],
        [("bash", {"command": "echo different > notes.txt; cat missing.txt"})],
        [("count_lines", {"path": "notes.txt"})],
    ],
]
ROWS = [("a", "alpha"), ("b", "beta\ngamma")]


async def count_lines(path: str, sandbox: RolloutSandbox) -> str:
    """Count the lines of a file in the sandbox.

    Args:
        path: the file to count
    """
    return (await sandbox.bash(f"wc -l < {path}")).strip()


def answer_reward(completion: Any, **_: Any) -> float:
    return 1.0 if completion and field(completion[-1], "content") == FINAL_ANSWER else 0.0


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trees")
    made = {}
    for name, text in ROWS:
        (root / name).mkdir()
        (root / name / "notes.txt").write_text(text + "\n")
        made[name] = root / name
    return made


@pytest.fixture(scope="module")
def factories(trees: dict[str, Path]) -> Iterator[dict[str, Any]]:
    if not linux.overlay_supported():
        pytest.skip("overlay shell sandboxes need root")
    made = {name: ShellSandbox.factory(tree) for name, tree in trees.items()}
    yield made
    for factory in made.values():
        factory.close()


def dataset() -> Any:
    rows = [
        {"prompt": [{"role": "user", "content": f"Look after the notes of tree {name}."}], "info": {"tree": name}}
        for name, _ in ROWS
    ]
    return datasets.Dataset.from_list(rows)


def client(model: ScriptedModel) -> Any:
    return vf.ClientConfig(api_base_url=model.base_url, api_key_var="TVCACHE_SCRIPTED_KEY", max_retries=0)


class UncachedShellEnv(vf.StatefulToolEnv):
    """The reference: the same tools, each command run directly in this rollout's own fresh sandbox."""

    def __init__(self, factories: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.factories = factories
        self.add_tool(self.bash, args_to_skip=["sandbox"])
        self.add_tool(count_lines, args_to_skip=["sandbox"])

    async def setup_state(self, state: Any, **kwargs: Any) -> Any:
        state["live"] = await self.factories[state["info"]["tree"]].start()
        return await super().setup_state(state, **kwargs)

    def update_tool_args(self, tool_name: str, tool_args: dict[str, Any], messages: Any, state: Any, **_: Any) -> Any:
        return {**tool_args, "sandbox": _Direct(state["live"])}

    async def bash(self, command: str, sandbox: Any) -> str:
        """Run a bash command in the task's sandbox and return its combined output.

        Args:
            command: the bash command to run
        """
        return await sandbox.bash(command) or "(no output)"

    @vf.cleanup
    async def stop_live(self, state: Any) -> None:
        await state["live"].stop()


class _Direct:
    def __init__(self, sandbox: Any) -> None:
        self.sandbox = sandbox

    async def bash(self, command: str) -> str:
        return str((await self.sandbox.execute(ToolCall("sh", {"cmd": command}))).output)


class RecordingEnv(TVCacheSandboxEnv):  # type: ignore[misc]
    """Keeps each rollout's sandbox handle, to check its session was closed with the rollout."""

    handles: list[RolloutSandbox] = []

    async def post_rollout(self, state: Any) -> None:
        self.handles.append(state["tvcache_sandbox"])


def make_env(factories: dict[str, Any], cache: Any) -> Any:
    return RecordingEnv(
        eval_dataset=dataset(),
        sandbox=lambda state: factories[state["info"]["tree"]],
        cache=cache,
        sandbox_tools=[count_lines],
        rubric=vf.Rubric(funcs=[answer_reward]),
        max_turns=10,
    )


def field(message: Any, name: str) -> Any:
    """A field of a message as verifiers hands it back (a dict, or one of its message models)."""
    return message[name] if isinstance(message, dict) else getattr(message, name)


def script_of(output: Any) -> int:
    first = next(m for m in output["completion"] if field(m, "role") == "assistant")
    call = field(first, "tool_calls")[0]
    call_id = json.loads(call)["id"] if isinstance(call, str) else field(call, "id")
    return int(call_id.split("-")[1])


def tool_results(output: Any) -> list[str]:
    return [field(m, "content") for m in output["completion"] if field(m, "role") == "tool"]


def by_rollout(outputs: list[Any]) -> dict[tuple[int, int], list[str]]:
    return {(o["example_id"], script_of(o)): tool_results(o) for o in outputs}


def test_groups_of_divergent_rollouts_hit_on_the_second_epoch_and_match_the_uncached_env(
    factories: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TVCACHE_SCRIPTED_KEY", "scripted")
    with ScriptedModel(SCRIPTS) as model:
        reference_env = UncachedShellEnv(factories, eval_dataset=dataset(), rubric=vf.Rubric(funcs=[answer_reward]))
        reference = asyncio.run(reference_env.evaluate(client(model), "scripted", rollouts_per_example=len(SCRIPTS)))
        expected = by_rollout(reference["outputs"])
        assert len(expected) == len(ROWS) * len(SCRIPTS)

        cache = Cache()
        env = make_env(factories, cache)
        # Epoch 1 through evaluate (one group per dataset row, its rollouts concurrent).
        first = asyncio.run(env.evaluate(client(model), "scripted", rollouts_per_example=len(SCRIPTS)))
        after_first = cache.stats()
        # Epoch 2 through run_group, group by group, as a trainer (prime-rl) drives it.
        inputs = env._get_eval_inputs(rollouts_per_example=len(SCRIPTS))

        async def second_epoch() -> list[Any]:
            outputs = []
            for example in range(len(ROWS)):
                group = [row for row in inputs if row["example_id"] == example]
                outputs += await env.run_group(group, client(model), "scripted", {})
            return outputs

        second = asyncio.run(second_epoch())
        after_second = cache.stats()

    for outputs in (first["outputs"], second):
        assert by_rollout(outputs) == expected  # every tool result equals the uncached run's
        assert all(o["reward"] == 1.0 for o in outputs)
    assert expected[(0, 0)][0] == "alpha\n"
    assert expected[(1, 0)][0] == "beta\ngamma\n"
    assert "[exit code 1]" in expected[(0, 2)][1]  # a failing command's answer is served as it was
    assert after_first.hits > 0  # siblings share the group's calls within the epoch
    assert after_second.misses == after_first.misses  # the second epoch executed nothing new
    assert after_second.hits > after_first.hits
    assert all(handle.session.closed for handle in RecordingEnv.handles)
    assert len(RecordingEnv.handles) == 2 * len(expected)
    saved = after_second.seconds_saved - after_first.seconds_saved
    print(
        f"\nverifiers v0: epoch 1 hits={after_first.hits} misses={after_first.misses}; epoch 2 "
        f"hits={after_second.hits - after_first.hits} misses={after_second.misses - after_first.misses}; "
        f"tool time saved: epoch 1 {after_first.seconds_saved:.2f} s, epoch 2 {saved:.2f} s "
        f"(executed {after_second.seconds_executed:.2f} s in all)"
    )


def test_a_persistent_shell_keeps_the_rollouts_shell_state_and_hits(
    trees: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    if not linux.overlay_supported():
        pytest.skip("overlay shell sandboxes need root")
    monkeypatch.setenv("TVCACHE_SCRIPTED_KEY", "scripted")
    scripts = [
        [[("bash", {"command": "mkdir -p sub && cd sub && export MARK=1"})], [("bash", {"command": "pwd; echo $MARK"})]]
    ]
    shell = ShellSandbox.factory(trees["a"], persistent=True)
    try:
        cache = Cache()
        env = TVCacheSandboxEnv(
            eval_dataset=datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "go"}]}]),
            sandbox=shell,
            cache=cache,
            rubric=vf.Rubric(funcs=[answer_reward]),
        )
        with ScriptedModel(scripts) as model:
            runs = [asyncio.run(env.evaluate(client(model), "scripted", rollouts_per_example=2)) for _ in range(2)]
    finally:
        shell.close()
    results = [tool_results(o) for run in runs for o in run["outputs"]]
    assert results == [["(no output)", f"{trees['a']}/sub\n1\n"]] * 4
    assert cache.stats().misses == 2
    assert cache.stats().hits == 6


def test_the_task_is_the_dataset_row_shared_by_its_siblings_and_epochs() -> None:
    def state(example_id: int, prompt: str) -> dict[str, Any]:
        return {"input": {"example_id": example_id, "prompt": [{"role": "user", "content": prompt}], "info": {}}}

    assert row_task_id("env", state(0, "p")) == row_task_id("env", state(0, "p"))
    assert row_task_id("env", state(0, "p")) != row_task_id("env", state(1, "p"))
    assert row_task_id("env", state(0, "p")) != row_task_id("env", state(0, "changed"))
    assert row_task_id("env", state(0, "p")).startswith("verifiers:env:0:")


def test_a_sandbox_tool_needs_the_hidden_sandbox_parameter(factories: dict[str, Any]) -> None:
    def no_sandbox(path: str) -> str:
        return path

    with pytest.raises(TypeError, match="needs a 'sandbox' parameter"):
        TVCacheSandboxEnv(eval_dataset=dataset(), sandbox=factories["a"], sandbox_tools=[no_sandbox])
    env = TVCacheSandboxEnv(eval_dataset=dataset(), sandbox=factories["a"], sandbox_tools=[count_lines])
    shown = {tool.name: json.dumps(tool.parameters) for tool in env.tool_defs}
    assert set(shown) == {"bash", "count_lines"}
    assert all("sandbox" not in schema for schema in shown.values())  # hidden from the model
