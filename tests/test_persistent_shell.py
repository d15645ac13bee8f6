"""Persistent shell sandboxes: state across calls, the sentinel protocol under bad input, timeouts, a shell that
ends, snapshots by route (shell state, declined) whose forks are indistinguishable, and no leaks."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import random
import re
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tvcache import AlwaysSnapshot, Cache, SandboxError, Snapshot, SnapshotDeclined, ToolCall
from tvcache.sandboxes import ShellSandbox, ShellSandboxFactory
from tvcache.sandboxes.shell import linux
from tvcache.sandboxes.shell.criu import criu_unavailable_reason, find_criu
from tvcache.sandboxes.shell.criu_route import CriuRoute
from tvcache.sandboxes.shell.linux import overlay_supported
from tvcache.sandboxes.shell.persistent import NEW_SHELL_NOTE, PERSISTENT_KIND
from tvcache.sandboxes.shell.shell_state import ShellStateRoute
from tvcache.sandboxes.shell.zygote_process import SPARES

pytestmark = pytest.mark.skipif(
    not overlay_supported(), reason="overlay mounts need root on Linux >= 6.8 (the shell backend falls back to copies)"
)

CRIU = find_criu(warn=False) if overlay_supported() else None

# What a later command can observe of the shell itself (bash's dynamic variables print no value in declare -p).
OBSERVE = 'declare -p; declare -f; alias; shopt; set -o; umask; trap -p; dirs; pwd; echo "$? $_ $# $* $LINENO"'


def sh(cmd: str, **extra: object) -> ToolCall:
    return ToolCall("sh", {"cmd": cmd, **extra})


def factory_for(tmp_path: Path, **options: object) -> ShellSandboxFactory:
    base = tmp_path / "base"
    if not base.exists():
        (base / "sub").mkdir(parents=True)
        (base / "a.txt").write_text("base\n")
    factory = ShellSandbox.factory(base, fallback=False, store_root=tmp_path / "layers", persistent=True, **options)
    assert isinstance(factory, ShellSandboxFactory)
    return factory


def run(factory: ShellSandboxFactory, commands: list[str], **extra: object) -> list[str]:
    async def main() -> list[str]:
        sandbox = await factory.start()
        try:
            return [(await sandbox.execute(sh(command, **extra))).output for command in commands]
        finally:
            await sandbox.stop()

    return asyncio.run(main())


def test_the_shell_state_persists_between_calls(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)
    outputs = run(
        factory,
        [
            "cd sub; X=1; export Y=2; f() { echo in-f; }; alias hi='echo hello'; umask 027; set -o noclobber",
            'pwd; echo "$X $Y"; f; hi; umask; set -o | grep noclobber; env | grep -c "^X="',
            "false",
            'echo "$?"',
            "echo $LINENO",
        ],
    )
    factory.close()
    assert outputs[1] == f"{factory.base}/sub\n1 2\nin-f\nhello\n0027\nnoclobber      \ton\n0\n[exit code 1]"
    assert outputs[2] == "[exit code 1]"
    assert outputs[3] == "1\n"
    assert outputs[4] == "5\n"  # one line per call, as typed at a terminal


def test_bad_input_never_breaks_the_protocol(tmp_path: Path) -> None:
    factory = factory_for(tmp_path, max_output_bytes=1000)
    fake = "printf '\\n%s 1 0\\n' 0123456789abcdef0123456789abcdef; echo still"
    outputs = run(
        factory,
        [
            "if then fi",
            "echo 'unterminated",
            "cat <<EOF\nno end",
            fake,
            "cat; read line; echo read=$?",
            "head -c 5000 /dev/zero | tr '\\0' x",
            "printf '\\x00\\xff\\x01'",
            "stty -F /dev/tty sane echo icanon; echo after-stty",
            "echo ok",
        ],
    )
    factory.close()
    assert "syntax error" in outputs[0]
    assert outputs[0].endswith("[exit code 2]")
    assert "unexpected EOF" in outputs[1]
    assert "here-document at line 3 delimited by end-of-file" in outputs[2]
    assert "no end" in outputs[2]
    assert outputs[3].endswith("still\n")
    assert outputs[4] == "read=1\n"  # stdin is at end of file: nothing waits
    assert outputs[5].startswith("x" * 1000)
    assert "[output truncated: first 1000 of 5000 bytes shown]" in outputs[5]
    assert outputs[6] == "\x00\ufffd\x01"
    assert outputs[7] == "after-stty\r\n"  # as a terminal shows it; the next command gets raw mode back
    assert outputs[8] == "ok\n"


def test_a_timeout_interrupts_the_foreground_job_and_the_shell_lives_on(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)

    async def main() -> list[tuple[str, bool]]:
        sandbox = await factory.start()
        try:
            steps = ["X=kept", "sleep 100", "trap '' INT; sleep 100", "trap - INT; while :; do :; done", "echo $X"]
            results = []
            for step in steps:
                outcome = await sandbox.execute(sh(step, timeout=0.5))
                results.append((outcome.output, outcome.deterministic))
            return results
        finally:
            await sandbox.stop()

    results = asyncio.run(main())
    factory.close()
    for output, deterministic in results[1:4]:
        assert output.endswith("[timed out after 0.5s]")
        assert not deterministic
    assert results[4] == ("kept\n", True)


@pytest.mark.parametrize("ending", ["exit 3", "exec false"])
def test_a_command_that_ends_the_shell_leaves_the_sandbox_untrusted(tmp_path: Path, ending: str) -> None:
    factory = factory_for(tmp_path)

    async def main() -> None:
        sandbox = await factory.start()
        await sandbox.execute(sh("X=1; echo data > f.txt"))
        ended = await sandbox.execute(sh(ending))
        assert ended.is_error
        assert not ended.deterministic
        assert "[the shell ended with code" in ended.output
        after = await sandbox.execute(sh("echo x=$X; cat f.txt"))
        assert after.output == f"{NEW_SHELL_NOTE}\nx=\ndata\n"  # a new shell, the same files
        assert not after.deterministic
        assert not sandbox.trusted
        with pytest.raises(SnapshotDeclined, match="shell ended"):
            await sandbox.snapshot(tmp_path / "snap")
        await sandbox.stop()

    asyncio.run(main())
    assert factory.route_counts() == {"declined": 1}
    factory.close()


def test_what_a_command_prints_before_it_ends_the_shell_is_in_its_output(tmp_path: Path) -> None:
    """The reader holds back a tail that may be the start of the sentinel; when the shell ends no sentinel can
    come, and that tail (here all of ``abc``) is output the harness's terminal would show."""
    factory = factory_for(tmp_path)

    async def main() -> str:
        sandbox = await factory.start()
        try:
            return (await sandbox.execute(sh("printf abc; exit 3"))).output
        finally:
            await sandbox.stop()

    output = asyncio.run(main())
    factory.close()
    assert output.startswith("abc")  # then bash's own "exit", as an interactive shell prints it
    assert "[the shell ended with code 3" in output


