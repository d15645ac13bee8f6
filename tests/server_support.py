"""Helpers shared by the server tests: a real server on 127.0.0.1 and a bounded wait."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_until(condition: Callable[[], bool], *, timeout: float = 10.0, interval: float = 0.005) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds (never an unbounded wait)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)
