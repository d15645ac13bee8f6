"""The persistent shell's protocol against a command that tries to forge its status or break the protocol
(issue 23, items 1, 2, 6 and 7), on the overlay flavour; the Docker flavour runs the same cases in
tests/test_docker.py. Also the out-of-band reader itself (``bash_observer``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from shell_trust_cases import CASES, Case, Run, run_background_case, run_case, sh
from tvcache.sandboxes import ShellSandbox, ShellSandboxFactory
from tvcache.sandboxes.shell.linux import overlay_supported
from tvcache.sandboxes.shell.pty_shell import decode_prompt

pytestmark = pytest.mark.skipif(not overlay_supported(), reason="overlay mounts need root on Linux >= 6.8")


def factory_for(tmp_path: Path) -> ShellSandboxFactory:
    base = tmp_path / "base"
    base.mkdir(exist_ok=True)
    factory = ShellSandbox.factory(base, fallback=False, store_root=tmp_path / "layers", persistent=True)
    assert isinstance(factory, ShellSandboxFactory)
    return factory


def on_one_sandbox(tmp_path: Path, check: Callable[[Run], Awaitable[None]]) -> None:
    """``check`` over one fresh persistent sandbox's ``execute``, everything stopped after."""
    factory = factory_for(tmp_path)

    async def main() -> None:
        sandbox = await factory.start()
        try:
            await check(sandbox.execute)
        finally:
            await sandbox.stop()

    try:
        asyncio.run(main())
    finally:
        factory.close()


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_a_command_cannot_forge_or_break_the_protocol(tmp_path: Path, case: Case) -> None:
    on_one_sandbox(tmp_path, lambda run: run_case(run, case))


def test_output_from_a_background_process_is_not_deterministic(tmp_path: Path) -> None:
    on_one_sandbox(tmp_path, run_background_case)


def test_exec_of_another_program_ends_the_call_and_untrusts_the_sandbox(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)

    async def main() -> list[str]:
        sandbox = await factory.start()
        try:
            outputs = [(await sandbox.execute(sh("exec bash --norc -i"))).output]
            outputs.append((await sandbox.execute(sh("echo after"))).output)
            assert not sandbox.trusted
            return outputs
        finally:
            await sandbox.stop()

    try:
        replaced, after = asyncio.run(main())
    finally:
        factory.close()
    assert "replaced itself" in replaced or "shell ended" in replaced
    assert after.endswith("after\n")


@pytest.mark.parametrize(
    ("raw", "decoded"),
    [
        (b"", b""),
        (b"(.venv) ", b"(.venv) "),
        (b"\\s-\\v\\$ ", b"bash-5.2# "),
        (b"(.venv) \\u@\\h:\\[\\e[1m\\]x\\[\\e[0m\\] ", b"(.venv) root@box:\x1b[1mx\x1b[0m "),
        (b"\\101\\n", b"A\n"),
        (b"\\w$ ", None),  # the directory: not fixed
        (b"$(date) ", None),  # an expansion
        (b"\\# ", None),  # the command number
    ],
)
def test_prompts_decode_only_when_fixed(raw: bytes, decoded: bytes | None) -> None:
    escapes = {"s": "bash", "v": "5.2", "$": "#", "u": "root", "h": "box"}
    assert decode_prompt(raw, escapes) == decoded


@pytest.mark.parametrize("last", ["false | true", "true | false | true", "echo a b", "(exit 3)"])
def test_a_fork_shows_the_pipestatus_status_and_underscore_of_its_origin(tmp_path: Path, last: str) -> None:
    """Item 6 across a fork (shell-state route): ``PIPESTATUS``, ``$?`` and ``$_`` as the origin's next command
    sees them, and the namespace's next PID too (the pipeline that restores PIPESTATUS is paid for)."""
    factory = factory_for(tmp_path)
    observe = 'echo "${PIPESTATUS[*]} | $? | $_"; sleep 0 & echo $!'

    async def main() -> tuple[str, str, str]:
        live = await factory.start()
        try:
            await live.execute(sh("X=1"))
            await live.execute(sh(last))
            snapshot = await live.snapshot(tmp_path / "snap")
            fork = await factory.fork(snapshot)
            try:
                forked = (await fork.execute(sh(observe))).output
            finally:
                await fork.stop()
            truth = (await live.execute(sh(observe))).output
            factory.discard(snapshot)
            return snapshot.meta["route"], truth, forked
        finally:
            await live.stop()

    try:
        route, truth, forked = asyncio.run(main())
    finally:
        factory.close()
    assert route == "shell-state"
    assert forked.splitlines()[:2] == truth.splitlines()[:2]


def test_a_capture_is_framed_whatever_ifs_is(tmp_path: Path) -> None:
    """The capture's token is read with the user's IFS out of the way: under ``IFS=0`` a token ending in 0 (one
    in sixteen) lost that digit, no header matched, and the capture's text opened the next call's output."""
    factory = factory_for(tmp_path)

    async def main() -> list[str]:
        sandbox = await factory.start()
        try:
            await sandbox.execute(sh("IFS=0"))
            outputs = []
            for _ in range(80):  # every token an old capture drew: (15/16)**80 < 1% that none ended in 0
                await sandbox.state_digest()
                outputs.append((await sandbox.execute(sh("echo ok"))).output)
            return outputs
        finally:
            await sandbox.stop()

    try:
        outputs = asyncio.run(main())
    finally:
        factory.close()
    assert set(outputs) == {"ok\n"}
