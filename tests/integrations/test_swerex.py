"""SWE-ReX: rollouts through its own session API (create_session, run_in_session, close_session) on a
``CachingDeployment`` over real ``LocalDeployment``s (a persistent bash each), compared with the same rollouts
on the real deployment."""

from __future__ import annotations

import asyncio
import re
import shutil
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("swerex", reason="the 'swe-rex' extra is not installed: pip install 'tvcache[swe-rex]'")

# Real SWE-ReX (pexpect on a pty) is the reference here, and it answers by timing: `make test` runs these after
# the parallel part, one at a time.
pytestmark = pytest.mark.serial

from swerex.deployment.local import LocalDeployment  # noqa: E402
from swerex.exceptions import (  # noqa: E402
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (  # noqa: E402
    BashAction,
    BashInterruptAction,
    BashObservation,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    CreateBashSessionResponse,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)

from tvcache import AlwaysSnapshot, Cache, CostAwareSnapshots, InvalidToolCall, NeverSnapshot  # noqa: E402
from tvcache.integrations.swerex import CachingDeployment, ShellDeployment  # noqa: E402
from tvcache.sandboxes import ShellSandbox, ShellSandboxFactory  # noqa: E402
from tvcache.sandboxes.shell.linux import overlay_supported  # noqa: E402


@pytest.fixture
def fresh(tmp_path: Path) -> tuple[Path, Callable[[], LocalDeployment], list[int]]:
    """A deployment factory whose deployments start in the task's initial state: the work directory is laid
    anew from the template each time one starts (as a container from an image would be)."""
    template, work = tmp_path / "template", tmp_path / "work"
    template.mkdir()
    (template / "notes.txt").write_text("one\n")
    started: list[int] = []

    class FreshDeployment(LocalDeployment):
        async def start(self) -> None:
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(template, work)
            started.append(1)
            await super().start()

    return work, FreshDeployment, started


def commands(work: Path, greeting: str) -> list[str]:
    return [f"cd {work}", f"export GREETING={greeting}", "echo $GREETING >> notes.txt", "cat notes.txt; pwd"]


async def rollout(deployment: Any, work: Path, greeting: str, runtimes: list[Any] | None = None) -> list[Any]:
    """What SWE-agent does: one bash session, commands typed into it, a failing command, files read back."""
    await deployment.start()
    runtime = deployment.runtime
    if runtimes is not None:
        runtimes.append(runtime)
    seen: list[Any] = [await runtime.create_session(CreateBashSessionRequest(session="main"))]
    for command in commands(work, greeting):
        seen.append(await runtime.run_in_session(BashAction(command=command, session="main", check="silent")))
    try:
        await runtime.run_in_session(BashAction(command="test -f missing.txt", session="main", check="raise"))
    except NonZeroExitCodeError as error:
        seen.append(("raised", type(error).__name__, str(error)))
    seen.append(await runtime.read_file(ReadFileRequest(path=str(work / "notes.txt"))))
    seen.append(await runtime.execute(Command(command="ls", cwd=str(work), shell=True)))
    seen.append(await runtime.close_session(CloseBashSessionRequest(session="main")))
    await deployment.stop()
    return seen


def test_repeated_and_divergent_rollouts_hit_and_match_uncached(fresh: Any) -> None:
    work, make, started = fresh
    greetings = ["hello", "hello", "bye"]

    async def main() -> tuple[list[Any], list[Any], list[tuple[int, int, int]]]:
        uncached = [await rollout(make(), work, greeting) for greeting in greetings]
        cache = Cache()
        cached, stats = [], []
        for greeting in greetings:
            before = len(started)
            deployment = CachingDeployment(make, cache=cache, task_id="notes", deterministic=True)
            runtimes: list[Any] = []
            cached.append(await rollout(deployment, work, greeting, runtimes))
            session = runtimes[0].session
            stats.append((session.stats.hits, session.stats.misses, len(started) - before))
        return uncached, cached, stats

    uncached, cached, stats = asyncio.run(main())
    # SWE-ReX's own BashSession output varies in blank lines from run to run (pexpect timing around its exit-code
    # probe), uncached too: compare the models with that whitespace dropped; everything else field by field.
    assert [[_steady(seen) for seen in run] for run in cached] == [[_steady(seen) for seen in run] for run in uncached]
    assert uncached[0][4].output.strip().splitlines() == ["one", "hello", str(work)]
    assert uncached[0][5][0] == "raised"
    assert stats[0] == (0, 9, 1)
    assert stats[1] == (9, 0, 0)  # rollout 2: every call a hit, no deployment started
    assert stats[2] == (2, 7, 1)  # diverges at the export: session creation and cd hit, the rest runs


def _steady(seen: Any) -> Any:
    if isinstance(seen, CreateBashSessionResponse):  # whether bash printed its own prompt first is timing
        return seen.model_copy(update={"output": None})
    if not hasattr(seen, "output"):
        return seen
    lines = [line for line in seen.output.replace("\r", "").split("\n") if line]
    return seen.model_copy(update={"output": lines})


def test_unsteady_shell_output_is_caught_by_the_default_first_hit_check(fresh: Any) -> None:
    """Undeclared determinism (the default): the first hit of each tool in a task is executed once more and
    compared, so an output that varies is never served as if it were the only one."""
    work, make, started = fresh

    async def main() -> list[Any]:
        cache = Cache()
        runs = []
        for _ in range(2):
            deployment = CachingDeployment(make, cache=cache, task_id="notes")
            runtimes: list[Any] = []
            runs.append(await rollout(deployment, work, "hello", runtimes))
            runs.append(runtimes[0].session.stats)
        return runs

    first, _, second, stats = asyncio.run(main())
    assert stats.verified >= 1  # checked rather than trusted
    assert len(started) == 2
    assert [_steady(seen) for seen in first] == [_steady(seen) for seen in second]


def test_uploads_are_keyed_by_content(fresh: Any, tmp_path: Path) -> None:
    work, make, started = fresh
    source = tmp_path / "patch.txt"

    async def upload_and_read(content: str) -> str:
        source.write_text(content)
        deployment = CachingDeployment(make, cache=cache, task_id="upload", deterministic=True)
        await deployment.start()
        runtime = deployment.runtime
        await runtime.upload(UploadRequest(source_path=str(source), target_path=str(work / "patch.txt")))
        await runtime.write_file(WriteFileRequest(path=str(work / "extra.txt"), content="x"))
        read = await runtime.read_file(ReadFileRequest(path=str(work / "patch.txt")))
        await deployment.stop()
        return read.content

    cache = Cache()
    first = asyncio.run(upload_and_read("v1"))
    again = asyncio.run(upload_and_read("v1"))
    changed = asyncio.run(upload_and_read("v2"))
    assert (first, again, changed) == ("v1", "v1", "v2")
    assert len(started) == 2  # the same content hit; new content is a new call


def test_interrupts_pass_through_uncached_and_are_logged_once(fresh: Any, caplog: pytest.LogCaptureFixture) -> None:
    work, make, started = fresh

    async def main() -> tuple[Any, Any]:
        deployment = CachingDeployment(make, cache=Cache(), task_id="interrupt", deterministic=True)
        await deployment.start()
        runtime = deployment.runtime
        await runtime.create_session(CreateBashSessionRequest(session="main"))
        first = await runtime.run_in_session(BashInterruptAction(session="main"))
        await runtime.run_in_session(BashInterruptAction(session="main"))
        after = await runtime.run_in_session(BashAction(command="echo still here", session="main"))
        stats = runtime.session.stats
        await deployment.stop()
        assert runtime.pass_throughs.counts["BashInterruptAction"] == 2
        assert stats.uncached == 3
        assert stats.misses == 1
        return first, after

    with caplog.at_level("WARNING", logger="tvcache.integrations"):
        first, after = asyncio.run(main())
    assert first.exit_code == 0
    assert after.output.strip() == "still here"
    assert sum("passes through uncached" in record.message for record in caplog.records) == 1


# ---------------------------------------------------------------------------------------------------------
# The persistent shell flavour: SWE-ReX sessions on tvcache's own confined shells (no SWE-ReX runtime at all).

needs_overlay = pytest.mark.skipif(not overlay_supported(), reason="persistent shell sandboxes need root (overlays)")


def lay_tree(template: Path, work: Path) -> Path:
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(template, work)
    return work


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    template = tmp_path / "template"
    (template / "sub").mkdir(parents=True)
    (template / "notes.txt").write_text("one\n")
    return template


def persistent(work: Path, tmp_path: Path) -> ShellSandboxFactory:
    shell = ShellSandbox.factory(work, fallback=False, persistent=True, store_root=tmp_path / "layers")
    assert isinstance(shell, ShellSandboxFactory)
    return shell


async def outcome(operation: Any) -> Any:
    """What a request returned, or the exception it raised as (type name, message)."""
    try:
        return await operation
    except Exception as error:
        return ("raised", type(error).__name__, str(error))


async def session_script(deployment: Any, work: Path, upload: Path) -> list[Any]:
    """A SWE-agent-like rollout whose every answer can be compared with SWE-ReX's own LocalRuntime: state carried
    across run_in_session calls (cwd, exported and plain variables, functions, aliases, $?), check modes, a syntax
    error, one-shot commands that see none of the session's variables, files written, read and uploaded."""
    await deployment.start()
    runtime = deployment.runtime
    await runtime.create_session(CreateBashSessionRequest(session="main"))
    steps: list[tuple[str, Any]] = [
        (f"cd {work}/sub", "silent"),
        ("X=1; export Y=two", "silent"),
        ('f() { echo "f $1"; }; alias hi="echo hello"', "silent"),
        ('pwd; echo "$X $Y"; f a; hi', "silent"),
        ("false", "silent"),
        ("echo $?", "silent"),  # 0: SWE-ReX's exit-code probe ran in between
        ("false", "ignore"),
        ("echo $?", "silent"),  # 1: no probe after check="ignore"
        ("cd ..; echo data >> notes.txt; cat notes.txt", "silent"),
        ("unset X; echo x=$X; env | grep -c '^Y=two$'", "silent"),
        ("if then fi", "silent"),
        ("test -f missing.txt", "raise"),
        ("cat new/deep.txt up.txt", "silent"),
    ]
    seen: list[Any] = []
    for command, check in steps:
        if command.startswith("cat new/"):
            seen.append(await runtime.write_file(WriteFileRequest(path=str(work / "new" / "deep.txt"), content="x\n")))
            seen.append(await runtime.upload(UploadRequest(source_path=str(upload), target_path=str(work / "up.txt"))))
        action = BashAction(command=command, session="main", check=check)
        seen.append(await outcome(runtime.run_in_session(action)))
    seen.append(await runtime.execute(Command(command=["cat", "notes.txt"], cwd=str(work))))
    seen.append(await runtime.execute(Command(command="echo Y=$Y; echo oops >&2; exit 3", shell=True, cwd=str(work))))
    seen.append(await outcome(runtime.execute(Command(command=["no-such-program"]))))
    seen.append(await runtime.read_file(ReadFileRequest(path=str(work / "notes.txt"))))
    seen.append(await outcome(runtime.read_file(ReadFileRequest(path=str(work / "missing.txt")))))
    seen.append(await outcome(runtime.read_file(ReadFileRequest(path=str(work / "sub")))))
    await deployment.stop()
    return seen


def comparable(seen: Any) -> Any:
    """SWE-ReX's pexpect session adds carriage returns and blank lines around outputs (timing): drop both; the
    expect string of a LocalRuntime is its prompt, as ours reports it. Failure messages quote that output."""
    if isinstance(seen, BashObservation):
        lines = [line for line in seen.output.replace("\r", "").split("\n") if line]
        return seen.model_copy(update={"output": lines})
    if isinstance(seen, tuple) and seen[1] == "NonZeroExitCodeError":
        return (*seen[:2], seen[2].split(". Here is the output")[0])
    return seen


@needs_overlay
def test_a_shell_session_answers_as_swe_rex_local_runtime_does(tree: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    upload = tmp_path / "patch.txt"
    upload.write_text("patched\n")
    lay_tree(tree, work)
    real = asyncio.run(session_script(LocalDeployment(), work, upload))
    lay_tree(tree, work)  # the sandbox's tree, untouched by the real run
    shell = persistent(work, tmp_path)
    ours = asyncio.run(session_script(ShellDeployment(shell), work, upload))
    shell.close()
    assert [comparable(seen) for seen in ours] == [comparable(seen) for seen in real]
    assert ours[3].output == f"{work}/sub\n1 two\nf a\nhello\n"
    assert (ours[5].output, ours[7].output) == ("0\n", "1\n")
    assert ours[10][1] == BashIncorrectSyntaxError.__name__
    assert ours[11][1] == NonZeroExitCodeError.__name__
    assert ours[14].output == "x\npatched\n"
    assert ours[16].stdout == "Y=\n"  # one-shot commands never see the session's exports
    assert ours[17][:2] == ("raised", "FileNotFoundError")
    assert ours[19][:2] == ("raised", "FileNotFoundError")
    assert ours[20][:2] == ("raised", "IsADirectoryError")
    assert (work / "notes.txt").read_text() == "one\n"  # the tree itself never changes


def shell_rollout_steps(work: Path, greeting: str) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("run", {"command": "cd sub"}),
        ("run", {"command": f'export GREETING={greeting}; shout() {{ echo "$GREETING!"; }}'}),
        ("run", {"command": "shout >> ../notes.txt; cat ../notes.txt; pwd"}),
        ("write", {"path": "sub/reply.txt", "content": f"{greeting} back\n"}),
        ("run", {"command": "cat reply.txt; shout"}),
        ("execute", {"command": "ls sub; echo G=$GREETING", "shell": True}),
        ("read", {"path": "sub/reply.txt"}),
        ("run", {"command": "test -f nothing", "check": "raise"}),
    ]


async def shell_rollout(deployment: Any, work: Path, greeting: str) -> tuple[list[Any], Any]:
    await deployment.start()
    runtime = deployment.runtime
    seen: list[Any] = [await runtime.create_session(CreateBashSessionRequest(session="main"))]
    for kind, fields in shell_rollout_steps(work, greeting):
        if kind == "run":
            request = runtime.run_in_session(BashAction(session="main", **{"check": "silent", **fields}))
        elif kind == "write":
            request = runtime.write_file(WriteFileRequest(**fields))
        elif kind == "execute":
            request = runtime.execute(Command(**fields))
        else:
            request = runtime.read_file(ReadFileRequest(**fields))
        seen.append(await outcome(request))
    stats = getattr(runtime, "session", None)
    await deployment.stop()
    return seen, (stats.stats if stats is not None else None)


@needs_overlay
@pytest.mark.parametrize("policy", ["always", "never", "cost-aware"])
def test_shell_rollouts_hit_fork_and_match_an_uncached_shell(tree: Path, tmp_path: Path, policy: str) -> None:
    work = lay_tree(tree, tmp_path / "work")
    shell = persistent(work, tmp_path)
    greetings = ["hello", "hello", "bye"]
    snapshots = {"always": AlwaysSnapshot(), "never": NeverSnapshot(), "cost-aware": CostAwareSnapshots()}[policy]

    async def main() -> tuple[list[Any], list[Any]]:
        uncached = [(await shell_rollout(ShellDeployment(shell), work, g))[0] for g in greetings]
        cache = Cache(snapshot_policy=snapshots)
        cached = []
        for greeting in greetings:
            deployment = CachingDeployment(shell, cache=cache, task_id="shell-notes", deterministic=True)
            cached.append(await shell_rollout(deployment, work, greeting))
        cache.close()
        return uncached, cached

    uncached, cached = asyncio.run(main())
    routes = shell.route_counts()
    shell.close()
    assert [seen for seen, _ in cached] == uncached  # 0 mismatches, field by field

    assert uncached[0][3].output == f"one\nhello!\n{work}/sub\n"
    assert uncached[2][3].output == f"one\nbye!\n{work}/sub\n"
    assert uncached[0][6].stdout == "reply.txt\nG=\n"
    assert uncached[0][8][1] == "NonZeroExitCodeError"
    first, second, third = (stats for _, stats in cached)
    assert (first.hits, first.misses, first.sandboxes_started) == (0, 9, 1)
    assert (second.hits, second.misses, second.sandboxes_started, second.sandboxes_forked) == (9, 0, 0, 0)
    assert (third.hits, third.misses) == (2, 7)  # session and cd hit; it diverges at the export
    if policy == "always":  # the divergent rollout forks the shell after `cd sub`: nothing replayed
        assert (third.sandboxes_forked, third.sandboxes_started, third.calls_replayed) == (1, 0, 0)
        assert routes.get("shell-state", 0) >= 1
    if policy == "never":  # no snapshot: a fresh shell replays the session and the cd
        assert (third.sandboxes_forked, third.sandboxes_started, third.calls_replayed) == (0, 1, 2)


@needs_overlay
def test_one_bash_session_per_shell_sandbox_with_swe_rex_session_errors(tree: Path, tmp_path: Path) -> None:
    work = lay_tree(tree, tmp_path / "work")
    shell = persistent(work, tmp_path)

    async def main() -> list[Any]:
        deployment = ShellDeployment(shell)
        await deployment.start()
        runtime = deployment.runtime
        seen = [await outcome(runtime.run_in_session(BashAction(command="true", session="main")))]
        await runtime.create_session(CreateBashSessionRequest(session="main"))
        seen.append(await outcome(runtime.create_session(CreateBashSessionRequest(session="main"))))
        seen.append(await outcome(runtime.create_session(CreateBashSessionRequest(session="other"))))
        seen.append(await outcome(runtime.run_in_session(BashAction(command="true", session="other"))))
        seen.append(await outcome(runtime.run_in_session(BashAction(command="gdb", session="main", expect=["(gdb)"]))))
        seen.append(await runtime.run_in_session(BashInterruptAction(session="main")))
        seen.append(await runtime.close_session(CloseBashSessionRequest(session="main")))
        seen.append(await outcome(runtime.create_session(CreateBashSessionRequest(session="main"))))
        await deployment.stop()
        return seen

    missing, exists, second, other, interactive, interrupted, closed, again = asyncio.run(main())
    shell.close()
    assert missing == ("raised", SessionDoesNotExistError.__name__, "session 'main' does not exist")
    assert exists == ("raised", SessionExistsError.__name__, "session main already exists")
    assert second[1] == InvalidToolCall.__name__
    assert "holds one bash session" in second[2]
    assert other[1] == SessionDoesNotExistError.__name__
    assert interactive[1] == InvalidToolCall.__name__
    assert "expect patterns" in interactive[2]
    assert (interrupted.exit_code, interrupted.output) == (0, "")
    assert closed.session_type == "bash"
    assert again[1] == InvalidToolCall.__name__
    assert "its session was closed" in again[2]


@needs_overlay
def test_a_timeout_raises_swe_rex_error_is_never_cached_and_the_shell_lives_on(tree: Path, tmp_path: Path) -> None:
    work = lay_tree(tree, tmp_path / "work")
    shell = persistent(work, tmp_path)

    async def rollout(cache: Cache) -> tuple[list[Any], Any]:
        deployment = CachingDeployment(shell, cache=cache, task_id="slow", deterministic=True)
        await deployment.start()
        runtime = deployment.runtime
        await runtime.create_session(CreateBashSessionRequest(session="main"))
        seen = [await runtime.run_in_session(BashAction(command="X=kept", session="main"))]
        seen.append(await outcome(runtime.run_in_session(BashAction(command="sleep 30", session="main", timeout=0.3))))
        seen.append(await runtime.run_in_session(BashAction(command="echo $X", session="main")))
        stats = runtime.session.stats
        await deployment.stop()
        return seen, stats

    async def main() -> list[tuple[list[Any], Any]]:
        cache = Cache(snapshot_policy=NeverSnapshot())
        return [await rollout(cache), await rollout(cache)]

    (first, _), (second, stats) = asyncio.run(main())
    shell.close()
    assert first[1] == (
        "raised",
        CommandTimeoutError.__name__,
        "timeout after 0.3 seconds while running command 'sleep 30'",
    )
    assert first[2].output == "kept\n"  # interrupted, and the shell lived on
    assert second == first
    assert (stats.hits, stats.uncached) == (2, 2)  # the timeout ran again, and the rollout went on uncached


@needs_overlay
def test_the_shell_flavour_snippet_of_the_docs_runs_as_written(tmp_path: Path) -> None:
    snippet = Path(__file__).parent.parent.parent / "docs" / "harnesses.md"
    found = re.search(r"<!-- snippet: swe-rex-shell -->\n```\w+\n(.*?)```", snippet.read_text(), re.S)
    assert found is not None
    code = found.group(1).replace("/data/tvcache", str(tmp_path / "cache"))
    factory_line = "shell = ShellSandbox.factory(checkout, persistent=True)  # once per process\n"
    assert factory_line in code
    code = code.replace(factory_line, "")  # made once below, as the snippet says, and shared by both runs
    checkout = tmp_path / "checkout"
    (checkout / "src").mkdir(parents=True)
    shell = persistent(checkout, tmp_path)
    body = textwrap.indent(code, "    ") + "\n    return locals()\n"
    runs = []
    for _ in range(2):
        namespace: dict[str, Any] = {"shell": shell, "checkout": checkout, "instance_id": "task-1"}
        exec(compile(f"async def snippet():\n{body}", "<snippet>", "exec"), namespace)
        runs.append(asyncio.run(namespace["snippet"]()))
    shell.close()
    assert runs[0]["observation"].output == runs[1]["observation"].output == f"{checkout}/src\n-O0\n"
