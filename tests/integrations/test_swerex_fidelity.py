"""The SWE-ReX shell flavour (``ShellDeployment``) against SWE-ReX 1.4's own ``LocalDeployment``, action by
action: the text its ``BashSession`` types (bashlex's split rejoined with ``;``, or its terminator line after a
command bashlex cannot parse), what it waits for, its exit-code probe, its session start. Each remaining
difference that docs/harnesses.md lists is pinned here by name (``test_difference_*``)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, Literal

import pytest

pytest.importorskip("swerex", reason="the 'swe-rex' extra is not installed: pip install 'tvcache[swe-rex]'")

# Real SWE-ReX (pexpect on a pty) is the reference here, and it answers by timing: `make test` runs these after
# the parallel part, one at a time.
pytestmark = pytest.mark.serial

from swerex.deployment.local import LocalDeployment  # noqa: E402
from swerex.exceptions import CommandTimeoutError, NonZeroExitCodeError  # noqa: E402
from swerex.runtime.abstract import (  # noqa: E402
    BashAction,
    BashObservation,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
)
from swerex.runtime.local import _split_bash_command  # noqa: E402

from tvcache import Cache, NeverSnapshot  # noqa: E402
from tvcache.integrations._swerex_shell_sandbox import PS1, UNIQUE, typed_command  # noqa: E402
from tvcache.integrations.swerex import CachingDeployment, ShellDeployment  # noqa: E402
from tvcache.sandboxes import ShellSandbox, ShellSandboxFactory  # noqa: E402
from tvcache.sandboxes.shell.linux import overlay_supported  # noqa: E402

needs_overlay = pytest.mark.skipif(not overlay_supported(), reason="persistent shell sandboxes need root (overlays)")

Step = tuple[str, Literal["silent", "raise", "ignore"]] | ReadFileRequest | Command  # a command and its check mode


def shell_factory(work: Path, tmp_path: Path, **options: Any) -> ShellSandboxFactory:
    work.mkdir(exist_ok=True)
    layers = tmp_path / f"layers-{work.name}"
    shell = ShellSandbox.factory(work, fallback=False, persistent=True, store_root=layers, **options)
    assert isinstance(shell, ShellSandboxFactory)
    return shell


async def outcome(operation: Any) -> Any:
    try:
        return await operation
    except Exception as error:
        return ("raised", type(error).__name__, str(error))


async def session(deployment: Any, steps: list[Step], *, timeout: float = 3.0, **start: Any) -> list[Any]:
    """The session's start, then each step's answer (or the exception it raised)."""
    await deployment.start()
    runtime = deployment.runtime
    seen = [await outcome(runtime.create_session(CreateBashSessionRequest(session="main", **start)))]
    for step in steps:
        if isinstance(step, ReadFileRequest):
            seen.append(await outcome(runtime.read_file(step)))
        elif isinstance(step, Command):
            seen.append(await outcome(runtime.execute(step)))
        else:
            action = BashAction(command=step[0], session="main", check=step[1], timeout=timeout)
            seen.append(await outcome(runtime.run_in_session(action)))
    await deployment.stop()
    return seen


def both(
    tmp_path: Path, name: str, steps: list[Step], *, files: dict[str, str] | None = None, **options: Any
) -> tuple[list[Any], list[Any]]:
    """The same session on a LocalDeployment and on our shell flavour, each in a directory of its own holding
    ``files``."""
    real_dir, our_dir = tmp_path / f"real-{name}", tmp_path / f"ours-{name}"
    for directory in (real_dir, our_dir):
        directory.mkdir()
        for file, text in (files or {}).items():
            (directory / file).write_text(text)
    cwd = Path.cwd()
    try:
        os.chdir(real_dir)  # LocalRuntime's bash starts in the process's directory
        real = asyncio.run(session(LocalDeployment(), steps, **options))
    finally:
        os.chdir(cwd)
    shell = shell_factory(our_dir, tmp_path)
    try:
        ours = asyncio.run(session(ShellDeployment(shell), steps, **options))
    finally:
        shell.close()
    return real, ours


def lines(seen: Any) -> Any:
    """An answer without what a LocalRuntime's pty adds (carriage returns, blank lines: they vary with timing)."""
    if isinstance(seen, BashObservation):
        kept = [line for line in seen.output.replace("\r", "").split("\n") if line]
        return (kept, seen.exit_code, seen.expect_string)
    if isinstance(seen, tuple) and seen[1] == NonZeroExitCodeError.__name__:
        return (*seen[:2], seen[2].split(". Here is the output")[0])
    if isinstance(seen, tuple):
        return seen[:2] if seen[1] in ("TIMEOUT", "EOF") else seen  # pexpect's messages name its objects
    return seen