def test_reading_the_state_does_not_swallow_a_job_notification(tmp_path: Path) -> None:
    """``jobs -l`` marks finished jobs as reported: a capture that ran it (a snapshot attempt, a state digest)
    made the shell skip the "Done" line a terminal shows next."""
    factory = factory_for(tmp_path)

    async def main(capture: bool) -> str:
        sandbox = await factory.start()
        try:
            await sandbox.execute(sh("sleep 0.1 &"))
            shell = sandbox._shell  # the job ends while bash waits at its prompt: reported with the next command
            assert shell is not None
            deadline = time.monotonic() + 10
            while shell.children() and time.monotonic() < deadline:  # noqa: ASYNC110 - a process, not an event
                await asyncio.sleep(0.01)
            if capture:
                await sandbox.state_digest()
            return "".join([(await sandbox.execute(sh(command))).output for command in ("echo after", "true")])
        finally:
            await sandbox.stop()

    captured, plain = asyncio.run(main(True)), asyncio.run(main(False))
    factory.close()
    assert "Done" in plain
    assert captured == plain


def test_kill_9_of_the_shell_itself_is_ignored_as_for_any_namespace_init(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)
    outputs = run(factory, ["X=1; kill -9 $$; echo $$", "echo $X"])
    factory.close()
    assert outputs == ["1\n", "1\n"]


HISTORY = [
    "cd sub && mkdir -p deep && cd deep",
    "X=1; export Y='two words'; declare -a A=(1 '2 3'); declare -A M=([k]=v); readonly R=1; declare -n N=X",
    "f() { echo \"f $1\"; }; export -f f; alias ll='ls -l'; shopt -s extglob; set -o noclobber; umask 027",
    "trap 'echo bye' EXIT; trap 'true' USR1; pushd /tmp >/dev/null; pushd /; cd -; set -- a 'b c'",
    "unset HOME; export -n PATH; [[ abc =~ (b) ]]; ls >/dev/null; (:); PS1='$ '; false",
]


