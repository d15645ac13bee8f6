"""Benchmarks, run as ``tvcache bench NAME``. Each prints figures measured side by side in one run and can
write them as JSON (``--json PATH``). They are commands, never test assertions."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..calls import ToolSpec
from ..protocol import Sandbox, Snapshot


@contextlib.contextmanager
def overlay_scratch(name: str) -> Iterator[Path]:
    """A scratch directory for a benchmark of overlay sandboxes (under ``$TVCACHE_BENCH_DIR`` if set), or exit
    saying why it cannot run here."""
    from ..sandboxes.shell.linux import overlay_supported

    if not overlay_supported():
        raise SystemExit(f"tvcache bench {name}: overlay mounts need root on Linux >= 6.8")
    with tempfile.TemporaryDirectory(prefix=f"tvcache-bench-{name}-", dir=os.environ.get("TVCACHE_BENCH_DIR")) as tmp:
        yield Path(tmp)


def latency_stats(samples: list[float]) -> dict[str, float]:
    """p50 and p95 in milliseconds of timings in seconds, and how many there were."""
    ordered = sorted(samples)
    return {
        "p50_ms": statistics.median(ordered) * 1000,
        "p95_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))] * 1000,
        "n": len(ordered),
    }


def write_figures(figures: dict[str, Any], json_path: str | None, *, blank_line: bool = False) -> None:
    """Write a benchmark's figures as JSON to ``json_path`` (None: nowhere) and say so, after a blank line when
    ``blank_line`` (below a table)."""
    if json_path:
        Path(json_path).write_text(json.dumps(figures, indent=2))
        print(f"{chr(10) if blank_line else ''}wrote {json_path}")


class HitsOnly:
    """A sandbox factory for benchmarks whose every call hits: none is ever started, and this one refuses to.
    ``tool``: the deterministic tool the calls name."""

    kind = "bench"

    def __init__(self, tool: str) -> None:
        self.tools = {tool: ToolSpec(name=tool, deterministic=True)}  # every call hits: nothing to check

    async def start(self) -> Sandbox:
        raise AssertionError("a hit must not start a sandbox")

    async def fork(self, snapshot: Snapshot) -> Sandbox:
        raise AssertionError("a hit must not fork a sandbox")

    def discard(self, snapshot: Snapshot) -> None:
        pass
