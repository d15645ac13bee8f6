"""TRL: GRPOTrainer with ``environment_factory=CachingEnvironment.factory(...)``, through TRL's own code path — its
discovery of the environment's public methods as tools, its pool of instances reset per rollout, its tool loop and
its rewards — for two epochs of real training steps on CPU, against the same run with a plain, uncached TRL
environment over the same sandboxes.

The model is a real tiny Qwen3 built from a config, with a tokenizer built here (``trl_tiny``); only its sampling
is scripted (a test double for a GPU model: a random tiny model writes no tool calls). The sandboxes are real
overlay shell sandboxes (one-shot, and persistent shells), so the tests need root.
"""

from __future__ import annotations

import itertools
import os
import shlex
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the 'trl' extra is not installed (trl needs torch): pip install 'tvcache[trl]'")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import PrinterCallback, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl_tiny import Plan, scripted_policy, tiny_tokenizer  # noqa: E402

from tvcache import Cache, InvalidInput, SessionClosed, ToolCall  # noqa: E402
from tvcache.integrations.background_loop import shared_loop  # noqa: E402
from tvcache.integrations.trl import CachingEnvironment, CachingEnvironmentFactory  # noqa: E402
from tvcache.sandboxes import ShellSandboxFactory  # noqa: E402
from tvcache.sandboxes.shell import linux  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not linux.overlay_supported(), reason="overlay shell sandboxes need root"),
    pytest.mark.filterwarnings("ignore:.*is deprecated and will be removed in v6:FutureWarning"),  # TRL's own calls
]

CHECKS = {
    "notes": "grep -qx done notes.txt && echo pass || echo fail",
    "numbers": "cmp -s sorted <(sort -n nums.txt) && echo pass || echo fail",
}


def bash(command: str) -> tuple[str, dict[str, Any]]:
    return "bash", {"command": command}


def read(path: str) -> tuple[str, dict[str, Any]]:
    return "read_file", {"path": path}


# Three divergent plans per task (num_generations = 3): they share prefixes, so siblings hit each other's calls.
SCRIPTS: dict[str, list[Plan]] = {
    "notes": [
        [[bash("cat notes.txt")], [bash("echo beta >> notes.txt")], [read("notes.txt")]],
        [[bash("cat notes.txt")], [bash("echo done >> notes.txt")], [bash("cat notes.txt"), bash("wc -l notes.txt")]],
        [[bash("cat notes.txt")], [bash("echo done >> notes.txt")], [read("notes.txt")]],
    ],
    "numbers": [
        [[bash("sort -n nums.txt")], [bash("sort -n nums.txt > sorted && touch sorted")], [read("sorted")]],
        [[bash("sort -n nums.txt")], [bash("sort -r nums.txt")]],
        [[bash("sort -n nums.txt"), read("nums.txt")], [bash("sort -n nums.txt > sorted; cat sorted; pwd")]],
    ],
}


class TaskEnvironment(CachingEnvironment):
    """The adapter as a user subclasses it: a tool of its own, a sandbox per task, an observation, a reward."""

    def __init__(self, *, sandboxes: Mapping[str, ShellSandboxFactory], **settings: Any) -> None:
        super().__init__(**settings)
        self._sandboxes = sandboxes
        self._check_command = ""

    def reset(self, **row: Any) -> str | None:
        super().reset(**row)
        self._check_command = row["check"]
        return "\nFiles: " + self._shell("ls")

    def read_file(self, path: str) -> str:
        """Read a file of the task's directory.

        Args:
            path: The file's path, relative to the task's directory.
        """
        return self._shell(f"cat -- {shlex.quote(path)}")

    def get_reward(self) -> float:
        verdict = self._check(self._check_command)
        REWARDS.append(verdict)
        return 1.0 if verdict == "pass\n" else 0.0

    def _sandbox_for(self, row: Mapping[str, Any]) -> ShellSandboxFactory:
        return self._sandboxes[row["task_id"]]


