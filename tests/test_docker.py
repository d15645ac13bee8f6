"""Docker sandboxes and image-based overlay sandboxes, against a real engine.

The command lines are checked without an engine. Everything else needs one (scripts/install-docker.sh) and the
local base image (scripts/build-base-image.sh): without them these tests skip, naming why — unless
TVCACHE_REQUIRE_DOCKER=1 (as in CI), where a missing engine fails them. Every container and image a test makes
is removed when it ends, also after a failure; the tests about ownership check that nothing was left first.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shell_trust_cases import CASES as TRUST_CASES
from shell_trust_cases import Case, run_background_case, run_case
from test_differential import SHELL, cached, uncached
from test_sandboxes import (
    Backend,
    test_discard_removes_the_snapshot_and_forking_it_then_fails,
    test_factory_and_sandbox_satisfy_the_protocol,
    test_forks_are_independent_and_snapshots_frozen,
    test_snapshot_refuses_an_existing_destination,
    test_stop_is_idempotent_and_a_stopped_sandbox_refuses_work,
    test_tool_failures_are_outcomes_and_bad_calls_raise,
)
from tvcache import AlwaysSnapshot, Budget, Cache, CostAwareSnapshots, ToolCall
from tvcache.errors import SandboxError, SnapshotDeclined
from tvcache.sandboxes import DockerSandbox, ShellSandbox
from tvcache.sandboxes.docker import OWNER_LABEL, DockerCommands, docker_available, remove_orphans
from tvcache.sandboxes.docker_engine import CONTAINER_CAPABILITIES
from tvcache.sandboxes.image import inspect_image
from tvcache.sandboxes.shell.limits import DEFAULT_LIMITS, SandboxLimits
from tvcache.sandboxes.shell.linux import KEPT_CAPABILITIES, overlay_supported

__all__ = [  # the contract suite, run here over the docker and image backends (the ``backend`` fixture below)
    "test_discard_removes_the_snapshot_and_forking_it_then_fails",
    "test_factory_and_sandbox_satisfy_the_protocol",
    "test_forks_are_independent_and_snapshots_frozen",
    "test_snapshot_refuses_an_existing_destination",
    "test_stop_is_idempotent_and_a_stopped_sandbox_refuses_work",
    "test_tool_failures_are_outcomes_and_bad_calls_raise",
]

REQUIRE = os.environ.get("TVCACHE_REQUIRE_DOCKER") == "1"
BASE = os.environ.get("TVCACHE_DOCKER_IMAGE", "tvcache-base:bookworm")
OWNER = DockerCommands().owner
ITEMS_DOCKERFILE = f"""\
FROM {BASE}
WORKDIR /work
RUN mkdir items && echo red > items/apple && echo green > items/pear && echo x > a.txt
ENV GREETING=hello
"""


def _why_not() -> str | None:
    available, why = docker_available()
    if not available:
        return f"needs a Docker engine ({why}); start one with scripts/install-docker.sh"
    found = subprocess.run(["docker", "image", "inspect", BASE], capture_output=True, timeout=60)
    if found.returncode != 0:
        return f"needs the base image {BASE}; build it with scripts/build-base-image.sh"
    return None


WHY_NOT = _why_not()
# Whether runc finds a CRIU >= 4.1 (scripts/install-criu.sh; install-docker.sh puts it on dockerd's PATH).
CHECKPOINTS = WHY_NOT is None and Path(os.environ.get("TVCACHE_CRIU_DIR", "/var/cache/tvcache/criu"), "criu").exists()


def docker(*argv: str) -> str:
    return subprocess.run(["docker", *argv], capture_output=True, text=True, timeout=120, check=True).stdout


def ours() -> tuple[set[str], set[str]]:
    """The containers and images this test process owns in the engine now."""
    label = f"label={OWNER_LABEL}={OWNER}"
    containers = set(docker("ps", "--all", "--quiet", "--filter", label).split())
    images = set(docker("images", "--quiet", "--filter", label).split())
    return containers, images


@pytest.fixture
def engine() -> Iterator[None]:
    """Runs the test against the engine (or skips/fails without one), then removes whatever it left there."""
    if WHY_NOT is not None:
        if REQUIRE:
            pytest.fail(f"TVCACHE_REQUIRE_DOCKER=1, but this test {WHY_NOT}")
        pytest.skip(WHY_NOT)
    before = ours()
    yield
    containers, images = ours()
    if containers - before[0]:
        subprocess.run(["docker", "rm", "--force", *(containers - before[0])], capture_output=True, timeout=120)
    if images - before[1]:
        subprocess.run(["docker", "image", "rm", "--force", *(images - before[1])], capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def items_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A two-layer image built from a Dockerfile over the base: /work/items/{apple,pear}, WORKDIR /work."""
    if WHY_NOT is not None:
        pytest.fail(WHY_NOT) if REQUIRE else pytest.skip(WHY_NOT)
    context = tmp_path_factory.mktemp("items-image")
    (context / "Dockerfile").write_text(ITEMS_DOCKERFILE)
    tag = f"tvcache-test-items:{os.getpid()}"
    docker("build", "--quiet", "--tag", tag, str(context))
    yield tag
    subprocess.run(["docker", "image", "rm", "--force", tag], capture_output=True, timeout=120)
    shutil.rmtree(f"/tmp/tvcache-test-images-{os.getpid()}", ignore_errors=True)  # image_backend's exports


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def sh(cmd: str, **extra: Any) -> ToolCall:
    return ToolCall("sh", {"cmd": cmd, **extra})


