"""``tvcache bench shell``: what one command costs in a shell sandbox, and where the time goes.

Measured side by side in one run (root; overlay mounts):

* ``latency``: ``execute`` of ``true``, ``echo x > f`` and ``cat f`` in a ``ShellSandbox`` (confined, overlay,
  one ``bash -c`` per command), a persistent ``ShellSandbox`` (the same confinement, one long-lived bash over a
  pty) and a ``FolderSandbox`` (a plain ``bash -c`` in a folder), calls interleaved, back to back and with think
  time between calls (as between an agent's tool calls); p50/p95, the shell/folder and persistent/shell ratios;
* ``persistent forks``: a persistent shell that ran a history (cd, variables, a function, an alias, files) is
  snapshotted by the shell-state route; forking it (until its first command answers) into a warm shell and into
  a cold one (``warm``) next to replaying the same history in a fresh persistent shell, and the snapshot itself;
  p50/p95 and the snapshot routes taken;
* ``persistent CRIU forks``: the same history plus a background ``python3 -m http.server`` (started, then waited
  for until it answers), snapshotted by the CRIU route (where a working CRIU exists): fork next to replay, and
  the snapshot (dump, freeze, and the sandbox's own restore);
* ``breakdown``: process creation from this (large) Python process, each namespace's ``unshare`` and teardown,
  each confinement step (timed inside a child that is PID 1 of a new PID namespace, as commands are), bash
  startup, and the proof digests of the upper layer;
* ``paths``: the whole confined start of ``bash -c true`` the way it was done per command before the zygote
  (fork of this process with the confinement as ``preexec_fn``, then ``unshare(1)`` and bash) next to the
  zygote's (a spare, ready).

Run-to-run noise on a small machine is large; read the ratios, not the absolute numbers.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import select
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..calls import ToolCall
from . import latency_stats as _stats
from . import overlay_scratch, write_figures

COMMANDS = ("true", "echo x > f", "cat f")


def _timed(action: Callable[[], object]) -> float:
    began = time.perf_counter()
    action()
    return time.perf_counter() - began


# ------------------------------------------------------------------------------------------ latency


async def _latency(base: Path, scratch: Path, repeats: int, gap: float) -> dict[str, Any]:
    from ..protocol import Sandbox
    from ..sandboxes import FolderSandbox, ShellSandboxFactory

    shell = ShellSandboxFactory(base, store_root=scratch / "layers")
    persistent = ShellSandboxFactory(base, store_root=scratch / "layers-persistent", persistent=True)
    folder = FolderSandbox.factory(base)
    sandboxes: dict[str, Sandbox] = {
        "shell": await shell.start(),
        "persistent": await persistent.start(),
        "folder": await folder.start(),
    }
    await asyncio.sleep(0.2)  # the zygote boots and readies its spares
    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for command in COMMANDS:
            for name, sandbox in sandboxes.items():
                if gap:
                    await asyncio.sleep(gap)
                began = time.perf_counter()
                await sandbox.execute(ToolCall("sh", {"cmd": command}))
                samples.setdefault((name, command), []).append(time.perf_counter() - began)
    for sandbox in sandboxes.values():
        await sandbox.stop()
    shell.close()
    persistent.close()
    folder.close()
    rows: dict[str, Any] = {}
    for command in COMMANDS:
        row: dict[str, Any] = {name: _stats(samples[(name, command)]) for name in sandboxes}
        row["shell_over_folder_p50"] = row["shell"]["p50_ms"] / row["folder"]["p50_ms"]
        row["persistent_over_shell_p50"] = row["persistent"]["p50_ms"] / row["shell"]["p50_ms"]
        rows[command] = row
    return rows


def _print_latency(gap_ms: float, rows: dict[str, Any]) -> None:
    print(f"\nper-command latency, {'back to back' if not gap_ms else f'{gap_ms:g} ms between calls'}")
    print(
        f"  {'command':<12} | {'one-shot p50/p95 ms':>19} | {'persistent p50/p95':>19} | {'folder p50/p95 ms':>17} "
        "| shell/folder | persistent/one-shot"
    )
    for command, row in rows.items():
        shell, persistent, folder = row["shell"], row["persistent"], row["folder"]
        print(
            f"  {command:<12} | {shell['p50_ms']:>8.3f} / {shell['p95_ms']:>8.3f} | "
            f"{persistent['p50_ms']:>8.3f} / {persistent['p95_ms']:>8.3f} | "
            f"{folder['p50_ms']:>7.2f} / {folder['p95_ms']:>7.2f} | {row['shell_over_folder_p50']:>11.2f}x | "
            f"{row['persistent_over_shell_p50']:>18.3f}x"
        )


# ------------------------------------------------------------------------------- persistent forks

FORK_HISTORY = (
    "mkdir -p src/lib && cd src",
    "export CFLAGS=-O0 MODE=debug; COUNT=3",
    "build() { echo building $1 with $CFLAGS; }",
    "alias ll='ls -1'",
    "echo 'int main(void) { return 0; }' > main.c",
    "build main.c; ll",
    "cd lib; pushd .. >/dev/null",
    "shopt -s nullglob; set -o noclobber; umask 027",
)


async def _settled(factory: Any, timeout: float = 5.0) -> None:
    """Until the factory's warm shells are all ready: a refill must not overlap the next measured operation."""
    pool = factory.warm_pool()
    if pool is not None:
        await asyncio.to_thread(pool.wait_ready, None, timeout)


