"""The persistent-shell trust cases of issue 23 (items 1, 2, 6 and 7), written once and run against every flavour:
the overlay one in tests/test_shell_protocol_trust.py and the Docker one in tests/test_docker.py. Each case is a
list of commands and a check of their outcomes; every check here failed on the sentinel protocol this replaced."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tvcache import ToolCall
from tvcache.protocol import Outcome

Run = Callable[[ToolCall], Awaitable[Outcome]]

# Item 1: the old sentinel was typed on the command line, so `history` showed it; the forged end came first.
HISTORY_FORGERY = (
    "s=$(history 1 | grep -o '__tvcache_end [0-9a-f]\\{32\\}' | cut -d' ' -f2); "
    "printf 'visible\\n\\n%s 1 42\\n@@\\n' \"$s\"; echo REAL-TAIL"
)
# Item 1: a DEBUG trap that answers for the protocol's epilogue with a status-0 marker.
DEBUG_FORGERY = (
    "shopt -s extdebug; trap 'if [[ $BASH_COMMAND == __tvcache_end\\ * ]]; then "
    'printf "\\n%s 1 0\\n@@\\n" "${BASH_COMMAND:14:32}"; false; fi\' DEBUG'
)


def sh(command: str, timeout: float = 10) -> ToolCall:
    return ToolCall("sh", {"cmd": command, "timeout": timeout})


@dataclass(frozen=True)
class Case:
    name: str
    commands: tuple[str, ...]
    check: Callable[[list[Outcome]], None]


def _forged_history(outcomes: list[Outcome]) -> None:
    forged, after = outcomes[1], outcomes[2]
    assert "REAL-TAIL" in forged.output
    assert "[exit code 42]" not in forged.output
    assert after.output == "after\n", after.output  # nothing of the forgery was pushed into the next call


def _forged_debug(outcomes: list[Outcome]) -> None:
    assert outcomes[1].output == "[exit code 1]"
    assert outcomes[1].is_error
    assert outcomes[2].output == "1\n"


def _harmless(outcomes: list[Outcome]) -> None:
    for outcome in outcomes:
        assert "timed out" not in outcome.output, outcome.output
        assert "shell ended" not in outcome.output, outcome.output
    assert [outcome.output for outcome in outcomes[-1:]] == ["still-here\n"]


def _no_protocol_in_user_file(outcomes: list[Outcome]) -> None:
    assert outcomes[1].output == "", outcomes[1].output  # `echo f` went to the file
    assert outcomes[3].output == "f\n"  # and nothing of ours did


def _line_editing(outcomes: list[Outcome]) -> None:
    assert "line editing" in outcomes[0].output
    assert outcomes[0].is_error
    assert not outcomes[0].deterministic
    assert outcomes[1].output.endswith("x\n")
    assert not outcomes[1].deterministic  # a new shell, untrusted


def _xtrace(outcomes: list[Outcome]) -> None:
    assert outcomes[0].output == "+ echo g\ng\n"
    assert outcomes[1].output == "+ echo h\nh\n+ set +x\n"  # as a plain bash traces it
    assert "tvcache" not in "".join(outcome.output for outcome in outcomes)


def _verbose(outcomes: list[Outcome]) -> None:
    assert outcomes[1].output == "echo v\nv\n"  # as a plain bash echoes what it reads


def _pipestatus_and_underscore(outcomes: list[Outcome]) -> None:
    assert outcomes[1].output == "1 0\n"
    assert outcomes[3].output == "b\n"


def _prompt(outcomes: list[Outcome]) -> None:
    assert outcomes[1].output == "p\n", outcomes[1].output
    assert outcomes[2].output == "(.venv) \\s-\\v\\$ \n"  # the variable itself is the user's


def _background(outcomes: list[Outcome]) -> None:
    """The late line lands in whichever call runs when it comes, and that call is never deterministic; the
    others may be (the job wrote nothing during them)."""
    carrying = [outcome for outcome in outcomes if "late-output" in outcome.output]
    assert len(carrying) == 1, [outcome.output for outcome in outcomes]
    assert not carrying[0].deterministic


def _killed_job(outcomes: list[Outcome]) -> None:
    """`kill %1` returns before its job dies: the notice lands in that call or a later one, as in a plain bash,
    and none of the calls up to it is cached as deterministic; no prompt of ours shows either way."""
    noticed = [index for index, outcome in enumerate(outcomes) if "Terminated" in outcome.output]
    assert len(noticed) == 1, [outcome.output for outcome in outcomes]
    assert noticed[0] >= 1, [outcome.output for outcome in outcomes]
    assert not [outcome for outcome in outcomes[1 : noticed[0] + 1] if outcome.deterministic], outcomes
    assert outcomes[-1].output.endswith("more\n")
    assert not [line for outcome in outcomes for line in outcome.output.splitlines() if line.startswith("> ")]


CASES = (
    Case("history forgery", ("set -o history", HISTORY_FORGERY, "echo after"), _forged_history),
    Case("debug-trap forgery", (DEBUG_FORGERY, "false", 'echo "$?"'), _forged_debug),
    Case(
        "harmless commands",
        (
            "IFS=0; echo c",
            "echo d",
            "unset LINENO",
            "enable -n printf",
            "enable -n builtin",
            "PROMPT_COMMAND='echo from-prompt-command >/dev/null'",
            "echo still-here",
        ),
        _harmless,
    ),
    Case(
        "exec redirection", ("exec 3>&1 >log.txt", "echo f", "exec >&3 3>&-", "cat log.txt"), _no_protocol_in_user_file
    ),
    Case("line editing", ("set -o emacs", "echo x"), _line_editing),
    Case("xtrace", ("set -x; echo g", "echo h; set +x"), _xtrace),
    Case("verbose", ("set -v", "echo v", "set +v"), _verbose),
    Case(
        "pipestatus and $_",
        ("false | true", 'echo "${PIPESTATUS[@]}"', "echo a b", 'echo "$_"'),
        _pipestatus_and_underscore,
    ),
    Case("prompt", ("PS1='(.venv) '\"$PS1\"", "echo p", 'echo "$PS1"'), _prompt),
    Case(
        "killed job",
        # The job has become `sleep` before the kill (a SIGTERM that reaches bash's child before it execs is lost,
        # in a plain bash too); the foreground `sleep` of the last call collects the job's end at the latest.
        (
            'sleep 30 & until [ "$(cat /proc/$!/comm)" = sleep ]; do :; done',
            "kill %1",
            "echo next",
            "sleep 0.3; echo more",
        ),
        _killed_job,
    ),
)


async def run_case(run: Run, case: Case) -> None:
    outcomes = [await run(sh(command)) for command in case.commands]
    case.check(outcomes)


async def run_background_case(run: Run) -> None:
    """Item 7: a line written by a process other than the call's command is never cached as deterministic."""
    outcomes = [await run(sh("( (sleep 0.4; echo late-output) & )")), await run(sh("echo second"))]
    await asyncio.sleep(0.6)
    outcomes.append(await run(sh("echo third")))
    _background(outcomes)