def test_a_fork_is_indistinguishable_from_the_shell_that_ran_the_history(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)

    async def main() -> tuple[str, str, str]:
        uncached = await factory.start()
        for step in HISTORY:
            await uncached.execute(sh(step))
        truth = (await uncached.execute(sh(OBSERVE))).output
        await uncached.stop()
        live = await factory.start()
        for step in HISTORY:
            await live.execute(sh(step))
        snapshot = await live.snapshot(tmp_path / "snap")
        assert snapshot.kind == PERSISTENT_KIND
        assert snapshot.meta["route"] == "shell-state"
        after_snapshot = (await live.execute(sh(OBSERVE))).output
        fork = await factory.fork(snapshot)
        forked = (await fork.execute(sh(OBSERVE))).output
        await live.stop()
        await fork.stop()
        return truth, after_snapshot, forked

    truth, after_snapshot, forked = asyncio.run(main())
    assert factory.route_counts() == {"shell-state": 1}
    factory.close()
    assert 'declare -x Y="two words"' in truth
    assert "f ()" in truth
    assert "alias ll='ls -l'" in truth
    assert after_snapshot == truth
    assert forked == truth


# What a warm shell could differ in from a cold one, beyond OBSERVE: its PIDs, descriptors, confinement, the
# mounts its confinement made (without mount ids and superblock options, which differ between any two sandboxes;
# the host's own mounts are those of the moment its namespace was made, cold or warm), history and job table.
PROCESS_VIEW = (
    "echo $$ $BASHPID $PPID $HISTCMD; history | wc -l; jobs; ls /proc/1/fd; "
    "readlink /proc/1/cwd; grep -E '^(Sig(Blk|Ign|Cgt)|Cap|NoNewPrivs|Seccomp|NSpid|Umask)' /proc/1/status; "
    "awk -v B={base} '$5 ~ /^[/](tmp|var[/]tmp|run|proc|dev([/](shm|null|zero|full|random|urandom|tty))?)$/ "
    "|| $5 == B {{ print $4, $5, $9 }}' /proc/1/mountinfo; hostname; ls -a /tmp /dev"
)


def test_a_warm_fork_is_indistinguishable_from_a_cold_one(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)
    probe = [OBSERVE, PROCESS_VIEW.format(base=factory.base), "echo $SECONDS", "sleep 0 & echo $!"]

    async def forked(snapshot: Snapshot) -> list[str]:
        sandbox = await factory.fork(snapshot)
        try:
            return [(await sandbox.execute(sh(command))).output for command in probe]
        finally:
            await sandbox.stop()

    async def main() -> tuple[list[str], list[str], list[str]]:
        live = await factory.start()
        for step in HISTORY:
            await live.execute(sh(step))
        snapshot = await live.snapshot(tmp_path / "snap")  # its own restore starts the pool's filler
        await live.stop()
        warm_shells, factory.warm_shells = factory.warm_shells, 0
        cold = await forked(snapshot)
        factory.warm_shells = warm_shells
        pool = factory.warm_pool()
        assert pool is not None
        assert await asyncio.to_thread(pool.wait_ready, 1)
        # $SECONDS counts whole seconds: only a warm shell older than one second can show it restarted at the fork.
        await asyncio.sleep(1.5)
        served = pool.served
        warm = await forked(snapshot)
        assert pool.served == served + 1
        assert pool.failures == 0
        assert await asyncio.to_thread(pool.wait_ready)  # full: the filler waits for the next take
        for shell in [shell for _, shell in pool._ready]:
            shell.kill()  # dead warm shells are passed over: the next fork gets a cold shell
            assert shell.spawned is not None
            assert shell.spawned.wait(5)
        fallback = await forked(snapshot)
        assert pool.served == served + 1
        factory.discard(snapshot)
        return cold, warm, fallback

    cold, warm, fallback = asyncio.run(main())
    factory.close()
    # $SECONDS is compared by its range: a second may begin between any two shells' reads, cold or warm.
    seconds = [outputs.pop(2).removeprefix("$ ") for outputs in (cold, warm, fallback)]
    assert warm == cold
    assert fallback == cold
    assert set(seconds) <= {"0\n", "1\n"}  # counted from the fork, not from the (older) warm shell's start


