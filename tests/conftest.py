import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tvcache.server.service import CacheService

sys.path.insert(0, str(Path(__file__).parent))

# Ray clusters started by the tests run on loopback only (Ray otherwise advertises the machine's interface
# address); Ray reads this once, when first imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture
def tiny_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs: a real filesystem that really fills up (a full disk without mocking one)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill up needs root")
    mount = tmp_path / "tiny"
    mount.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.fixture
def service() -> Iterator["CacheService"]:
    """A fresh in-memory server service (tests that need a budget define their own). Imported here, not at the
    top: a venv that runs only some tests need not have the server's dependencies."""
    from tvcache.server.service import CacheService

    service = CacheService()
    yield service
    service.close()