# ----------------------------------------------------------------- without an engine


def test_commands_are_argument_vectors_without_a_shell() -> None:
    commands = DockerCommands(network="none", workdir="/work")
    run_argv = commands.run("debian:12", "tvcache-x")
    assert run_argv[:3] == ["docker", "run", "--detach"]
    assert run_argv[run_argv.index("--network") : run_argv.index("--network") + 2] == ["--network", "none"]
    assert run_argv[run_argv.index("--pull") : run_argv.index("--pull") + 2] == ["--pull", "never"]
    assert f"{OWNER_LABEL}={OWNER}" in run_argv  # a later start tells a live owner's containers from orphans
    assert run_argv[-3:] == ["debian:12", "sleep", "infinity"]
    assert "LANG=C.UTF-8" in run_argv
    command = "echo 'quoted; $(not expanded)' && ls"
    exec_argv = commands.exec("tvcache-x", command, 2.5)
    assert exec_argv[-3:] == ["bash", "-c", command]  # passed as one argument, never interpolated
    assert exec_argv[exec_argv.index("timeout") : exec_argv.index("timeout") + 4] == ["timeout", "-s", "KILL", "2.5"]
    assert commands.commit("tvcache-x", "tvcache-snapshot:1", snapshot="/c/s") == [
        "docker", "commit", "--pause=true", "--change", 'LABEL tvcache.snapshot="/c/s"', "tvcache-x",
        "tvcache-snapshot:1",
    ]  # fmt: skip
    checkpoint = commands.checkpoint("tvcache-x", "snap", "/d")
    assert checkpoint[:4] == ["docker", "checkpoint", "create", "--leave-running"]
    assert commands.start_from_checkpoint("n", "snap") == ["docker", "start", "--checkpoint", "snap", "n"]
    assert commands.remove_container("n") == ["docker", "rm", "--force", "--volumes", "n"]
    assert commands.remove_image("i") == ["docker", "image", "rm", "--force", "i"]
    assert "--workdir" not in DockerCommands().exec("n", "ls", 1)  # the image's own WORKDIR by default


def test_containers_keep_only_the_shell_sandboxes_capabilities_and_their_limits() -> None:
    argv = DockerCommands().run("img", "name")
    assert "--privileged" not in argv
    assert not {"--volume", "-v", "--mount"} & set(argv)  # no host mount
    assert argv[argv.index("--cap-drop") : argv.index("--cap-drop") + 2] == ["--cap-drop", "ALL"]
    added = [argv[index + 1] for index, option in enumerate(argv) if option == "--cap-add"]
    assert added == list(CONTAINER_CAPABILITIES)
    assert {f"CAP_{name}" for name in added} == set(KEPT_CAPABILITIES) - {"CAP_CHECKPOINT_RESTORE"}
    assert argv[argv.index("--security-opt") + 1] == "no-new-privileges"
    assert argv[argv.index("--pids-limit") + 1] == str(DEFAULT_LIMITS.pids)
    memory = f"{DEFAULT_LIMITS.memory_bytes}b"
    assert argv[argv.index("--memory") + 1] == argv[argv.index("--memory-swap") + 1] == memory  # no swap beyond
    assert argv[argv.index("--cpus") + 1] == f"{DEFAULT_LIMITS.cpus:g}"
    shell = DockerCommands().run_shell("img", "name", {}, create_only=True)
    assert (
        shell[shell.index("--cap-drop") : shell.index("--security-opt") + 2]
        == argv[argv.index("--cap-drop") : argv.index("--security-opt") + 2]
    )  # persistent shells, restored ones included, are confined alike
    factory = DockerSandbox.factory("img", limits=SandboxLimits(pids=64, memory_bytes=64 << 20, cpus=0.5))
    limited = factory.commands.run("img", "name")
    assert limited[limited.index("--pids-limit") + 1] == "64"
    assert limited[limited.index("--memory") + 1] == str(64 << 20) + "b"
    assert limited[limited.index("--cpus") + 1] == "0.5"
    unlimited = DockerSandbox.factory("img", limits=None).commands.run("img", "name")
    assert not {"--pids-limit", "--memory", "--memory-swap", "--cpus"} & set(unlimited)
    assert "--cap-drop" in unlimited  # capabilities are not a limit: always dropped
    with pytest.raises(ValueError, match="at least 6 MiB"):
        DockerCommands(limits=SandboxLimits(memory_bytes=1 << 20))


def test_podman_runs_get_the_ulimits_it_needs_here() -> None:
    factory = DockerSandbox.factory("img", engine="podman")
    argv = factory.commands.run("img", "name")
    assert argv[0] == "podman"
    assert argv[argv.index("--ulimit") : argv.index("--ulimit") + 2] == ["--ulimit", "nofile=20000:20000"]


def test_a_missing_engine_is_reported_with_the_reason() -> None:
    available, why = docker_available("/nonexistent/docker")
    assert not available
    assert "not installed" in why


def test_bad_factory_options_are_refused() -> None:
    with pytest.raises(ValueError, match="timeout"):
        DockerSandbox.factory("debian:12", timeout=0)
    with pytest.raises(ValueError, match="max_containers"):
        DockerSandbox.factory("debian:12", max_containers=0)


# ------------------------------------------------------------ the contract, for real