def test_a_warm_shell_that_ends_while_it_resumes_gives_way_to_a_cold_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tvcache.sandboxes.shell import pty_shell

    factory = factory_for(tmp_path)

    async def main() -> tuple[str, str, int, int]:
        live = await factory.start()
        await live.execute(sh("cd sub; V=kept"))
        snapshot = await live.snapshot(tmp_path / "snap")
        truth = (await live.execute(sh(OBSERVE))).output
        await live.stop()
        pool = factory.warm_pool()
        assert pool is not None
        assert await asyncio.to_thread(pool.wait_ready)
        # The snapshot's own restores may have found a warm shell ready, or not (timing): count from here.
        served, failures = pool.served, pool.failures
        # As when the shell cannot write its namespace's last PID: it exits before it is ready.
        monkeypatch.setattr(pty_shell, "WARM_HEAD", "builtin exit 97\n{last_pid}")
        fork = await factory.fork(snapshot)
        forked = (await fork.execute(sh(OBSERVE))).output
        await fork.stop()
        factory.discard(snapshot)
        return truth, forked, pool.served - served, pool.failures - failures

    truth, forked, served, failures = asyncio.run(main())
    assert served == 1
    assert failures == 1
    factory.close()
    assert forked == truth


def test_hundreds_of_warm_forks_leave_only_the_pool_and_it_ends_with_the_factory(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)
    processes = _own_processes()
    outputs: set[str] = set()

    async def main() -> None:
        live = await factory.start()
        await live.execute(sh("cd sub; V=kept"))
        snapshot = await live.snapshot(tmp_path / "snap")
        await live.stop()
        for _ in range(200):
            fork = await factory.fork(snapshot)
            # Whether bash notes the job's end ("Done") before it waits again is timing, as at a terminal.
            outputs.add(_without_job_notices((await fork.execute(sh("echo $V $PWD; sleep 0 & echo $!"))).output))
            await fork.stop()
        factory.discard(snapshot)

    asyncio.run(main())
    pool = factory.warm_pool()
    assert pool is not None
    assert pool.served > 10  # forks got warm shells (the others cold ones, while the pool refilled)
    assert pool.failures == 0
    assert outputs == {f"kept {factory.base}/sub\n[1] 2\n2\n"}  # warm or cold, the same shell
    zygote = factory.zygote.pid
    assert zygote is not None
    assert len(_descendants(zygote)) <= SPARES + factory.warm_shells  # the spares and the warm shells only
    assert factory.store.live_layers() == []
    with open("/proc/self/mountinfo") as handle:
        assert not [line for line in handle if str(tmp_path) in line]
    factory.close()
    assert len(pool) == 0
    _assert_gone(_own_processes() - processes)


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        ("sleep 60 &", "process"),
        ("coproc cat", "process"),
        ("exec 3>log.txt", "descriptors"),
        ("sleep 0 & wait", r"\$!"),
        ("trap 'echo x' DEBUG", "DEBUG"),
        ("trap 'echo x' ERR", "ERR trap"),
        ("g() { echo $LINENO; }", "LINENO"),
        ("echo kept > /tmp/f", "private tmpfs directories \\(/tmp/f\\)"),
        ("mkdir /dev/shm/d; touch /dev/x", "private tmpfs directories \\(/dev/x, /dev/shm/d\\)"),
    ],
)
def test_what_the_shell_state_route_cannot_carry_is_declined(tmp_path: Path, setup: str, reason: str) -> None:
    factory = factory_for(tmp_path)
    factory.snapshot_routes = (ShellStateRoute(),)  # the CRIU route, where it works, carries them all (below)

    async def main() -> str:
        sandbox = await factory.start()
        try:
            await sandbox.execute(sh(setup))
            with pytest.raises(SnapshotDeclined, match=reason):
                await sandbox.snapshot(tmp_path / "snap")
            return (await sandbox.execute(sh("echo goes on"))).output
        finally:
            await sandbox.stop()

    output = asyncio.run(main())
    assert "goes on\n" in output  # a DEBUG trap prints around it
    assert NEW_SHELL_NOTE not in output
    assert factory.route_counts() == {"declined": 1}
    factory.close()


def test_a_state_too_large_to_capture_declines_and_the_shell_goes_on(tmp_path: Path) -> None:
    # A 7 MB variable is one `x=$(cat big.log)` away. Its capture passes MAX_STATE_BYTES: the snapshot is declined
    # by every route (CRIU's restore is checked against a capture too), and the live shell keeps its state - the
    # capture once ended the shell there, and the next call said a new shell was started.
    factory = factory_for(tmp_path)

    async def main() -> str:
        sandbox = await factory.start()
        try:
            await sandbox.execute(sh("x=$(seq 1 1000000); f() { echo kept; }"))
            with pytest.raises(SnapshotDeclined, match="over 4 MiB"):
                await sandbox.snapshot(tmp_path / "snap")
            return (await sandbox.execute(sh('echo "${#x}"; f'))).output
        finally:
            await sandbox.stop()

    assert asyncio.run(main()) == "6888895\nkept\n"
    assert factory.route_counts() == {"declined": 1}
    factory.close()