# ------------------------------------------------------------------------------------ what BashSession types

SPLIT_CORPUS = [
    "echo a",
    "cd /tmp && ls -la | head -3",
    "echo a\necho b",
    "echo a # note\necho b",
    "sleep 0.1 &\necho after-bg",
    "sleep 1 & echo x",
    "cat <<EOF\nx\nEOF",
    "cat <<EOF > out.txt\nline\nEOF",
    "cat > out.txt <<EOF\nline\nEOF\necho done",
    "if true; then\n echo a\nfi\necho b",
    "f() {\n echo x\n}",
    "echo a |\n grep a",
    "echo a &&\necho b",
    "   ",
    "",
    "# only a comment",
    "# a\n\n# b",
    "[[ 1 -eq 1 ]] && echo yes",
    "echo $(( 2 + 3 ))",
    "case a in a) echo A;; esac",
    "arr=(1 2 3); echo ${arr[1]}",
    "cat <<'EOF'\nhello $X\nEOF",
    "echo a \\",
]


@pytest.mark.parametrize("command", SPLIT_CORPUS)
def test_typed_text_is_what_swe_rex_bash_session_types(command: str) -> None:
    typed = typed_command(command)
    try:
        parts = _split_bash_command(command)
    except Exception:  # BashSession falls back to its terminator line
        assert (typed.expect, typed.text[: len(command)]) == (UNIQUE, command)
        assert typed.text[len(command) :] == f"\n TMPEXITCODE=$? ; sleep 0.1; echo -n '{UNIQUE}' ; (exit $TMPEXITCODE)"
    else:
        assert (typed.expect, typed.text) == (PS1, " ; ".join(parts))


# ----------------------------------------------------------------------------- answers, side by side with SWE-ReX

SAME_STEPS: list[Step] = [
    ("[[ 1 -eq 1 ]] && echo yes", "silent"),  # bashlex cannot parse these: the terminator is the expect string
    ("echo $(( 2 + 3 ))", "silent"),
    ("case a in a) echo A;; esac", "silent"),
    ("arr=(1 2 3); echo ${arr[1]}", "silent"),
    ("cat <<'EOF'\nhello $X\nEOF", "silent"),
    ("[[ 1 ]]\necho two\necho three", "silent"),
    ("[[ 1 -eq 2 ]]", "silent"),
    ("echo T=$TMPEXITCODE", "silent"),  # the terminator line's variable, as it left it
    ("[[ 1 -eq 2 ]]", "raise"),
    ("echo a \\", "silent"),  # the continuation runs on into the terminator line
    ("sleep 0.1 &\necho after-bg", "silent"),  # rejoined as `sleep 0.1 & ; echo after-bg`: a syntax error
    ("echo a b", "silent"),
    ("echo $_", "silent"),  # the probe's argument
    ("false", "ignore"),
    ("echo $?", "silent"),
    ("echo x y", "ignore"),
    ("echo $_", "silent"),  # nothing ran after a check="ignore" command
    ("# only a comment", "silent"),
    ("", "silent"),
    ("echo $PS1; echo after", "silent"),  # SWE-ReX removes its own strings from a probed output
    (f"echo {UNIQUE} mid; echo after", "silent"),
    ("env | grep -c '^PS[012]='", "silent"),  # its prompt settings are exported
    ("printf abc; false", "silent"),
    ("echo a b", "silent"),
    ("false", "ignore"),
    ReadFileRequest(path="notes.txt"),  # requests beside the session leave its `$?` and `$_` as they were
    Command(command="true", shell=True),
    ('echo "$? $_"', "silent"),
]


@needs_overlay
def test_a_session_answers_as_swe_rex_local_runtime_does(tmp_path: Path) -> None:
    real, ours = both(tmp_path, "same", SAME_STEPS, files={"notes.txt": "one\n"})
    assert [lines(seen) for seen in ours[1:]] == [lines(seen) for seen in real[1:]]
    by_command = {step[0]: seen for step, seen in zip(SAME_STEPS, ours[1:], strict=True) if isinstance(step, tuple)}
    assert (by_command["[[ 1 -eq 1 ]] && echo yes"].expect_string, by_command["echo a b"].expect_string) == (
        UNIQUE,
        PS1,
    )
    syntax = by_command["sleep 0.1 &\necho after-bg"]
    assert (syntax.output, syntax.exit_code) == ("bash: syntax error near unexpected token `;'\n", 2)
    assert by_command["printf abc; false"].output == "abc"  # exactly what the command printed
    assert by_command['echo "$? $_"'].output == "1 false\n"