def docker_backend(image: str, **options: Any) -> Backend:
    return Backend(
        factory=DockerSandbox.factory(image, **options),
        read=sh("ls items"),
        write=lambda name: sh(f"echo new > items/{name}"),
        failing=sh("echo failing; exit 3"),
        bad_arguments=ToolCall("sh", {"command": "ls"}),
        items=lambda outcome: set(outcome.output.splitlines()),
    )


def image_backend(image: str, tmp_path: Path) -> Backend:
    if not overlay_supported():
        pytest.skip("image-based overlay sandboxes need overlay mounts (root on Linux >= 6.8)")
    # One export of the image for the whole module: it is per digest, and the image does not change meanwhile.
    cache_dir = Path(f"/tmp/tvcache-test-images-{os.getpid()}")
    factory = ShellSandbox.from_image(image, cache_dir=cache_dir, store_root=tmp_path / "layers")
    return Backend(
        factory=factory,
        read=sh("ls items"),
        write=lambda name: sh(f"echo new > items/{name}"),
        failing=sh("echo failing; exit 3"),
        bad_arguments=ToolCall("sh", {"command": "ls"}),
        items=lambda outcome: set(outcome.output.splitlines()),
    )


@pytest.fixture(params=["docker", "docker-checkpoint", "image"])
def backend(request: pytest.FixtureRequest, engine: None, items_image: str, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "image":
        made = image_backend(items_image, tmp_path)
    else:
        made = docker_backend(items_image, checkpoint=request.param == "docker-checkpoint")
    yield made
    made.factory.close()  # type: ignore[attr-defined]


# ----------------------------------------------------------------- DockerSandbox


def test_snapshot_and_fork_through_an_engine_keep_files_and_time_out(engine: None, tmp_path: Path) -> None:
    factory = DockerSandbox.factory(BASE)

    async def main() -> None:
        sandbox = await factory.start()
        await sandbox.execute(sh("echo one > /root/f"))
        snapshot = await sandbox.snapshot(tmp_path / "snap")
        assert 0 < snapshot.bytes < 10_000_000  # the commit's own layer, not the whole image
        await sandbox.execute(sh("echo two > /root/f"))
        fork = await factory.fork(snapshot)
        assert (await fork.execute(sh("cat /root/f"))).output == "one\n"
        assert (await sandbox.execute(sh("cat /root/f"))).output == "two\n"
        timed = await fork.execute(sh("sleep 30", timeout=1))
        assert timed.is_error
        assert not timed.deterministic
        assert (await fork.execute(sh("echo still usable"))).output == "still usable\n"
        for each in (sandbox, fork):
            await each.stop()
        factory.discard(snapshot)

    run(main())
    assert factory.owned() == ([], [])
    assert ours() == (set(), set())


def test_processes_survive_a_checkpoint_fork_and_a_commit_declines_them(engine: None, tmp_path: Path) -> None:
    with_processes = DockerSandbox.factory(BASE, checkpoint=True)
    files_only = DockerSandbox.factory(BASE)

    async def main() -> None:
        plain = await files_only.start()
        await plain.execute(sh("sleep 300 >/dev/null 2>&1 &"))
        with pytest.raises(SnapshotDeclined, match="process"):
            await plain.snapshot(tmp_path / "declined")
        await plain.stop()
        sandbox = await with_processes.start()
        # The counter file is replaced, never truncated, so a checkpoint never catches it half-written.
        counter = "i=0; while :; do i=$((i+1)); echo $i > /tmp/n.new; mv /tmp/n.new /tmp/n; sleep 0.05; done"
        await sandbox.execute(sh(f"({counter}) >/dev/null 2>&1 &"))
        if with_processes.checkpoint_declined is not None or not CHECKPOINTS:
            # No CRIU >= 4.1 for runc here: declined, saying why (CI installs one: scripts/install-criu.sh).
            with pytest.raises(SnapshotDeclined, match="checkpoint"):
                await sandbox.snapshot(tmp_path / "snap")
            await sandbox.stop()
            return
        await sandbox.execute(sh("until [ -s /tmp/n ]; do sleep 0.01; done"))  # the loop has written once
        snapshot = await sandbox.snapshot(tmp_path / "snap")
        fork = await with_processes.fork(snapshot)
        first = int((await fork.execute(sh("cat /tmp/n"))).output)
        await fork.execute(sh("sleep 0.3"))
        assert int((await fork.execute(sh("cat /tmp/n"))).output) > first  # the loop runs on in the fork
        for each in (sandbox, fork):
            await each.stop()
        with_processes.discard(snapshot)
        assert not Path(snapshot.meta["checkpoint_dir"]).exists()

    run(main())
    assert ours() == (set(), set())


def image_without_bash(tmp_path: Path) -> str:
    """An image holding only sleep, timeout and the libraries they need: no bash."""
    root = tmp_path / "no-bash"
    (root / "bin").mkdir(parents=True)
    base = Path(docker("image", "inspect", "--format", "{{.GraphDriver.Data.UpperDir}}", BASE).strip())
    for name in ("sleep", "timeout"):
        (root / "bin" / name).write_bytes((base / "usr" / "bin" / name).read_bytes())
        (root / "bin" / name).chmod(0o755)
    for library in ("lib", "lib64"):
        subprocess.run(["cp", "-a", str(base / "usr" / library), str(root / library)], check=True)
    tag = f"tvcache-test-no-bash:{os.getpid()}"
    labels = ["--change", "LABEL tvcache.sandbox=1", "--change", f"LABEL {OWNER_LABEL}={OWNER}"]
    with subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE) as tar:
        subprocess.run(["docker", "import", *labels, "-", tag], stdin=tar.stdout, check=True, capture_output=True)
    return tag


