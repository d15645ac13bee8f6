"""``tvcache bench published``: forking a shell snapshot another process published, next to rebuilding it.

A snapshot made in one process is forked in another through a shared ``DirectoryStore`` (as after a restart of a
durable cache, or by another worker of one ``tvcache serve``, or another node with a shared directory). For each
layer profile (files and MiB the rollout step writes), in one run:

* ``publish``: the snapshot in the making process, including packing its new layer and storing it;
* ``fork (fetch)``: a fork in the other process, which fetches, verifies and unpacks the layer first;
* ``fork (held)``: a second fork there, from the layer it now holds;
* ``start + replay``: what the other process pays without the store: a fresh sandbox re-running the step.

Each process is stood for by its own layer store and node cache (layers are process-scoped; the fetch path is
the one a second process takes). The step here is cheap file writing: real steps (builds, installs) make
replay far dearer while the fork costs stay the same. Needs root (overlay mounts) and GNU tar.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ..calls import ToolCall
from . import overlay_scratch


def _step(files: int, mib: int) -> ToolCall:
    blob = f" && head -c {mib}M /dev/urandom > data/blob" if mib else ""
    return ToolCall("sh", {"cmd": f"mkdir -p data && for i in $(seq {files}); do echo $i > data/f$i; done{blob}"})


async def _once(scratch: Path, base: Path, step: ToolCall) -> dict[str, float]:
    from ..sandboxes import ShellSandboxFactory
    from ..sandboxes.published import PublishedSnapshots
    from ..snapshots import DirectoryStore, NodeCache

    store = DirectoryStore(scratch / "store")

    shells: list[ShellSandboxFactory] = []

    def process(name: str) -> PublishedSnapshots:
        shells.append(ShellSandboxFactory(base, store_root=scratch / f"layers-{name}"))
        return PublishedSnapshots(shells[-1], store, cache=NodeCache(scratch / f"node-{name}"), node_id=name)

    maker, other = process("maker"), process("other")
    sandbox = await maker.start()
    began = time.perf_counter()
    await sandbox.execute(step)
    step_seconds = time.perf_counter() - began
    began = time.perf_counter()
    snapshot = await sandbox.snapshot(scratch / "snapshot")
    publish = time.perf_counter() - began
    await sandbox.stop()

    figures = {"publish": publish, "step": step_seconds}
    for label in ("fork (fetch)", "fork (held)"):
        began = time.perf_counter()
        fork = await other.fork(snapshot)
        figures[label] = time.perf_counter() - began
        await fork.stop()
    began = time.perf_counter()
    fresh = await other.start()
    await fresh.execute(step)
    figures["start + replay"] = time.perf_counter() - began
    await fresh.stop()
    for shell in shells:
        shell.close()  # deletes each process's layers; the store goes with the scratch directory
    return figures


def run(
    *, profiles: tuple[tuple[int, int], ...] = ((10, 0), (1000, 1), (2000, 32)), repeats: int = 5, json_path: str | None
) -> dict[str, Any]:
    from ..sandboxes.shell.layer_archive import require_gnu_tar

    require_gnu_tar()
    columns = ("publish", "fork (fetch)", "fork (held)", "start + replay")
    print(f"{'layer':>20} | " + " | ".join(f"{c:>14}" for c in columns) + " | replay/fetch")
    results: dict[str, Any] = {}
    with overlay_scratch("published") as tmp:
        base = tmp / "base"
        base.mkdir()
        (base / "README").write_text("a project tree\n")
        for files, mib in profiles:
            runs = [
                asyncio.run(_once(Path(tempfile.mkdtemp(dir=tmp)), base, _step(files, mib))) for _ in range(repeats)
            ]
            medians = {key: statistics.median(run[key] for run in runs) * 1000 for key in runs[0]}
            label = f"{files} files + {mib} MiB"
            results[label] = {f"{key}_ms_p50": value for key, value in medians.items()}
            ratio = medians["start + replay"] / medians["fork (fetch)"]
            cells = " | ".join(f"{medians[c]:>11.1f} ms" for c in columns)
            print(f"{label:>20} | {cells} | {ratio:>11.1f}x", flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2))
        print(f"wrote {json_path}")
    return results
