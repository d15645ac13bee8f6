"""The differential fuzzer of the persistent shells (``tvcache.shell_fuzz``): its grammar is safe and repeatable,
its reference answers as a bash typed at a terminal does, its differ sees a difference on every route, and the
persistent shells — uncached and through the cache on each snapshot route — answer as the reference does: a fast
seed set here, thousands of commands per route and flavour in the slow suite."""

from __future__ import annotations

import asyncio
import fcntl
import os
import re
import select
import struct
import subprocess
import termios
import time
import tty
from pathlib import Path

import pytest

from tvcache.sandboxes.shell.linux import overlay_supported
from tvcache.shell_fuzz import (
    GRAMMAR,
    JOB_START,
    ROUTES,
    SETUP,
    TREE,
    ReferenceShell,
    RouteReport,
    Step,
    _several_commands,  # the reference's own check, applied to the grammar
    fuzz,
    generate,
    main,
    place,
)

needs_overlay = pytest.mark.skipif(
    not overlay_supported(), reason="persistent shell sandboxes need overlay mounts (root on Linux >= 6.8)"
)
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TZ": "UTC", "TERM": "dumb"}


def _distinct_commands() -> set[str]:
    return {step.command for seed in range(40) for step in generate(seed, 120)}


def test_the_grammar_is_repeatable_parses_and_is_safe() -> None:
    assert generate(7, 80) == generate(7, 80)
    assert generate(7, 80) != generate(8, 80)
    assert generate(7, 80)[0] == Step(command=SETUP, production="setup")
    assert place("cd @T@/d1; cd @T@/.", "/") == "cd /d1; cd /."  # a tree at the root (Docker)
    commands = _distinct_commands()
    drawn = {step.production for seed in range(40) for step in generate(seed, 120)}
    assert drawn == {rule.name for rule in GRAMMAR} | {"setup"}  # every rule is reachable
    for command in commands:
        checked = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
        assert checked.returncode == 0, (command, checked.stderr)
        assert re.findall(rf"{re.escape(TREE)}(?!/)", command) == [], command  # always a path under the tree
        for removal in re.findall(r"\b(?:rm|rmdir)\b[^;&|]*", command):
            assert all(word.startswith(TREE + "/") for word in removal.split()[1:] if not word.startswith("-"))
        for pause in re.findall(r"\bsleep ([0-9.]+)", command):
            assert float(pause) <= 0.2, command
        assert _several_commands(command) is None, command  # one group: as a terminal runs it
        if "kill" in command:  # only a signal the same command traps
            assert re.fullmatch(r"trap .* USR1; kill -USR1 \"\$\$\"; .*", command), command


# --------------------------------------------------------------------------- the reference against a terminal

# Commands that read nothing from their terminal, so that typing them straight into a bash is what a user sees.
TYPED = [
    "set +o history",
    "echo a b",
    'echo "$_"',
    "false | true",
    'echo "$? ${PIPESTATUS[@]} $_"',
    "! true",
    'echo "$? ${PIPESTATUS[@]}"',
    'f() {\n  echo "in f"\n}',
    'echo "LINENO=$LINENO"',
    "f",
    "M1[$'a\\nb']=v",  # an expansion error ends the rest of the line
    'echo "$? LINENO=$LINENO"',
    "set -u",
    "echo $NOPE; echo not-reached",
    'echo "$? $_"',
    "set +u",
    "set -x",
    "echo traced",
    "set +x",
    "set -v",
    "cat <<EOF\nverbose\nEOF",
    "set +v",
    "exec {FZOUT}>&1 >>out.log; echo into-file",
    "echo hidden",
    "exec >&$FZOUT {FZOUT}>&-; cat out.log",
    "alias a1='echo alias-one'",
    "a1",
    "trap $'echo u1\\necho u2' USR1; kill -USR1 $$; echo after-usr1",
    "sleep 0.05 & wait",
    "enable -n printf; printf 'external %s\\n' ok",
    "IFS=0; echo c",
    'echo "$_ LINENO=$LINENO"',
    "unset LINENO",
    'echo "LINENO=$LINENO"',
]


