"""CRIU dumps and restores of a confined shell with live processes (the CRIU route of persistent shells).

The shell is started exactly as persistent shell sandboxes start theirs: by the project's zygote, as PID 1 of
fresh namespaces (read-only host, private /tmp, own loopback), over a detached overlay of a tree, with a pty as
its terminal. Real CRIU throughout: these tests skip, naming why, where none works (`make criu` installs one;
CI does so before `make test`).
"""

from __future__ import annotations

import glob
import json
import os
import re
import secrets
import select
import signal
import tempfile
import threading
import time
import tty
from collections.abc import Iterator
from pathlib import Path

import pytest

from tvcache.errors import CriuError, SandboxError
from tvcache.sandboxes.shell import linux
from tvcache.sandboxes.shell.criu import (
    META_FILE,
    Criu,
    Keepers,
    criu_unavailable_reason,
    discard_images,
    find_criu,
    kernel_data_path,
    required_version,
)
from tvcache.sandboxes.shell.linux import overlay_supported
from tvcache.sandboxes.shell.sandbox import _confinement
from tvcache.sandboxes.shell.zygote import Spawned, Zygote

CRIU = find_criu(warn=False) if overlay_supported() else None
needs_criu = pytest.mark.skipif(
    CRIU is None,
    reason=f"no working CRIU: {criu_unavailable_reason() or 'overlay mounts need root'}",
)
SERVER = "python3 -m http.server -b 127.0.0.1 8000 >/dev/null 2>&1 &"
COUNTER = "(i=0; while :; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.02; done) &"


class Shell:
    """An interactive bash on a pty, confined by the zygote, over an overlay of ``base`` (or over a given
    mount); ``run`` types a command and returns its output, found by a random end marker."""

    def __init__(self, master: int, tree: Spawned, pid: int) -> None:
        self.master = master
        self.tree = tree
        self.pid = pid

    @classmethod
    def start(cls, zygote: Zygote, mount_fd: int) -> Shell:
        master, slave = os.openpty()
        tty.setraw(slave)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "PS1": "", "HOME": "/tmp"}
        argv = ["/bin/bash", "--norc", "--noprofile", "--noediting", "-i"]
        spawned = zygote.spawn(argv, env=env, mount_fd=mount_fd, output_fd=slave, terminal=True)
        os.close(slave)
        spawned.wait_started()
        assert spawned.pid is not None, spawned.errors
        shell = cls(master, spawned, spawned.pid)
        shell.run("true")  # bash runs (the pid comes before the exec), with the pty as its terminal
        return shell

    def run(self, command: str, timeout: float = 20.0) -> str:
        marker = secrets.token_hex(8)
        # The marker is printed by printf from two halves, so the typed line itself never contains it.
        os.write(self.master, f"{command}\nprintf '%s%s\\n' {marker[:8]} {marker[8:]}\n".encode())
        output = b""
        deadline = time.monotonic() + timeout
        while marker.encode() not in output:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no answer to {command!r} within {timeout} s; got {output!r}"
            if select.select([self.master], [], [], remaining)[0]:
                output += os.read(self.master, 65536)
        return output.decode(errors="replace").split(marker)[0].rstrip("\n")

    def close(self) -> None:
        self.tree.kill()
        self.tree.wait(10)
        self.tree.close()
        os.close(self.master)


class Trees:
    """Overlay trees over one base: the original's, and forks of its files frozen at a point."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.base = root / "base"
        self.base.mkdir()
        (self.base / "README").write_text("base\n")
        self.fds: list[int] = []
        self.count = 0

    def mount(self, lowers: list[Path]) -> int:
        self.count += 1
        upper, work = self.root / f"upper{self.count}", self.root / f"work{self.count}"
        upper.mkdir()
        work.mkdir()
        fd = linux.mount_overlay([str(path) for path in lowers], str(upper), str(work))
        self.fds.append(fd)
        return fd

    def freeze(self, upper_index: int) -> Path:
        """A copy of an upper layer, as the sandbox's freeze would make it a read-only layer."""
        frozen = self.root / f"frozen{upper_index}-{self.count}"
        os.system(f"cp -a {self.root / f'upper{upper_index}'} {frozen}")
        return frozen

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