class PlainEnvironment:
    """The uncached reference: a TRL environment as one is written without tvcache, over the same sandboxes (a
    fresh one per rollout, stopped at the next reset)."""

    sandboxes: Mapping[str, ShellSandboxFactory] = {}
    seconds = 0.0  # tool time, over all instances

    def __init__(self) -> None:
        self._sandbox: Any = None
        self._check_command = ""

    def reset(self, **row: Any) -> str | None:
        if self._sandbox is not None:
            shared_loop().run(self._sandbox.stop())
        self._sandbox = shared_loop().run(self.sandboxes[row["task_id"]].start())
        self._check_command = row["check"]
        return "\nFiles: " + self._run("ls")

    def bash(self, command: str) -> str:
        """Run a bash command in the task's sandbox and return its output (stdout and stderr).

        Args:
            command: The bash command to run.
        """
        return self._run(command)

    def read_file(self, path: str) -> str:
        """Read a file of the task's directory.

        Args:
            path: The file's path, relative to the task's directory.
        """
        return self._run(f"cat -- {shlex.quote(path)}")

    def get_reward(self) -> float:
        verdict = self._run(self._check_command)
        REWARDS.append(verdict)
        return 1.0 if verdict == "pass\n" else 0.0

    def _run(self, command: str) -> str:
        began = time.perf_counter()
        output: str = shared_loop().run(self._sandbox.execute(ToolCall("sh", {"cmd": command}))).output
        PlainEnvironment.seconds += time.perf_counter() - began
        return output

    def _stop(self) -> None:
        if self._sandbox is not None:
            shared_loop().run(self._sandbox.stop())
            self._sandbox = None


REWARDS: list[str] = []  # every get_reward's verdict, in order
TRANSCRIPTS: list[tuple[int, str, tuple[Any, ...]]] = []  # (step, task, the rollout's calls and tool messages)


def record(completions: list[list[dict[str, Any]]], task_id: list[str], trainer_state: Any, **_: Any) -> list[float]:
    """A reward function that scores nothing: it records each rollout's conversation as TRL built it."""
    for task, messages in zip(task_id, completions, strict=True):
        turns = tuple((m["role"], m.get("content"), _calls(m)) for m in messages)
        TRANSCRIPTS.append((trainer_state.global_step, task, turns))
    return [0.0] * len(completions)


def _calls(message: dict[str, Any]) -> tuple[Any, ...]:
    calls = message.get("tool_calls") or ()
    return tuple((c["function"]["name"], tuple(sorted(c["function"]["arguments"].items()))) for c in calls)


def tool_results(transcripts: list[tuple[int, str, tuple[Any, ...]]]) -> dict[tuple[Any, ...], list[Any]]:
    """Each rollout's tool messages, by (step, task, the plan its first message names)."""
    by_rollout: dict[tuple[Any, ...], list[Any]] = {}
    for step, task, turns in transcripts:
        key = (step, task, turns[0][1])
        assert key not in by_rollout
        by_rollout[key] = [content for role, content, _ in turns if role == "tool"]
    return by_rollout


class CacheCounts(TrainerCallback):  # type: ignore[misc]
    """The cache's counters at the end of each training step."""

    def __init__(self, cache: Cache) -> None:
        self.cache = cache
        self.steps: list[Any] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.append(self.cache.stats())


@pytest.fixture(params=[False, True], ids=["one-shot", "persistent"])
def sandboxes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, ShellSandboxFactory]]:
    notes, numbers = tmp_path / "notes", tmp_path / "numbers"
    notes.mkdir()
    numbers.mkdir()
    (notes / "notes.txt").write_text("alpha\n")
    (numbers / "nums.txt").write_text("3\n1\n2\n")
    factories = {
        "notes": ShellSandboxFactory(notes, persistent=request.param),
        "numbers": ShellSandboxFactory(numbers, persistent=request.param),
    }
    yield factories
    for factory in factories.values():
        factory.close()


def dataset() -> Dataset:
    rows = [
        {"prompt": [{"role": "user", "content": f"[task {task}] Work in the directory."}], "task_id": task,
         "check": CHECKS[task]}
        for task in SCRIPTS
    ]  # fmt: skip
    return Dataset.from_list(rows)


