"""Docker sandboxes: the command lines are checked here; engine tests run only where an engine answers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tvcache import ToolCall
from tvcache.sandboxes.docker import DockerCommands, DockerSandbox, docker_available

AVAILABLE, WHY = docker_available()
needs_engine = pytest.mark.skipif(not AVAILABLE, reason=f"needs a Docker engine: {WHY}")


def test_commands_are_argument_vectors_without_a_shell() -> None:
    commands = DockerCommands(network="none", workdir="/work")
    run = commands.run("debian:12", "tvcache-x")
    assert run[:3] == ["docker", "run", "--detach"]
    assert run[run.index("--network") : run.index("--network") + 2] == ["--network", "none"]
    assert run[-3:] == ["debian:12", "sleep", "infinity"]
    assert "--env" in run
    assert "LANG=C.UTF-8" in run
    command = "echo 'quoted; $(not expanded)' && ls"
    exec_argv = commands.exec("tvcache-x", command, 2.5)
    assert exec_argv[-3:] == ["bash", "-c", command]  # passed as one argument, never interpolated
    assert exec_argv[exec_argv.index("timeout") : exec_argv.index("timeout") + 4] == ["timeout", "-s", "KILL", "2.5"]
    assert commands.commit("tvcache-x", "tvcache-snapshot:1") == [
        "docker", "commit", "--pause=true", "tvcache-x", "tvcache-snapshot:1",
    ]  # fmt: skip
    checkpoint = commands.checkpoint("tvcache-x", "snap", "/d")
    assert checkpoint[:4] == ["docker", "checkpoint", "create", "--leave-running"]
    assert commands.start_from_checkpoint("n", "snap", "/d") == [
        "docker", "start", "--checkpoint", "snap", "--checkpoint-dir", "/d", "n",
    ]  # fmt: skip
    assert commands.remove_container("n") == ["docker", "rm", "--force", "--volumes", "n"]
    assert commands.remove_image("i") == ["docker", "image", "rm", "--force", "i"]


def test_a_missing_engine_is_reported_with_the_reason() -> None:
    available, why = docker_available("/nonexistent/docker")
    assert not available
    assert "not installed" in why
    if not AVAILABLE:
        assert WHY  # the skip reason shown for the engine tests below


def test_bad_factory_options_are_refused() -> None:
    with pytest.raises(ValueError, match="timeout"):
        DockerSandbox.factory("debian:12", timeout=0)


@needs_engine
def test_snapshot_and_fork_through_an_engine(tmp_path: Path) -> None:
    factory = DockerSandbox.factory("debian:12-slim")

    async def main() -> None:
        sandbox = await factory.start()
        await sandbox.execute(ToolCall("sh", {"cmd": "echo one > /root/f"}))
        snapshot = await sandbox.snapshot(tmp_path / "snap")
        await sandbox.execute(ToolCall("sh", {"cmd": "echo two > /root/f"}))
        fork = await factory.fork(snapshot)
        assert (await fork.execute(ToolCall("sh", {"cmd": "cat /root/f"}))).output == "one\n"
        assert (await sandbox.execute(ToolCall("sh", {"cmd": "cat /root/f"}))).output == "two\n"
        timed = await fork.execute(ToolCall("sh", {"cmd": "sleep 30", "timeout": 1}))
        assert timed.is_error
        for each in (sandbox, fork):
            await each.stop()
        factory.discard(snapshot)

    asyncio.run(main())