def test_faults_are_clear_errors_and_a_dead_container_is_never_trusted_again(engine: None, tmp_path: Path) -> None:
    no_bash = image_without_bash(tmp_path)

    async def main() -> None:
        with pytest.raises(SandboxError, match="no-such-image.*docker run failed"):
            await DockerSandbox.factory("tvcache-no-such-image:1").start()
        factory = DockerSandbox.factory(BASE)
        sandbox = await factory.start()
        docker("kill", sandbox.name)  # killed from outside
        with pytest.raises(SandboxError, match=f"{sandbox.name}.*call sh\\('echo hi'\\).*not running"):
            await sandbox.execute(sh("echo hi"))
        docker("start", sandbox.name)  # even alive again, it is not trusted
        with pytest.raises(SandboxError, match="not running"):
            await sandbox.execute(sh("echo hi"))
        with pytest.raises(SandboxError, match="not running"):
            await sandbox.snapshot(tmp_path / "snap")
        await sandbox.stop()
        bare = await DockerSandbox.factory(no_bash).start()
        with pytest.raises(SandboxError, match="no bash"):
            await bare.execute(sh("echo hi"))
        await bare.stop()
        factory.close()
        # The persistent flavour fails as clearly, at its start (its shell is the container's main process).
        with pytest.raises(SandboxError, match="no-such-image.*shell ended while starting.*docker exit 125"):
            await DockerSandbox.factory("tvcache-no-such-image:1", persistent=True).start()
        with pytest.raises(SandboxError, match="the image needs bash"):
            await DockerSandbox.factory(no_bash, persistent=True).start()

    run(main())


def test_a_container_keeps_only_its_capabilities(engine: None) -> None:
    kept = sum(1 << number for name, number in KEPT_CAPABILITIES.items() if name != "CAP_CHECKPOINT_RESTORE")

    async def main() -> None:
        factory = DockerSandbox.factory(BASE)
        sandbox = await factory.start()
        try:
            status = (await sandbox.execute(sh("grep ^Cap /proc/self/status"))).output
            sets = dict(line.split(":\t") for line in status.splitlines())
            assert {name: int(value, 16) for name, value in sets.items()} == {
                "CapInh": 0, "CapPrm": kept, "CapEff": kept, "CapBnd": kept, "CapAmb": 0,
            }  # fmt: skip
        finally:
            await sandbox.stop()
            factory.close()

    run(main())


# Small limits, so that the fork bomb and the memory hog hit them fast (the defaults are 1024 pids, 2 GiB).
SMALL_LIMITS = SandboxLimits(pids=128, memory_bytes=128 << 20, cpus=1.0, tmpfs_bytes=None)
HOSTILE = {  # the command, and the limit it hits
    "fork-bomb": (":(){ :|:& };:; sleep 3", "pids"),
    "memory-hog": ("head -c 512M /dev/zero | tail -n 1 >/dev/null", "memory"),
}


@pytest.mark.parametrize("hostile", sorted(HOSTILE))
@pytest.mark.parametrize("persistent", [False, True], ids=["one-shot", "persistent"])
def test_a_limit_hit_ends_the_call_clearly_and_untrusts_the_container(
    engine: None, persistent: bool, hostile: str
) -> None:
    command, kind = HOSTILE[hostile]
    note = SMALL_LIMITS.describe(kind)  # "the sandbox hit its process limit of 128", as the shell sandboxes say

    async def main() -> None:
        factory = DockerSandbox.factory(BASE, limits=SMALL_LIMITS, persistent=persistent)
        try:
            sandbox = await factory.start()
            assert sandbox.counters_missing is None  # the engine runs here: its cgroups are read on this machine
            outcome = await asyncio.wait_for(sandbox.execute(sh(command, timeout=30)), 60)
            assert outcome.output.endswith(f"[{note}]")
            assert outcome.is_error
            assert not outcome.deterministic
            with pytest.raises(SandboxError, match=f"no longer trusted.*{re.escape(note)}"):
                await sandbox.execute(sh("echo hi"))
            with pytest.raises(SnapshotDeclined, match=re.escape(note)):
                await sandbox.snapshot(Path(f"/tmp/tvcache-never-{os.getpid()}"))
            await sandbox.stop()
            fresh = await factory.start()  # a new container of the factory works as ever
            assert (await fresh.execute(sh("echo ok"))).output == "ok\n"
            await fresh.stop()
        finally:
            factory.close()

    run(main())


@pytest.mark.parametrize("persistent", [False, True], ids=["one-shot", "persistent"])
def test_a_limit_hit_after_a_call_returned_is_reported_by_the_next(engine: None, persistent: bool) -> None:
    async def main() -> None:
        factory = DockerSandbox.factory(BASE, limits=SMALL_LIMITS, persistent=persistent)
        sandbox = await factory.start()
        try:
            # A fork bomb in the background, a moment after its call returned.
            first = await sandbox.execute(sh("(sleep 0.5; :(){ :|:& };:) >/dev/null 2>&1 & echo started"))
            assert "started" in first.output
            counters = sandbox._counters
            assert counters is not None
            for _ in range(600):  # bounded: 30 s at most
                if counters.hit_since(sandbox._mark) is not None:
                    break
                await asyncio.sleep(0.05)
            with pytest.raises(SandboxError, match="hit its process limit of 128"):
                await sandbox.execute(sh("echo hi"))
            with pytest.raises(SandboxError, match="no longer trusted.*process limit"):
                await sandbox.execute(sh("echo hi"))
        finally:
            await sandbox.stop()
            factory.close()

    run(main())


