"""CRIU dump and restore of a confined shell with one background server (the CRIU route of persistent shells).

The shell is started as persistent shell sandboxes start theirs (the zygote: PID 1 of fresh namespaces over a
detached overlay, a pty as its terminal) and runs ``python3 -m http.server`` in the background. Per cycle: a
dump with the tree left running, then a restore over a fresh overlay with a new pty, timed until the tree runs
and until the restored shell answers a command (what a fork costs before its first call), then the copy is
killed. p50/p95 and the image size; the issue's target for a CRIU fork is <= 150 ms.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import time
import tty
from pathlib import Path
from typing import Any

from . import latency_stats, overlay_scratch

SERVER = "python3 -m http.server -b 127.0.0.1 8000 >/dev/null 2>&1 &"


def _answer(master: int, command: str, timeout: float = 20.0) -> str:
    marker = secrets.token_hex(8)
    os.write(master, f"{command}\nprintf '%s%s\\n' {marker[:8]} {marker[8:]}\n".encode())
    output = b""
    deadline = time.monotonic() + timeout
    while marker.encode() not in output:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no answer to {command!r} within {timeout} s")
        if select.select([master], [], [], remaining)[0]:
            output += os.read(master, 65536)
    return output.decode(errors="replace").split(marker)[0]


def _wait_for_server(master: int) -> None:
    probe = "python3 -c 'import urllib.request as u; print(u.urlopen(\"http://127.0.0.1:8000/\").status)' 2>/dev/null"
    deadline = time.monotonic() + 20
    while "200" not in _answer(master, probe):
        if time.monotonic() > deadline:
            raise TimeoutError("the background server did not answer within 20 s")


def run(*, cycles: int = 20, json_path: str | None = None) -> dict[str, Any]:
    """Measure ``cycles`` dump/restore pairs; print a table and return the figures (JSON to ``json_path``)."""
    from ..sandboxes.shell import linux
    from ..sandboxes.shell.criu import criu_unavailable_reason, discard_images, find_criu
    from ..sandboxes.shell.sandbox import ShellSandboxFactory

    criu = find_criu(warn=False)
    if criu is None:
        raise SystemExit(f"tvcache bench criu: {criu_unavailable_reason()} (install it: make criu)")
    dumps: list[float] = []
    restores: list[float] = []
    answers: list[float] = []
    sizes: list[int] = []
    with overlay_scratch("criu") as scratch:
        base = scratch / "base"
        base.mkdir()
        mounts: list[int] = []

        def overlay(index: int) -> int:
            upper, work = scratch / f"upper{index}", scratch / f"work{index}"
            upper.mkdir()
            work.mkdir()
            return linux.mount_overlay([str(base)], str(upper), str(work))

        factory = ShellSandboxFactory(base, store_root=scratch / "layers")  # for its zygote, as shells get it
        zygote = factory.zygote
        master, slave = os.openpty()
        tty.setraw(slave)
        mounts.append(overlay(0))
        original = zygote.spawn(
            ["/bin/bash", "--norc", "--noprofile", "--noediting", "-i"],
            env={"PATH": "/usr/local/bin:/usr/bin:/bin", "PS1": "", "HOME": "/tmp"},
            mount_fd=mounts[0],
            output_fd=slave,
            terminal=True,
        )
        os.close(slave)
        try:
            original.wait_started()
            assert original.pid is not None, original.errors
            _answer(master, f"cd /tmp; export STATE=kept; {SERVER}")
            _wait_for_server(master)
            for cycle in range(1, cycles + 1):
                dumped = criu.dump(original.pid, scratch / f"images{cycle}", tree_mountpoint=str(base))
                dumps.append(dumped.seconds)
                sizes.append(dumped.image_bytes)
                fork_fd = overlay(cycle)
                copy_master, copy_slave = os.openpty()
                tty.setraw(copy_slave)
                began = time.perf_counter()
                try:
                    restored = criu.restore(dumped.images, tty_fd=copy_slave, tree_mount_fd=fork_fd)
                finally:
                    os.close(copy_slave)
                    os.close(fork_fd)
                try:
                    restores.append(restored.seconds)
                    if "kept" not in _answer(copy_master, "echo $STATE"):
                        raise RuntimeError("the restored shell lost its state")
                    answers.append(time.perf_counter() - began)
                finally:
                    restored.tree.kill()
                    restored.tree.wait(10)
                    restored.tree.close()
                    os.close(copy_master)
                    discard_images(dumped.images)
        finally:
            original.kill()
            original.wait(10)
            original.close()
            os.close(master)
            factory.close()
            for fd in mounts:
                os.close(fd)
    figures: dict[str, Any] = {
        "criu": ".".join(map(str, criu.version)),
        "dump": latency_stats(dumps),
        "restore": latency_stats(restores),
        "restore_until_answer": latency_stats(answers),
        "image_mb_p50": sorted(sizes)[len(sizes) // 2] / 1e6,
        "load_average": os.getloadavg()[0],
    }
    print(f"CRIU {figures['criu']}: bash + python3 -m http.server, confined; {cycles} cycles")
    print(f"{'step':<40} | {'p50':>9} | {'p95':>9}")
    for name, key in (
        ("dump (--leave-running)", "dump"),
        ("restore until the tree runs", "restore"),
        ("restore until the shell answers (fork)", "restore_until_answer"),
    ):
        row = figures[key]
        print(f"{name:<40} | {row['p50_ms']:>6.1f} ms | {row['p95_ms']:>6.1f} ms")
    print(f"image {figures['image_mb_p50']:.1f} MB; load average {figures['load_average']:.2f}")
    if json_path:
        Path(json_path).write_text(json.dumps(figures, indent=2))
        print(f"wrote {json_path}")
    return figures


if __name__ == "__main__":
    run()
