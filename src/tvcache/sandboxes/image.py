"""Container images as the read-only base of overlay shell sandboxes (``ShellSandbox.from_image``).

An image's filesystem is found once per image *digest*: the engine's own layer directory when the image is one
overlay layer (``docker import``-ed bases; nothing is copied), else its root filesystem exported once
(``docker create`` + ``docker export``) into a cache directory kept per digest, so a rebuilt image never
reuses another's tree. Sandboxes over it are ``ShellSandbox`` sandboxes with ``rootfs=True``: they fork and
snapshot in about a millisecond instead of a ``docker commit`` + ``docker run``. The image's ``ENV`` becomes
the commands' environment, and ``WORKDIR`` and ``USER`` are applied to every command (``env --chdir`` and
``setpriv``, which the image must then contain).

Task ids must pin the image: ``ImageConfig.task_id(name)`` appends the digest, and the factory carries its
``ImageConfig`` as ``factory.image``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from ..errors import SandboxError
from ..private_storage import private_directory
from .docker import OWNER_LABEL, SANDBOX_LABEL, DockerCommands

__all__ = [
    "ImageConfig",
    "ImageSetup",
    "default_cache_dir",
    "image_root",
    "image_setup",
    "inspect_image",
]

DOCKER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # what docker gives an image without


@dataclass(frozen=True, kw_only=True)
class ImageConfig:
    """What an image is and how its commands run, as the engine reports it."""

    reference: str  # as the user named it ("tvcache-base:bookworm")
    digest: str  # the image id, "sha256:..."; the same reference may name another image tomorrow
    environment: Mapping[str, str]
    workdir: str  # "" for the image's default ("/")
    user: str  # "" for root
    layers: tuple[str, ...]  # the engine's overlay layer directories, newest first; () where it exposes none

    def task_id(self, name: str) -> str:
        """A task id that pins this image: a rebuilt image (a new digest) never shares its cache."""
        return f"{name}@{self.digest}"


def inspect_image(reference: str, *, engine: str = "docker") -> ImageConfig:
    """The image's digest, configuration and layer directories (``docker image inspect``)."""
    try:
        result = subprocess.run(
            [engine, "image", "inspect", "--format", "{{json .}}", reference],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SandboxError(f"image {reference!r}: {engine} image inspect failed: {error}") from error
    if result.returncode != 0:
        raise SandboxError(
            f"image {reference!r}: {engine} image inspect failed (build or import it first; nothing is pulled): "
            f"{result.stderr.strip()[:300]}"
        )
    data = json.loads(result.stdout)
    if isinstance(data, list):  # podman answers with a list
        data = data[0]
    config = data.get("Config") or {}
    environment = dict(item.partition("=")[::2] for item in config.get("Env") or [])
    driver = data.get("GraphDriver") or {}
    layers: tuple[str, ...] = ()
    if driver.get("Name") in ("overlay2", "overlay"):
        found = driver.get("Data") or {}
        upper, lower = found.get("UpperDir"), found.get("LowerDir")
        layers = tuple(path for path in [upper, *(lower.split(":") if lower else [])] if path)
    return ImageConfig(
        reference=reference,
        digest=str(data["Id"]) if str(data["Id"]).startswith("sha256:") else f"sha256:{data['Id']}",
        environment=MappingProxyType(environment),
        workdir=str(config.get("WorkingDir") or ""),
        user=str(config.get("User") or ""),
        layers=layers,
    )


def default_cache_dir() -> Path:
    """Where exported root filesystems are kept: outside any checkout, so one machine exports each image once."""
    system = Path("/var/cache/tvcache/images")
    with contextlib.suppress(OSError):
        system.mkdir(parents=True, exist_ok=True)
        if os.access(system, os.W_OK):
            return system
    return Path.home() / ".cache" / "tvcache" / "images"


def image_root(config: ImageConfig, *, engine: str = "docker", cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The image's root filesystem as a directory: its single overlay layer in the engine, or its export under
    ``cache_dir/<digest>/rootfs`` (made once; concurrent processes wait for the first)."""
    if len(config.layers) == 1 and Path(config.layers[0]).is_dir():
        return Path(config.layers[0])  # a whole tree already; overlay whiteouts cannot occur in a lone layer
    # Private (0700): an export keeps the image's set-user-ID files, which another host user must not run.
    cache = private_directory(Path(cache_dir) if cache_dir is not None else default_cache_dir())
    entry = cache / config.digest.removeprefix("sha256:")
    root = entry / "rootfs"
    with open(cache / f"{entry.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not root.is_dir():
            _export(config, engine, cache, entry)
    return root


def _export(config: ImageConfig, engine: str, cache: Path, entry: Path) -> None:
    build = Path(tempfile.mkdtemp(prefix=".export-", dir=cache))
    (build / "rootfs").mkdir()
    owner = DockerCommands().owner
    create = [engine, "create", "--pull", "never", "--label", f"{SANDBOX_LABEL}=1", "--label", f"{OWNER_LABEL}={owner}"]
    try:
        created = subprocess.run([*create, config.digest, "true"], capture_output=True, text=True, timeout=120)
        if created.returncode != 0:
            raise SandboxError(f"image {config.reference!r}: {engine} create failed: {created.stderr.strip()[:300]}")
        container = created.stdout.strip()
        try:
            with subprocess.Popen([engine, "export", container], stdout=subprocess.PIPE) as export:
                untar = subprocess.run(
                    ["tar", "-x", "-p", "--numeric-owner", "-C", str(build / "rootfs")],
                    stdin=export.stdout,
                    capture_output=True,
                    text=True,
                )
            if export.returncode != 0 or untar.returncode != 0:
                raise SandboxError(
                    f"image {config.reference!r}: exporting its filesystem failed ({engine} export exit "
                    f"{export.returncode}, tar: {untar.stderr.strip()[:300]})"
                )
        finally:
            subprocess.run([engine, "rm", "--force", container], capture_output=True, timeout=120)
        (build / "image.json").write_text(json.dumps({"reference": config.reference, "digest": config.digest}))
        os.rename(build, entry)  # whole or not at all: an interrupted export leaves only a .export- directory
    finally:
        shutil.rmtree(build, ignore_errors=True)


def _passwd_entry(root: Path, user: str) -> tuple[int, int, str] | None:
    """(uid, gid, home) of ``user`` (a name or a uid) in the image's /etc/passwd."""
    with contextlib.suppress(OSError):
        for line in (root / "etc" / "passwd").read_text().splitlines():
            fields = line.split(":")
            if len(fields) >= 6 and user in (fields[0], fields[2]):
                return int(fields[2]), int(fields[3]), fields[5]
    return None


def _group_id(root: Path, group: str) -> int | None:
    if group.isdigit():
        return int(group)
    with contextlib.suppress(OSError):
        for line in (root / "etc" / "group").read_text().splitlines():
            fields = line.split(":")
            if len(fields) >= 3 and fields[0] == group:
                return int(fields[2])
    return None


def _identity(config: ImageConfig, root: Path) -> tuple[list[str], str]:
    """The command prefix that takes on the image's USER (``setpriv``), and that user's home."""
    name, _, group = config.user.partition(":")
    if name in ("", "root", "0") and group in ("", "root", "0"):
        return [], "/root"
    entry = _passwd_entry(root, name)
    if entry is None and not name.isdigit():
        raise SandboxError(f"image {config.reference!r}: USER {config.user!r} is not in the image's /etc/passwd")
    uid, gid, home = entry if entry is not None else (int(name), int(name), "/")
    if group:
        found = _group_id(root, group)
        if found is None:
            raise SandboxError(f"image {config.reference!r}: USER {config.user!r} names an unknown group")
        gid = found
    setpriv = _find_in(root, "setpriv")
    if setpriv is None:
        raise SandboxError(
            f"image {config.reference!r}: USER {config.user!r} is applied with setpriv (util-linux), which the image "
            "lacks; install it in the image or use DockerSandbox"
        )
    groups = ["--init-groups"] if entry is not None and not group else ["--clear-groups"]
    return [setpriv, f"--reuid={uid}", f"--regid={gid}", *groups, "--"], home


def _find_in(root: Path, program: str) -> str | None:
    """The program's path inside the image (commands are started without a PATH search)."""
    for directory in DOCKER_PATH.split(":"):
        if (root / directory.lstrip("/") / program).exists():
            return f"{directory}/{program}"
    return None


@dataclass(frozen=True, kw_only=True)
class ImageSetup:
    """How shell sandboxes over an image run: the tree to use as base (``rootfs=True``), the commands'
    environment, what runs before bash (``WORKDIR`` and ``USER``), and the image itself (for task ids)."""

    root: Path
    environment: dict[str, str]
    command_prefix: tuple[str, ...]
    config: ImageConfig


def image_setup(
    reference: str,
    *,
    engine: str = "docker",
    cache_dir: str | os.PathLike[str] | None = None,
    environment: Mapping[str, str] | None = None,
    persistent: bool = False,
) -> ImageSetup:
    """The image's filesystem, with its ENV, WORKDIR and USER; extra ``environment`` entries override the
    image's. ``ShellSandbox.from_image`` builds the factory from it (this module knows no sandbox class,
    so the shell sandboxes can depend on it)."""
    config = inspect_image(reference, engine=engine)
    root = image_root(config, engine=engine, cache_dir=cache_dir)
    if not (root / "bin" / "bash").exists() and not (root / "usr" / "bin" / "bash").exists():
        raise SandboxError(f"image {reference!r} has no bash; shell sandboxes run commands with bash")
    prefix, home = _identity(config, root)
    # As in its containers: docker's default PATH and the image's ENV, then what DockerSandbox adds.
    env = {"PATH": DOCKER_PATH, "HOME": home, "HOSTNAME": "sandbox", "LANG": "C.UTF-8", "TZ": "UTC"}
    env.update(config.environment)
    env.update(environment or {})
    if config.workdir and config.workdir != "/":
        env_program = _find_in(root, "env")
        if env_program is None:
            raise SandboxError(f"image {reference!r}: WORKDIR is applied with env --chdir, which the image lacks")
        prefix = [env_program, f"--chdir={config.workdir}", *prefix]
    if prefix and persistent:
        raise SandboxError(
            f"image {reference!r}: persistent shells do not apply an image's WORKDIR or USER yet; use one-shot "
            "shell sandboxes (persistent=False) or DockerSandbox"
        )
    return ImageSetup(root=root, environment=env, command_prefix=tuple(prefix), config=config)
