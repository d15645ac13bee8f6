"""Shell sandboxes on overlayfs: confinement, kills, layers, squashing, leaks, crash cleanup, a real project."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
import warnings
from pathlib import Path

import pytest

from tvcache import AlwaysSnapshot, Budget, Cache, CostAwareSnapshots, SandboxError, SnapshotDeclined, ToolCall
from tvcache.sandboxes import ShellSandbox, ShellSandboxFactory
from tvcache.sandboxes.shell import linux
from tvcache.sandboxes.shell.layers import LayerStore
from tvcache.sandboxes.shell.linux import overlay_supported
from tvcache.workloads.shell import BUGS, make_project

pytestmark = pytest.mark.skipif(
    not overlay_supported(), reason="overlay mounts need root on Linux >= 6.8 (the shell backend falls back to copies)"
)


def sh(cmd: str, **extra: object) -> ToolCall:
    return ToolCall("sh", {"cmd": cmd, **extra})


def factory_for(tmp_path: Path, **options: object) -> ShellSandboxFactory:
    base = tmp_path / "base"
    if not base.exists():
        base.mkdir()
        (base / "a.txt").write_text("base\n")
    factory = ShellSandbox.factory(base, fallback=False, store_root=tmp_path / "layers", **options)
    assert isinstance(factory, ShellSandboxFactory)
    return factory


def mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as handle:
        return [line for line in handle if str(path) in line]


def test_writes_stay_inside_the_sandbox(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)
    host_tmp = Path("/tmp") / f"tvcache-test-{uuid.uuid4().hex}"

    async def main() -> None:
        one, two = await factory.start(), await factory.start()
        out = await one.execute(sh(f"echo mine > {factory.base}/a.txt; echo t > {host_tmp}; cat a.txt; cat {host_tmp}"))
        assert out.output == "mine\nt\n"
        refused = await one.execute(sh("echo x > /etc/tvcache-test 2>&1; touch /usr/tvcache-test 2>&1; echo done"))
        assert refused.output.count("Read-only file system") == 2
        assert (await two.execute(sh("cat a.txt; ls /tmp"))).output == "base\n" + _tmp_listing(factory)
        assert (await one.execute(sh("mount -o remount,rw / 2>&1 || echo refused"))).output.endswith("refused\n")
        for sandbox in (one, two):
            await sandbox.stop()

    asyncio.run(main())
    assert (factory.base / "a.txt").read_text() == "base\n"
    assert not host_tmp.exists()
    assert not Path("/etc/tvcache-test").exists()


def _tmp_listing(factory: ShellSandboxFactory) -> str:
    """What ``ls /tmp`` shows inside: an empty private tmpfs, except the path down to the base tree itself."""
    parts = factory.base.parts
    return f"{parts[2]}\n" if parts[1] == "tmp" else ""


def test_the_network_is_unreachable(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]

    async def main() -> str:
        sandbox = await factory.start()
        try:
            probe = f"(echo hi > /dev/tcp/127.0.0.1/{port}) 2>&1 && echo reached || echo unreachable"
            return (await sandbox.execute(sh(probe))).output
        finally:
            await sandbox.stop()

    try:
        output = asyncio.run(main())
    finally:
        server.close()
    assert output.strip().endswith("unreachable")
    assert "Connection refused" in output


def test_a_timeout_kills_the_command_and_everything_it_forked(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)
    marker = f"tvcache-hang-{uuid.uuid4().hex[:8]}"

    async def main() -> tuple[float, str]:
        sandbox = await factory.start()
        began = time.perf_counter()
        command = (
            f"(exec -a {marker} sleep 300 &); setsid bash -c 'exec -a {marker} sleep 300' & exec -a {marker} sleep 300"
        )
        outcome = await sandbox.execute(sh(command, timeout=0.5))
        await sandbox.stop()
        return time.perf_counter() - began, outcome.output

    elapsed, output = asyncio.run(main())
    assert "[timed out after 0.5s]" in output
    assert elapsed < 10
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    assert left == ""


def test_background_processes_die_with_the_command(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)
    marker = f"tvcache-bg-{uuid.uuid4().hex[:8]}"

    async def main() -> str:
        sandbox = await factory.start()
        out = await sandbox.execute(sh(f"(setsid bash -c 'exec -a {marker} sleep 300' &) ; echo started"))
        await sandbox.stop()
        return out.output

    assert asyncio.run(main()) == "started\n"
    assert subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout == ""


def test_paths_and_environment_are_the_same_in_every_sandbox(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)

    async def main() -> list[str]:
        outputs = []
        for _ in range(2):
            sandbox = await factory.start()
            outputs.append((await sandbox.execute(sh("pwd; echo $HOME; hostname; env | sort"))).output)
            await sandbox.stop()
        return outputs

    first, second = asyncio.run(main())
    assert first == second
    assert first.startswith(f"{factory.base}\n{factory.base}\nsandbox\n")
    assert "PYTEST" not in first


def test_deletions_and_squashed_stacks_keep_the_state(tmp_path: Path) -> None:
    factory = factory_for(tmp_path, max_layers=3)
    (factory.base / "doomed.txt").write_text("bye\n")

    async def main() -> None:
        sandbox = await factory.start()
        await sandbox.execute(sh("rm doomed.txt"))
        for index in range(7):
            await sandbox.execute(sh(f"echo {index} >> a.txt; mkdir -p d{index}"))
            snapshot = await sandbox.snapshot(tmp_path / f"snap{index}")
            assert len(snapshot.meta["layers"]) <= 3
        expected = "base\n" + "".join(f"{i}\n" for i in range(7))
        assert (await sandbox.execute(sh("cat a.txt"))).output == expected
        fork = await factory.fork(snapshot)
        listing = (await fork.execute(sh("ls"))).output.split()
        assert "doomed.txt" not in listing
        assert listing == ["a.txt", *[f"d{i}" for i in range(7)]]
        assert (await fork.execute(sh("cat a.txt"))).output == expected
        for sandbox_ in (sandbox, fork):
            await sandbox_.stop()

    asyncio.run(main())


def test_thousands_of_forks_snapshots_and_evictions_leave_nothing_behind(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)
    store = factory.store
    rng = random.Random(3)

    async def main() -> None:
        live = [await factory.start()]
        snapshots = []
        for step in range(2000):
            choice = rng.random()
            if choice < 0.35 and live:
                sandbox = rng.choice(live)
                upper = sandbox._upper
                (upper / f"f{step}").write_text("x")  # a change, made directly (commands are tested elsewhere)
                snapshots.append(await sandbox.snapshot(tmp_path / "snaps" / f"s{step}"))
            elif choice < 0.6 and snapshots:
                live.append(await factory.fork(rng.choice(snapshots)))
            elif choice < 0.8 and snapshots:
                factory.discard(snapshots.pop(rng.randrange(len(snapshots))))
            elif live:
                await live.pop(rng.randrange(len(live))).stop()
            if len(live) > 20:
                await live.pop(0).stop()
        referenced = {layer for snapshot in snapshots for layer in snapshot.meta["layers"]}
        referenced |= {layer for sandbox in live for layer in sandbox.layers}
        assert {str(layer.path) for layer in store.live_layers()} == referenced
        assert set(os.listdir(store.directory / "layers")) == {Path(path).name for path in referenced}
        for sandbox in live:
            await sandbox.stop()
        for snapshot in snapshots:
            factory.discard(snapshot)

    asyncio.run(main())
    assert store.live_layers() == []
    assert os.listdir(store.directory / "layers") == []
    assert os.listdir(store.directory / "uppers") == []
    assert mounts_under(tmp_path) == []


def test_a_crashed_process_store_is_removed_by_the_next_one(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    root = tmp_path / "layers"
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        from tvcache.sandboxes import ShellSandbox
        async def main():
            factory = ShellSandbox.factory({str(base)!r}, fallback=False, store_root={str(root)!r})
            sandbox = await factory.start()
            await sandbox.execute(__import__("tvcache").ToolCall("sh", {{"cmd": "echo x > f"}}))
            await sandbox.snapshot(__import__("pathlib").Path({str(tmp_path / "snap")!r}))
            print(factory.store.directory, flush=True)
            await asyncio.sleep(600)
        asyncio.run(main())
        """
    )
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    orphan = Path(process.stdout.readline().strip())
    assert (orphan / "layers").exists()
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    LayerStore(root).close()
    assert not orphan.exists()