def test_the_engine_dying_mid_run_is_a_clear_error(engine: None, tmp_path: Path) -> None:
    # A second engine client pointing at a socket nobody serves stands for an engine that went away: the
    # container (of the real engine) is then unreachable, and the sandbox says so instead of guessing.
    factory = DockerSandbox.factory(BASE)

    async def main() -> None:
        sandbox = await factory.start()
        gone = DockerCommands(docker=str(tmp_path / "docker"))
        (tmp_path / "docker").write_text(f'#!/bin/sh\nexec docker -H unix://{tmp_path}/none.sock "$@"\n')
        (tmp_path / "docker").chmod(0o755)
        object.__setattr__(factory, "commands", gone)
        with pytest.raises(SandboxError, match="engine does not answer"):
            await sandbox.execute(sh("echo hi"))
        with pytest.raises(SandboxError, match="engine does not answer"):
            await sandbox.execute(sh("echo hi"))

    run(main())
    factory._owned.commands = DockerCommands()  # the real engine again, to remove the container
    factory.close()


def test_concurrent_sandboxes_are_bounded_by_the_pool(engine: None) -> None:
    factory = DockerSandbox.factory(BASE, max_containers=2)
    peak = 0

    async def one(index: int) -> str:
        nonlocal peak
        sandbox = await factory.start()
        peak = max(peak, len(factory.owned()[0]))
        try:
            return (await sandbox.execute(sh(f"echo {index}"))).output
        finally:
            await sandbox.stop()

    async def main() -> list[str]:
        return await asyncio.gather(*(one(index) for index in range(5)))

    assert run(main()) == [f"{index}\n" for index in range(5)]
    assert peak == 2


# ----------------------------------------------------------------- ownership


def test_an_in_memory_cache_leaves_no_snapshot_image_at_close(engine: None) -> None:
    factory = DockerSandbox.factory(BASE)
    for _ in range(2):
        with Cache(snapshot_policy=AlwaysSnapshot()) as cache:

            async def main(cache: Cache = cache) -> None:
                async with cache.session("t", sandbox=factory) as session:
                    await session.call("sh", {"cmd": "echo a > /root/a"})
                    await session.call("sh", {"cmd": "echo b > /root/b"})

            run(main())
            assert len(ours()[1]) >= 1  # snapshots were taken
        assert ours() == (set(), set())  # the close removed every one of them


