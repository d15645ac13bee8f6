"""Capabilities of a sandboxed shell (issue 24, finding 3): an allowlist, ``KEPT_CAPABILITIES``, and nothing
else, in every flavour (one-shot, persistent, restored by CRIU): no kernel log, no real-time scheduling, no
inheritable or ambient capabilities."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tvcache import ToolCall
from tvcache.sandboxes import ShellSandbox, ShellSandboxFactory
from tvcache.sandboxes.shell.criu import find_criu
from tvcache.sandboxes.shell.linux import KEPT_CAPABILITY_MASK, overlay_supported

pytestmark = pytest.mark.skipif(
    not overlay_supported(), reason="overlay mounts need root on Linux >= 6.8 (the shell backend falls back to copies)"
)

PROBE = (
    "grep ^Cap /proc/$$/status; dmesg >/dev/null 2>&1; echo dmesg=$?; chrt -f 1 true 2>/dev/null; echo chrt=$?; "
    "renice -n -5 $$ >/dev/null 2>&1; echo renice=$?"
)


def sh(cmd: str) -> ToolCall:
    return ToolCall("sh", {"cmd": cmd})


def factory_for(tmp_path: Path, **options: object) -> ShellSandboxFactory:
    base = tmp_path / "base"
    base.mkdir(exist_ok=True)
    factory = ShellSandbox.factory(base, fallback=False, store_root=tmp_path / "layers", **options)
    assert isinstance(factory, ShellSandboxFactory)
    return factory


def check(output: str) -> None:
    fields = dict(line.replace(":", "=", 1).split("=", 1) for line in output.splitlines())
    sets = {name: int(fields[name].strip(), 16) for name in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
    assert sets == {
        "CapInh": 0,
        "CapPrm": KEPT_CAPABILITY_MASK,
        "CapEff": KEPT_CAPABILITY_MASK,
        "CapBnd": KEPT_CAPABILITY_MASK,
        "CapAmb": 0,
    }, {name: hex(value) for name, value in sets.items()}
    if Path("/proc/sys/kernel/dmesg_restrict").read_text().strip() != "0":  # else anyone may read it
        assert fields["dmesg"] != "0"
    assert fields["chrt"] != "0"  # CAP_SYS_NICE
    assert fields["renice"] != "0"


def test_a_one_shot_command_keeps_only_the_kept_capabilities(tmp_path: Path) -> None:
    factory = factory_for(tmp_path)

    async def main() -> str:
        sandbox = await factory.start()
        try:
            return (await sandbox.execute(sh(PROBE))).output
        finally:
            await sandbox.stop()

    try:
        check(asyncio.run(main()))
    finally:
        factory.close()


@pytest.mark.parametrize("restored", [False, True], ids=["persistent", "criu-restored"])
def test_a_persistent_shell_keeps_only_the_kept_capabilities(tmp_path: Path, restored: bool) -> None:
    if restored and find_criu(warn=False) is None:
        pytest.skip("no working CRIU (make criu)")
    factory = factory_for(tmp_path, persistent=True)

    async def main() -> str:
        sandbox = await factory.start()
        try:
            if not restored:
                return (await sandbox.execute(sh(PROBE))).output
            await sandbox.execute(sh("sleep 60 &"))  # a live job: only CRIU can carry it
            snapshot = await sandbox.snapshot(tmp_path / "snap")
            fork = await factory.fork(snapshot)
            try:
                return (await fork.execute(sh(PROBE))).output
            finally:
                await fork.stop()
                factory.discard(snapshot)
        finally:
            await sandbox.stop()

    try:
        check(asyncio.run(main()))
        if restored:
            assert factory.route_counts() == {"criu": 1}
    finally:
        factory.close()


def test_a_warm_shell_keeps_only_the_kept_capabilities(tmp_path: Path) -> None:
    """A fork of a shell-state snapshot runs in a warm shell, started before its tree was known."""
    factory = factory_for(tmp_path, persistent=True)

    async def main() -> str:
        sandbox = await factory.start()
        try:
            await sandbox.execute(sh("X=1"))
            snapshot = await sandbox.snapshot(tmp_path / "snap")
            fork = await factory.fork(snapshot)
            try:
                return (await fork.execute(sh(PROBE))).output
            finally:
                await fork.stop()
                factory.discard(snapshot)
        finally:
            await sandbox.stop()

    try:
        check(asyncio.run(main()))
    finally:
        factory.close()
