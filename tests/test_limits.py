"""Limits per shell sandbox (``SandboxLimits``, ``shell.cgroups``), on real cgroups: a fork bomb and a memory hog
end their call with a clear error within its timeout, the sandbox is untrusted afterwards, the host recovers,
sandboxes running beside them are unaffected, every tree (one-shot command, persistent shell, CRIU-restored
copy) has a cgroup of its own that goes with it, and what a killed owner left is removed by the next start."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tvcache import SandboxError, ToolCall
from tvcache.sandboxes import ShellSandbox, ShellSandboxFactory
from tvcache.sandboxes.shell.cgroups import CgroupHost, host_cgroups
from tvcache.sandboxes.shell.criu import criu_unavailable_reason, find_criu
from tvcache.sandboxes.shell.limits import SandboxLimits
from tvcache.sandboxes.shell.linux import overlay_supported

HOST = host_cgroups() if overlay_supported() else "overlay mounts need root on Linux >= 6.8"
pytestmark = pytest.mark.skipif(not isinstance(HOST, CgroupHost), reason=f"no cgroup limits here: {HOST}")
CRIU = find_criu(warn=False) if isinstance(HOST, CgroupHost) else None
needs_criu = pytest.mark.skipif(
    CRIU is None and os.environ.get("TVCACHE_REQUIRE_CRIU") != "1",
    reason=f"no working CRIU: {criu_unavailable_reason()} (make criu)",
)

SMALL = SandboxLimits(pids=64, memory_bytes=64 << 20, cpus=1.0, tmpfs_bytes=16 << 20)
TIMEOUT = 20.0
# PID 1 waits after starting the bomb, as an interactive shell would: the bomb's own shell ending first would
# take the bomb with it (everything in the namespace dies with PID 1) before it hit anything.
FORK_BOMB = ":(){ :|:& };:; sleep 30"
# 16 MiB more per step, far past the limit (up to 64 GiB).
MEMORY_HOG = "python3 -c 'x = []\nfor _ in range(4096): x.append(bytearray(16 << 20))'; sleep 30"
ORDINARY = (
    "seq 1 20000 | sha256sum; for i in $(seq 1 40); do echo $i > f$i; done; cat f* | sort -n | tail -3; ls | wc -l"
)


def sh(cmd: str, **extra: object) -> ToolCall:
    return ToolCall("sh", {"cmd": cmd, **extra})


def factory_for(tmp_path: Path, *, persistent: bool, limits: SandboxLimits | None = SMALL) -> ShellSandboxFactory:
    base = tmp_path / "base"
    base.mkdir(exist_ok=True)
    factory = ShellSandbox.factory(
        base,
        fallback=False,
        store_root=tmp_path / f"layers-{persistent}",
        persistent=persistent,
        limits=limits,
        timeout=TIMEOUT,
    )
    assert isinstance(factory, ShellSandboxFactory)
    return factory


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def process_count() -> int:
    return sum(1 for name in os.listdir("/proc") if name.isdigit())


def available_memory() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no MemAvailable in /proc/meminfo")


def tree_dirs(name: str) -> list[str]:
    assert isinstance(HOST, CgroupHost)
    return [os.path.join(parent, name) for parent in HOST.parents]


@pytest.mark.parametrize("persistent", [False, True], ids=["one-shot", "persistent"])
@pytest.mark.parametrize(
    ("command", "message"),
    [
        (FORK_BOMB, "[the sandbox hit its process limit of 64]"),
        (MEMORY_HOG, "[the sandbox hit its memory limit of 64 MiB: a process was killed]"),
    ],
    ids=["fork-bomb", "memory-hog"],
)
def test_a_limit_hit_ends_the_call_with_a_clear_error_and_the_host_recovers(
    tmp_path: Path, persistent: bool, command: str, message: str
) -> None:
    factory = factory_for(tmp_path, persistent=persistent)
    processes, memory = process_count(), available_memory()

    async def main() -> tuple[float, object, str]:
        sandbox = await factory.start()
        try:
            began = time.monotonic()
            outcome = await sandbox.execute(sh(command))
            seconds = time.monotonic() - began
            with pytest.raises(SandboxError, match="no longer trusted: an earlier call ended because the sandbox hit"):
                await sandbox.execute(sh("echo still here"))
            return seconds, outcome, ""
        finally:
            await sandbox.stop()

    seconds, outcome, _ = asyncio.run(main())
    factory.close()
    assert seconds < TIMEOUT / 2  # ended at the hit, not at the timeout
    assert outcome.is_error  # type: ignore[attr-defined]
    assert not outcome.deterministic  # type: ignore[attr-defined]
    assert outcome.output.endswith(message), outcome.output  # type: ignore[attr-defined]
    assert wait_until(lambda: process_count() <= processes + 5)  # the bomb is gone, down to the last process
    assert wait_until(lambda: available_memory() > memory - (256 << 20))


def test_eight_sandboxes_beside_a_fork_bomb_and_a_memory_hog_return_what_they_return_alone(tmp_path: Path) -> None:
    factory = factory_for(tmp_path, persistent=False)
    persistent = factory_for(tmp_path, persistent=True)

    async def alone() -> str:
        sandbox = await factory.start()
        try:
            return (await sandbox.execute(sh(ORDINARY))).output
        finally:
            await sandbox.stop()

    async def beside() -> tuple[list[str], list[str]]:
        hostile = [await factory.start(), await persistent.start()]
        others = [await (persistent if index % 2 else factory).start() for index in range(8)]
        try:
            attacks = [hostile[0].execute(sh(FORK_BOMB)), hostile[1].execute(sh(MEMORY_HOG))]
            calls = [sandbox.execute(sh(ORDINARY)) for sandbox in others]
            outcomes = await asyncio.gather(*attacks, *calls)
            return [outcome.output for outcome in outcomes[:2]], [outcome.output for outcome in outcomes[2:]]
        finally:
            for sandbox in [*hostile, *others]:
                await sandbox.stop()

    expected = asyncio.run(alone())
    attacks, outputs = asyncio.run(beside())
    factory.close()
    persistent.close()
    assert expected.endswith("38\n39\n40\n40\n"), expected
    assert attacks[0].endswith("[the sandbox hit its process limit of 64]")
    assert attacks[1].endswith("[the sandbox hit its memory limit of 64 MiB: a process was killed]")
    assert outputs == [expected] * 8


def test_every_tree_has_its_own_cgroup_which_goes_with_it(tmp_path: Path) -> None:
    one_shot, persistent = factory_for(tmp_path, persistent=False), factory_for(tmp_path, persistent=True)

    async def main() -> tuple[str, str, str, list[str]]:
        sandbox = await one_shot.start()
        command = (await sandbox.execute(sh("grep pids /proc/self/cgroup"))).output
        await sandbox.stop()
        shell = await persistent.start()
        listed = (await shell.execute(sh("grep pids /proc/self/cgroup"))).output
        name = shell._shell.spawned.cgroup  # type: ignore[attr-defined]
        assert all(os.path.isdir(path) for path in tree_dirs(name))
        other = await persistent.start()
        other_name = other._shell.spawned.cgroup  # type: ignore[attr-defined]
        await shell.stop()
        await other.stop()
        return command, listed, name, [other_name]

    command, listed, name, others = asyncio.run(main())
    assert isinstance(HOST, CgroupHost)
    parent = os.path.basename(HOST.parents[0])
    assert f"/{parent}/" in command
    assert f"/{parent}/{name}\n" in listed
    assert name not in others
    # Removed by the zygote once nothing runs, off the commands' path (and again soon if the kernel still held it).
    assert wait_until(lambda: not any(os.path.exists(path) for path in tree_dirs(name)))
    one_shot.close()
    persistent.close()
    assert wait_until(lambda: HOST.trees() == [])  # type: ignore[union-attr]  # spares' too, with their zygotes


def test_the_private_tmpfs_dirs_are_sized_and_no_limits_opts_out(tmp_path: Path) -> None:
    limited, unlimited = factory_for(tmp_path, persistent=False), factory_for(tmp_path, persistent=False, limits=None)

    async def run(factory: ShellSandboxFactory, command: str) -> str:
        sandbox = await factory.start()
        try:
            return (await sandbox.execute(sh(command))).output
        finally:
            await sandbox.stop()

    check = "df -k --output=size /tmp /dev/shm | tail -2; grep pids /proc/self/cgroup"
    sized, free = asyncio.run(run(limited, check)), asyncio.run(run(unlimited, check))
    limited.close()
    unlimited.close()
    assert sized.split()[:2] == ["16384", "16384"], sized
    assert "tvcache-" in sized
    assert "tvcache-" not in free
    assert int(free.split()[0]) > 16384


@needs_criu
def test_a_criu_restored_fork_lives_in_a_cgroup_of_its_own_with_the_limits(tmp_path: Path) -> None:
    factory = factory_for(tmp_path, persistent=True)

    async def main() -> tuple[str, str, str, str, object]:
        live = await factory.start()
        await live.execute(sh("sleep 60 &"))
        snapshot = await live.snapshot(tmp_path / "snap")
        assert snapshot.meta["route"] == "criu"
        fork = await factory.fork(snapshot)
        names = [sandbox._shell.spawned.cgroup for sandbox in (live, fork)]  # type: ignore[attr-defined]
        seen = (await fork.execute(sh("grep pids /proc/self/cgroup; grep pids /proc/$(jobs -p)/cgroup"))).output
        hog = await fork.execute(sh(MEMORY_HOG))
        await live.stop()
        await fork.stop()
        return names[0], names[1], seen, str(snapshot.path), hog

    live_name, fork_name, seen, _, hog = asyncio.run(main())
    factory.close()
    assert live_name.startswith("criu-")
    assert fork_name.startswith("criu-")
    assert live_name != fork_name
    assert seen.count(f"/{fork_name}\n") == 2, seen  # the shell and its restored job
    assert hog.output.endswith("[the sandbox hit its memory limit of 64 MiB: a process was killed]")  # type: ignore[attr-defined]
    assert not any(os.path.exists(path) for path in tree_dirs(fork_name))


OWNER = """
import asyncio, json, sys, time
from pathlib import Path
from tvcache import ToolCall
from tvcache.sandboxes import ShellSandboxFactory
from tvcache.sandboxes.shell.cgroups import host_cgroups
from tvcache.sandboxes.shell.limits import SandboxLimits

