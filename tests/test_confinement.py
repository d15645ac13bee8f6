"""The confinement checker (``tvcache.testing.check_confinement``) over every shell flavour: one-shot,
persistent, and persistent restored from CRIU. The image-based and Docker flavours run it in
``test_docker_confinement.py``, against a real engine. Real mounts, namespaces, cgroups and CRIU throughout."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tvcache import ToolCall
from tvcache.sandboxes import SandboxLimits, ShellSandbox
from tvcache.sandboxes.shell.criu import criu_unavailable_reason, find_criu
from tvcache.sandboxes.shell.linux import overlay_supported
from tvcache.sandboxes.shell.sandbox import ShellSandboxFactory
from tvcache.testing import CONFINEMENT_CHECKS, ConfinementCheckFailed, ConfinementProbe, check_confinement

pytestmark = pytest.mark.skipif(not overlay_supported(), reason="shell sandboxes need root and overlay mounts")

FLAVOURS = ("one-shot", "persistent", "criu")
# A background process makes a persistent shell's snapshot take the CRIU route (no process but the shell: the
# shell-state route).
BACKGROUND = ToolCall("sh", {"cmd": "sleep 1000 >/dev/null 2>&1 &"})


# Small limits, so that the fork bomb and the memory hog hit them fast (the defaults are 1024 pids, 2 GiB).
LIMITS = SandboxLimits(pids=128, memory_bytes=128 << 20, cpus=1.0, tmpfs_bytes=64 << 20)


def shell(command: str) -> ToolCall:
    return ToolCall("sh", {"cmd": command, "timeout": 30})


@pytest.fixture(params=FLAVOURS)
def flavour(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[str, ShellSandboxFactory, ConfinementProbe]]:
    name = request.param
    if name == "criu" and find_criu(warn=False) is None:
        pytest.skip(f"no working CRIU: {criu_unavailable_reason()}")
    base = tmp_path / "tree"
    base.mkdir()
    (base / "README").write_text("a project\n")
    factory = ShellSandbox.factory(base, persistent=name != "one-shot", fallback=False, limits=LIMITS)
    assert isinstance(factory, ShellSandboxFactory)
    probe = ConfinementProbe(
        shell=shell,
        setup=(BACKGROUND,) if name == "criu" else (),
        fork=name == "criu",
        memory_limit_bytes=LIMITS.memory_bytes,
        pids_limit=LIMITS.pids,
        limit_timeout=40,
    )
    try:
        yield name, factory, probe
    finally:
        factory.close()


@pytest.mark.parametrize("check", list(CONFINEMENT_CHECKS))
def test_every_shell_flavour_passes_the_confinement_check(
    flavour: tuple[str, ShellSandboxFactory, ConfinementProbe], check: str
) -> None:
    name, factory, probe = flavour
    check_confinement(factory, probe, storage=[factory.store.root], checks=[check])
    if name == "criu" and check != "storage-modes":  # the one check that starts no sandbox
        assert factory.route_counts().get("criu", 0) > 0, f"the fork was not restored by CRIU: {factory.route_counts()}"


def test_an_unknown_check_is_named() -> None:
    with pytest.raises(ValueError, match="no confinement check 'nope'"):
        check_confinement(object(), ConfinementProbe(shell=shell), checks=["nope"])  # type: ignore[arg-type]


def test_the_checker_fails_a_sandbox_that_shows_the_host(tmp_path: Path) -> None:
    """The checker can fail: a 'sandbox' that runs commands on the host itself breaks host-files."""
    from tvcache.sandboxes import FolderSandbox

    (tmp_path / "tree").mkdir()
    factory = FolderSandbox.factory(tmp_path / "tree")
    with pytest.raises(ConfinementCheckFailed, match="host-files"):
        check_confinement(factory, ConfinementProbe(shell=shell), checks=["host-files"])


def test_the_readme_snippet_checks_confinement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = (Path(__file__).parent.parent / "README.md").read_text()
    match = re.search(r"<!-- snippet: check-confinement -->\n```python\n(.*?)```", text, re.S)
    assert match is not None, "README has no check-confinement snippet"
    (tmp_path / "tree").mkdir()
    monkeypatch.chdir(tmp_path)
    exec(compile(match.group(1), "README.md", "exec"), {})