def train(environment_factory: Any, tmp_path: Path, callbacks: list[Any]) -> tuple[GRPOTrainer, Any, Any]:
    """Two epochs (two steps: 2 tasks x 3 rollouts each) of GRPO on CPU; returns the trainer, the policy, and its
    parameters from before training."""
    tokenizer = tiny_tokenizer()
    policy = scripted_policy(tokenizer, SCRIPTS)
    before = [p.detach().clone() for p in policy.parameters()]
    args = GRPOConfig(
        output_dir=str(tmp_path / "grpo"), use_cpu=True, per_device_train_batch_size=6, num_generations=3,
        num_train_epochs=2, max_completion_length=1024, learning_rate=1e-2, logging_steps=1, save_strategy="no",
        report_to=[], seed=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=policy, reward_funcs=record, args=args, train_dataset=dataset(), processing_class=tokenizer,
        environment_factory=environment_factory, callbacks=callbacks,
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # its log lines would drown the figures printed
    trainer.train()
    return trainer, policy, before


def test_grpo_two_epochs_with_cached_environments_match_plain_environments(
    sandboxes: dict[str, ShellSandboxFactory], tmp_path: Path
) -> None:
    flavour = "persistent" if sandboxes["notes"].persistent else "one-shot"
    # The plain run first: the reference.
    TRANSCRIPTS.clear()
    REWARDS.clear()
    PlainEnvironment.sandboxes, PlainEnvironment.seconds = sandboxes, 0.0
    plain_instances: list[PlainEnvironment] = []

    def plain_factory() -> PlainEnvironment:
        plain_instances.append(PlainEnvironment())
        return plain_instances[-1]

    _, plain_policy, _ = train(plain_factory, tmp_path / "plain", [])
    for instance in plain_instances:
        instance._stop()
    expected, expected_rewards = list(TRANSCRIPTS), list(REWARDS)
    assert len(expected) == 12  # 2 steps x 2 tasks x 3 rollouts
    assert Counter(expected_rewards) == {"pass\n": 8, "fail\n": 4}  # plans 1 and 2 of notes, 0 and 2 of numbers

    TRANSCRIPTS.clear()
    REWARDS.clear()
    cache = Cache()
    counts = CacheCounts(cache)
    environments = TaskEnvironment.factory(cache=cache, sandbox=sandboxes["notes"], sandboxes=sandboxes)
    assert isinstance(environments, CachingEnvironmentFactory)
    trainer, policy, before = train(environments, tmp_path / "cached", [counts])

    # TRL's discovery: the public methods are the tools (not reset, get_reward, properties or classmethods), and
    # their schemas were rendered into the prompts.
    assert sorted(tool.__name__ for tool in trainer.tools) == ["bash", "read_file"]
    assert '"name": "bash"' in policy.contexts[0]
    assert '"name": "read_file"' in policy.contexts[0]
    # TRL's pool: six instances (one per rollout of a batch), each reset for a rollout of each step.
    assert [instance.rollouts for instance in environments.environments] == [2] * 6

    # Every tool result and verdict equals the plain run's, rollout for rollout (a rollout is named by its step,
    # task and plan, which its first message states).
    plain = tool_results(expected)
    cached = tool_results(TRANSCRIPTS)
    assert cached.keys() == plain.keys()
    tool_messages = sum(len(results) for results in plain.values())
    differing = sum(a != b for key in plain for a, b in itertools.zip_longest(plain[key], cached[key]))
    assert differing == 0
    assert Counter(REWARDS) == Counter(expected_rewards)
    # ... and so does every context the policy continued: prompts, reset's observations, tool schemas, tool results.
    assert Counter(policy.contexts) == Counter(plain_policy.contexts)

    first, second = counts.steps
    assert first.hits > 0  # siblings share their prefixes
    assert second.hits - first.hits > 0
    assert second.misses == first.misses  # the second epoch ran nothing new
    assert second.sandboxes_started == first.sandboxes_started  # nor started a sandbox

    # A real training step: the environment's rewards differ within a group, so the policy's weights moved.
    grad_norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    assert len(grad_norms) == 2
    assert any(float(norm) > 0 for norm in grad_norms)
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, policy.parameters(), strict=True))

    environments.close()
    assert all(instance.session is None for instance in environments.environments)
    stats = cache.stats()
    print(
        f"\ntrl ({flavour} shell sandboxes): {len(TRANSCRIPTS)} rollouts, {differing} of {tool_messages} tool "
        f"results differing from the plain run (and every context and verdict the same); "
        f"epoch 1: {first.hits} hits / {first.misses} misses, epoch 2: {second.hits - first.hits} hits / "
        f"{second.misses - first.misses} misses; sandboxes started {stats.sandboxes_started}, forked "
        f"{stats.sandboxes_forked}; tool time: plain run {PlainEnvironment.seconds:.3f} s, cached run executed "
        f"{stats.seconds_executed:.3f} s, saved {stats.seconds_saved:.3f} s; grad norms {grad_norms}"
    )
    cache.close()