@needs_overlay
@pytest.mark.parametrize(
    "command",
    ["cat <<EOF > out.txt\nline\nEOF", "cat > out.txt <<EOF\nline\nEOF\necho done"],
    ids=["redirect-after-heredoc", "command-after-heredoc"],
)
def test_a_here_document_the_split_cuts_off_times_out_as_in_swe_rex(tmp_path: Path, command: str) -> None:
    real, ours = both(tmp_path, "heredoc", [(command, "silent")], timeout=1.0)
    typed = typed_command(command).text
    expected = ("raised", CommandTimeoutError.__name__, f"timeout after 1.0 seconds while running command {typed!r}")
    assert real[1] == ours[1] == expected


# ------------------------------------------------------------------------------------------- the session's start

SLOW_START = "echo starting\nsleep 1\nexport V=sourced\necho done-sourcing\n"


@needs_overlay
def test_a_start_past_its_startup_timeout_raises_pexpect_timeout_and_the_sources_run_on(tmp_path: Path) -> None:
    start: dict[str, Any] = {"startup_source": ["slow.sh"], "startup_timeout": 0.5}
    real, ours = both(tmp_path, "start", [("echo V=$V", "silent")], files={"slow.sh": SLOW_START}, **start)
    assert lines(real[0]) == lines(ours[0]) == ("raised", "TIMEOUT")
    assert lines(ours[1]) == (["starting", "done-sourcing", "V=sourced"], 0, PS1)
    assert lines(real[1])[0][-3:] == ["starting", "done-sourcing", "V=sourced"]  # after its startup prompt


