"""No tool outlives its call: cancellation, a client hanging up and the server stopping each kill running tools.

Real processes throughout: ``cacherouter serve-mcp`` in a subprocess driven by the MCP SDK client, and a probe tool
that starts a child of its own, reports the process ids over a local socket, then waits far longer than any test.
Process ends are awaited through pidfds (Linux), so every wait is an event with a bound, not a sleep.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support import add_tool, make_repo

pytest.importorskip("mcp", reason="the 'mcp' extra is not installed: pip install 'tvcache[mcp]'")
if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
    pytest.skip("watches processes through pidfds (Linux)", allow_module_level=True)

import anyio  # noqa: E402
import mcp.client.stdio  # noqa: E402
import mcp.types as types  # noqa: E402
from anyio.abc import SocketAttribute, SocketListener  # noqa: E402
from mcp import Client, StdioServerParameters  # noqa: E402

WAIT = 30.0  # every wait is bounded by this; a healthy run takes well under a second per wait
LONG = 300  # seconds the probe and its child would run if nothing stopped them

PROBE = f'''"""Start a child, report the process ids, then wait."""
import argparse, os, socket, subprocess, sys, time
p = argparse.ArgumentParser(description="Start a child, report the process ids, then wait.")
p.add_argument("--port", type=int, required=True, help="where the test listens")
args = p.parse_args()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep({LONG})"])
with socket.create_connection(("127.0.0.1", args.port)) as s:
    s.sendall(f"{{os.getpid()}} {{os.getppid()}} {{child.pid}}\\n".encode())
time.sleep({LONG})
'''


@dataclass(frozen=True, kw_only=True)
class Probe:
    tool: int  # the probe tool's process
    server: int  # its parent: the process that ran it
    child: int  # a process the tool started: in the tool's process group


def probe_repo(root: Path) -> Path:
    make_repo(root)
    add_tool(root, "tail", "probe", "probe_tool").write_text(PROBE)
    return root


def server(root: Path, *extra: str) -> StdioServerParameters:
    argv = ["-m", "cacherouter.cli", "serve-mcp", "--repo", str(root), "--tool-timeout", str(LONG), *extra]
    return StdioServerParameters(command=sys.executable, args=argv, env=dict(os.environ))


@pytest.fixture
def reaper() -> Iterator[list[int]]:
    """Process ids to SIGKILL after the test, whatever it did: a failing test must not leave probes behind."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            os.close(fd)


@asynccontextmanager
async def listening() -> AsyncIterator[tuple[SocketListener, int]]:
    async with await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0) as listeners:
        [listener] = listeners.listeners  # one address: a single socket listener
        assert isinstance(listener, SocketListener)
        yield listener, listener.extra(SocketAttribute.local_port)


async def probe_started(listener: SocketListener, reaper: list[int]) -> Probe:
    with anyio.fail_after(WAIT):
        async with await listener.accept() as connection:
            line = b""
            while not line.endswith(b"\n"):
                line += await connection.receive()
    tool, server_pid, child = map(int, line.split())
    reaper.extend([tool, child])
    return Probe(tool=tool, server=server_pid, child=child)


def watch(*pids: int) -> list[int]:
    """pidfds of ``pids``, opened now, while the processes are known to be ours."""
    return [os.pidfd_open(pid) for pid in pids]


async def ended(fds: list[int]) -> None:
    """Wait until every watched process has ended (a pidfd turns readable on exit), at most WAIT seconds."""
    try:
        with anyio.fail_after(WAIT):
            for fd in fds:
                await anyio.wait_readable(fd)
    finally:
        for fd in fds:
            os.close(fd)


async def swallowed(call: Awaitable[Any]) -> None:
    """Run a call whose connection the test breaks on purpose; how it fails is not what is tested."""
    try:
        await call
    except Exception:  # a closed connection surfaces as one of several SDK errors
        pass