def _typed_at_a_terminal(directory: Path, commands: list[str]) -> list[bytes]:
    """Each command typed straight into ``bash -i`` on a pty, its output read up to the next prompt (bash prints
    PS1 when it has run what was typed and wants more; PS2 is empty)."""
    master, slave = os.openpty()
    tty.setraw(slave)
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    process = subprocess.Popen(
        ["bash", "--norc", "--noprofile", "--noediting", "-i"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=directory,
        env={**ENV, "HOME": str(directory), "PS1": PROMPT.decode(), "PS2": ""},
        start_new_session=True,
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
    )
    buffer = bytearray()

    def until_prompt() -> bytes:
        deadline = time.monotonic() + 10
        while (index := buffer.find(PROMPT)) < 0:
            assert time.monotonic() < deadline, f"no prompt: {bytes(buffer)!r}"
            if select.select([master], [], [], 1)[0]:
                buffer.extend(os.read(master, 1 << 16))
        output = bytes(buffer[:index])
        del buffer[: index + len(PROMPT)]
        return output

    try:
        until_prompt()
        outputs = []
        for command in commands:
            os.write(master, command.encode() + b"\n")
            outputs.append(until_prompt())
        return outputs
    finally:
        process.kill()
        process.wait()
        os.close(slave)
        os.close(master)


PROMPT = b"@@prompt@@"


def test_the_reference_answers_as_a_bash_typed_at_a_terminal(tmp_path: Path) -> None:
    (tmp_path / "typed").mkdir()
    (tmp_path / "reference").mkdir()
    typed = _typed_at_a_terminal(tmp_path / "typed", TYPED)
    with ReferenceShell(tree=tmp_path / "reference", env={**ENV, "HOME": str(tmp_path / "reference")}) as shell:
        answered = [shell.type(command) for command in TYPED]
    assert [note for _, _, note in answered] == [None] * len(TYPED)

    def plain(output: bytes) -> str:
        return JOB_START.sub(r"\1 <pid>", output.decode())

    assert [plain(output) for output, _, _ in answered] == [plain(output) for output in typed]
    statuses = [status for _, status, _ in answered]
    assert statuses[TYPED.index("! true")] == 1
    assert statuses[TYPED.index("M1[$'a\\nb']=v")] == 1
    assert plain(answered[TYPED.index('echo "LINENO=$LINENO"')][0]) == "LINENO=11\n"  # 7 lines, then 3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_reference_answers_generated_sequences_as_a_bash_typed_at_a_terminal(tmp_path: Path, seed: int) -> None:
    """Whole generated sequences (but prompt changes, which a terminal shows), typed straight and through the
    reference: the same output, command for command."""
    steps = [step for step in generate(f"typed.{seed}", 80) if step.production != "hostile:prompts"]
    outputs = {}
    for name in ("typed", "reference"):
        tree = tmp_path / name
        tree.mkdir()
        commands = ["set +o history"] + [place(step.command, str(tree)) for step in steps]
        if name == "typed":
            printed = _typed_at_a_terminal(tree, commands)
        else:
            with ReferenceShell(tree=tree, env={**ENV, "HOME": str(tree)}) as shell:
                printed = [shell.type(command)[0] for command in commands]
        outputs[name] = [JOB_START.sub(r"\1 <pid>", out.decode().replace(str(tree), "<tree>")) for out in printed]
    assert outputs["reference"] == outputs["typed"]


# --------------------------------------------------------------------------------------------- the differ


@needs_overlay
def test_the_differ_sees_a_difference_on_every_route(tmp_path: Path) -> None:
    """The shell's PID differs from any plain bash's (it is its namespace's init): every route must say so,
    once, and find its forks and replays equal to the uncached shell."""
    sequences = {"pid": [Step(command=SETUP, production="setup"), Step(command="echo $$", production="pid")]}
    reports = asyncio.run(fuzz(sequences=sequences, workdir=tmp_path, rollouts=2))
    for report in reports:
        print(report.summary())
        if report.skipped is not None:
            continue
        assert report.errors == []
        assert {(d.index, d.against, d.production) for d in report.differences} == {(1, "reference", "pid")}
        assert report.differences[0].got.output == "1\n"


def _print_and_check(reports: list[RouteReport]) -> None:
    for report in reports:
        print(report.render(show=5))
    for report in reports:
        assert report.errors == [], report.render()
        assert report.warnings == [], report.render()  # a snapshot or a fork that failed (not declined)
        assert report.differences == [], report.render()


@needs_overlay
def test_a_fast_seed_set_answers_as_a_plain_bash_on_every_route(tmp_path: Path) -> None:
    """About 100 commands per route (CRIU's only where it works), against the reference and the uncached shell."""
    reports = asyncio.run(fuzz(seed="fast", commands=100, length=25, workdir=tmp_path))
    assert [report.route for report in reports] == list(ROUTES)
    ran = [report for report in reports if report.skipped is None]
    assert all(report.commands >= 100 for report in ran)
    _print_and_check(reports)


@needs_overlay
def test_the_command_line_prints_the_counts(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--seed", "cli", "--commands", "6", "--route", "uncached", "--show", "1"])
    printed = capsys.readouterr().out
    counts = re.match(r"overlay/uncached: (\d+) commands \(\1 executed, 0 served\) in 1 sequences", printed)
    assert counts is not None, printed
    differences = re.search(r"; (\d+) differences from the reference", printed)
    assert differences is not None, printed
    assert code == (1 if int(differences[1]) else 0)


def _docker_missing() -> str | None:
    from tvcache.sandboxes.docker import docker_available

    available, why = docker_available()
    if not available:
        return f"needs a Docker engine ({why}); start one with scripts/install-docker.sh"
    image = os.environ.get("TVCACHE_DOCKER_IMAGE", "tvcache-base:bookworm")
    found = subprocess.run(["docker", "image", "inspect", image], capture_output=True, timeout=60)
    return None if found.returncode == 0 else f"needs the base image {image}; build it with scripts/build-base-image.sh"


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["overlay", "docker"])
def test_thousands_of_commands_per_route_answer_as_a_plain_bash(tmp_path: Path, flavour: str) -> None:
    if flavour == "overlay" and not overlay_supported():
        pytest.skip("persistent shell sandboxes need overlay mounts (root on Linux >= 6.8)")
    if flavour == "docker" and (why := _docker_missing()) is not None:
        if os.environ.get("TVCACHE_REQUIRE_DOCKER") == "1":
            pytest.fail(f"TVCACHE_REQUIRE_DOCKER=1, but this test {why}")
        pytest.skip(why)
    reports = asyncio.run(fuzz(seed="long", commands=2000, flavour=flavour, workdir=tmp_path))
    ran = [report for report in reports if report.skipped is None]
    assert all(report.commands >= 2000 for report in ran)
    _print_and_check(reports)