async def _fork_rows(
    factory: Any, calls: list[ToolCall], *, route: str, replay: str, repeats: int, gap: float, snaps: Path, cold: bool
) -> dict[str, Any]:
    """Snapshot a shell that ran ``calls`` (``repeats`` times), then fork the last snapshot next to replaying
    ``calls`` in a fresh shell, each until ``true`` answers; with ``cold``, forks with the warm shells turned off
    too. The factory is closed at the end."""
    probe = ToolCall("sh", {"cmd": "true"})
    origin = await factory.start()
    for call in calls:
        await origin.execute(call)
    snapshot_name, fork_name, cold_name = f"snapshot ({route})", f"fork ({route})", f"fork ({route}, cold shell)"
    samples: dict[str, list[float]] = {snapshot_name: [], fork_name: [], replay: []}
    if cold:
        samples[cold_name] = []
    snapshots = []
    for index in range(repeats):
        began = time.perf_counter()
        snapshots.append(await origin.snapshot(snaps / f"s{index}"))
        samples[snapshot_name].append(time.perf_counter() - began)
        await origin.execute(probe)
    snapshot = snapshots[-1]
    for _ in range(repeats):
        for name in [name for name in samples if name != snapshot_name]:
            await _settled(factory)
            if gap:
                await asyncio.sleep(gap)
            warm_shells = factory.warm_shells
            began = time.perf_counter()
            if name == replay:
                sandbox = await factory.start()
                for call in calls:
                    await sandbox.execute(call)
            else:
                factory.warm_shells = 0 if name == cold_name else warm_shells
                try:
                    sandbox = await factory.fork(snapshot)
                finally:
                    factory.warm_shells = warm_shells
            await sandbox.execute(probe)
            samples[name].append(time.perf_counter() - began)
            await sandbox.stop()
    await origin.stop()
    for each in snapshots:
        factory.discard(each)
    routes = factory.route_counts()
    pool = factory.warm_pool()
    warm_served = pool.served if pool is not None else 0
    factory.close()
    rows: dict[str, Any] = {name: _stats(values) for name, values in samples.items()}
    rows["replay_over_fork_p50"] = rows[replay]["p50_ms"] / rows[fork_name]["p50_ms"]
    if cold:
        rows["cold_over_warm_fork_p50"] = rows[cold_name]["p50_ms"] / rows[fork_name]["p50_ms"]
    rows["history_calls"] = len(calls)
    rows["routes"] = routes
    rows["warm_shells_served"] = warm_served
    rows["image_mb"] = int(snapshot.meta["shell"].get("image_bytes", 0)) / 1e6
    return rows


async def _persistent_forks(base: Path, scratch: Path, repeats: int, gap: float) -> dict[str, Any]:
    """Fork of a shell-state snapshot (a warm shell, and a cold one) next to a replay of the same history."""
    from ..sandboxes import ShellSandboxFactory

    factory = ShellSandboxFactory(base, store_root=scratch / "layers-forks", persistent=True)
    calls = [ToolCall("sh", {"cmd": command}) for command in FORK_HISTORY]
    snaps = scratch / "persistent-snaps"
    return await _fork_rows(
        factory, calls, route="shell state", replay="replay", repeats=repeats, gap=gap, snaps=snaps, cold=True
    )


