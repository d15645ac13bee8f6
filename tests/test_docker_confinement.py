"""The confinement checker (``tvcache.testing.check_confinement``) over the flavours that need a container
engine: image-based overlay sandboxes (one-shot and persistent) and ``DockerSandbox`` (one-shot and persistent),
against a real engine, all of them with small limits so that the fork bomb and the memory hog hit them fast.
Without one these tests skip, naming why — unless TVCACHE_REQUIRE_DOCKER=1 (CI)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from test_docker import BASE, engine, items_image  # noqa: F401  (fixtures)
from tvcache import ToolCall
from tvcache.sandboxes import DockerSandbox, SandboxLimits, ShellSandbox
from tvcache.sandboxes.shell.linux import overlay_supported
from tvcache.testing import CONFINEMENT_CHECKS, ConfinementProbe, check_confinement

FLAVOURS = ("image", "image-persistent", "docker", "docker-persistent")
CHECKS = list(CONFINEMENT_CHECKS)
# Small limits, so that the fork bomb and the memory hog hit them fast (the defaults are 1024 pids, 2 GiB).
LIMITS = SandboxLimits(pids=128, memory_bytes=128 << 20, cpus=1.0, tmpfs_bytes=64 << 20)


def shell(command: str) -> ToolCall:
    return ToolCall("sh", {"cmd": command, "timeout": 30})


PROBE = ConfinementProbe(
    shell=shell,
    memory_limit_bytes=LIMITS.memory_bytes,
    pids_limit=LIMITS.pids,
    limit_timeout=60,
)


@pytest.fixture(params=FLAVOURS)
def flavour(
    request: pytest.FixtureRequest,
    engine: None,  # noqa: F811
    items_image: str,  # noqa: F811
    tmp_path: Path,
) -> Iterator[tuple[Any, list[Path]]]:
    name = request.param
    if name.startswith("image"):
        if not overlay_supported():
            pytest.skip("image-based overlay sandboxes need overlay mounts (root on Linux >= 6.8)")
        cache_dir = Path(f"/tmp/tvcache-test-images-{os.getpid()}")
        # Persistent shells over an image take no WORKDIR or USER yet: the plain base image for those.
        persistent = name.endswith("persistent")
        image = BASE if persistent else items_image
        factory: Any = ShellSandbox.from_image(
            image, cache_dir=cache_dir, store_root=tmp_path / "layers", persistent=persistent, limits=LIMITS
        )
        storage = [tmp_path / "layers", cache_dir]
    else:
        # tmpfs_bytes does not apply to a container (its /tmp is part of its files).
        factory = DockerSandbox.factory(items_image, persistent=name.endswith("persistent"), limits=LIMITS)
        storage = []
    try:
        yield factory, storage
    finally:
        factory.close()


@pytest.mark.parametrize("check", CHECKS)
def test_every_engine_flavour_passes_the_confinement_check(flavour: tuple[Any, list[Path]], check: str) -> None:
    factory, storage = flavour
    check_confinement(factory, PROBE, storage=storage, checks=[check])