def synchronous(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test body on a fresh event loop (the suite uses no async pytest plugin)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


@synchronous
async def test_a_cancelled_call_kills_its_tool_and_the_connection_keeps_serving(
    tmp_path: Path, reaper: list[int]
) -> None:
    root = probe_repo(tmp_path / "repo")
    async with listening() as (listener, port), Client(server(root), cache=None) as client:
        async with anyio.create_task_group() as calls:
            calls.start_soon(client.call_tool, "probe_tool", {"port": port})
            probe = await probe_started(listener, reaper)
            fds = watch(probe.tool, probe.child)
            calls.cancel_scope.cancel()  # the client sends notifications/cancelled
        await ended(fds)
        echoed = await client.call_tool("echo_text", {"text": "still here"})
        block = echoed.content[0]
        assert isinstance(block, types.TextContent)
        assert block.text.strip() == "echo_text:still here"


@synchronous
async def test_a_client_hanging_up_kills_running_tools_and_the_server_exits_by_itself(
    tmp_path: Path, reaper: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = probe_repo(tmp_path / "repo")
    escalations: list[object] = []
    terminate = mcp.client.stdio._terminate_process_tree

    async def recorded(process: Any) -> None:
        escalations.append(process)
        await terminate(process)

    # The SDK closes stdin, waits for the server to exit, and only then kills the server's process group.
    monkeypatch.setattr(mcp.client.stdio, "_terminate_process_tree", recorded)
    monkeypatch.setattr(mcp.client.stdio, "PROCESS_TERMINATION_TIMEOUT", WAIT)
    async with listening() as (listener, port), anyio.create_task_group() as calls:
        async with Client(server(root), cache=None) as client:
            calls.start_soon(swallowed, client.call_tool("probe_tool", {"port": port}))
            probe = await probe_started(listener, reaper)
            fds = watch(probe.tool, probe.child, probe.server)
        # the client is gone while the call was running
        await ended(fds)
    assert escalations == []  # the server ended on its own at the end of its input


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@synchronous
async def test_a_signal_ends_the_server_and_its_running_tools(
    tmp_path: Path, reaper: list[int], signum: signal.Signals
) -> None:
    root = probe_repo(tmp_path / "repo")
    async with (
        listening() as (listener, port),
        anyio.create_task_group() as calls,
        Client(server(root), cache=None) as client,
    ):
        calls.start_soon(swallowed, client.call_tool("probe_tool", {"port": port}))
        probe = await probe_started(listener, reaper)
        fds = watch(probe.tool, probe.child, probe.server)
        os.kill(probe.server, signum)
        await ended(fds)


@synchronous
async def test_a_tool_dies_with_a_server_killed_outright(tmp_path: Path, reaper: list[int]) -> None:
    root = probe_repo(tmp_path / "repo")
    async with (
        listening() as (listener, port),
        anyio.create_task_group() as calls,
        Client(server(root), cache=None) as client,
    ):
        calls.start_soon(swallowed, client.call_tool("probe_tool", {"port": port}))
        probe = await probe_started(listener, reaper)
        fds = watch(probe.tool, probe.server)
        os.kill(probe.server, signal.SIGKILL)  # no clean-up runs: the kernel's parent-death signal does it
        await ended(fds)
        # The tool's own child is not covered by that signal; the reaper fixture ends it.


@pytest.mark.parametrize("stop", ["cancel", "kill_running"])
def test_run_script_returns_at_once_when_cancelled_or_killed(tmp_path: Path, reaper: list[int], stop: str) -> None:
    from cacherouter.tools.executor import Cancellation, kill_running, run_script

    script = probe_repo(tmp_path / "repo") / "tail" / "probe" / "probe_tool.py"
    cancel = Cancellation()
    with socket.create_server(("127.0.0.1", 0)) as listener, ThreadPoolExecutor(1) as pool:
        listener.settimeout(WAIT)
        argv = [f"--port={listener.getsockname()[1]}"]
        # timeout=WAIT: without a working stop the run ends there, timed out rather than cancelled
        running = pool.submit(run_script, script, argv, tool="probe_tool", timeout=WAIT, cancel=cancel)
        connection, _ = listener.accept()
        with connection:
            tool, _, child = map(int, connection.makefile().readline().split())
        reaper.extend([tool, child])
        fds = watch(tool, child)
        if stop == "cancel":
            cancel.cancel()
        else:
            assert kill_running() == 1
        result = running.result(timeout=WAIT)
    asyncio.run(ended(fds))
    assert result.cancelled
    assert not result.timed_out
    assert not result.ok
    assert result.exit_code is None
    assert result.to_json()["error"].startswith("cancelled")


def test_a_run_cancelled_before_it_starts_is_stopped_as_it_starts(tmp_path: Path) -> None:
    from cacherouter.tools.executor import Cancellation, run_script

    script = probe_repo(tmp_path / "repo") / "tail" / "probe" / "probe_tool.py"
    cancel = Cancellation()
    cancel.cancel()
    result = run_script(script, ["--port=1"], tool="probe_tool", timeout=WAIT, cancel=cancel)
    assert result.cancelled
    assert not result.ok