SERVER_STEP = (
    "python3 -m http.server -b 127.0.0.1 8000 >/dev/null 2>&1 & "
    "until python3 -c 'import urllib.request as u; u.urlopen(\"http://127.0.0.1:8000/\")' 2>/dev/null; "
    "do sleep 0.02; done"
)


async def _criu_forks(base: Path, scratch: Path, repeats: int, gap: float) -> dict[str, Any]:
    """Fork of a CRIU snapshot (a shell with one background HTTP server) next to replaying the same history
    (which starts the server and waits until it answers), each until ``true`` answers."""
    from ..sandboxes import ShellSandboxFactory
    from ..sandboxes.shell.criu import criu_unavailable_reason, find_criu

    if find_criu(warn=False) is None:
        return {"skipped": f"no working CRIU: {criu_unavailable_reason()} (make criu)"}
    factory = ShellSandboxFactory(base, store_root=scratch / "layers-criu", persistent=True)
    calls = [ToolCall("sh", {"cmd": command}) for command in (*FORK_HISTORY, SERVER_STEP)]
    snaps = scratch / "criu-snaps"
    return await _fork_rows(
        factory, calls, route="CRIU", replay="replay (server)", repeats=repeats, gap=gap, snaps=snaps, cold=False
    )


def _print_fork_rows(title: str, rows: dict[str, Any]) -> None:
    if "skipped" in rows:
        print(f"\n{title}: skipped ({rows['skipped']})")
        return
    print(f"\n{title} vs replaying its {rows['history_calls']} calls")
    for name, row in rows.items():
        if isinstance(row, dict) and "p50_ms" in row:
            print(f"  {name:<32} {row['p50_ms']:>7.2f} / {row['p95_ms']:>7.2f} ms (p50 / p95)")
    print(f"  {'replay/fork':<32} {rows['replay_over_fork_p50']:>7.2f}x   routes: {rows['routes']}")
    if "cold_over_warm_fork_p50" in rows:
        served = rows["warm_shells_served"]
        print(f"  {'cold/warm fork':<32} {rows['cold_over_warm_fork_p50']:>7.2f}x   warm shells served: {served}")


# ---------------------------------------------------------------------------------------- breakdown


