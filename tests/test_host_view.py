"""A minimal view of the host (issue 24, findings 2 and 3): what a shell sandbox's commands see of the host.

From inside a one-shot, a persistent and a CRIU-restored sandbox: host files under ``/root`` and ``/var``, the
factory's layer store and a cache directory's snapshots (CRIU images among them) are not there, a root-owned
0600 unix socket under ``/root`` cannot be reached, ``/etc/shadow`` is absent; ``visible=`` paths are there,
read-only, and nothing beside them; ``host_view()`` lists exactly the mounts a command finds in its
``/proc/self/mountinfo``. Real mounts and real CRIU throughout.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tvcache import ToolCall
from tvcache.errors import SandboxError
from tvcache.sandboxes import ShellSandbox, ShellSandboxFactory
from tvcache.sandboxes.shell.criu import criu_unavailable_reason, find_criu
from tvcache.sandboxes.shell.linux import overlay_supported

pytestmark = pytest.mark.skipif(not overlay_supported(), reason="overlay sandboxes need root on Linux >= 6.8")
CRIU = find_criu(warn=False) if overlay_supported() else None
needs_criu = pytest.mark.skipif(
    CRIU is None, reason=f"no working CRIU: {criu_unavailable_reason() or 'overlay mounts need root'} (make criu)"
)


def sh(cmd: str) -> ToolCall:
    return ToolCall("sh", {"cmd": cmd})


@dataclass(frozen=True)
class Host:
    """Things on the host a sandbox must not reach, made fresh for one test."""

    secret: Path  # a file in /root
    sock: Path  # a root-owned 0600 unix socket in /root, listening
    var: Path  # a fresh directory under /var, with a file in it
    store: Path  # the factory's layer store, outside the sandbox tree
    cache: Path  # a cache directory's snapshots (and their CRIU images)

    def hidden(self) -> list[str]:
        return [str(self.secret), str(self.var), str(self.var / "token"), str(self.store), str(self.cache)]


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    tag = uuid.uuid4().hex[:10]
    var = Path(f"/var/cache/tvcache-host-view-{tag}")
    var.mkdir(parents=True)
    (var / "token").write_text("a rollout's secret\n")
    secret = Path(f"/root/tvcache-host-view-{tag}")
    secret.write_text("the host's secret\n")
    sock = Path(f"/root/tvcache-host-view-{tag}.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(sock))
    os.chmod(sock, 0o600)
    server.listen()
    try:
        yield Host(secret=secret, sock=sock, var=var, store=var / "layers", cache=var / "cache")
    finally:
        server.close()
        sock.unlink(missing_ok=True)
        secret.unlink(missing_ok=True)
        shutil.rmtree(var, ignore_errors=True)


def probe(host: Host, *extra: str) -> str:
    """A command printing, for each path, whether it is there, then whether the socket answers."""
    paths = " ".join([*host.hidden(), "/etc/shadow", "/etc/gshadow", *extra])
    connect = f"import socket; socket.socket(socket.AF_UNIX).connect({str(host.sock)!r}); print('connected')"
    return (
        f"for p in {paths}; do if [ -e $p ]; then echo present $p; else echo absent $p; fi; done; "
        f'python3 -c "{connect}" 2>/dev/null || echo refused'
    )


def expected(host: Host, *extra: str) -> str:
    paths = [*host.hidden(), "/etc/shadow", "/etc/gshadow", *extra]
    return "".join(f"absent {path}\n" for path in paths) + "refused\n"


def mount_points(mountinfo: str) -> set[str]:
    points = set()
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4:
            points.add(re.sub(r"\\([0-7]{3})", lambda octal: chr(int(octal.group(1), 8)), fields[4]))
    return points


def make_factory(tmp_path: Path, host: Host, **options: object) -> ShellSandboxFactory:
    base = tmp_path / "base"
    base.mkdir(exist_ok=True)
    (base / "a.txt").write_text("base\n")
    factory = ShellSandbox.factory(base, fallback=False, store_root=host.store, **options)
    assert isinstance(factory, ShellSandboxFactory)
    return factory


def test_a_one_shot_command_sees_nothing_of_the_host_beyond_its_view(tmp_path: Path, host: Host) -> None:
    factory = make_factory(tmp_path, host)

    async def main() -> tuple[list[str], list[str]]:
        sandbox = await factory.start()
        try:
            await sandbox.execute(sh("echo changed > a.txt"))
            host.cache.mkdir()
            await sandbox.snapshot(host.cache / "s1")  # a cache directory's snapshot, and a layer of the store
            layers = sandbox.layers
            outputs = [
                (await sandbox.execute(sh(probe(host, *layers)))).output,
                (await sandbox.execute(sh("cat /proc/self/mountinfo"))).output,
                (await sandbox.execute(sh("cat a.txt; ls /"))).output,
            ]
            return outputs, layers
        finally:
            await sandbox.stop()

    (seen, mountinfo, listing), layers = asyncio.run(main())
    factory.close()
    assert layers
    assert all(layer.startswith(str(host.store)) for layer in layers)
    assert seen == expected(host, *layers)
    assert mount_points(mountinfo) == factory.host_view().mount_points()
    assert listing.splitlines()[0] == "changed"
    assert not {"root", "home", "opt", "srv", "mnt", "media", "work", "sys"} & set(listing.splitlines())


def test_a_persistent_shell_sees_nothing_of_the_host_beyond_its_view(tmp_path: Path, host: Host) -> None:
    factory = make_factory(tmp_path, host, persistent=True)

    async def main() -> list[str]:
        sandbox = await factory.start()
        try:
            return [
                (await sandbox.execute(sh(probe(host)))).output,
                (await sandbox.execute(sh("cat /proc/self/mountinfo"))).output,
            ]
        finally:
            await sandbox.stop()

    seen, mountinfo = asyncio.run(main())
    factory.close()
    assert seen == expected(host)
    assert mount_points(mountinfo) == factory.host_view().mount_points()


@needs_criu
def test_a_criu_restored_shell_sees_neither_the_host_nor_its_own_images(tmp_path: Path, host: Host) -> None:
    factory = make_factory(tmp_path, host, persistent=True)
    dest = host.cache / "snapshots" / "s1"

    writes = "for p in /x /usr/x /etc/passwd /dev/null; do touch $p 2>/dev/null && echo wrote $p; done; echo done"

    async def main() -> tuple[str, str, str, str]:
        sandbox = await factory.start()
        try:
            await sandbox.execute(sh("token=$(cat a.txt); sleep 1000 &"))  # a live process: the CRIU route
            assert (await sandbox.execute(sh(writes))).output == "done\n"
            snapshot = await sandbox.snapshot(dest)
            fork = await factory.fork(snapshot)
            try:
                images = str(dest.with_name(dest.name + ".criu"))
                assert os.path.isdir(images), "the snapshot did not take the CRIU route"
                jobs = (await fork.execute(sh("jobs"))).output
                assert (await fork.execute(sh(writes))).output == "done\n"  # read-only as in the original
                seen = (await fork.execute(sh(probe(host, images, str(dest))))).output
                mountinfo = (await fork.execute(sh("cat /proc/self/mountinfo"))).output
                return str(snapshot.meta["route"]), jobs, seen, mountinfo
            finally:
                await fork.stop()
        finally:
            await sandbox.stop()

    route, jobs, seen, mountinfo = asyncio.run(main())
    factory.close()
    assert route == "criu"
    assert "sleep 1000" in jobs
    images = str(dest.with_name(dest.name + ".criu"))
    assert seen == expected(host, images, str(dest))
    assert mount_points(mountinfo) == factory.host_view().mount_points()


def test_visible_paths_are_there_read_only_and_nothing_beside_them(tmp_path: Path, host: Host) -> None:
    tool = host.var / "tool"
    (tool / "bin").mkdir(parents=True)
    (tool / "bin" / "hello").write_text("#!/bin/sh\necho hello from the tool\n")
    (tool / "bin" / "hello").chmod(0o755)
    config = host.var / "config.txt"
    config.write_text("setting=1\n")
    factory = make_factory(tmp_path, host, visible=[str(tool), str(config)])
    command = (
        f"{tool}/bin/hello; cat {config}; "
        f"echo x > {config} 2>&1 || echo refused file; touch {tool}/new 2>&1 || echo refused dir; "
        f"test -e {host.var}/token && echo token present || echo token absent; ls {host.var}"
    )

    async def main() -> list[str]:
        sandbox = await factory.start()
        try:
            return [
                (await sandbox.execute(sh(command))).output,
                (await sandbox.execute(sh("cat /proc/self/mountinfo"))).output,
            ]
        finally:
            await sandbox.stop()

    output, mountinfo = asyncio.run(main())
    view = factory.host_view()
    factory.close()
    lines = [line for line in output.splitlines() if "Read-only file system" not in line]
    assert lines == [
        "hello from the tool",
        "setting=1",
        "refused file",
        "refused dir",
        "token absent",
        "config.txt",
        "tool",
    ]
    assert config.read_text() == "setting=1\n"
    assert {str(tool), str(config)} <= set(view.host_paths())
    assert mount_points(mountinfo) == view.mount_points()


def test_the_host_view_is_printable_and_says_what_is_hidden(tmp_path: Path, host: Host) -> None:
    factory = make_factory(tmp_path, host, visible=["/usr/share"])
    view = factory.host_view()
    factory.close()
    text = str(view)
    for shown in ("/usr ", "/etc/passwd", "private tmpfs"):
        assert shown in text
    assert "/etc/shadow" not in text
    assert "/root" in text.splitlines()[-1]  # named as hidden on the last line
    shared = next(entry for entry in view.entries if entry.path == "/usr/share")
    assert not shared.mounted  # shown through /usr already: no mount of its own
    assert "/usr" in shared.why
    assert "/usr/share" not in view.mount_points()
    with pytest.raises(AttributeError):
        view.entries = ()  # type: ignore[misc]


def test_visible_paths_the_sandbox_cannot_show_are_refused(tmp_path: Path, host: Host) -> None:
    base = tmp_path / "base"
    base.mkdir()
    for visible, message in (
        ([str(host.var / "missing")], "does not exist"),
        (["/"], "whole host"),
        (["/proc/self"], "own of"),
        ([str(base)], "overlaps the sandbox tree"),
    ):
        with pytest.raises(SandboxError, match=message):
            ShellSandbox.factory(base, fallback=False, store_root=host.store, visible=visible)


def test_a_rootfs_sandbox_sees_only_its_image(tmp_path: Path, host: Host) -> None:
    rootfs = tmp_path / "rootfs"
    _install("/bin/bash", rootfs)
    _install("/bin/cat", rootfs)
    for name in ("dev", "proc", "tmp"):
        (rootfs / name).mkdir()
    factory = ShellSandbox.factory(rootfs, rootfs=True, fallback=False, store_root=host.store)
    assert isinstance(factory, ShellSandboxFactory)

    async def main() -> str:
        sandbox = await factory.start()
        try:
            return (await sandbox.execute(sh("cat /proc/self/mountinfo"))).output
        finally:
            await sandbox.stop()

    mountinfo = asyncio.run(main())
    view = factory.host_view()
    factory.close()
    lines = [line for line in mountinfo.splitlines() if line[:1].isdigit()]  # not bash's locale warning
    assert mount_points("\n".join(lines)) == view.mount_points()
    (root,) = [line.split() for line in lines if line.split()[4] == "/"]
    assert "overlay" in root, lines  # the image's overlay is the root


def _install(binary: str, rootfs: Path) -> None:
    """Copy a binary and the shared libraries it loads into ``rootfs`` at the same paths."""
    libraries = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    paths = {binary, *(token for line in libraries.splitlines() for token in line.split() if token.startswith("/"))}
    for path in paths:
        target = rootfs / Path(path).relative_to("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            shutil.copy2(path, target)