def test_a_minimal_root_filesystem_is_the_whole_world(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs"
    for binary in ("/bin/bash", "/usr/bin/unshare", "/bin/ls", "/bin/cat"):
        _install(binary, rootfs)
    for directory in ("tmp", "proc", "dev", "root", "run"):
        (rootfs / directory).mkdir(exist_ok=True)
    (rootfs / "etc").mkdir()
    (rootfs / "etc" / "motd").write_text("inside\n")
    environment = {"PATH": "/usr/bin:/bin", "HOME": "/root"}  # no locales in this tiny rootfs
    factory = ShellSandbox.factory(
        rootfs, rootfs=True, fallback=False, store_root=tmp_path / "layers", environment=environment
    )

    async def main() -> tuple[str, str]:
        sandbox = await factory.start()
        look = (await sandbox.execute(sh("pwd; cat /etc/motd; ls /; echo changed > /etc/motd"))).output
        fork = await factory.fork(await sandbox.snapshot(tmp_path / "snap"))
        after = (await fork.execute(sh("cat /etc/motd"))).output
        await sandbox.stop()
        await fork.stop()
        return look, after

    look, after = asyncio.run(main())
    assert look.startswith("/\ninside\n")
    assert set(look.split()[2:]) == {"bin", "dev", "etc", "lib", "lib64", "proc", "root", "run", "tmp", "usr"} - (
        set() if (rootfs / "lib64").exists() else {"lib64"}
    )
    assert after == "changed\n"
    assert (rootfs / "etc" / "motd").read_text() == "inside\n"


def _install(binary: str, rootfs: Path) -> None:
    """Copy a binary and the shared libraries it loads into ``rootfs`` at the same paths."""
    libraries = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    paths = {binary}
    for line in libraries.splitlines():
        for token in line.split():
            if token.startswith("/"):
                paths.add(token)
    for path in paths:
        resolved = Path(path)
        target = rootfs / resolved.relative_to("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            shutil.copy2(resolved, target)


@pytest.mark.parametrize("policy", ["cost-aware", "always"])
def test_cached_rollouts_on_a_real_c_project_equal_uncached_execution(tmp_path: Path, policy: str) -> None:
    """Inspect, build, patch (right or wrong), rebuild and test a C project: through the cache and fresh."""
    project = make_project(tmp_path / "project", "mul")
    factory = ShellSandbox.factory(project, fallback=False, store_root=tmp_path / "layers")
    snapshots = AlwaysSnapshot() if policy == "always" else CostAwareSnapshots()
    cache = Cache(snapshot_policy=snapshots, budget=Budget(max_snapshots_per_task=8))
    rng = random.Random(policy)
    mismatches = []
    hits = calls = 0
    _, fix, wrong_fixes = BUGS["mul"]
    actions = ["ls", "cat calc.c", "grep -n mul calc.c", "make 2>&1", "make check 2>&1", "make clean", "./test_calc"]
    actions += ["rm -f test_calc.c", "git status 2>&1 | head -1", *wrong_fixes]

    async def rollout(history: list[str]) -> list[tuple[str, bool]]:
        async with cache.session("fix-calc", sandbox=factory) as session:
            return [((r := await session.call("sh", {"cmd": cmd})).output, r.hit) for cmd in history]

    async def fresh(history: list[str]) -> list[str]:
        sandbox = await factory.start()
        try:
            return [(await sandbox.execute(sh(cmd))).output for cmd in history]
        finally:
            await sandbox.stop()

    async def main() -> None:
        nonlocal hits, calls
        for _ in range(6):  # groups of rollouts, sharing a prefix like an RL group
            stem = ["cat calc.c", "make 2>&1"][: rng.randrange(0, 3)]
            group = []
            for _ in range(4):
                middle = [rng.choice(actions) for _ in range(rng.randrange(0, 3))]
                patch = rng.choice([fix, fix, *wrong_fixes])
                group.append([*stem, *middle, patch, "make 2>&1", "make check 2>&1"])
            answers = await asyncio.gather(*(rollout(history) for history in group))
            for history, answer in zip(group, answers, strict=True):
                truth = await fresh(history)
                for step, ((output, hit), expected) in enumerate(zip(answer, truth, strict=True)):
                    calls += 1
                    hits += hit
                    if output != expected:
                        mismatches.append((history[: step + 1], output, expected))

    asyncio.run(main())
    stats = cache.stats()
    cache.check_invariants()
    cache.close()
    assert mismatches == [], mismatches[:2]
    assert hits > 0
    assert stats.replay_divergences == 0
    assert calls >= 100


def test_stacks_of_hundreds_of_layers_mount(tmp_path: Path) -> None:
    factory = factory_for(tmp_path, max_layers=400)

    async def main() -> tuple[int, str]:
        sandbox = await factory.start()
        for index in range(300):
            (sandbox._upper / f"f{index}").write_text(str(index))
            snapshot = await sandbox.snapshot(tmp_path / "snaps" / str(index))
        fork = await factory.fork(snapshot)
        listing = (await fork.execute(sh("ls | wc -l; cat f0 f299"))).output
        depth = len(fork.layers)
        await fork.stop()
        await sandbox.stop()
        return depth, listing

    depth, listing = asyncio.run(main())
    assert depth == 300
    assert listing == "301\n0299"


def test_nothing_is_left_on_disk_at_interpreter_exit(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    script = textwrap.dedent(
        f"""
        import asyncio
        from tvcache import ToolCall
        from tvcache.sandboxes import ShellSandbox
        async def main():
            factory = ShellSandbox.factory({str(base)!r}, fallback=False, store_root={str(tmp_path / "layers")!r})
            sandbox = await factory.start()  # never stopped: exit must still clean up
            await sandbox.execute(ToolCall("sh", {{"cmd": "echo x > f"}}))
            await sandbox.snapshot(__import__("pathlib").Path({str(tmp_path / "snap")!r}))
            print(factory.store.directory)
        asyncio.run(main())
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert not Path(result.stdout.strip()).exists()
    assert mounts_under(tmp_path) == []


def test_without_overlay_privileges_it_falls_back_to_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tvcache.sandboxes import FolderSandboxFactory
    from tvcache.sandboxes.shell import sandbox as shell

    monkeypatch.setattr(shell.linux, "overlay_supported", lambda: False)
    base = tmp_path / "base"
    base.mkdir()
    with pytest.warns(RuntimeWarning, match="fall back to copying"):
        factory = ShellSandbox.factory(base)
    assert isinstance(factory, FolderSandboxFactory)
    with pytest.raises(Exception, match="not permitted"):
        ShellSandbox.factory(base, fallback=False)


def test_a_squash_keeps_owners_hard_links_and_special_files(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "a.txt").write_text("base\n")
    os.link(base / "a.txt", base / "hard")  # in the base tree: a sandbox cannot snapshot hard links it made
    factory = factory_for(tmp_path, max_layers=2)

    async def main() -> tuple[str, str]:
        sandbox = await factory.start()
        setup = "touch owned && chown 65534 owned && mkfifo pipe && stat -c '%U %h %F' owned a.txt pipe"
        before = (await sandbox.execute(sh(setup))).output
        for index in range(4):  # more snapshots than max_layers: the stack is squashed
            await sandbox.execute(sh(f"echo {index} > f{index}"))
            await sandbox.snapshot(tmp_path / f"s{index}")
        assert len(sandbox.layers) <= 2
        after = (await sandbox.execute(sh("stat -c '%U %h %F' owned a.txt pipe"))).output
        await sandbox.stop()
        return before, after

    before, after = asyncio.run(main())
    assert before == after == "nobody 1 regular empty file\nroot 2 regular file\nroot 1 fifo\n"


@pytest.mark.parametrize("policy", ["cost-aware", "always"])
def test_hard_links_made_in_a_rollout_behave_as_in_uncached_execution(tmp_path: Path, policy: str) -> None:
    """overlayfs splits a lower file's hard links on copy-up: a snapshot between ``ln`` and a write through one
    name would make the other name keep the old content in forks. Such states are not snapshotted."""
    factory = factory_for(tmp_path)
    snapshots = AlwaysSnapshot() if policy == "always" else CostAwareSnapshots()
    cache = Cache(snapshot_policy=snapshots)
    history = ["echo a > f && ln f g", "sleep 0.05; echo b >> f", "cat g", "stat -c %h g"]

    async def rollout(steps: list[str]) -> list[str]:
        async with cache.session("links", sandbox=factory) as session:
            return [(await session.call("sh", {"cmd": cmd})).output for cmd in steps]

    async def fresh(steps: list[str]) -> list[str]:
        sandbox = await factory.start()
        try:
            return [(await sandbox.execute(sh(cmd))).output for cmd in steps]
        finally:
            await sandbox.stop()

    async def main() -> tuple[list[str], list[str], list[str]]:
        first = await rollout(history)
        branch = await rollout([*history[:1], "cat g", *history[1:]])  # forks at the state after `ln`, if any
        return first, branch, await fresh(history)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # declining a snapshot is not worth a warning
        first, branch, truth = asyncio.run(main())
    cache.close()
    assert cache.stats().snapshots_declined > 0
    assert first == truth == ["", "", "a\nb\n", "2\n"]
    assert branch == ["", "a\n", "", "a\nb\n", "2\n"]


def test_a_sandbox_declines_to_snapshot_hard_links_it_made_and_keeps_working(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)

    async def main() -> str:
        sandbox = await factory.start()
        try:
            await sandbox.execute(sh("echo a > f && ln f g"))
            with pytest.raises(SnapshotDeclined, match="hard links"):
                await sandbox.snapshot(tmp_path / "snap")
            assert not (tmp_path / "snap").exists()
            return (await sandbox.execute(sh("echo b >> f && cat g"))).output
        finally:
            await sandbox.stop()

    assert asyncio.run(main()) == "a\nb\n"


def three_ways(factory: ShellSandboxFactory, before: str, after: str, snap: Path) -> tuple[str, str, str]:
    """``after``'s output uncached, in the sandbox that snapshotted after ``before``, and in a fork of that."""

    async def main() -> tuple[str, str, str]:
        fresh = await factory.start()
        await fresh.execute(sh(before))
        uncached = (await fresh.execute(sh(after))).output
        await fresh.stop()
        live = await factory.start()
        await live.execute(sh(before))
        snapshot = await live.snapshot(snap)
        continued = (await live.execute(sh(after))).output
        await live.stop()
        fork = await factory.fork(snapshot)
        forked = (await fork.execute(sh(after))).output
        await fork.stop()
        return uncached, continued, forked

    return asyncio.run(main())


@pytest.mark.parametrize(
    ("before", "after"),
    [
        # a directory made before a snapshot lies in a lower layer after it: renaming it needs overlay redirects
        ("mkdir -p pkg && echo x > pkg/m.py", 'python3 -c \'import os; os.rename("pkg", "lib")\' 2>&1; ls'),
        # overlay shows the root with the upper root's attributes: a fresh upper must inherit them
        ("chmod 700 . && chown 65534 . && touch -d 2001-01-01 .", "stat -c '%a %u %y' ."),
        ("echo x > f", "find . -maxdepth 0 -newer f | wc -l"),
    ],
)
def test_a_snapshot_and_its_forks_behave_like_the_sandbox_that_never_snapshotted(
    tmp_path: Path, before: str, after: str
) -> None:
    uncached, continued, forked = three_ways(factory_for(tmp_path), before, after, tmp_path / "snap")
    assert continued == uncached
    assert forked == uncached
    assert "error" not in uncached.lower()


@pytest.mark.parametrize("links", ["mkfifo p && ln p q", "ln -s target p && ln p q", "echo a > f && ln f g"])
def test_hard_links_of_any_kind_made_in_a_sandbox_are_not_snapshotted(tmp_path: Path, links: str) -> None:
    """overlay splits a lower inode's names on copy-up (a chmod through one name would not show through the other)."""
    factory = factory_for(tmp_path)

    async def main() -> None:
        sandbox = await factory.start()
        await sandbox.execute(sh(f"{links} && mkdir d && rm a.txt"))  # the whiteout of a.txt is no hard link
        with pytest.raises(SnapshotDeclined, match="hard links"):
            await sandbox.snapshot(tmp_path / "snap")
        await sandbox.execute(sh("rm -f q g"))
        await sandbox.snapshot(tmp_path / "snap")  # one name left: nothing to split
        await sandbox.stop()

    asyncio.run(main())


def test_a_bad_timeout_is_a_clear_error_and_keeps_the_sandbox(tmp_path: Path) -> None:
    from tvcache import InvalidToolCall

    factory = factory_for(tmp_path)
    cache = Cache()

    async def main() -> None:
        async with cache.session("t", sandbox=factory) as session:
            await session.call("sh", {"cmd": "echo x > f"})
            live = session._sandbox
            with pytest.raises(InvalidToolCall, match="timeout must be > 0"):
                await session.call("sh", {"cmd": "cat f", "timeout": 0})
            assert session._sandbox is live

    asyncio.run(main())


def test_cancelled_starts_leave_nothing_behind(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)

    async def main() -> None:
        for _ in range(10):
            task = asyncio.create_task(factory.start())
            await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(main())
    assert os.listdir(factory.store.directory / "uppers") == []


def test_proc_shows_only_the_commands_own_processes(tmp_path: Path) -> None:
    """The host's /proc would show host processes, and /proc/<pid>/root leads into their writable mounts."""
    factory = factory_for(tmp_path)
    host_pid = os.getpid()
    host_file = Path("/tmp") / f"tvcache-escape-{uuid.uuid4().hex}"
    command = (
        f"echo $$; test -e /proc/{host_pid} && echo visible || echo hidden; "
        f"(echo x > /proc/{host_pid}/root{host_file}) 2>/dev/null && echo wrote || echo refused; "
        "tr '\\0' ' ' < /proc/1/cmdline; echo; grep NoNewPrivs /proc/self/status"
    )

    async def main() -> str:
        sandbox = await factory.start()
        try:
            return (await sandbox.execute(sh(command))).output
        finally:
            await sandbox.stop()

    output = asyncio.run(main())
    factory.close()
    assert not host_file.exists()
    assert output.splitlines() == ["1", "hidden", "refused", f"{factory.bash} -c {command} ", "NoNewPrivs:\t1"]


def test_no_namespace_state_survives_a_command_or_crosses_sandboxes(tmp_path: Path) -> None:
    """Each command gets fresh network and IPC namespaces (a spare serves one command): loopback left down, a
    SysV segment left behind or a port left in TIME_WAIT would otherwise reach the next command, which a fork
    of a snapshot would not see."""
    factory = factory_for(tmp_path)
    lo_down = (
        'python3 -c "import fcntl, socket, struct; fcntl.ioctl(socket.socket(socket.AF_INET, socket.SOCK_DGRAM), '
        "0x8914, struct.pack('16sH14s', b'lo', 0, b''))\" 2>/dev/null && echo lo down || echo lo stays up"
    )
    loopback = (
        "python3 -c \"import socket; s = socket.socket(); s.bind(('127.0.0.1', 8642)); s.listen(); "
        "c = socket.create_connection(('127.0.0.1', 8642)); a, _ = s.accept(); a.close(); c.close(); s.close(); "
        "print('loopback ok')\" 2>&1 | tail -1"
    )
    shared_memory = "ipcmk -M 4096 >/dev/null && echo made; ipcs -m | grep -c '^0x'"

    async def main() -> list[str]:
        one, two = await factory.start(), await factory.start()
        try:
            outputs = [(await one.execute(sh(f"{loopback}; {shared_memory}"))).output]  # TIME_WAIT on 8642
            outputs.append((await two.execute(sh(f"{loopback}; ipcs -m | grep -c '^0x'; {lo_down}"))).output)
            outputs.append((await one.execute(sh(f"{loopback}; ipcs -m | grep -c '^0x' || true"))).output)
            outputs.append((await two.execute(sh(loopback))).output)
            return outputs
        finally:
            await one.stop()
            await two.stop()

    outputs = asyncio.run(main())
    factory.close()
    assert outputs == [
        "loopback ok\nmade\n1\n",
        "loopback ok\n0\nlo stays up\n",  # CAP_NET_ADMIN is dropped: a command cannot take it down
        "loopback ok\n0\n",
        "loopback ok\n",
    ]


def test_signal_dispositions_are_reset_for_the_command(tmp_path: Path) -> None:
    """Whatever the main process ignores or blocks when the helper starts (Python ignores SIGPIPE; libraries and
    test runners ignore or block others), the command starts with every signal at its default."""
    factory = factory_for(tmp_path)

    async def main() -> str:
        sandbox = await factory.start()
        try:
            return (await sandbox.execute(sh("yes | head -2; grep -E '^Sig(Ign|Blk)' /proc/self/status"))).output
        finally:
            await sandbox.stop()

    hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
    ignore = ctypes.create_string_buffer(32)  # a raw sigaction: SIG_IGN (1); signal 32 is glibc's own
    ignore[0] = 1
    saved = ctypes.create_string_buffer(32)
    assert linux._syscall(linux.SYS_RT_SIGACTION, 32, ignore, saved, 8) == 0
    try:
        output = asyncio.run(main())
    finally:
        linux._syscall(linux.SYS_RT_SIGACTION, 32, saved, None, 8)
        signal.signal(signal.SIGHUP, hup)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    factory.close()
    assert output == "y\ny\nSigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n"


def _wait_for_process(marker: str, *, present: bool, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout != ""
        if found == present:
            return
        time.sleep(0.02)
    raise AssertionError(f"{marker} {'never appeared' if present else 'still runs'} after {within}s")


def test_cancelling_a_call_kills_the_command(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)
    marker = f"tvcache-cancel-{uuid.uuid4().hex[:8]}"

    async def main() -> str:
        sandbox = await factory.start()
        call = asyncio.create_task(
            sandbox.execute(sh(f"(exec -a {marker}-bg sleep 300 &); exec -a {marker} sleep 300"))
        )
        await asyncio.to_thread(_wait_for_process, marker, present=True)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        after = (await sandbox.execute(sh("echo still usable"))).output
        await sandbox.stop()
        return after

    assert asyncio.run(main()) == "still usable\n"
    factory.close()
    _wait_for_process(marker, present=False)


def test_the_zygote_is_per_factory_restarted_when_it_dies_and_ended_by_close(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = factory_for(tmp_path / "a"), factory_for(tmp_path / "b")
    marker = f"tvcache-orphan-{uuid.uuid4().hex[:8]}"

    async def main() -> list[str]:
        one, two = await first.start(), await second.start()
        outputs = [(await one.execute(sh("echo one"))).output, (await two.execute(sh("echo two"))).output]
        assert first.zygote.pid is not None
        assert second.zygote.pid not in (None, first.zygote.pid)
        # A zygote killed under a running command: the call fails clearly, the command dies with it.
        running = asyncio.create_task(one.execute(sh(f"exec -a {marker} sleep 300")))
        await asyncio.to_thread(_wait_for_process, marker, present=True)
        os.kill(first.zygote.pid, signal.SIGKILL)
        with pytest.raises(SandboxError, match="zygote"):
            await running
        await asyncio.to_thread(_wait_for_process, marker, present=False)
        outputs.append((await one.execute(sh("echo again"))).output)  # a new zygote
        for sandbox in (one, two):
            await sandbox.stop()
        return outputs

    assert asyncio.run(main()) == ["one\n", "two\n", "again\n"]
    pid = first.zygote.pid
    assert pid is not None
    first.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    second.close()
    assert second.zygote.pid is None


def test_a_failing_confinement_is_a_clear_error(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs"
    _install("/bin/bash", rootfs)  # no /dev to mount the minimal /dev on
    factory = ShellSandbox.factory(rootfs, rootfs=True, fallback=False, store_root=tmp_path / "layers")

    async def main() -> None:
        sandbox = await factory.start()
        try:
            with pytest.raises(SandboxError, match="cannot run a command in the shell sandbox: .*'/dev'"):
                await sandbox.execute(sh("echo hi"))
        finally:
            await sandbox.stop()

    asyncio.run(main())
    factory.close()


def test_a_killed_process_leaves_no_zygote_and_no_command_behind(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    marker = f"tvcache-left-{uuid.uuid4().hex[:8]}"
    script = textwrap.dedent(
        f"""
        import asyncio
        from tvcache import ToolCall
        from tvcache.sandboxes import ShellSandbox
        async def main():
            factory = ShellSandbox.factory({str(base)!r}, fallback=False, store_root={str(tmp_path / "layers")!r})
            sandbox = await factory.start()
            print(factory.zygote.pid, flush=True)
            await sandbox.execute(ToolCall("sh", {{"cmd": "exec -a {marker} sleep 300"}}))
        asyncio.run(main())
        """
    )
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    zygote = int(process.stdout.readline())
    _wait_for_process(marker, present=True)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    _wait_for_process(marker, present=False)
    deadline = time.monotonic() + 10
    while not _exited(zygote) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _exited(zygote)


def _exited(pid: int) -> bool:
    """Gone, or a zombie (a process whose parent was killed waits there for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_shell_benchmark_runs_and_reports_each_part(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tvcache.cli import main

    report = tmp_path / "bench.json"
    assert main(["bench", "shell", "--calls", "3", "--gaps", "0", "--json", str(report)]) == 0
    figures = json.loads(report.read_text())
    assert set(figures["latency"]["gap_0ms"]) == {"true", "echo x > f", "cat f"}
    assert set(figures["breakdown"]) == {"process creation", "namespaces", "confinement steps", "upper digest"}
    assert "mount proc" in figures["breakdown"]["confinement steps"]
    assert figures["paths"]["gap_0ms"]["before_over_now_p50"] > 0
    assert figures["latency"]["gap_0ms"]["true"]["persistent_over_shell_p50"] > 0
    forks = figures["persistent forks"]
    assert forks["routes"]["shell-state"] >= 3
    assert forks["replay_over_fork_p50"] > 0
    out = capsys.readouterr().out
    assert "before/now" in out
    assert "replay/fork" in out


def test_commands_cannot_regain_the_capabilities_that_reach_past_the_sandbox(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)

    async def main() -> str:
        sandbox = await factory.start()
        try:
            return (await sandbox.execute(sh("grep -E '^Cap(Bnd|Eff):' /proc/self/status"))).output
        finally:
            await sandbox.stop()

    masks = dict(line.split(":") for line in asyncio.run(main()).splitlines())
    factory.close()
    for name in ("CapBnd", "CapEff"):
        mask = int(masks[name], 16)
        for cap in (2, 16, 17, 21, 27):  # dac_read_search, sys_module, sys_rawio, sys_admin, mknod
            assert not mask & (1 << cap), (name, cap)


def test_device_nodes_in_the_tree_cannot_be_opened(tmp_path: Path) -> None:
    """A device node in a layer (a forged published blob, a stray one in the base) is not a way to the host's
    devices: the overlay is mounted nodev, while the sandbox's own /dev keeps working."""
    base = tmp_path / "base"
    base.mkdir()
    os.mknod(base / "zero", 0o666 | stat.S_IFCHR, os.makedev(1, 5))
    factory = factory_for(tmp_path)

    async def main() -> tuple[str, str]:
        sandbox = await factory.start()
        try:
            tree = (await sandbox.execute(sh("head -c 4 zero | wc -c"))).output
            own = (await sandbox.execute(sh("head -c 4 /dev/zero | wc -c"))).output
            return tree, own
        finally:
            await sandbox.stop()

    tree, own = asyncio.run(main())
    factory.close()
    assert "Permission denied" in tree, tree
    assert own.strip() == "4"


def test_a_command_cannot_change_the_hosts_device_nodes(tmp_path: Path) -> None:
    """The sandbox's /dev holds clones of the host's own device inodes: were they writable mounts, a command's
    ``chmod 000 /dev/null`` would break every program on the host. They are read-only mounts, which still let the
    devices be read and written."""
    names = ("null", "zero", "full")
    before = {name: os.stat(f"/dev/{name}") for name in names}
    factory = factory_for(tmp_path)

    async def main() -> str:
        sandbox = await factory.start()
        try:
            script = "chmod 600 /dev/null; chown 1:1 /dev/zero; touch -d 2000-01-01 /dev/full; echo x > /dev/null"
            return (await sandbox.execute(sh(f"{script}; echo written=$?"))).output
        finally:
            await sandbox.stop()

    try:
        output = asyncio.run(main())
    finally:
        factory.close()
        for name, info in before.items():  # on a broken confinement, put the host back as it was
            os.chmod(f"/dev/{name}", stat.S_IMODE(info.st_mode))
            os.chown(f"/dev/{name}", info.st_uid, info.st_gid)
            os.utime(f"/dev/{name}", ns=(info.st_atime_ns, info.st_mtime_ns))
    after = {name: os.stat(f"/dev/{name}") for name in names}
    for name in names:
        assert (after[name].st_mode, after[name].st_uid, after[name].st_mtime_ns) == (
            before[name].st_mode,
            before[name].st_uid,
            before[name].st_mtime_ns,
        ), name
    assert output.count("Read-only file system") == 3, output
    assert output.endswith("written=0\n")


def test_visible_directories_under_a_private_tmp_stay_readable_and_read_only(tmp_path: Path) -> None:
    """A program installed under /tmp (a checkout's venv: CI clones into /tmp) must be runnable inside the
    sandbox, whose /tmp is otherwise a fresh tmpfs; what is not named stays hidden."""
    shown = Path(tempfile.mkdtemp(prefix="tvcache-visible-", dir="/tmp"))
    hidden = Path(tempfile.mkdtemp(prefix="tvcache-hidden-", dir="/tmp"))
    try:
        (shown / "tool.sh").write_text("echo from the tool\n")
        (hidden / "secret").write_text("no\n")
        factory = factory_for(tmp_path, visible=[str(shown)])

        async def main() -> str:
            sandbox = await factory.start()
            try:
                script = f"bash {shown}/tool.sh; cat {hidden}/secret; touch {shown}/new; echo listing; ls /tmp"
                return (await sandbox.execute(sh(script))).output
            finally:
                await sandbox.stop()

        output = asyncio.run(main())
        factory.close()
        assert output.startswith("from the tool\n")
        assert "No such file or directory" in output  # the other directory under /tmp is not there
        assert "Read-only file system" in output
        listing = output.split("listing\n")[1].split()
        assert shown.name in listing
        assert hidden.name not in listing
        assert not (shown / "new").exists()
    finally:
        shutil.rmtree(shown)
        shutil.rmtree(hidden)


def test_the_upper_digest_covers_every_entry_in_a_fixed_order(tmp_path: Path) -> None:
    """The fast walk hashes what a plain ``os.walk`` + ``lstat`` in name order does, and sees any change."""
    import hashlib

    from tvcache.sandboxes.shell.layers import upper_digest

    def reference(upper: Path) -> str:
        hasher = hashlib.blake2b(digest_size=16)
        for directory, dirs, files in os.walk(upper):
            dirs.sort()
            for name in sorted(dirs + files):
                path = os.path.join(directory, name)
                info = os.lstat(path)
                fields = (info.st_mode, info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, info.st_rdev)
                hasher.update(b"%s\0%o %d %d %d %d %d\n" % (os.fsencode(os.path.relpath(path, upper)), *fields))
        return hasher.hexdigest()

    upper = tmp_path / "upper"
    for index, name in enumerate(["b/deep/er", "a", "a-b/x", "a.b", "c/d"]):
        (upper / name).mkdir(parents=True)
        (upper / name / f"f{index}").write_text(name)
    os.symlink("a", upper / "link-to-dir")
    os.mkfifo(upper / "c" / "pipe")
    before = upper_digest(upper)
    assert before == reference(upper)
    (upper / "a-b" / "x" / "f2").write_text("changed")
    assert upper_digest(upper) == reference(upper) != before
