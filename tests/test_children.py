"""Children the project starts for its data (tar, cp) die with the process that started them, even by SIGKILL.

Real processes throughout: a Python parent starts a long-running child the way the snapshot code does (from an
``asyncio.to_thread`` worker that waits for it), is SIGKILLed, and the child must be gone within a bounded wait.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tvcache.children import run

from server_support import wait_until

PARENT = """
import asyncio, subprocess, sys
from tvcache.children import run

tied = sys.argv[2] == "tied"
start = run if tied else subprocess.run
child = ["sh", "-c", 'echo $$ > "$0.tmp" && mv "$0.tmp" "$0" && exec sleep 600', sys.argv[1]]

async def main():
    # From a pool thread that waits for the child, as the snapshot code runs tar: the thread that forked the
    # child lives exactly as long as the child, so the parent-death signal fires only when the process dies.
    await asyncio.to_thread(start, child, check=False)

asyncio.run(main())
"""


def exited(pidfd: int, within: float) -> bool:
    """Whether the process behind ``pidfd`` has exited, waiting at most ``within`` seconds (never unbounded)."""
    ready, _, _ = select.select([pidfd], [], [], within)
    return bool(ready)


@contextmanager
def watched(pid: int) -> Iterator[int]:
    """A pidfd on ``pid`` (it cannot be confused with a later process of the same number); the process is
    killed on the way out if it still runs, so a failing test leaves no sleeper behind."""
    pidfd = os.pidfd_open(pid)
    try:
        yield pidfd
    finally:
        if not exited(pidfd, 0):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            exited(pidfd, 10)
        os.close(pidfd)


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rpartition(")")[2].split()[1])


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_child_started_through_the_helper_dies_with_its_parent_killed_by_sigkill(tied: bool, tmp_path: Path) -> None:
    """The untied run is the control: the same child started by plain ``subprocess.run`` outlives its killed
    parent, so the check below does detect a survivor."""
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(pid_file), "tied" if tied else "untied"])
    try:
        wait_until(pid_file.exists, timeout=30)
        pid = int(pid_file.read_text())
        with watched(pid) as child:
            assert parent_of(pid) == parent.pid  # the child we watch is the one the parent started, still running
            parent.send_signal(signal.SIGKILL)
            parent.wait(10)
            if tied:
                assert exited(child, 10), "a tied child outlived the process that started it"
            else:
                assert not exited(child, 0), "the control child died with its parent: the test detects nothing"
    finally:
        parent.kill()
        parent.wait(10)


def test_a_tied_child_otherwise_runs_as_subprocess_run_would(tmp_path: Path) -> None:
    result = run(["sh", "-c", "cat; echo err >&2; exit 3"], input=b"in\n", capture_output=True, check=False)
    assert (result.returncode, result.stdout, result.stderr) == (3, b"in\n", b"err\n")
    with pytest.raises(TypeError, match="preexec_fn"):
        run(["true"], preexec_fn=lambda: None)
