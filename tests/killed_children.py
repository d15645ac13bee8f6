"""A child Python process killed at a chosen point, for the crash tests of the journal and its checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def run_until(script: str, marker: str) -> str:
    """Run ``script`` until it prints a line starting with ``marker``, then SIGKILL it; returns that line."""
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith(marker), f"the child ended early: {line!r}"
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        if process.stdout is not None:
            process.stdout.close()
    return line
