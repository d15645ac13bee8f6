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


# Modules whose module-scoped fixtures start something costly (a Ray cluster, a browser, npm MCP servers, a
# served cache): `make test` (pytest-xdist, --dist loadgroup) runs each on one worker, so that its fixture starts
# once rather than on every worker that is handed one of its tests. The store contract's Ray cases likewise.
ONE_WORKER_MODULES = frozenset(
    {
        "test_ray",
        "test_ray_shell",
        "test_ray_dashboard",
        "test_dashboard_browser",
        "test_mcp_eval",
        "test_mcp_sandboxed_upstreams",
        "test_relevance",
        "test_snapshot_stores",
        "test_server_hot_path",
    }
)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.path.stem
        callspec = getattr(item, "callspec", None)
        if module == "test_store_contract" and callspec is not None and callspec.params.get("harness") == "ray":
            item.add_marker(pytest.mark.xdist_group("ray-store-contract"))
        elif module in ONE_WORKER_MODULES:
            item.add_marker(pytest.mark.xdist_group(module))
