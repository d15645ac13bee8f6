"""OpenHands SDK: rollouts through its own agent loop (``Conversation`` running an ``Agent``) on a
``CachingWorkspace``, compared with the same rollouts on the SDK's own ``LocalWorkspace``.

The LLM is a test double: the SDK's own ``openhands.sdk.testing.TestLLM``, replaying scripted tool calls (there is
no model here). Everything else is real: the SDK's conversation, agent, tool dispatch and event log; a git
repository; tvcache's persistent shell sandboxes on overlayfs (root).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM would fetch its price list at import
os.environ.setdefault("OPENHANDS_SUPPRESS_BANNER", "1")
pytest.importorskip("openhands.sdk", reason="the 'openhands' extra is not installed: pip install 'tvcache[openhands]'")

from openhands.sdk import Agent, Conversation, Tool  # noqa: E402
from openhands.sdk.event import ObservationEvent  # noqa: E402
from openhands.sdk.llm import Message, MessageToolCall, TextContent  # noqa: E402
from openhands.sdk.testing import TestLLM  # noqa: E402
from openhands.sdk.workspace import LocalWorkspace  # noqa: E402

from tvcache import AlwaysSnapshot, Cache, SandboxError  # noqa: E402
from tvcache.integrations.openhands import CachingWorkspace, sdk_paths  # noqa: E402
from tvcache.sandboxes import ShellSandbox  # noqa: E402
from tvcache.sandboxes.shell.linux import overlay_supported  # noqa: E402

pytestmark = pytest.mark.skipif(not overlay_supported(), reason="persistent shell sandboxes need overlay mounts (root)")

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]


@pytest.fixture
def template(tmp_path: Path) -> Path:
    """The task's tree: a git repository with one commit (copied to the same path for every uncached run)."""
    repo = tmp_path / "template"
    (repo / "src").mkdir(parents=True)
    (repo / "notes.txt").write_text("one\n")
    (repo / "src" / "app.py").write_text("print('hi')\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run([*GIT, "add", "."], cwd=repo, check=True)
    subprocess.run([*GIT, "commit", "-qm", "start"], cwd=repo, check=True)
    return repo


def lay(template: Path, work: Path) -> Path:
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(template, work, symlinks=True)
    return work


@pytest.fixture
def upload(tmp_path: Path) -> Path:
    """A file the harness uploads before the agent runs, with fixed times (what lands in the tree is keyed)."""
    path = tmp_path / "patch.txt"
    path.write_text("patched\n")
    os.utime(path, (1_700_000_000, 1_700_000_000))
    return path


def commands(greeting: str) -> list[str]:
    """What the scripted model does: read, diverge on the greeting, build, fail, then read again."""
    return [
        "cat notes.txt; git status --short",
        f"echo {greeting} >> notes.txt && sed -i 's/hi/{greeting}/' src/app.py",
        "mkdir -p build && (cd build && echo built > out.txt) && ls build; cat patch.txt",
        "cat notes.txt; echo to stderr >&2; exit 3",
    ]


def scripted_llm(greeting: str) -> TestLLM:
    def call(index: int, name: str, **arguments: Any) -> Message:
        tool_call = MessageToolCall(id=f"c{index}", name=name, arguments=json.dumps(arguments), origin="completion")
        return Message(role="assistant", content=[TextContent(text="")], tool_calls=[tool_call])

    steps = [call(i, "workspace_command", command=command) for i, command in enumerate(commands(greeting))]
    return TestLLM.from_messages([*steps, call(len(steps), "finish", message=f"said {greeting}")])


def rollout(workspace: Any, greeting: str, root: Path, upload: Path, downloads: Path) -> list[Any]:
    """One rollout as a harness runs it: upload, the agent loop, then the patch and a check read back."""
    shutil.rmtree(downloads, ignore_errors=True)
    seen: list[Any] = [workspace.file_upload(upload, root / "patch.txt")]
    agent = Agent(llm=scripted_llm(greeting), tools=[Tool(name="WorkspaceCommandTool")])
    conversation = Conversation(agent=agent, workspace=workspace, visualizer=None)
    conversation.send_message(f"Add {greeting!r} to notes.txt and src/app.py.")
    conversation.run()
    seen += [event.observation.model_dump(mode="json") for event in conversation.state.events if _observed(event)]
    seen.append(workspace.git_changes(""))
    seen.append(workspace.git_diff("src/app.py"))
    seen.append(workspace.file_download(root / "notes.txt", downloads / "notes.txt"))
    seen.append((downloads / "notes.txt").read_text())
    seen.append(workspace.execute_command(f"grep -c {greeting} notes.txt", cwd=root))
    conversation.close()
    return seen


def _observed(event: Any) -> bool:
    return isinstance(event, ObservationEvent)


@pytest.fixture
def report(capsys: pytest.CaptureFixture[str]) -> Callable[[str], None]:
    """Print a measured figure to the terminal, past pytest's capture."""

    def show(line: str) -> None:
        with capsys.disabled():
            print(f"\n[openhands] {line}")

    return show


@pytest.fixture
def shells() -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for shell in made:
        shell.close()


@pytest.mark.parametrize("snapshots", ["cost-aware", "always"])
def test_divergent_agent_rollouts_match_local_workspace_and_hit_on_the_second_epoch(
    template: Path, tmp_path: Path, upload: Path, shells: list[Any], report: Callable[[str], None], snapshots: str
) -> None:
    work, downloads = tmp_path / "work", tmp_path / "downloads"
    greetings = ["hello", "hello", "bye"]
    uncached = [rollout(LocalWorkspace(working_dir=lay(template, work)), g, work, upload, downloads) for g in greetings]

    lay(template, work)  # the sandboxes' tree: never changed by them
    shell = ShellSandbox.factory(work, persistent=True, visible=sdk_paths())
    shells.append(shell)
    cache = Cache(snapshot_policy=AlwaysSnapshot()) if snapshots == "always" else Cache()
    epochs: list[list[Any]] = []
    for _ in range(2):
        runs = []
        for greeting in greetings:
            workspace = CachingWorkspace(shell=shell, cache=cache, task_id="notes", deterministic=True)
            runs.append((rollout(workspace, greeting, work, upload, downloads), workspace.session.stats))
            workspace.close()
        epochs.append(runs)

    different = sum(seen != expected for epoch in epochs for (seen, _), expected in zip(epoch, uncached, strict=True))
    assert different == 0  # every observation, change list, diff, download and check as LocalWorkspace gave them
    hello = uncached[0]
    assert (hello[1]["exit_code"], hello[4]["exit_code"]) == (0, 3)
    assert "one\n" in hello[1]["content"][0]["text"]
    assert "hello" in hello[4]["content"][0]["text"]
    assert [str(change.path) for change in hello[-5]] == ["build/out.txt", "notes.txt", "patch.txt", "src/app.py"]
    assert (hello[-4].modified, hello[-4].original) == ("print('hello')", "print('hi')")
    assert uncached[2][-1].stdout == "1\n"
    assert (work / "notes.txt").read_text() == "one\n"  # the tree itself never changes

    (first, s1), (second, s2), (third, s3) = epochs[0]
    calls = 1 + len(commands("x")) + 4  # the upload, the agent's commands, changes, diff, download, check
    assert (s1.hits, s1.misses, s1.sandboxes_started) == (0, calls, 1)
    assert (s2.hits, s2.misses, s2.sandboxes_started + s2.sandboxes_forked) == (calls, 0, 0)  # no sandbox at all
    assert (s3.hits, s3.misses) == (2, calls - 2)  # the upload and the first read hit; it diverges at the greeting
    if snapshots == "always":
        assert (s3.sandboxes_forked, s3.sandboxes_started, s3.calls_replayed) == (1, 0, 0)
    second_epoch = [stats for _, stats in epochs[1]]
    assert all(stats.misses == 0 and stats.hits == calls for stats in second_epoch)
    executed = sum(stats.seconds for _, stats in epochs[0])
    saved = sum(stats.seconds_saved for stats in second_epoch)
    report(
        f"snapshots={snapshots}: {different} of {len(epochs) * len(greetings)} rollouts differ from LocalWorkspace; "
        f"epoch 2: {sum(s.hits for s in second_epoch)} hits, 0 misses; tool time {executed:.3f} s in epoch 1, "
        f"{saved:.3f} s saved in epoch 2; routes {shell.route_counts()}"
    )


def test_a_timeout_is_never_cached_and_the_rollout_then_runs_uncached(template: Path, shells: list[Any]) -> None:
    shell = ShellSandbox.factory(template, persistent=True)
    shells.append(shell)
    cache = Cache()
    seen, stats = [], []
    for _ in range(2):
        workspace = CachingWorkspace(shell=shell, cache=cache, task_id="slow", deterministic=True)
        seen.append([workspace.execute_command("echo a > a.txt"), workspace.execute_command("sleep 5", timeout=0.3)])
        seen[-1].append(workspace.execute_command("cat a.txt"))
        stats.append(workspace.session.stats)
        workspace.close()
    assert seen[0] == seen[1]
    assert (seen[0][1].exit_code, seen[0][1].timeout_occurred) == (-1, True)
    assert seen[0][2].stdout == "a\n"
    assert (stats[1].hits, stats[1].uncached) == (1, 2)  # after the timeout, nothing is served from cache


def test_uploads_are_keyed_by_what_lands(template: Path, tmp_path: Path, shells: list[Any]) -> None:
    """An upload is keyed by the content, permission bits and times that land in the tree (shutil.copy2 copies
    the source's access time as it is after the read, so a file's first read is its own key)."""
    shell = ShellSandbox.factory(template, persistent=True)
    shells.append(shell)
    cache = Cache()
    same, other = tmp_path / "same.txt", tmp_path / "other.txt"
    same.write_text("same\n")
    other.write_text("other\n")
    results = []
    for source in (same, same, other):
        workspace = CachingWorkspace(shell=shell, cache=cache, task_id="uploads", deterministic=True)
        result = workspace.file_upload(source, "in/data.txt")
        results.append((result, workspace.execute_command("cat in/data.txt").stdout, workspace.session.stats.hits))
        workspace.close()
    assert [(r.success, r.file_size, Path(r.source_path).name) for r, _, _ in results] == [
        (True, 5, "same.txt"),
        (True, 5, "same.txt"),
        (True, 6, "other.txt"),
    ]
    assert [(out, hits) for _, out, hits in results] == [("same\n", 0), ("same\n", 2), ("other\n", 0)]
    missing = CachingWorkspace(shell=shell, cache=cache, task_id="uploads")
    failed = missing.file_upload(tmp_path / "nothing.txt", "in/x.txt")
    missing.close()
    expected = LocalWorkspace(working_dir=tmp_path).file_upload(tmp_path / "nothing.txt", tmp_path / "in" / "x.txt")
    assert (failed.success, failed.error) == (expected.success, expected.error)


def test_pause_freezes_the_sandbox_and_the_next_call_forks_it_back(template: Path, shells: list[Any]) -> None:
    shell = ShellSandbox.factory(template, persistent=True)
    shells.append(shell)
    workspace = CachingWorkspace(shell=shell, cache=Cache(), task_id="pause", deterministic=True)
    workspace.execute_command("echo kept > state.txt")
    live = workspace._factory.live
    workspace.pause()
    assert live._paused is not None  # the shell stopped; its state is a snapshot now
    assert workspace.execute_command("cat state.txt; ls").stdout == "kept\nnotes.txt\nsrc\nstate.txt\n"
    assert live._paused is None
    workspace.pause()
    workspace.resume()
    assert live._paused is None
    workspace.close()


def test_git_operations_say_how_to_show_the_sdk_to_the_sandbox(template: Path, shells: list[Any]) -> None:
    shell = ShellSandbox.factory(template, persistent=True)  # no visible=sdk_paths()
    shells.append(shell)
    workspace = CachingWorkspace(shell=shell, cache=Cache(), task_id="git")
    with pytest.raises(SandboxError, match="visible=sdk_paths"):
        workspace.git_changes("")
    assert workspace.session.stats.misses == 0  # refused before anything ran
    workspace.close()


def test_differences_from_local_workspace_are_the_documented_ones(template: Path, shells: list[Any]) -> None:
    """docs/harnesses.md (OpenHands) lists what differs from LocalWorkspace; these are pinned here."""
    shell = ShellSandbox.factory(template, persistent=True)
    shells.append(shell)
    workspace = CachingWorkspace(shell=shell, cache=Cache(), task_id="differences")
    local = LocalWorkspace(working_dir=template)
    commands = ["echo $HOME $AI_AGENT", "kill -9 $$", "printf 'a\\377b\\n'"]
    ours = [workspace.execute_command(command) for command in commands]
    theirs = [local.execute_command(command) for command in commands]
    workspace.close()
    assert ours[0].stdout == f"{shell.environment['HOME']} openhands\n"  # the factory's environment, sanitised
    assert theirs[0].stdout == f"{os.environ.get('HOME', '')} openhands\n"  # this process's
    assert (ours[1].exit_code, theirs[1].exit_code) == (137, -9)  # killed by a signal: as a shell reports it
    assert ours[2].stdout == "a\ufffdb\n"  # undecodable bytes replaced; LocalWorkspace's reader stops at them
    assert theirs[2].stdout != ours[2].stdout
