"""A small Harbor task directory and a minimal root filesystem to run it on (``OverlayEnvironment``), for the
Harbor adapter's tests and its documentation snippet."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ENVIRONMENT = {"PATH": "/usr/bin:/bin", "HOME": "/root"}  # no locales in this tiny root filesystem
BINARIES = (
    "bash sh cat ls mkdir rm chmod cp mv mktemp base64 tar env find test printf echo sed grep wc tail head " "sleep"
).split()


def make_rootfs(root: Path) -> Path:
    """The binaries Harbor's trial and the task use, with their libraries, in a merged-/usr layout."""
    root.mkdir(parents=True, exist_ok=True)
    for directory in ("bin", "lib", "lib64", "sbin"):
        (root / "usr" / directory).mkdir(parents=True, exist_ok=True)
        if not (root / directory).is_symlink():
            (root / directory).symlink_to(f"usr/{directory}")
    for name in BINARIES:
        found = shutil.which(name, path="/usr/bin:/bin")
        if found is not None:
            _install(found, root)
    for directory in ("tmp", "proc", "dev", "root", "run", "app", "etc"):
        (root / directory).mkdir(exist_ok=True)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    return root


def _install(binary: str, root: Path) -> None:
    """Copy a binary and the shared libraries it loads into ``root`` at the same paths."""
    libraries = subprocess.run(["ldd", binary], capture_output=True, text=True, check=False).stdout
    paths = {binary} | {token for line in libraries.splitlines() for token in line.split() if token.startswith("/")}
    for path in paths:
        target = root / Path(path).relative_to("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            shutil.copy2(Path(path).resolve(), target)


def make_task(parent: Path) -> Path:
    """A Harbor task directory: instruction, environment, reference solution, verifier."""
    root = parent / "hello-overlay"
    for part in ("environment", "solution", "tests"):
        (root / part).mkdir(parents=True)
    (root / "task.toml").write_text(
        'schema_version = "1.4"\n[verifier]\ntimeout_sec = 60.0\n[agent]\ntimeout_sec = 60.0\n'
        "[environment]\nbuild_timeout_sec = 60.0\n"
    )
    (root / "instruction.md").write_text('Create /app/hello.txt containing "Hello, world!".\n')
    (root / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\n")
    (root / "solution" / "solve.sh").write_text("#!/bin/bash\nprintf 'Hello, world!' > /app/hello.txt\necho done\n")
    (root / "tests" / "test.sh").write_text(
        '#!/bin/bash\nif [ "$(cat /app/hello.txt)" = "Hello, world!" ]; then echo 1; else echo 0; fi'
        " > /logs/verifier/reward.txt\n"
    )
    return root
