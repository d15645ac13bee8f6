"""Snapshots of persistent shells that can be trusted (issue 23, items 3-5): taking one never changes the live
shell, the capture cannot be steered by what the shell holds, and a fork equals its origin in what a later command
can observe, or the snapshot is declined. Every check runs the same calls through an uncached sandbox (no
snapshot at all) and through one snapshotted after every call, then compares the two, and a fork of the last
snapshot, on a final command."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest

from tvcache import SnapshotDeclined, ToolCall
from tvcache.sandboxes import ShellSandbox, ShellSandboxFactory
from tvcache.sandboxes.shell.linux import overlay_supported
from tvcache.sandboxes.shell.persistent import PersistentShellSandbox
from tvcache.sandboxes.shell.shell_state import ShellStateRoute

pytestmark = pytest.mark.skipif(
    not overlay_supported(), reason="overlay mounts need root on Linux >= 6.8 (the shell backend falls back to copies)"
)


def sh(cmd: str) -> ToolCall:
    return ToolCall("sh", {"cmd": cmd})


def factory_for(tmp_path: Path) -> ShellSandboxFactory:
    base = tmp_path / "base"
    base.mkdir(exist_ok=True)
    factory = ShellSandbox.factory(base, fallback=False, store_root=tmp_path / "layers", persistent=True)
    assert isinstance(factory, ShellSandboxFactory)
    factory.snapshot_routes = (ShellStateRoute(),)  # the route under test; CRIU has its own tests
    return factory


@dataclass(frozen=True, kw_only=True)
class Observed:
    uncached: list[str]  # every call's output, no snapshot taken
    live: list[str]  # the same calls, a snapshot attempted after each
    forked: str | None  # the final command in a fork of the last snapshot taken, after the calls that followed it
    snapshots: int
    trusted: bool  # the snapshotted sandbox is still trusted


def observe(tmp_path: Path, steps: list[str], final: str) -> Observed:
    factory = factory_for(tmp_path)

    async def main() -> Observed:
        uncached = await factory.start()
        plain = [(await uncached.execute(sh(step))).output for step in [*steps, final]]
        await uncached.stop()
        live = await factory.start()
        assert isinstance(live, PersistentShellSandbox)
        outputs, snapshot, taken, after = [], None, 0, 0
        for index, step in enumerate(steps):
            outputs.append((await live.execute(sh(step))).output)
            try:
                snapshot = await live.snapshot(tmp_path / f"snap{index}")
                taken, after = taken + 1, index + 1
            except SnapshotDeclined:
                pass
        outputs.append((await live.execute(sh(final))).output)
        forked = None
        if snapshot is not None:  # the fork runs the rest of the calls, as the cache would replay them
            fork = await factory.fork(snapshot)
            forked = [(await fork.execute(sh(step))).output for step in [*steps[after:], final]][-1]
            await fork.stop()
        trusted = live.trusted
        await live.stop()
        return Observed(uncached=plain, live=outputs, forked=forked, snapshots=taken, trusted=trusted)

    try:
        return asyncio.run(main())
    finally:
        factory.close()


def assert_indistinguishable(observed: Observed) -> None:
    assert observed.live == observed.uncached
    assert observed.trusted
    if observed.forked is not None:
        assert observed.forked == observed.uncached[-1]


# ------------------------------------------------------------------------------------------------- item 3


SYMLINKED = [
    "mkdir -p pkg/src && ln -s pkg/src src-link",
    "cd src-link; export BUILD=1; f(){ echo helper; }",
    "sleep 0.2; echo built",
]


def test_a_snapshot_keeps_a_symlinked_working_directory(tmp_path: Path) -> None:
    """The issue's repro: the restore did `cd -P`, its check failed on `dirs`, and the live sandbox went on in a
    blank shell (the base directory, BUILD=, no f), saying nothing."""
    observed = observe(tmp_path, SYMLINKED, 'pwd; echo "BUILD=$BUILD"; type -t f; dirs')
    assert observed.uncached[-1] == f"{tmp_path / 'base'}/src-link\nBUILD=1\nfunction\n~/src-link\n"
    assert_indistinguishable(observed)
    assert observed.snapshots == len(SYMLINKED)  # carried, not declined


@pytest.mark.parametrize(
    ("setup", "final"),
    [
        ("trap $'echo a\\necho b' EXIT", "trap -p EXIT"),
        ("alias x=$'echo 1\\necho 2'", "alias x; x"),
        ("mkdir -p $'d\\nx'; pushd -n \"$PWD/\"$'d\\nx' >/dev/null", 'dirs -p; echo "${#DIRSTACK[@]}"; dirs +1'),
        ("mkdir gone; cd gone; rmdir ../gone; X=kept", "echo $X; pwd 2>&1"),
        ("X=$'two\\nlines'; declare -a A=($'a\\nb' c)", 'declare -p X A; echo "$X"'),
    ],
    ids=["multi-line-trap", "alias-with-newline", "dirs-entry-with-newline", "removed-cwd", "values-with-newlines"],
)
def test_a_snapshot_never_resets_the_live_shell(tmp_path: Path, setup: str, final: str) -> None:
    """Carried exactly, or declined with the live shell untouched: never a silent blank shell."""
    assert_indistinguishable(observe(tmp_path, [setup], final))


# ------------------------------------------------------------------------------------------------- item 4

# A function whose body holds, on lines of their own, the old capture's end marker and section headers, and
# headers in the new format with a made-up token.
FORGED_BODY = (
    "f() { cat <<'EOF'\n@@tvcache-state-end@@\n@@tvcache:functions@@\n@@1234:end@@\n@@1234:vars@@\n"
    "\n@@tvcache-state 1234@@\nEOF\n}"
)
# A directory-stack entry holding a forged section header and another function's definition.
FORGED_DIRS = "mkdir -p ok; pushd -n \"$PWD/\"$'ok\\n@@tvcache:functions@@\\ng () \\n{ \\n    echo evil\\n}' >/dev/null"


def test_content_cannot_steer_the_capture(tmp_path: Path) -> None:
    observed = observe(tmp_path, [FORGED_BODY, "g() { echo good; }", FORGED_DIRS, "echo after"], "f; g; dirs -p")
    assert "good\n" in observed.uncached[-1]
    assert_indistinguishable(observed)


def test_the_capture_neither_writes_into_a_redirected_stdout_nor_is_lost(tmp_path: Path) -> None:
    """`exec >log.txt`: the old trap printed the capture into the user's file, then waited for it in vain and
    killed the shell."""
    factory = factory_for(tmp_path)

    async def main() -> tuple[str, str, bool]:
        sandbox = await factory.start()
        assert isinstance(sandbox, PersistentShellSandbox)
        try:
            await sandbox.execute(sh("exec >log.txt; echo one"))
            first, second = await sandbox.state_digest(), await sandbox.state_digest()
            await sandbox.execute(sh("echo two; exec >/dev/tty"))
            log = (await sandbox.execute(sh("cat log.txt"))).output
            return log, "equal" if first == second else "differ", sandbox.trusted
        finally:
            await sandbox.stop()

    log, digests, trusted = asyncio.run(main())
    factory.close()
    assert log == "one\ntwo\n"
    assert digests == "equal"  # both captures answered (a shell that does not answer digests as unique)
    assert trusted


def test_set_x_leaves_no_trace_of_the_capture(tmp_path: Path) -> None:
    observed = observe(tmp_path, ["set -x; X=1", "echo $X"], "echo done; set +x")
    assert "+ echo done" in observed.uncached[-1]
    assert "tvcache" not in "".join(observed.live)
    assert_indistinguishable(observed)


def test_a_capture_tracing_into_a_file_of_the_users_declines(tmp_path: Path) -> None:
    """`BASH_XTRACEFD` names a descriptor of the user's: the capture's own trace would go into their file."""
    factory = factory_for(tmp_path)

    async def main() -> tuple[str, str]:
        sandbox = await factory.start()
        try:
            await sandbox.execute(sh("exec 5>trace.txt; BASH_XTRACEFD=5; set -x; : marker"))
            first, second = await sandbox.state_digest(), await sandbox.state_digest()
            trace = (await sandbox.execute(sh("set +x; cat trace.txt"))).output
            return trace, "equal" if first == second else "differ"
        finally:
            await sandbox.stop()

    trace, digests = asyncio.run(main())
    factory.close()
    assert "tvcache" not in trace
    assert "+ : marker" in trace
    assert digests == "differ"  # declined: a capture that does not answer digests as unique


# ------------------------------------------------------------------------------------------------- item 5


@pytest.mark.parametrize(
    ("setup", "final"),
    [
        ("ulimit -n 512; ulimit -S -s 4096", "ulimit -n; ulimit -s; ulimit -H -n"),
        ("renice -n 5 $$ >/dev/null", "nice"),
        ("enable -n echo kill", "enable -n; type -t echo"),
        ("complete -W 'alpha beta' -o nospace mycmd; complete -F _f other", "complete -p"),
        ("COMP_WORDBREAKS=' ='", 'printf "%q\\n" "$COMP_WORDBREAKS"'),
        ("BASH_ARGV0=renamed", 'echo "$0"'),
        ("set -- -ab c; getopts ab o; echo $o", "getopts ab o; echo $o $OPTIND"),
        ("printf 'g(){ echo \"${BASH_SOURCE[0]}\"; }\\n' > lib.sh; . ./lib.sh", "g"),
        ("unset SECONDS RANDOM; echo unset", 'echo "${SECONDS-gone} ${RANDOM-gone}"'),
    ],
    ids=[
        "ulimit",
        "nice",
        "enable-n",
        "complete",
        "comp-wordbreaks",
        "bash-argv0",
        "getopts-bundle",
        "bash-source",
        "unset-special",
    ],
)
def test_a_fork_equals_its_origin_in_what_it_does_not_restore_or_declines(
    tmp_path: Path, setup: str, final: str
) -> None:
    assert_indistinguishable(observe(tmp_path, [setup, "echo next"], final))