@pytest.fixture
def setting(tmp_path: Path) -> Iterator[tuple[Criu, Zygote, Trees]]:
    assert CRIU is not None
    trees = Trees(tmp_path)
    zygote = Zygote(_confinement(trees.base, rootfs=False))
    yield CRIU, zygote, trees
    zygote.close()
    trees.close()


def restore_shell(criu: Criu, images: Path, mount_fd: int, keepers: Keepers | None = None) -> tuple[Shell, float]:
    master, slave = os.openpty()
    tty.setraw(slave)
    try:
        restored = criu.restore(images, tty_fd=slave, tree_mount_fd=mount_fd, keepers=keepers)
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    return Shell(master, restored.tree, restored.pid), restored.seconds


def dumped_after(setting: tuple[Criu, Zygote, Trees], command: str) -> Path:
    """The images of a shell over the base tree that ran ``command``, dumped (the shell then closed)."""
    criu, zygote, trees = setting
    original = Shell.start(zygote, trees.mount([trees.base]))
    try:
        original.run(command)
        return criu.dump(original.pid, trees.root / "images", tree_mountpoint=str(trees.base)).images
    finally:
        original.close()


def counter(shell: Shell) -> int:
    return int(shell.run("cat /tmp/counter").strip().splitlines()[-1])


def wait_for_counter_above(shell: Shell, value: int) -> int:
    deadline = time.monotonic() + 10
    while (now := counter(shell)) <= value:
        assert time.monotonic() < deadline, f"the background loop stopped at {now}"
    return now


def answers_http(shell: Shell) -> bool:
    probe = "python3 -c 'import urllib.request as u; print(u.urlopen(\"http://127.0.0.1:8000/\").status)'"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if shell.run(probe + " 2>/dev/null").strip().endswith("200"):
            return True
    return False


def own_processes(zygote: Zygote | None = None) -> set[int]:
    """Processes started from this test process (its descendants); with ``zygote``, its own and its spares
    (which it makes anew after each command) aside."""
    me = os.getpid()
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = set(), [me]
    while todo:
        for child in children.get(todo.pop(), []):
            if zygote is not None and child == zygote.pid:
                continue
            found.add(child)
            todo.append(child)
    return found


def mounts() -> list[str]:
    """This namespace's mounts that CRIU or these tests could have left (others come and go with other
    programs on the machine, such as a container engine)."""
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return sorted(point for point in points if "criu" in point or "pytest" in point or "tvcache" in point)


# ------------------------------------------------------------------------------------------------ tests


def test_required_version_follows_the_kernel() -> None:
    assert required_version("6.1.0") == (4, 1)
    assert required_version("6.13.2") == (4, 1)
    assert required_version("6.16.0-rc1") == (4, 2)
    assert required_version("6.18.44-fc") == (4, 2)


def test_find_criu_says_why_it_finds_none(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from tvcache.sandboxes.shell import criu as module

    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\necho 'Version: 3.17.1'\n")
    fake.chmod(0o755)
    try:
        for path, reason in ((tmp_path / "missing", "not found"), (fake, "too old")):
            monkeypatch.setenv("TVCACHE_CRIU", str(path))
            module._probe.cache_clear()
            monkeypatch.setattr(module, "_warned", False)
            if os.geteuid() != 0:
                assert find_criu(warn=False) is None
                continue
            with pytest.warns(RuntimeWarning, match=reason):
                assert find_criu() is None
            assert reason in (criu_unavailable_reason() or "")
            with warnings_as_errors():
                assert find_criu() is None  # said once per process
    finally:
        monkeypatch.delenv("TVCACHE_CRIU")
        module._probe.cache_clear()


class warnings_as_errors:
    def __enter__(self) -> None:
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc: object) -> None:
        self._catch.__exit__(*exc)