needs_criu = pytest.mark.skipif(
    CRIU is None, reason=f"no working CRIU: {criu_unavailable_reason() or 'overlay mounts need root'} (make criu)"
)
# What the shell-state route cannot carry, all at once: jobs, a coproc, a descriptor, an ERR trap, a function
# reading $LINENO, files in the private /tmp and /dev/shm.
CRIU_HISTORY = [
    "cd sub; X=1; export Y=2; f() { echo f; }",
    "sleep 60 & coproc cat",
    "exec 3>log.txt; trap 'echo err' ERR; g() { echo $LINENO; }; echo kept > /tmp/f; echo shm > /dev/shm/s",
]
CRIU_CHECK = (
    OBSERVE + "; jobs -l; cat /tmp/f /dev/shm/s; echo line >&3; cat log.txt; "
    'echo ping >&"${COPROC[1]}"; read -r -t 5 l <&"${COPROC[0]}"; echo "$l"; g; false; sleep 1 & echo $!'
)


@needs_criu
def test_the_criu_route_carries_what_the_shell_state_route_cannot(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)

    async def main() -> tuple[str, str, str, Snapshot]:
        uncached = await factory.start()
        for step in CRIU_HISTORY:
            await uncached.execute(sh(step))
        truth = (await uncached.execute(sh(CRIU_CHECK))).output
        await uncached.stop()
        live = await factory.start()
        for step in CRIU_HISTORY:
            await live.execute(sh(step))
        snapshot = await live.snapshot(tmp_path / "snap")
        assert Path(snapshot.meta["shell"]["images"]).is_dir()
        fork = await factory.fork(snapshot)
        after_snapshot = (await live.execute(sh(CRIU_CHECK))).output
        forked = (await fork.execute(sh(CRIU_CHECK))).output
        await live.stop()
        await fork.stop()
        return truth, after_snapshot, forked, snapshot

    truth, after_snapshot, forked, snapshot = asyncio.run(main())
    assert snapshot.meta["route"] == "criu"
    assert snapshot.bytes >= snapshot.meta["shell"]["image_bytes"] > 0  # counted against the byte budget
    assert factory.route_counts() == {"criu": 1}
    factory.discard(snapshot)
    assert not Path(snapshot.meta["shell"]["images"]).exists()
    factory.close()
    assert "Running                 sleep 60 &" in truth
    assert "kept\nshm\nline\nping\n" in truth
    assert after_snapshot == truth
    assert forked == truth  # the new job's PID ($!) included: the namespace's last PID is carried too


def _without_job_notices(output: str) -> str:
    return "".join(line for line in output.splitlines(keepends=True) if not re.match(r"\[\d+\][+-]? +Done ", line))


@needs_criu
def test_processes_that_move_the_state_on_by_themselves_still_fork(tmp_path: Path) -> None:
    """A job that forks all the time moves the namespace's last PID, and one that ends changes the job table,
    between the capture before the dump and any check after a restore: that, and only that, may differ."""
    factory = factory_for(tmp_path)

    async def main() -> tuple[str, str, bool]:
        live = await factory.start()
        await live.execute(sh("X=1; (while :; do /bin/true; done) & sleep 0.2 & sleep 0.1"))
        snapshot = await live.snapshot(tmp_path / "snap")
        fork = await factory.fork(snapshot)
        answers = (await live.execute(sh("echo $X"))).output, (await fork.execute(sh("echo $X"))).output
        trusted = live.trusted and fork.trusted
        await live.stop()
        await fork.stop()
        factory.discard(snapshot)
        return *answers, trusted

    # The job that ended is noted ("[2]+ Done") by whichever shell reads a command after it ended: timing.
    live, forked, trusted = asyncio.run(main())
    assert (_without_job_notices(live), _without_job_notices(forked), trusted) == ("1\n", "1\n", True)
    assert factory.route_counts() == {"criu": 1}
    factory.close()