async def main():
    factory = ShellSandboxFactory(sys.argv[1], store_root=sys.argv[2], persistent=True, limits=SandboxLimits(pids=64))
    sandbox = await factory.start()
    await sandbox.execute(ToolCall("sh", {"cmd": "sleep 600 &"}))
    print(json.dumps({"zygote": factory.zygote.pid, "parents": host_cgroups().parents}), flush=True)
    time.sleep(600)

asyncio.run(main())
"""


def test_the_next_start_removes_what_a_killed_owner_left(tmp_path: Path) -> None:
    import json

    base = tmp_path / "base"
    base.mkdir()
    owner = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(OWNER), str(base), str(tmp_path / "layers")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None
        started = json.loads(owner.stdout.readline())
        os.kill(started["zygote"], signal.SIGKILL)  # the zygote first: nothing is left to clean up after it
        owner.kill()
    finally:
        owner.kill()
        owner.wait(10)
    parents = started["parents"]
    assert all(os.path.isdir(parent) for parent in parents)
    assert wait_until(lambda: not any(_procs(parent) for parent in parents))  # the shell died with its parent
    assert all(os.listdir(parent) for parent in parents)  # its cgroup is left: nobody removed it
    subprocess.run(
        [sys.executable, "-c", "from tvcache.sandboxes.shell.cgroups import host_cgroups; host_cgroups()"],
        check=True,
        timeout=30,
    )
    assert not any(os.path.exists(parent) for parent in parents)


def _procs(parent: str) -> list[str]:
    found = []
    for directory, _, files in os.walk(parent):
        if "cgroup.procs" in files:
            with open(os.path.join(directory, "cgroup.procs")) as listing:
                found += listing.read().split()
    return found