@needs_criu
def test_restored_copies_keep_the_shell_and_its_processes(setting: tuple[Criu, Zygote, Trees]) -> None:
    criu, zygote, trees = setting
    original = Shell.start(zygote, trees.mount([trees.base]))
    copies: list[Shell] = []
    try:
        original.run(f"mkdir -p src && cd src && export FLAGS=-O0 && plain=kept; {SERVER} {COUNTER}")
        assert answers_http(original)
        dumped = criu.dump(original.pid, trees.root / "images", tree_mountpoint=str(trees.base))
        at_dump = counter(original)
        assert dumped.image_bytes > 0
        assert dumped.tty is not None
        assert dumped.seconds > 0
        frozen = trees.freeze(1)  # the files as the snapshot froze them
        original.run("echo after > made-after-the-dump")
        for _ in range(2):  # two copies of one image, alive at once, beside the original
            shell, seconds = restore_shell(criu, dumped.images, trees.mount([frozen, trees.base]))
            copies.append(shell)
            assert seconds > 0
        for shell in copies:
            assert shell.pid not in (original.pid, *[other.pid for other in copies if other is not shell])
            assert shell.run("echo $FLAGS $plain; pwd").splitlines()[-2:] == ["-O0 kept", f"{trees.base}/src"]
            assert "Running" in shell.run("jobs")
            assert wait_for_counter_above(shell, 0) >= 1
            assert answers_http(shell)  # the server listens again, on this copy's own loopback
            assert shell.run("ls").strip() == ""  # the file made after the dump is the original's only
            assert os.tcgetpgrp(shell.master) == shell.pid  # the new pty is the restored session's terminal
            fds = shell.run("ls /proc/$$/fd").split()
            assert sorted(fds) == ["0", "1", "2", "255"]  # nothing from outside came in
        assert wait_for_counter_above(original, at_dump) > at_dump
        assert original.run("ls") == "made-after-the-dump"
    finally:
        for shell in copies:
            shell.close()
        original.close()
    for shell in copies:
        assert shell.tree.returncode is not None


@needs_criu
def test_a_restore_needs_the_terminal_and_the_tree(setting: tuple[Criu, Zygote, Trees]) -> None:
    criu, zygote, trees = setting
    original = Shell.start(zygote, trees.mount([trees.base]))
    try:
        dumped = criu.dump(original.pid, trees.root / "images", tree_mountpoint=str(trees.base))
        with pytest.raises(CriuError, match="pass a pty slave"):
            criu.restore(dumped.images, tree_mount_fd=trees.fds[0])
        master, slave = os.openpty()
        with pytest.raises(CriuError, match="tree_mount_fd"):
            criu.restore(dumped.images, tty_fd=slave)
        os.close(master)
        os.close(slave)
        with pytest.raises(CriuError, match="already exists"):
            criu.dump(original.pid, dumped.images)
        with pytest.raises(CriuError, match="no usable CRIU dump"):
            criu.restore(trees.root)
        assert isinstance(CriuError("x"), SandboxError)
    finally:
        original.close()


@needs_criu
@pytest.mark.serial  # it races CRIU on purpose: on a loaded machine the stop lands later, in the parasite's time
def test_criu_stopped_mid_dump_leaves_the_shell_running_and_nothing_behind(
    setting: tuple[Criu, Zygote, Trees],
) -> None:
    criu, zygote, trees = setting
    original = Shell.start(zygote, trees.mount([trees.base]))
    try:
        original.run(f"cd /tmp; {COUNTER}")
        images = trees.root / "images"
        killed: list[int] = []

        def stop_criu_once_it_starts() -> None:
            deadline = time.monotonic() + 20
            found: int | None = None
            while time.monotonic() < deadline and not killed:
                # CRIU logs before it seizes the tree. A stop later, while its parasite code runs inside the
                # tree's processes, can take the tree down (always with SIGKILL, now and then with SIGTERM):
                # the persistent shell then meets a shell that ended. So CRIU is found first, and stopped the
                # moment its log appears, however busy the machine.
                if found is None:
                    for pid in own_processes():
                        try:
                            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                            parent = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
                        except (OSError, ValueError):
                            continue
                        # CRIU itself, our child; not one of the helpers it forks (they have its command line).
                        if parent == os.getpid() and b"dump" in cmdline and str(images).encode() in cmdline:
                            found = pid
                elif (images / "dump.log").exists():
                    os.kill(found, signal.SIGTERM)  # as the dump's timeout stops it
                    killed.append(found)

        killer = threading.Thread(target=stop_criu_once_it_starts)
        killer.start()
        with pytest.raises(CriuError, match=r"criu dump of process \d+ failed"):
            criu.dump(original.pid, images, tree_mountpoint=str(trees.base))
        killer.join()
        assert killed
        assert not images.exists()
        before = counter(original)
        assert wait_for_counter_above(original, before) > before  # the shell and its job go on
        assert original.run("echo $((6 * 7))").endswith("42")
    finally:
        original.close()