def test_a_capture_amid_a_storm_of_child_signals_is_taken_and_the_shell_goes_on(tmp_path: Path) -> None:
    """Orphans reparented to bash (PID 1 of its namespace) end all the time, so SIGCHLD keeps arriving: a capture
    signal taken while bash's SIGCHLD handler runs is left pending by the read that handler restarts. The capture
    sends it again instead of waiting out its time limit and ending the shell."""
    factory = factory_for(tmp_path)

    async def main() -> tuple[str, bool]:
        sandbox = await factory.start()
        try:
            await sandbox.execute(sh("X=kept; (while :; do (/bin/true &); done) >/dev/null 2>&1 &"))
            for _ in range(20):
                await sandbox.state_digest()
            return (await sandbox.execute(sh('echo "$X"'))).output, sandbox.trusted
        finally:
            await sandbox.stop()

    assert asyncio.run(main()) == ("kept\n", True)
    factory.close()


def test_without_criu_live_processes_decline_the_snapshot(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)
    factory.snapshot_routes = (ShellStateRoute(), CriuRoute(find=lambda: None))

    async def main() -> str:
        sandbox = await factory.start()
        try:
            await sandbox.execute(sh("X=1; sleep 60 &"))
            with pytest.raises(SnapshotDeclined, match=r"shell-state: 1 process.*; criu: no working CRIU"):
                await sandbox.snapshot(tmp_path / "snap")
            return (await sandbox.execute(sh("echo $X; jobs"))).output
        finally:
            await sandbox.stop()

    assert asyncio.run(main()).startswith("1\n[1]+  Running")
    assert factory.route_counts() == {"declined": 1}
    assert not (tmp_path / "snap.criu").exists()
    factory.close()


# A process another one traces: CRIU cannot seize it (as with anything else it cannot carry, the dump fails).
TRACED = """python3 -c 'import ctypes, os, time
if os.fork() == 0:
    print("traced", ctypes.CDLL(None).ptrace(0, 0, 0, 0), flush=True)
time.sleep(60)' &"""


@needs_criu
def test_what_criu_cannot_carry_declines_and_the_shell_goes_on(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)

    async def main() -> tuple[str, bool]:
        sandbox = await factory.start()
        try:
            await sandbox.execute(sh(f"X=1; {TRACED} sleep 0.3"))
            with pytest.raises(SnapshotDeclined, match="(?s)criu: CRIU could not dump.*Unseizable"):
                await sandbox.snapshot(tmp_path / "snap")
            return (await sandbox.execute(sh("echo $X; jobs"))).output, sandbox.trusted
        finally:
            await sandbox.stop()

    output, trusted = asyncio.run(main())
    assert output.startswith("1\n[1]+  Running")  # the dump failed cleanly: the tree went on
    assert trusted
    assert factory.route_counts() == {"declined": 1}
    assert not (tmp_path / "snap.criu").exists()
    factory.close()