def test_a_durable_cache_keeps_its_images_and_orphans_are_removed_after_a_crash(engine: None, tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import asyncio, os, sys
        from tvcache import AlwaysSnapshot, Cache
        from tvcache.sandboxes import DockerSandbox
        factory = DockerSandbox.factory({BASE!r})
        async def main(cache):
            async with cache.session("t", sandbox=factory) as session:
                await session.call("sh", {{"cmd": "echo a > /root/a"}})
        durable = Cache(sys.argv[1], snapshot_policy=AlwaysSnapshot())
        memory = Cache(snapshot_policy=AlwaysSnapshot())
        asyncio.run(main(durable)); asyncio.run(main(memory))
        asyncio.run(factory.start())  # a container left running
        durable.close()
        os._exit(0)  # a crash: no close, no exit handlers
    """)
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "durable")], check=True, timeout=120)
    label = f"label={OWNER_LABEL}"
    left = docker("images", "--quiet", "--filter", "reference=tvcache-snapshot").split()
    assert len(left) >= 2
    containers, images = remove_orphans()  # what the next start does
    assert containers >= 1
    assert images >= 1
    remaining = [image for image in docker("images", "--quiet", "--filter", label).split() if image in left]
    assert len(remaining) == 1  # the durable cache's snapshot is kept: its journal still records it

    async def fork_it() -> list[tuple[str, bool]]:
        with Cache(tmp_path / "durable") as cache:
            async with cache.session("t", sandbox=DockerSandbox.factory(BASE)) as session:
                calls = [await session.call("sh", {"cmd": cmd}) for cmd in ("echo a > /root/a", "cat /root/a")]
        return [(result.output, result.hit) for result in calls]

    try:
        assert run(fork_it()) == [("", True), ("a\n", False)]  # the cat ran in a fork of the kept image
    finally:
        subprocess.run(["docker", "image", "rm", "--force", *remaining], capture_output=True, timeout=120)


# ----------------------------------------------------------------- image-based overlay sandboxes


def test_an_image_sandbox_applies_env_workdir_and_pins_the_digest(
    engine: None, items_image: str, tmp_path: Path
) -> None:
    if not overlay_supported():
        pytest.skip("image-based overlay sandboxes need overlay mounts (root on Linux >= 6.8)")
    factory = ShellSandbox.from_image(items_image, cache_dir=tmp_path / "images", store_root=tmp_path / "layers")
    config = factory.image  # type: ignore[attr-defined]
    assert config.digest == inspect_image(items_image).digest
    assert config.task_id("build") == f"build@{config.digest}"
    assert (tmp_path / "images" / config.digest.removeprefix("sha256:") / "rootfs" / "work" / "items").is_dir()

    async def main() -> list[str]:
        sandbox = await factory.start()
        try:
            return [(await sandbox.execute(sh(cmd))).output for cmd in ("pwd", "echo $GREETING", "cat items/apple")]
        finally:
            await sandbox.stop()

    assert run(main()) == ["/work\n", "hello\n", "red\n"]
    factory.close()
    with pytest.raises(SandboxError, match="tvcache-no-such-image.*build or import it first"):
        ShellSandbox.from_image("tvcache-no-such-image:1")


def test_an_image_users_commands_run_as_that_user(engine: None, tmp_path: Path) -> None:
    if not overlay_supported():
        pytest.skip("image-based overlay sandboxes need overlay mounts (root on Linux >= 6.8)")
    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx" / "Dockerfile").write_text(
        f"FROM {BASE}\nRUN useradd -m -u 1234 agent\nUSER agent\nWORKDIR /home/agent\n"
    )
    tag = f"tvcache-test-user:{os.getpid()}"
    docker("build", "--quiet", "--label", f"{OWNER_LABEL}={OWNER}", "--tag", tag, str(tmp_path / "ctx"))
    factory = ShellSandbox.from_image(tag, cache_dir=tmp_path / "images", store_root=tmp_path / "layers")
    in_docker = DockerSandbox.factory(tag)

    async def outputs(made: Any) -> list[str]:
        sandbox = await made.start()
        try:
            return [(await sandbox.execute(sh(cmd))).output for cmd in ("id -u; id -g; pwd; echo $HOME", "touch f")]
        finally:
            await sandbox.stop()

    assert run(outputs(factory)) == run(outputs(in_docker)) == ["1234\n1234\n/home/agent\n/home/agent\n", ""]
    factory.close()
    in_docker.close()


# ----------------------------------------------------------------- differential


@pytest.mark.parametrize("cached_backend", ["docker", "image"])
def test_cached_equals_uncached_docker_over_random_rollouts(
    engine: None, items_image: str, tmp_path: Path, cached_backend: str
) -> None:
    """The truth is a fresh container per history; the cache serves from docker commits, or from overlay
    sandboxes over the same image, and must agree with it call for call."""
    truth = DockerSandbox.factory(items_image)
    if cached_backend == "image":
        through: Any = image_backend(items_image, tmp_path).factory
        task = through.image.task_id("task")
    else:
        through, task = DockerSandbox.factory(items_image), "task"
    cache = Cache(snapshot_policy=CostAwareSnapshots(), budget=Budget(max_snapshots_per_task=4))
    rng = random.Random(f"docker:{cached_backend}")
    mismatches: list[tuple[Any, ...]] = []
    hits = 0

    async def main() -> None:
        nonlocal hits
        for _ in range(3):
            stem = [rng.choice(SHELL) for _ in range(rng.randrange(1, 3))]
            histories = [[sh(text) for text in stem + [rng.choice(SHELL) for _ in range(3)]] for _ in range(3)]
            answers = await asyncio.gather(*(cached(cache, through, task, history) for history in histories))
            for history, answer in zip(histories, answers, strict=True):
                expected = await uncached(truth, history)
                hits += sum(hit for _, hit in answer)
                for step, ((output, _), wanted) in enumerate(zip(answer, expected, strict=True)):
                    if output != wanted:
                        mismatches.append((step, history[: step + 1], output, wanted))

    run(main())
    cache.check_invariants()
    cache.close()
    through.close()
    truth.close()
    assert mismatches == [], mismatches[:3]
    assert hits > 0


# ----------------------------------------------------------------- persistent shells in containers


def persistent_outputs(factory: Any, commands: list[str], **extra: Any) -> list[Any]:
    async def main() -> list[Any]:
        sandbox = await factory.start()
        try:
            return [await sandbox.execute(sh(cmd, **extra)) for cmd in commands]
        finally:
            await sandbox.stop()

    return run(main())


def test_a_persistent_docker_shell_keeps_its_state_and_survives_timeouts(engine: None) -> None:
    factory = DockerSandbox.factory(BASE, persistent=True)
    outcomes = persistent_outputs(
        factory,
        [
            "cd /tmp; X=1; export Y=2; f() { echo fn $1; }; alias hi='echo alias'; umask 027",
            "pwd; echo $X $Y; f a; hi; umask; env | grep -c '^Y='",
            "sleep 300 &",
            "jobs; sh -c 'echo $$'",
            "read line; echo read=[$line]",  # stdin is at end of file: never a hang
            "echo $TERM; tty",
            "sleep 30",  # times out: the foreground job is interrupted, the shell lives on
            "while :; do :; done",  # a loop in the shell itself: interrupted too
            "kill -9 $$; echo $X still",  # the shell is its container's PID 1
            "head -c 3000000 /dev/zero | tr '\\0' a",  # bounded output
        ],
        timeout=2,
    )
    outputs = [outcome.output for outcome in outcomes]
    assert outputs[:6] == [
        "",
        "/tmp\n1 2\nfn a\nalias\n0027\n1\n",
        "[1] 103\n",  # every fresh shell goes on from PID 100 (env and grep had 101, 102): the same in every run
        "[1]+  Running                 sleep 300 &\n104\n",
        "read=[]\n",
        "dumb\nnot a tty\n[exit code 1]",  # TERM=dumb; the command's stdin is /dev/null, not the terminal
    ]
    assert outputs[6] == outputs[7] == "[timed out after 2s]"
    assert [o.deterministic for o in outcomes[6:8]] == [False, False]
    assert outputs[8] == "1 still\n"
    assert outputs[9].startswith("a" * 1000)
    assert "output truncated" in outputs[9]
    assert all(outcome.changed_state for outcome in outcomes)  # even `cat` moves $LINENO in a persistent shell
    assert factory.owned() == ([], [])


@pytest.mark.parametrize("ending", ["exit 3", "exec false"])
def test_a_persistent_docker_shell_that_ends_leaves_the_sandbox_untrusted(engine: None, ending: str) -> None:
    factory = DockerSandbox.factory(BASE, persistent=True)

    async def main() -> list[Any]:
        sandbox = await factory.start()
        try:
            outcomes = [
                await sandbox.execute(sh(cmd)) for cmd in ("cd /tmp; X=1; echo x > f", ending, "pwd; cat /tmp/f")
            ]
            with pytest.raises(SnapshotDeclined, match="shell ended"):
                await sandbox.snapshot(Path("/nonexistent/never-written"))
            return [*outcomes, sandbox.trusted]
        finally:
            await sandbox.stop()

    first, ended, after, trusted = run(main())
    assert first.deterministic
    assert ended.is_error
    assert not ended.deterministic
    assert "the shell ended with code" in ended.output
    assert "nothing this sandbox does is cached" in ended.output
    # The next call starts a new shell in the same container files, says so, and is never cached.
    assert after.output.startswith("[a new shell was started")
    assert after.output.endswith("/\nx\n")
    assert not after.deterministic
    assert not trusted
    assert ours() == (set(), set())


def test_a_persistent_docker_snapshot_needs_a_checkpoint(engine: None, tmp_path: Path) -> None:
    history = ["cd /tmp; X=1; f() { echo fn $1 $X; }", "sleep 300 &", "X=2"]
    after = ["echo $X $PWD; f b; jobs; sh -c 'echo $$'"]

    async def main() -> None:
        files_only = DockerSandbox.factory(BASE, persistent=True)
        sandbox = await files_only.start()
        for cmd in history:
            await sandbox.execute(sh(cmd))
        with pytest.raises(SnapshotDeclined, match="docker commit does not keep"):
            await sandbox.snapshot(tmp_path / "declined")
        assert (await sandbox.execute(sh("echo $X"))).output == "2\n"  # declining changed nothing
        await sandbox.stop()
        if not CHECKPOINTS:
            pytest.skip("no CRIU >= 4.1 for runc here (scripts/install-criu.sh)")
        factory = DockerSandbox.factory(BASE, persistent=True, checkpoint=True)
        sandbox = await factory.start()
        for cmd in history:
            await sandbox.execute(sh(cmd))
        snapshot = await sandbox.snapshot(tmp_path / "snap")
        assert snapshot.kind == "docker-persistent"
        fork = await factory.fork(snapshot)
        expected = "2 /tmp\nfn b 2\n[1]+  Running                 sleep 300 &\n102\n"
        assert [(await each.execute(sh(cmd))).output for each in (sandbox, fork) for cmd in after] == [expected] * 2
        await fork.execute(sh("X=fork"))
        assert (await sandbox.execute(sh("echo $X"))).output == "2\n"  # independent
        with pytest.raises(SandboxError, match="docker-persistent"):
            await DockerSandbox.factory(BASE, checkpoint=True).fork(snapshot)  # never into a one-shot sandbox
        for each in (sandbox, fork):
            await each.stop()
        factory.discard(snapshot)

    run(main())
    assert ours() == (set(), set())


PERSISTENT = [
    "cd /tmp",
    "cd /root",
    "X=$((X + 1)); echo x=$X",
    "export Y=y$X",
    "f() { echo f$1 $PWD $X; }",
    "f 1",
    "alias hi='echo hi $X'",
    "hi",
    "echo line >> log; wc -l < log",
    "sleep 300 &",
    "jobs",
    "umask 077; touch m$X; stat -c %a m$X",
    "sh -c 'echo $$'",
    'echo "$X $Y $PWD $LINENO"',
]


@pytest.mark.parametrize("route", ["checkpoint", "declined"])
def test_cached_equals_uncached_persistent_docker_shell(engine: None, tmp_path: Path, route: str) -> None:
    """Rollouts of one task through the cache — forks of docker checkpoints, or replays when snapshots are
    declined — against an uncached persistent shell running each whole history: the same, call for call."""
    if route == "checkpoint" and not CHECKPOINTS:
        pytest.skip("no CRIU >= 4.1 for runc here (scripts/install-criu.sh)")
    truth = DockerSandbox.factory(BASE, persistent=True)
    through = DockerSandbox.factory(BASE, persistent=True, checkpoint=route == "checkpoint")
    cache = Cache(snapshot_policy=AlwaysSnapshot(), budget=Budget(max_snapshots_per_task=4))
    rng = random.Random(f"persistent-docker:{route}")
    mismatches: list[tuple[Any, ...]] = []
    hits = 0

    async def main() -> None:
        nonlocal hits
        for _ in range(2):
            # With checkpoints, a slow first call, as a build is: forking its checkpoint then beats replaying it.
            first = "sleep 1; X=0" if route == "checkpoint" else "X=0"
            stem = [first, *(rng.choice(PERSISTENT) for _ in range(rng.randrange(1, 3)))]
            histories = [[sh(text) for text in stem + [rng.choice(PERSISTENT) for _ in range(2)]] for _ in range(3)]
            answers = await asyncio.gather(*(cached(cache, through, "task", history) for history in histories))
            for history, answer in zip(histories, answers, strict=True):
                expected = await uncached(truth, history)
                hits += sum(hit for _, hit in answer)
                for step, ((output, _), wanted) in enumerate(zip(answer, expected, strict=True)):
                    if output != wanted:
                        mismatches.append((step, history[: step + 1], output, wanted))

    run(main())
    stats = cache.stats()
    cache.check_invariants()
    cache.close()
    through.close()
    truth.close()
    assert mismatches == [], mismatches[:3]
    assert hits > 0
    if route == "checkpoint":
        assert stats.sandboxes_forked > 0  # later states came from forks of checkpoints
    else:
        assert stats.sandboxes_forked == 0  # every snapshot declined: later states replayed
    assert ours() == (set(), set())


def test_a_full_disk_during_a_checkpoint_declines_and_changes_nothing(engine: None, tmp_path: Path) -> None:
    """The checkpoint is written beside the snapshot's file, in the cache's directory: a tiny tmpfs there fills
    up mid-dump. (A full disk during ``docker commit`` would need the engine's own data root on a small disk,
    i.e. a second engine: not tested here.)"""
    if not CHECKPOINTS:
        pytest.skip("no CRIU >= 4.1 for runc here (scripts/install-criu.sh)")
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tiny)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    history = ["cd /tmp; X=1", "sleep 300 &"]
    probe = "echo $X $PWD; jobs; sh -c 'echo $$'"
    try:

        async def main(factory: Any) -> list[str]:
            sandbox = await factory.start()
            try:
                for cmd in history:
                    await sandbox.execute(sh(cmd))
                with pytest.raises(SnapshotDeclined, match="no space left on device"):
                    await sandbox.snapshot(tiny / "snap")
                assert list(tiny.iterdir()) == []  # no partial checkpoint, no snapshot file
                return [(await sandbox.execute(sh(probe))).output]
            finally:
                await sandbox.stop()

        for persistent in (False, True):
            factory = DockerSandbox.factory(BASE, checkpoint=True, persistent=persistent)
            outputs = run(main(factory))
            assert factory.checkpoint_declined is None  # a full disk does not turn checkpoints off for good
            assert factory.owned() == ([], [])
            if persistent:  # the shell goes on exactly as one that was never checkpointed
                reference = persistent_outputs(DockerSandbox.factory(BASE, persistent=True), [*history, probe])
                assert outputs == [reference[-1].output]
    finally:
        subprocess.run(["umount", "-l", str(tiny)], capture_output=True)
    assert ours() == (set(), set())


# ----------------------------------------------------------------- the Dockerfile workload


def test_the_dockerfile_workload_runs_exactly_through_both_backends(engine: None, tmp_path: Path) -> None:
    before = set(docker("ps", "--all", "--quiet", "--filter", "label=tvcache.sandbox=1").split())
    out = tmp_path / "report"
    command = [sys.executable, "-m", "tvcache.cli", "demo", "--workloads", "dockerfile,dockerfile-docker"]
    # Four rollouts a group: with two, the sampled histories of the Docker backend's tasks shared no prefix at all
    # (0 hits in both epochs, at cb4439e as now), which is the policy's draw, not the cache.
    command += ["--quick", "--epochs", "2", "--rollouts", "4", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert set(report["workloads"]) == {"dockerfile", "dockerfile-docker"}
    for name, data in report["workloads"].items():
        assert all("@sha256:" in task for task in data["tasks"])  # task ids pin the images' digests
        assert [row["mismatches"] for row in data["epochs"]] == [0, 0], name
        assert any(row["hit_rate"] > 0 for row in data["epochs"]), name
        assert all(row["tool_seconds_uncached"] > 0 for row in data["epochs"]), name
    after = set(docker("ps", "--all", "--quiet", "--filter", "label=tvcache.sandbox=1").split())
    assert after <= before  # every container of the run was removed


def test_the_dockerfile_workload_is_left_out_without_an_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from tvcache import demo

    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    for name in ("dockerfile", "dockerfile-docker"):
        assert "needs a Docker engine" in (demo.unavailable(name) or "")
    command = [sys.executable, "-m", "tvcache.cli", "demo", "--workloads", "dockerfile-docker", "--out", "/nonexistent"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "cannot run here: needs a Docker engine" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("case", TRUST_CASES, ids=[case.name for case in TRUST_CASES])
def test_a_persistent_docker_shell_cannot_be_forged_or_broken(engine: None, case: Case) -> None:
    """The same trust cases as the overlay flavour's (tests/shell_trust_cases.py): one protocol, one driver."""
    factory = DockerSandbox.factory(BASE, persistent=True)

    async def main() -> None:
        sandbox = await factory.start()
        try:
            await run_case(sandbox.execute, case)
        finally:
            await sandbox.stop()

    run(main())
    assert factory.owned() == ([], [])


def test_output_from_a_background_process_in_a_docker_shell_is_not_deterministic(engine: None) -> None:
    factory = DockerSandbox.factory(BASE, persistent=True)

    async def main() -> None:
        sandbox = await factory.start()
        try:
            await run_background_case(sandbox.execute)
        finally:
            await sandbox.stop()

    run(main())