@needs_criu
def test_a_corrupt_image_fails_cleanly(setting: tuple[Criu, Zygote, Trees]) -> None:
    criu, zygote, trees = setting
    original = Shell.start(zygote, trees.mount([trees.base]))
    try:
        original.run(COUNTER)
        dumped = criu.dump(original.pid, trees.root / "images", tree_mountpoint=str(trees.base))
    finally:
        original.close()
    for image in dumped.images.glob("core-*.img"):
        image.write_bytes(b"\x00garbage" * 64)
    processes, mounted, scratch = own_processes(zygote), mounts(), _scratch_dirs()
    master, slave = os.openpty()
    try:
        with pytest.raises(CriuError, match="criu restore failed"):
            criu.restore(dumped.images, tty_fd=slave, tree_mount_fd=trees.mount([trees.base]))
    finally:
        os.close(master)
        os.close(slave)
    assert own_processes(zygote) - processes == set()
    assert mounts() == mounted
    assert _scratch_dirs() == scratch
    discard_images(dumped.images)
    assert not dumped.images.exists()


def _scratch_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"tvcache-criu-{os.getpid()}-*")))


@needs_criu
def test_no_process_mount_or_image_is_left_after_many_cycles(setting: tuple[Criu, Zygote, Trees]) -> None:
    criu, zygote, trees = setting
    original = Shell.start(zygote, trees.mount([trees.base]))
    original.run("sleep 1000 &")
    processes = own_processes(zygote)
    mounted, scratch = mounts(), _scratch_dirs()
    try:
        for cycle in range(24):
            dumped = criu.dump(original.pid, trees.root / f"images{cycle}", tree_mountpoint=str(trees.base))
            shell, _ = restore_shell(criu, dumped.images, trees.mount([trees.base]))
            assert re.fullmatch(r"\[1\]\+ +Running +sleep 1000 &", shell.run("jobs").strip())
            shell.close()
            assert shell.tree.returncode is not None
            os.close(trees.fds.pop())  # the fork's tree goes with its sandbox
            discard_images(dumped.images)
    finally:
        original.close()
    assert own_processes(zygote) - processes == set()
    assert mounts() == mounted
    assert _scratch_dirs() == scratch
    assert not list(trees.root.glob("images*"))


@needs_criu
def test_a_restore_leaves_the_forks_tree_usable_for_the_next(setting: tuple[Criu, Zygote, Trees]) -> None:
    """The keeper attaches a clone of the fork's detached tree: attaching the descriptor itself used it up, and a
    sandbox attaches its tree again for its next shell and for the restore after its next snapshot."""
    criu, zygote, trees = setting
    original = Shell.start(zygote, trees.mount([trees.base]))
    try:
        original.run("echo kept > made-before; sleep 1000 &")
        dumped = criu.dump(original.pid, trees.root / "images", tree_mountpoint=str(trees.base))
    finally:
        original.close()
    fork_tree = trees.mount([trees.freeze(1), trees.base])
    for _ in range(2):
        shell, _ = restore_shell(criu, dumped.images, fork_tree)
        try:
            assert shell.run("cat made-before") == "kept"
        finally:
            shell.close()
    fresh = Shell.start(zygote, fork_tree)  # and a new shell over it, as after a sandbox's shell ended
    try:
        assert fresh.run("cat made-before") == "kept"
    finally:
        fresh.close()
    discard_images(dumped.images)


NETWORK = "cat /proc/net/dev | cut -d: -f1 | tr -d ' '; cat /proc/net/if_inet6; grep -c . /proc/net/route"