@needs_criu
def test_no_space_for_the_image_declines_cleanly(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    linux.mount("tmpfs", str(tiny), "tmpfs", 0, "size=64k")

    async def main() -> str:
        sandbox = await factory.start()
        try:
            await sandbox.execute(sh("X=1; sleep 60 &"))
            with pytest.raises(SnapshotDeclined, match="CRIU could not dump"):
                await sandbox.snapshot(tiny / "snap")
            return (await sandbox.execute(sh("echo $X; jobs"))).output
        finally:
            await sandbox.stop()

    try:
        output = asyncio.run(main())
        assert os.listdir(tiny) == []  # the partial image is gone
    finally:
        linux.umount(str(tiny))
    assert output.startswith("1\n[1]+  Running")
    assert factory.route_counts() == {"declined": 1}
    factory.close()


@needs_criu
@pytest.mark.serial  # it races CRIU on purpose (a kill while it dumps)
def test_criu_killed_mid_dump_declines_and_leaves_nothing_behind(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)
    images = tmp_path / "snap.criu"
    killed: list[int] = []

    def kill_criu_once_it_dumps() -> None:
        found: int | None = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not killed:
            if found is None:  # CRIU is a child of this process (started from a worker thread)
                for pid in _descendants(os.getpid()):
                    with contextlib.suppress(OSError, ValueError):
                        parent = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
                        # Not one of the helpers CRIU forks, which have its command line too and come and go.
                        if parent == os.getpid() and str(images).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                            found = pid
            elif (images / "dump.log").exists():  # CRIU logs as it starts to seize the tree
                os.kill(found, signal.SIGKILL)
                killed.append(found)

    async def main() -> tuple[str, bool]:
        sandbox = await factory.start()
        try:
            await sandbox.execute(sh("X=1; sleep 60 &"))
            killer = threading.Thread(target=kill_criu_once_it_dumps)
            killer.start()
            try:
                with pytest.raises(SnapshotDeclined, match="CRIU could not dump"):
                    await sandbox.snapshot(tmp_path / "snap")
            finally:
                killer.join()
            return (await sandbox.execute(sh("echo $X", timeout=20))).output, sandbox.trusted
        finally:
            await sandbox.stop()

    processes = _own_processes()
    output, trusted = asyncio.run(main())
    assert killed
    # A SIGKILL leaves the tree as CRIU held it: running on (the sandbox goes on), or gone with the parasite code
    # CRIU had put in it (the shell ended: a new one, and nothing cached from this sandbox any more).
    assert output == "1\n" if trusted else output == f"{NEW_SHELL_NOTE}\n\n"
    assert factory.route_counts() == {"declined": 1}
    assert not images.exists()
    zygote = factory.zygote.pid
    assert _own_processes() - processes - {zygote} - _descendants(zygote or 0) == set()
    factory.close()


@needs_criu
def test_a_restore_that_fails_raises_and_the_cache_rebuilds_the_state(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)
    cache = Cache(tmp_path / "cache", snapshot_policy=AlwaysSnapshot())
    stem = ["cd sub; X=1", "sleep 60 & Y=2", "echo $X $Y; jobs"]
    first, second = [*stem, "echo first"], [*stem, "echo second $X $Y"]

    async def rollout(commands: list[str]) -> list[str]:
        async with cache.session("task", sandbox=factory) as session:
            return [(await session.call("sh", {"cmd": command})).output for command in commands]

    def corrupt(directory: Path) -> None:
        dumps = sorted(directory.rglob("*.criu"))
        assert dumps, "no CRIU snapshot was taken"
        for dump in dumps:  # every CRIU image turns unreadable: each fork of one fails
            for image in dump.glob("core-*.img"):
                image.write_bytes(b"\x00garbage" * 64)

    async def main() -> tuple[list[str], list[str]]:
        live = await factory.start()
        for command in stem:
            await live.execute(sh(command))
        snapshot = await live.snapshot(tmp_path / "direct" / "snap")
        await live.stop()
        corrupt(tmp_path / "direct")
        keepers = factory.criu_keepers()
        assert keepers is not None
        processes = _own_processes() - keepers.idle_pids()
        with pytest.raises(SandboxError, match="criu restore failed"):
            await factory.fork(snapshot)
        # The failed restore left nothing (the keeper that replaces the one it took is started behind it).
        for _ in range(100):
            if _own_processes() - keepers.idle_pids() == processes:
                break
            await asyncio.sleep(0.05)
        assert _own_processes() - keepers.idle_pids() == processes
        factory.discard(snapshot)
        truth = await _uncached(factory, second)
        await rollout(first)
        corrupt(tmp_path / "cache")
        with pytest.warns(RuntimeWarning, match="forking the snapshot of node"):
            answers = await rollout(second)
        return truth, answers

    truth, answers = asyncio.run(main())
    stats = cache.stats()
    cache.close()
    assert answers == truth
    assert stats.forks_failed >= 1
    with open("/proc/self/mountinfo") as handle:
        assert not [line for line in handle if str(tmp_path) in line]
    factory.close()


async def _uncached(factory: ShellSandboxFactory, commands: list[str]) -> list[str]:
    sandbox = await factory.start()
    try:
        return [(await sandbox.execute(sh(command))).output for command in commands]
    finally:
        await sandbox.stop()


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid``: each thread lists the children it forked (worker threads start CRIU)."""
    found, pending = set(), [pid]
    while pending:
        parent = pending.pop()
        children: set[int] = set()
        with contextlib.suppress(OSError):  # a process that ended meanwhile
            for task in os.listdir(f"/proc/{parent}/task"):
                with open(f"/proc/{parent}/task/{task}/children") as handle:
                    children |= {int(child) for child in handle.read().split()}
        pending += children - found
        found |= children
    return found


def _own_processes() -> set[int]:
    """This test process's descendants: the zygote, its spares, shells, CRIU keepers and restored trees."""
    return _descendants(os.getpid())


def _criu_scratch() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"tvcache-criu-{os.getpid()}-*")))