@needs_overlay
@pytest.mark.parametrize("flavour", ["replay", "shell"])
def test_a_start_that_timed_out_is_never_cached(tmp_path: Path, flavour: str) -> None:
    """pexpect's TIMEOUT is no TimeoutError: the replay flavour once cached it and served it to later rollouts."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "slow.sh").write_text(SLOW_START.replace("sleep 1", "sleep 0.5"))
    request = CreateBashSessionRequest(session="main", startup_source=[str(work / "slow.sh")], startup_timeout=0.2)
    shell = shell_factory(work, tmp_path)
    deployment: Any = LocalDeployment if flavour == "replay" else shell

    async def rollouts() -> list[tuple[Any, Any]]:
        cache = Cache(snapshot_policy=NeverSnapshot())
        seen = []
        for _ in range(2):
            caching = CachingDeployment(deployment, cache=cache, task_id="slow-start", deterministic=True)
            await caching.start()
            answer = await outcome(caching.runtime.create_session(request))
            seen.append((lines(answer), caching.runtime))
            await caching.stop()
        cache.close()
        return seen

    try:
        seen = asyncio.run(rollouts())
    finally:
        shell.close()
    assert [answer for answer, _ in seen] == [("raised", "TIMEOUT")] * 2
    assert [runtime.session.stats.hits for _, runtime in seen] == [0, 0]  # the second rollout ran it again
    if flavour == "replay":
        assert [runtime.deployments_started for _, runtime in seen] == [1, 1]


@needs_overlay
def test_difference_sources_past_the_factory_timeout_are_interrupted(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "endless.sh").write_text("echo starting\nsleep 30\nexport V=sourced\n")
    shell = shell_factory(work, tmp_path, timeout=1.0)
    start: dict[str, Any] = {"startup_source": ["endless.sh"], "startup_timeout": 0.5}
    try:
        ours = asyncio.run(session(ShellDeployment(shell), [("echo V=$V", "silent")], **start))
    finally:
        shell.close()
    assert lines(ours[0]) == ("raised", "TIMEOUT")
    assert lines(ours[1]) == (["starting", "V="], 0, PS1)  # SWE-ReX's sources would still be sleeping


# ------------------------------------------------------------------------------- the remaining differences, pinned


@needs_overlay
def test_difference_output_framing_and_startup_prompt(tmp_path: Path) -> None:
    real, ours = both(tmp_path, "framing", [("echo hi", "silent")])
    assert (ours[0].output, ours[1].output) == ("", "hi\n")
    assert "\r" in real[1].output  # its pty's line ends, and blank lines whose number varies with timing


@needs_overlay
def test_difference_commands_that_read_stdin_get_end_of_file(tmp_path: Path) -> None:
    real, ours = both(tmp_path, "stdin", [('read x; echo "[$x]"', "silent")], timeout=1.0)
    # Its `read` reads the terminal: it waits for a line (the usual end), or, on a busy machine, takes the line
    # SWE-ReX types next for itself. Never end of file.
    real_answer = lines(real[1])
    assert real_answer[1] == CommandTimeoutError.__name__ or "[]" not in real_answer[0], real_answer
    assert lines(ours[1]) == (["[]"], 0, PS1)


@needs_overlay
def test_difference_after_a_timeout_the_shell_lives_on(tmp_path: Path) -> None:
    steps: list[Step] = [("cat <<EOF > out.txt\nline\nEOF", "silent"), ("echo alive; ls", "silent")]
    real, ours = both(tmp_path, "after-timeout", steps, timeout=1.0)
    assert lines(real[2])[1] == CommandTimeoutError.__name__  # still reading the here-document
    assert lines(ours[2]) == (["alive"], 0, PS1)  # nothing of the here-document ran


@needs_overlay
def test_difference_check_ignore_and_swe_rex_strings_in_the_output(tmp_path: Path) -> None:
    steps: list[Step] = [(f"echo x {PS1} y", "ignore"), ("[[ 1 ]]\necho a", "ignore"), ("echo b", "ignore")]
    real, ours = both(tmp_path, "ignore", steps)
    assert [seen.output for seen in ours[1:]] == [f"x {PS1} y\n", "a\n", "b\n"]
    assert lines(real[1])[0] == ["x "]  # it stops at the first string like its prompt,
    assert PS1 in real[2].output  # gives the rest (and its prompt after each line) to the next answer,
    assert real[3].output.strip() == ""  # and answers the next command with the prompt left over


@needs_overlay
def test_difference_lineno_pipestatus_after_ignore_and_undecodable_bytes(tmp_path: Path) -> None:
    steps: list[Step] = [
        ("false | true", "ignore"),
        ('echo "${PIPESTATUS[@]}"', "silent"),
        ("printf '\\xff\\n'", "silent"),
        ("echo $LINENO", "silent"),
    ]
    real, ours = both(tmp_path, "small", steps)
    assert (real[2].output.strip(), ours[2].output) == ("1 0", "0\n")  # our end marker ran after the pipeline
    assert (real[3].output.strip(), ours[3].output) == ("\\xff", "\ufffd\n")
    assert real[4].output.strip() != ours[4].output.strip()  # our typed lines are not SWE-ReX's


@needs_overlay
def test_difference_a_shell_that_ends_raises_pexpect_eof_with_another_message(tmp_path: Path) -> None:
    real, ours = both(tmp_path, "exit", [("exit", "silent"), ("echo after", "silent")])
    assert [lines(seen) for seen in ours[1:]] == [lines(seen) for seen in real[1:]] == [("raised", "EOF")] * 2
    assert "the session's shell ended with code 0" in ours[1][2]
    assert "pexpect.pty_spawn.spawn object" in real[1][2]


@needs_overlay
def test_difference_the_output_limit_cuts_the_output_and_keeps_the_exit_code(tmp_path: Path) -> None:
    shell = shell_factory(tmp_path / "work", tmp_path, max_output_bytes=1000)
    try:
        ours = asyncio.run(session(ShellDeployment(shell), [("seq 2000", "silent")]))
    finally:
        shell.close()
    assert ours[1].exit_code == 0  # SWE-ReX has no limit: all 2000 lines
    assert ours[1].output.startswith("1\n2\n")
    assert len(ours[1].output) < 1200


@needs_overlay
def test_difference_a_killed_execute_program_reports_128_plus_the_signal(tmp_path: Path) -> None:
    command = Command(command="kill -9 $$", shell=True)
    shell = shell_factory(tmp_path / "work", tmp_path)

    async def execute(deployment: Any) -> Any:
        await deployment.start()
        answer = await deployment.runtime.execute(command)
        await deployment.stop()
        return answer

    try:
        codes = (
            asyncio.run(execute(LocalDeployment())).exit_code,
            asyncio.run(execute(ShellDeployment(shell))).exit_code,
        )
    finally:
        shell.close()
    assert codes == (-9, 137)


@needs_overlay
def test_difference_set_v_echoes_the_command_lines_only(tmp_path: Path) -> None:
    real, ours = both(tmp_path, "verbose", [("set -v", "silent"), ("echo v", "silent")])
    assert (real[2].exit_code, ours[2].exit_code) == (None, None)  # the probe's line, echoed, hides its answer
    assert ours[2].output == "echo v\nv\n"
