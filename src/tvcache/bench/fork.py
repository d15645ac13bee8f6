"""``tvcache bench fork``: fork and snapshot latency of shell sandboxes (overlayfs) next to copying the tree.

For each base tree size (default 10 MB and 1 GB, many small files plus a few large ones), in one run:

* ``overlay fork``: ``ShellSandboxFactory.fork`` of a snapshot (a fresh upper over the layer stack);
* ``overlay snapshot``: freezing a sandbox that changed one file (the upper becomes a layer);
* ``copy fork``: what a copy-based backend pays for the same fork (``FolderSandbox``: copy the whole tree).

Prints p50/p95 per operation and the copy/overlay ratio. Needs root (overlay mounts).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from ..calls import ToolCall
from ..protocol import Snapshot
from . import latency_stats as _stats
from . import overlay_scratch, write_figures


def make_tree(root: Path, total_bytes: int) -> Path:
    """About ``total_bytes`` in 64 KiB files (90%) and 4 large files (10%), in nested directories."""
    root.mkdir(parents=True)
    small = 64 * 1024
    count = max(1, int(total_bytes * 0.9) // small)
    chunk = os.urandom(small)
    for index in range(count):
        directory = root / f"d{index % 50:02d}" / f"s{index % 7}"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"f{index}.bin").write_bytes(chunk)
    large = max(1, int(total_bytes * 0.1) // 4)
    for index in range(4):
        (root / f"large{index}.bin").write_bytes(os.urandom(min(large, 1 << 20)) * max(1, large >> 20))
    return root


async def _measure(base: Path, repeats: int, copy_repeats: int, scratch: Path) -> dict[str, Any]:
    from ..sandboxes import FolderSandbox, ShellSandboxFactory

    shell = ShellSandboxFactory(base, store_root=scratch / "layers")
    origin = await shell.start()
    await origin.execute(ToolCall("sh", {"cmd": "echo changed > changed.txt"}))
    root_snapshot = await origin.snapshot(scratch / "root-snapshot")
    forks, snapshots = [], []
    for index in range(repeats):
        began = time.perf_counter()
        sandbox = await shell.fork(root_snapshot)
        forks.append(time.perf_counter() - began)
        (sandbox._upper / "note.txt").write_text(str(index))  # one changed file, written directly
        began = time.perf_counter()
        snapshot = await sandbox.snapshot(scratch / f"s{index}")
        snapshots.append(time.perf_counter() - began)
        await sandbox.stop()
        shell.discard(snapshot)
    await origin.stop()
    shell.discard(root_snapshot)
    shell.close()

    folder = FolderSandbox.factory(base)
    copy_snapshot = Snapshot(kind="folder", path=str(base), bytes=0)  # forking "from" the tree copies all of it
    copies = []
    for _ in range(copy_repeats):
        began = time.perf_counter()
        sandbox_copy = await folder.fork(copy_snapshot)
        copies.append(time.perf_counter() - began)
        await sandbox_copy.stop()
    folder.close()
    result: dict[str, Any] = {
        "overlay_fork": _stats(forks),
        "overlay_snapshot": _stats(snapshots),
        "copy_fork": _stats(copies),
    }
    result["copy_over_overlay_fork_p50"] = result["copy_fork"]["p50_ms"] / result["overlay_fork"]["p50_ms"]
    return result


def run(
    *, sizes_mb: tuple[int, ...] = (10, 1024), repeats: int = 200, copy_repeats: int = 5, json_path: str | None = None
) -> dict[str, Any]:
    figures: dict[str, Any] = {"sizes": {}}
    with overlay_scratch("fork") as scratch:
        header = (
            f"{'tree':>7} | {'overlay fork p50/p95':>21} | {'snapshot p50/p95':>17} | {'copy fork p50/p95':>21} | ratio"
        )
        print(header)
        for size in sizes_mb:
            began = time.perf_counter()
            base = make_tree(scratch / f"base-{size}", size * 1024 * 1024)
            print(f"  (built a {size} MB tree in {time.perf_counter() - began:.1f} s)", flush=True)
            row = asyncio.run(_measure(base, repeats, copy_repeats if size >= 512 else copy_repeats * 4, scratch))
            figures["sizes"][f"{size}MB"] = row
            fork, snap, copy = row["overlay_fork"], row["overlay_snapshot"], row["copy_fork"]
            print(
                f"{size:>5}MB | {fork['p50_ms']:>8.2f} / {fork['p95_ms']:>7.2f} ms | "
                f"{snap['p50_ms']:>6.2f} / {snap['p95_ms']:>6.2f} ms | "
                f"{copy['p50_ms']:>9.1f} / {copy['p95_ms']:>7.1f} ms | {row['copy_over_overlay_fork_p50']:,.0f}x"
            )
    write_figures(figures, json_path)
    return figures


# ----------------------------------------------------------------- --docker: one image, three ways to fork


async def _measure_docker(image: str, repeats: int, engine_repeats: int, scratch: Path) -> dict[str, Any]:
    from ..errors import SnapshotDeclined
    from ..sandboxes import DockerSandbox, ShellSandbox

    write = ToolCall("sh", {"cmd": "echo changed > /root/changed.txt"})
    overlay = ShellSandbox.from_image(image, store_root=scratch / "layers")
    origin = await overlay.start()
    await origin.execute(write)
    snapshot = await origin.snapshot(scratch / "overlay-snapshot")
    forks = []
    for _ in range(repeats):
        began = time.perf_counter()
        sandbox = await overlay.fork(snapshot)
        forks.append(time.perf_counter() - began)
        await sandbox.stop()
    await origin.stop()
    overlay.close()

    engine = DockerSandbox.factory(image)
    container = await engine.start()
    await container.execute(write)
    commit_runs, runs = [], []
    for index in range(engine_repeats):
        began = time.perf_counter()
        committed = await container.snapshot(scratch / f"commit-{index}")
        middle = time.perf_counter()
        forked = await engine.fork(committed)
        commit_runs.append(time.perf_counter() - began)
        runs.append(time.perf_counter() - middle)
        await forked.stop()
        engine.discard(committed)
    await container.stop()
    engine.close()
    result: dict[str, Any] = {
        "image": image,
        "image_overlay_fork": _stats(forks),
        "docker_commit_run": _stats(commit_runs),
        "docker_run_from_commit": _stats(runs),
        "docker_checkpoint_restore": None,
    }

    checkpointing = DockerSandbox.factory(image, checkpoint=True)
    container = await checkpointing.start()
    await container.execute(write)
    try:
        checkpoint = await container.snapshot(scratch / "checkpoint")
    except SnapshotDeclined as declined:
        result["checkpoint_declined"] = str(declined)
    else:
        restores = []
        for _ in range(engine_repeats):
            began = time.perf_counter()
            restored = await checkpointing.fork(checkpoint)
            restores.append(time.perf_counter() - began)
            await restored.stop()
        checkpointing.discard(checkpoint)
        result["docker_checkpoint_restore"] = _stats(restores)
    await container.stop()
    checkpointing.close()
    return result


def run_docker(
    *, image: str = "tvcache-base:bookworm", repeats: int = 200, engine_repeats: int = 10, json_path: str | None = None
) -> dict[str, Any]:
    """Image-overlay fork next to docker commit + run and docker checkpoint restore, on one image, in one run."""
    with overlay_scratch("fork-docker") as scratch:
        row = asyncio.run(_measure_docker(image, repeats, engine_repeats, scratch))
    overlay = row["image_overlay_fork"]
    print(f"image {image}; load average {os.getloadavg()[0]:.2f}")
    print(f"{'fork by':<34} | {'p50':>9} | {'p95':>9} | vs image-overlay p50")
    lines = [
        ("image-overlay fork (ShellSandbox)", overlay),
        ("docker commit + run", row["docker_commit_run"]),
        ("  of which docker run", row["docker_run_from_commit"]),
        ("docker checkpoint restore", row["docker_checkpoint_restore"]),
    ]
    for label, stats in lines:
        if stats is None:
            print(f"{label:<34} | declined: {row.get('checkpoint_declined', 'not measured')[:120]}")
            continue
        ratio = stats["p50_ms"] / overlay["p50_ms"]
        print(f"{label:<34} | {stats['p50_ms']:>6.2f} ms | {stats['p95_ms']:>6.2f} ms | {ratio:>9,.0f}x")
    if json_path:
        Path(json_path).write_text(json.dumps(row, indent=2))
        print(f"wrote {json_path}")
    return row