@needs_criu
@pytest.mark.parametrize("nsenter", [True, False], ids=["inside-the-namespace", "named-external"])
def test_a_network_namespace_nothing_can_configure_is_made_anew_not_carried(
    setting: tuple[Criu, Zygote, Trees], monkeypatch: pytest.MonkeyPatch, nsenter: bool
) -> None:
    """The sandbox's processes lack CAP_NET_ADMIN, so its network namespace is exactly the zygote's new one
    with its loopback up: the dump leaves it out (its CRIU runs inside it, or, without nsenter, names it
    external; no ip(8) or iptables runs either way) and a restore gets a new one its keeper made. The copy's
    network reads as the original's, and its server listens on its loopback."""
    import tvcache.sandboxes.shell.criu as criu_module

    if not nsenter:
        which = criu_module.shutil.which
        monkeypatch.setattr(
            criu_module.shutil, "which", lambda name, **kw: None if name == "nsenter" else which(name, **kw)
        )
    criu, zygote, trees = setting
    original = Shell.start(zygote, trees.mount([trees.base]))
    try:
        original.run(SERVER)
        assert answers_http(original)
        network = original.run(NETWORK)
        dumped = criu.dump(original.pid, trees.root / "images", tree_mountpoint=str(trees.base))
    finally:
        original.close()
    meta = json.loads((dumped.images / META_FILE).read_text())
    assert meta["network"] == ("new loopback, CRIU's own" if nsenter else "new loopback")
    # Inside it, the namespace is CRIU's own: no image of it at all (and no walk of the conntrack tables).
    assert bool(list(dumped.images.glob("netns-*.img"))) is not nsenter
    shell, _ = restore_shell(criu, dumped.images, trees.mount([trees.base]))
    try:
        assert answers_http(shell)
        assert shell.run(NETWORK) == network
    finally:
        shell.close()
    discard_images(dumped.images)


@needs_criu
def test_restores_keep_the_kernel_probe_and_a_stale_one_is_probed_again(setting: tuple[Criu, Zygote, Trees]) -> None:
    """CRIU's probe of the kernel (~30 ms a start) is kept for this boot in a directory of root's alone; a copy
    that is not CRIU's (a kernel update, a truncated file) is found stale by CRIU, which probes again."""
    criu, _, trees = setting
    kept = kernel_data_path(criu.version)
    assert kept is not None
    images = dumped_after(setting, "V=probe")
    for content in (None, b"\x00not a kernel probe", b""):
        if content is not None:
            Path(kept).write_bytes(content)
        shell, _ = restore_shell(criu, images, trees.mount([trees.base]))
        try:
            assert shell.run("echo $V") == "probe"
        finally:
            shell.close()
        assert os.stat(kept).st_mode & 0o777 == 0o600
        assert os.stat(os.path.dirname(kept)).st_mode & 0o077 == 0
        assert Path(kept).read_bytes() != content  # CRIU's own probe replaced the stale copy
    discard_images(images)


def test_the_kernel_probe_is_never_read_from_a_directory_others_can_write(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    assert kernel_data_path((4, 2, 1), str(shared)) is None
    private = tmp_path / "private"
    found = kernel_data_path((4, 2, 1), str(private))
    assert found is not None
    assert found.startswith(str(private))
    assert found.endswith("criu-4.2.1")
    assert private.stat().st_mode & 0o777 == 0o700


@needs_criu
def test_keepers_started_ahead_serve_restores_and_end_with_close(setting: tuple[Criu, Zygote, Trees]) -> None:
    criu, _, trees = setting
    keepers = Keepers(size=1)
    images = dumped_after(setting, "V=ahead")
    served = []
    for _ in range(3):
        deadline = time.monotonic() + 10
        while not keepers.idle_pids() and served and time.monotonic() < deadline:
            time.sleep(0.01)
        waiting = keepers.idle_pids()
        shell, _ = restore_shell(criu, images, trees.mount([trees.base]), keepers)
        try:
            assert shell.run("echo $V") == "ahead"
            served.append(waiting)
        finally:
            shell.close()
    assert all(len(waiting) == 1 for waiting in served[1:])  # each restore after the first took one started ahead
    idle = keepers.idle_pids()
    keepers.close()
    for pid in idle:
        assert not os.path.exists(f"/proc/{pid}") or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]
    assert keepers.idle_pids() == set()
    discard_images(images)


def test_ci_runs_the_criu_tests_rather_than_skipping_them() -> None:
    """CI installs CRIU before the suite (``scripts/install-criu.sh``) and sets TVCACHE_REQUIRE_CRIU=1, so a broken
    install fails the run instead of quietly skipping every CRIU test."""
    if os.environ.get("TVCACHE_REQUIRE_CRIU") != "1":
        pytest.skip("only CI requires CRIU (TVCACHE_REQUIRE_CRIU=1)")
    assert find_criu(warn=False) is not None, criu_unavailable_reason()