# ---- the adapter's own contract, outside a trainer


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[ShellSandboxFactory]:
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "a.txt").write_text("a\n")
    factory = ShellSandboxFactory(tmp_path / "tree")
    yield factory
    factory.close()


def test_task_ids_come_from_the_row(folder: ShellSandboxFactory) -> None:
    cache = Cache()
    environment = CachingEnvironment(cache=cache, sandbox=folder)
    prompt = [{"role": "user", "content": "hi"}]
    environment.reset(prompt=prompt, task_id="t-1")
    assert environment.session is not None
    assert environment.session.task_id == "t-1"

    environment.reset(prompt=prompt)  # no task_id column: a digest of the whole row, stable and distinct
    assert environment.session.task_id.startswith("trl:")
    digest = environment.session.task_id
    environment.reset(prompt=prompt)
    assert environment.session.task_id == digest
    environment.reset(prompt=prompt, level=2)
    assert environment.session.task_id != digest

    by_instance = CachingEnvironment(cache=cache, sandbox=folder, task_key="instance_id")
    by_instance.reset(prompt=prompt, instance_id="django-1", task_id="ignored")
    assert by_instance.session is not None
    assert by_instance.session.task_id == "django-1"
    with pytest.raises(InvalidInput, match="instance_id"):
        by_instance.reset(prompt=prompt, image=object())
    environment._end_rollout()
    by_instance._end_rollout()
    cache.close()


def test_reset_closes_the_previous_rollout_and_tools_need_one(folder: ShellSandboxFactory) -> None:
    cache = Cache()
    environment = CachingEnvironment(cache=cache, sandbox=folder)
    with pytest.raises(SessionClosed, match="reset"):
        environment.bash("ls")
    environment.reset(task_id="t")
    first = environment.session
    assert environment.bash("cat a.txt; echo b >> a.txt") == "a\n"
    environment.reset(task_id="t")
    assert first is not None
    assert first.closed
    assert environment.bash("cat a.txt; echo b >> a.txt") == "a\n"  # a hit, in the task's initial state
    assert environment.session is not None
    assert environment.session.stats.hits == 1
    assert environment.bash("cat a.txt") == "a\nb\n"
    environment._end_rollout()
    cache.close()


def test_a_subclass_tool_through_an_opened_cache(folder: ShellSandboxFactory, tmp_path: Path) -> None:
    class Files(CachingEnvironment):
        def size(self, path: str) -> str:
            """The size of a file in bytes.

            Args:
                path: The file.
            """
            return self._shell(f"wc -c < {shlex.quote(path)}")

    for round in range(2):
        environments = Files.factory(cache=tmp_path / "cache", sandbox=folder)
        environment = environments()
        environment.reset(task_id="t")
        assert environment.size("a.txt") == "2\n"
        assert environment.bash("echo x > b.txt; ls") == "a.txt\nb.txt\n"
        assert environment.session is not None
        assert environment.session.stats.hits == (2 if round else 0)  # durable: the second process-alike hits
        environments.close()
        assert environment.session is None