# Steps of the leak test's rollouts, by weight: plain calls keep bash alone (shell-state route), a background
# job takes the CRIU route (where it works) until it is killed, a DEBUG trap declines every route.
# Each CRIU cycle costs ~0.2 s of dump and ~0.2 s per restore: the default run keeps ~30 of them (~15 s), the
# slow one hundreds. A job started in a subshell leaves no `$!` (which only the CRIU route carries): once it is
# killed and reaped, bash is alone again and the shell-state route takes over.
KILL = 'pkill -x sleep; until ! read -r c </proc/1/task/1/children || [ -z "$c" ]; do :; done; '
CYCLE_STEPS = [
    (55, KILL + "V={step}; echo {step} >> f.txt"),
    (10, "(sleep 60 &); V={step}"),
    (5, "trap 'true' DEBUG; V={step}"),
    (15, "trap - DEBUG; V={step}"),
]
LONG_CYCLE_STEPS = [
    (40, "V={step}; echo {step} >> f.txt"),
    (15, "sleep 60 & V={step}"),
    (30, KILL + "V={step}"),
    (5, "trap 'true' DEBUG; V={step}"),
    (10, "trap - DEBUG; V={step}"),
]


@pytest.mark.parametrize(
    ("steps", "table", "expected_criu"),
    [(240, CYCLE_STEPS, 5), pytest.param(700, LONG_CYCLE_STEPS, 100, marks=pytest.mark.slow)],
    ids=["default", "hundreds-of-criu-cycles"],
)
def test_many_snapshot_fork_stop_cycles_leave_nothing_behind(
    tmp_path: Path, steps: int, table: list[tuple[int, str]], expected_criu: int
) -> None:
    factory = factory_for(tmp_path)
    store = factory.store
    rng = random.Random(13)
    weights = [weight for weight, _ in table]
    processes, scratch = _own_processes(), _criu_scratch()
    snaps = tmp_path / "snaps"

    async def main() -> None:
        live = [await factory.start()]
        snapshots = []
        for step in range(steps):
            if not live:
                live.append(await factory.start())
            choice = rng.random()
            if choice < 0.4 and live:
                sandbox = rng.choice(live)
                command = rng.choices(table, weights)[0][1].format(step=step)
                await sandbox.execute(sh(command))
                with contextlib.suppress(SnapshotDeclined):
                    snapshots.append(await sandbox.snapshot(snaps / f"s{step}"))
            elif choice < 0.65 and snapshots:
                live.append(await factory.fork(rng.choice(snapshots)))
            elif choice < 0.8 and snapshots:
                factory.discard(snapshots.pop(rng.randrange(len(snapshots))))
            elif live:
                await live.pop(rng.randrange(len(live))).stop()
            if len(live) > 6:
                await live.pop(0).stop()
        referenced = {layer for snapshot in snapshots for layer in snapshot.meta["layers"]}
        referenced |= {layer for sandbox in live for layer in sandbox.layers}
        assert {str(layer.path) for layer in store.live_layers()} == referenced
        images = {snapshot.meta["shell"]["images"] for snapshot in snapshots if snapshot.meta["route"] == "criu"}
        assert {str(path) for path in snaps.glob("*.criu")} == images  # no image beyond the snapshots' own
        for sandbox in live:
            await sandbox.stop()
        for snapshot in snapshots:
            factory.discard(snapshot)

    asyncio.run(main())
    counts = factory.route_counts()
    assert counts["shell-state"] > 10, counts
    assert counts["declined"] > 3, counts
    if CRIU is not None:
        assert counts["criu"] > expected_criu, counts
    assert store.live_layers() == []
    assert os.listdir(store.directory / "layers") == []
    assert os.listdir(store.directory / "uppers") == []
    assert list(snaps.iterdir()) == []  # snapshot files and CRIU images alike
    zygote = factory.zygote.pid
    assert zygote is not None
    pool = factory.warm_pool()
    assert pool is not None
    assert pool.served > 10
    assert pool.failures == 0
    assert len(pool) <= factory.warm_shells
    # Only the spares and the warm shells wait (each a bash alone): no shell of a sandbox and no job is left.
    assert len(_descendants(zygote)) <= SPARES + factory.warm_shells
    keepers = factory.criu_keepers()
    assert keepers is not None
    idle = keepers.idle_pids()  # started ahead for the next restore, as the warm shells are
    assert len(idle) <= keepers.size
    assert _own_processes() - processes - {zygote} - _descendants(zygote) - idle == set()  # no restore's keeper or tree
    assert _criu_scratch() == scratch
    with open("/proc/self/mountinfo") as handle:
        assert not [line for line in handle if str(tmp_path) in line]
    factory.close()
    assert len(pool) == 0
    _assert_gone(_own_processes() - processes)  # the zygote, its spares and every warm shell end with the factory


def _assert_gone(pids: set[int], timeout: float = 5.0) -> None:
    """Each of ``pids`` ends within ``timeout`` (killed processes are reaped by their parent a moment later)."""
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        pids = {pid for pid in pids if os.path.exists(f"/proc/{pid}")}
    assert pids == set()
