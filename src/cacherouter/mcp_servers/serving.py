"""What both MCP servers share: a tool's result as MCP sees it, and ending on a signal with no tool left running.

Requires the ``mcp`` SDK (``pip install 'tvcache[mcp]'``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator

from ..errors import ConfigError
from ..tools.executor import ScriptResult, kill_running

try:
    import mcp.types as types
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ConfigError("serving over MCP needs the 'mcp' SDK: pip install 'tvcache[mcp]' (mcp>=2.3,<3)") from e

__all__ = ["error_result", "exit_on_signals", "script_result"]

logger = logging.getLogger(__name__)


def error_result(message: str) -> types.CallToolResult:
    """A call that produced no tool result: one text block saying what went wrong."""
    return types.CallToolResult(content=[types.TextContent(type="text", text=message)], is_error=True)


def script_result(result: ScriptResult) -> types.CallToolResult:
    """A script's run as an MCP result: its output (or error and output) as text, the rest as structured content."""
    payload = result.to_json()
    stdout = payload.pop("stdout")  # with the truncation marker, if any
    text = stdout if result.ok else payload.get("error", "") + ("\n" + stdout if stdout else "")
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=text)],
        # Status, exit code and flags, and stderr (the text shows its last line at most); not stdout, which
        # the text content already carries: clients that pass both to the model would pay for it twice.
        structured_content=payload,
        is_error=not result.ok,
    )


@contextlib.contextmanager
def exit_on_signals(also: Callable[[], object] | None = None) -> Iterator[None]:
    """On SIGINT or SIGTERM, kill every running tool's process group (and run ``also``), then let the signal end
    the process.

    Ending the process rather than unwinding the server: the SDK's stdio transport reads stdin in a worker thread
    that cancellation does not reach, so a server asked to stop while its client holds stdin open would hang
    until the client writes or hangs up. Only the main thread can handle signals; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        loop.add_signal_handler(signum, _exit_by_signal, signum, also)
    try:
        yield
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)


def _exit_by_signal(signum: int, also: Callable[[], object] | None = None) -> None:
    # Runs on the event loop (asyncio's signal handling), not in a signal handler: kill_running may take a lock.
    stopped = kill_running()
    logger.warning("%s: killed %d running tool(s); exiting", signal.Signals(signum).name, stopped)
    if also is not None:
        try:
            also()
        except Exception:  # the process ends by the signal whatever happens here
            logger.exception("stopping on %s failed", signal.Signals(signum).name)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # die of the signal, as the sender expects