def _in_child(
    work: Callable[[], dict[str, float]], *, new_pid_namespace: bool = False
) -> tuple[dict[str, float], float]:
    """Fork; the child (or, with ``new_pid_namespace``, its child: PID 1 of a new PID namespace) runs ``work``
    and sends back its timings. Returns them and the parent's time from fork to reaping."""
    from ..sandboxes.shell import linux

    read_end, write_end = os.pipe()
    began = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            if new_pid_namespace:
                linux.unshare(linux.CLONE_NEWPID)
                inner = os.fork()
                if inner:
                    os.waitpid(inner, 0)
                    os._exit(0)
            os.write(write_end, json.dumps(work()).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    data = b""
    while chunk := os.read(read_end, 1 << 16):
        data += chunk
    os.close(read_end)
    os.waitpid(pid, 0)
    return (json.loads(data) if data else {}), time.perf_counter() - began


def _quiet(argv: list[str], preexec: Callable[[], None] | None = None) -> None:
    devnull = subprocess.DEVNULL
    subprocess.run(argv, stdin=devnull, stdout=devnull, stderr=devnull, preexec_fn=preexec, check=False)


def _process_creation(repeats: int) -> dict[str, Any]:
    def spawn() -> None:
        os.waitpid(os.posix_spawn("/bin/true", ["/bin/true"], {}), 0)

    variants: dict[str, Callable[[], object]] = {
        "posix_spawn /bin/true": spawn,
        "Popen /bin/true (vfork)": lambda: _quiet(["/bin/true"]),
        "Popen /bin/true, preexec_fn (fork)": lambda: _quiet(["/bin/true"], lambda: None),
        "os.fork + exit + wait": lambda: _in_child(dict),
        "Popen bash -c true": lambda: _quiet(["bash", "-c", "true"]),
        "Popen unshare --fork --kill-child bash -c true": lambda: _quiet(
            ["unshare", "--fork", "--kill-child", "bash", "-c", "true"]
        ),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, action in variants.items():
            samples[name].append(_timed(action))
    return {name: _stats(values) for name, values in samples.items()}


def _namespaces(repeats: int) -> dict[str, Any]:
    """unshare(flag) in a forked child, timed inside; teardown = parent's total - plain fork - unshare."""
    from ..sandboxes.shell import linux

    flags = {
        "mount": linux.CLONE_NEWNS,
        "network": linux.CLONE_NEWNET,
        "ipc": linux.CLONE_NEWIPC,
        "uts": linux.CLONE_NEWUTS,
        "pid": linux.CLONE_NEWPID,  # created here; its first process comes with the confinement steps
    }

    def unshare(flag: int) -> dict[str, float]:
        began = time.perf_counter()
        linux.unshare(flag)
        return {"unshare": time.perf_counter() - began}

    plain: list[float] = []
    inner: dict[str, list[float]] = {name: [] for name in flags}
    total: dict[str, list[float]] = {name: [] for name in flags}
    for _ in range(repeats):
        plain.append(_in_child(dict)[1])
        for name, flag in flags.items():
            timings, elapsed = _in_child(functools.partial(unshare, flag))
            inner[name].append(timings["unshare"])
            total[name].append(elapsed)
    fork_ms = statistics.median(plain) * 1000
    rows = {}
    for name in flags:
        unshare_ms = statistics.median(inner[name]) * 1000
        total_ms = statistics.median(total[name]) * 1000
        rows[name] = {"unshare_ms": unshare_ms, "teardown_ms": total_ms - fork_ms - unshare_ms}
    return rows


def _confinement_steps(confinement: dict[str, Any], mount_fd: int, repeats: int) -> dict[str, Any]:
    from ..sandboxes.shell.zygote_process import Confiner

    def steps() -> dict[str, float]:
        confiner = Confiner(**confinement)
        timings = {}
        for name, step in [*confiner.prepare_steps(), *confiner.enter_steps(mount_fd)]:
            timings[name] = _timed(step)
        return timings

    samples: dict[str, list[float]] = {}
    for _ in range(repeats):
        timings, _ = _in_child(steps, new_pid_namespace=True)
        for name, value in timings.items():
            samples.setdefault(name, []).append(value)
    rows = {name: _stats(values) for name, values in samples.items()}
    rows["sum of p50s"] = {"p50_ms": sum(row["p50_ms"] for row in rows.values())}
    return rows


def _digests(upper: Path, repeats: int) -> dict[str, Any]:
    from ..sandboxes.shell.layers import upper_digest

    rows = {"empty upper": _stats([_timed(lambda: upper_digest(upper)) for _ in range(repeats)])}
    for index in range(1000):
        (upper / f"f{index}").write_text("x")
    rows["1000 files"] = _stats([_timed(lambda: upper_digest(upper)) for _ in range(max(10, repeats // 4))])
    return rows


def _paths(base: Path, scratch: Path, repeats: int, gap: float) -> dict[str, Any]:
    """The confined start of ``bash -c true``, before (per-command fork of this process) and now (zygote)."""
    from ..sandboxes import ShellSandboxFactory
    from ..sandboxes.shell import linux
    from ..sandboxes.shell.zygote_process import Confiner

    factory = ShellSandboxFactory(base, store_root=scratch / "layers-paths")
    sandbox = asyncio.run(factory.start())
    mount_fd = sandbox._mount_fd
    if mount_fd is None:
        raise RuntimeError("a fresh shell sandbox has no mount")
    confinement = asdict(factory.confinement)
    argv = [factory.bash, "-c", "true"]

    def before_preexec() -> None:
        linux.unshare(linux.CLONE_NEWPID)
        confiner = Confiner(**confinement)
        confiner.prepare()
        confiner.enter(mount_fd)

    def before() -> None:
        subprocess.run(
            ["/usr/bin/unshare", "--fork", "--kill-child", *argv],
            env=factory.environment,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=before_preexec,
            check=True,
        )

    def now() -> None:
        read_end, write_end = os.pipe()
        spawned = factory.zygote.spawn(argv, env=factory.environment, mount_fd=mount_fd, output_fd=write_end)
        os.close(write_end)
        spawned.wait(None)
        spawned.close()
        while os.read(read_end, 1 << 16):
            pass
        os.close(read_end)
        if spawned.returncode != 0:
            raise RuntimeError(f"the zygote could not run bash: {spawned.errors}")

    samples: dict[str, list[float]] = {"before: fork + preexec + unshare(1) + bash": [], "now: zygote spare + bash": []}
    for _ in range(repeats):
        for name, action in zip(samples, (before, now), strict=True):
            if gap:
                select.select([], [], [], gap)
            samples[name].append(_timed(action))
    asyncio.run(sandbox.stop())
    factory.close()
    rows: dict[str, Any] = {name: _stats(values) for name, values in samples.items()}
    first, second = rows.values()
    rows["before_over_now_p50"] = first["p50_ms"] / second["p50_ms"]
    return rows


def _breakdown(base: Path, scratch: Path, repeats: int) -> dict[str, Any]:
    from ..sandboxes import ShellSandboxFactory

    factory = ShellSandboxFactory(base, store_root=scratch / "layers-steps")
    sandbox = asyncio.run(factory.start())
    mount_fd = sandbox._mount_fd
    if mount_fd is None:
        raise RuntimeError("a fresh shell sandbox has no mount")
    try:
        figures = {
            "process creation": _process_creation(repeats),
            "namespaces": _namespaces(repeats),
            "confinement steps": _confinement_steps(asdict(factory.confinement), mount_fd, repeats),
            "upper digest": _digests(sandbox._upper, repeats),
        }
    finally:
        asyncio.run(sandbox.stop())
        factory.close()
    return figures


def _print_breakdown(figures: dict[str, Any]) -> None:
    print("\nprocess creation, from this process (p50 / p95 ms)")
    for name, row in figures["process creation"].items():
        print(f"  {name:<48} {row['p50_ms']:>7.3f} / {row['p95_ms']:>7.3f}")
    print("\nnamespaces: unshare, and teardown at exit (p50 ms; teardown = fork+unshare+exit - fork+exit - unshare)")
    for name, row in figures["namespaces"].items():
        print(f"  {name:<28} unshare {row['unshare_ms']:>6.3f}   teardown {row['teardown_ms']:>6.3f}")
    print("\nconfinement steps, in PID 1 of a new PID namespace (p50 / p95 ms)")
    for name, row in figures["confinement steps"].items():
        p95 = f" / {row['p95_ms']:>6.3f}" if "p95_ms" in row else ""
        print(f"  {name:<28} {row['p50_ms']:>6.3f}{p95}")
    print("\nread-only proof: upper layer digest (p50 / p95 ms)")
    for name, row in figures["upper digest"].items():
        print(f"  {name:<28} {row['p50_ms']:>6.3f} / {row['p95_ms']:>6.3f}")


def run(
    *,
    repeats: int = 200,
    gaps_ms: tuple[float, ...] = (0.0, 20.0),
    breakdown: bool = True,
    json_path: str | None = None,
) -> dict[str, Any]:
    figures: dict[str, Any] = {"latency": {}}
    with overlay_scratch("shell") as scratch:
        base = scratch / "base"
        base.mkdir()
        (base / "README").write_text("a small tree\n")
        for gap_ms in gaps_ms:
            rows = asyncio.run(_latency(base, scratch, repeats, gap_ms / 1000))
            figures["latency"][f"gap_{gap_ms:g}ms"] = rows
            _print_latency(gap_ms, rows)
        forks = asyncio.run(_persistent_forks(base, scratch, max(3, repeats // 4), gaps_ms[-1] / 1000))
        figures["persistent forks"] = forks
        _print_fork_rows("persistent shell: fork of a shell-state snapshot", forks)
        criu_forks = asyncio.run(_criu_forks(base, scratch, max(3, repeats // 10), gaps_ms[-1] / 1000))
        figures["persistent CRIU forks"] = criu_forks
        mb = criu_forks.get("image_mb", 0.0)
        _print_fork_rows(
            f"persistent shell with a background HTTP server: fork of a CRIU snapshot ({mb:.1f} MB)", criu_forks
        )
        if breakdown:
            figures["paths"] = {f"gap_{gap:g}ms": _paths(base, scratch, repeats, gap / 1000) for gap in gaps_ms}
            print("\nconfined start of `bash -c true`, before and now (p50 / p95 ms)")
            for gap, rows in figures["paths"].items():
                for name, row in rows.items():
                    if isinstance(row, dict):
                        print(f"  {gap:<9} {name:<44} {row['p50_ms']:>7.2f} / {row['p95_ms']:>7.2f}")
                print(f"  {gap:<9} {'before/now':<44} {rows['before_over_now_p50']:>7.2f}x")
            figures["breakdown"] = _breakdown(base, scratch, max(5, repeats // 2))
            _print_breakdown(figures["breakdown"])
    write_figures(figures, json_path)
    return figures
