"""The Dockerfile workload: repair tasks whose environments are container images, as terminal-bench, Harbor and
SWE-bench ship theirs.

Each task is a Dockerfile (``data/dockerfile/<task>.Dockerfile``) over the local base image (debootstrap
minbase, scripts/build-base-image.sh): it copies a small project — ``ledger``, with a build (``build.sh``: an
awk program turned into a tool, balances computed from 60,000 transactions and checked against a recorded
checksum), a test suite (``test.sh``) and an HTTP service (``serve.pl``, checked by ``service-test.sh``, which
starts it on the sandbox's own loopback and stops it again) — and plants one bug. The base has no compiler and
no Python, and no package can be installed without a network, so the project is bash, coreutils, awk and perl.
The policy inspects, builds, tests, patches (one right patch, others wrong) and submits; the reward is whether
build, tests and service checks all pass in the rollout's final state, really run there.

Tools run in a shell inside the image, through one of two backends (one workload each in the demo):

* ``image``: overlay shell sandboxes over the image's filesystem (``ShellSandbox.from_image``), forking in about
  a millisecond;
* ``docker``: a container per sandbox (``DockerSandbox``), snapshots by ``docker commit``.

Task ids carry the image digest (``ImageConfig.task_id``), so a rebuilt image never shares another's cache.
Without an engine, the base image or (for ``image``) overlay mounts, ``dockerfile_workload`` raises
``WorkloadUnavailable`` saying why, and the demo skips the workload.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import TVCacheError
from ..protocol import SandboxFactory, close_factory
from ..sandboxes.docker import DockerSandbox, docker_available
from ..sandboxes.image import inspect_image
from .base import Action, Task, Workload

__all__ = [
    "BACKENDS",
    "CHECK",
    "TASKS",
    "WorkloadUnavailable",
    "build_images",
    "dockerfile_workload",
    "unavailable_reason",
]

CONTEXT = Path(__file__).with_name("data") / "dockerfile"  # the build context: the project and the Dockerfiles
BASE_IMAGE = os.environ.get("TVCACHE_DOCKER_IMAGE", "tvcache-base:bookworm")
REPOSITORY = "tvcache-ledger"  # the task images are its tags; kept in the engine, as docker's build cache is
WORKLOAD_LABEL = "tvcache.workload=ledger"
BACKENDS = ("image", "docker")
CHECK = (
    "./build.sh >/dev/null 2>&1 && ./test.sh >/dev/null 2>&1 && ./service-test.sh >/dev/null 2>&1 "
    "&& echo PASS || echo FAIL"
)
COMMON = ("ls", "cat README", "./build.sh 2>&1", "./test.sh 2>&1 | tail -n 4", "./service-test.sh 2>&1 | tail -n 4")


class WorkloadUnavailable(TVCacheError):
    """The workload cannot run on this machine (no engine, no base image, no overlay mounts, a failed image
    build); the message says why and what to do."""


@dataclass(frozen=True, kw_only=True)
class LedgerTask:
    """One Dockerfile's task: what the prompt says, a command that shows the bug, the right and wrong patches."""

    prompt: str
    inspect: str
    right: str
    wrong: tuple[str, ...]


TASKS = {
    "fix-build": LedgerTask(
        prompt="./build.sh fails in this image: make the build work, with its tests and service checks, then submit.",
        inspect="grep -n awk build.sh",
        right=r"sed -i 's|/usr/bin/gawk|/usr/bin/awk|' build.sh",
        wrong=(r"sed -i 's|gawk -f|gawk|' build.sh", r"sed -i 's|/usr/bin/gawk|/usr/bin/perl|' build.sh"),
    ),
    "fix-rounding": LedgerTask(
        prompt="The ledger's balances are off by a few cents: fix the computation, then submit.",
        inspect="grep -n cents ledger.awk",
        right=r"sed -i 's/int(\$4 \* 100)/int($4 * 100 + 0.5)/' ledger.awk",
        wrong=(r"sed -i 's/int(\$4 \* 100)/int($4 * 100 + 1)/' ledger.awk", "rm balances.sha256"),
    ),
    "fix-service": LedgerTask(
        prompt="The ledger service answers 404 for every account: fix it, then submit.",
        inspect="grep -n balance/ serve.pl",
        right=r"sed -i 's|(\[a-z\]+)|([a-z0-9-]+)|' serve.pl",
        wrong=(r"sed -i 's|(\[a-z\]+)|(\\w+)|' serve.pl", "sed -i 's|404 Not Found|200 OK|' serve.pl"),
    ),
}


def _passes(output: str | None) -> float:
    return 1.0 if output is not None and output.strip() == "PASS" else 0.0


def unavailable_reason(backend: str = "image", *, engine: str = "docker", base: str = BASE_IMAGE) -> str | None:
    """Why the workload cannot run here through ``backend``, or None (the demo leaves it out, saying why)."""
    available, why = docker_available(engine)
    if not available:
        return f"needs a Docker engine ({why}); start one with scripts/install-docker.sh"
    found = subprocess.run([engine, "image", "inspect", base], capture_output=True, timeout=60)
    if found.returncode != 0:
        return f"needs the base image {base}; build it with scripts/build-base-image.sh"
    if backend == "image":
        from ..sandboxes.shell.linux import overlay_supported

        if not overlay_supported():
            return "image-based overlay sandboxes need overlay mounts (root on Linux >= 6.8)"
    return None


def build_images(*, engine: str = "docker", base: str = BASE_IMAGE) -> dict[str, str]:
    """Build every task's image from its Dockerfile (the engine's build cache makes a rebuild ~1 s); returns
    task -> image tag."""
    images = {}
    for name in TASKS:
        tag = f"{REPOSITORY}:{name}"
        argv = [engine, "build", "--quiet", "--build-arg", f"BASE={base}", "--label", WORKLOAD_LABEL, "--tag", tag]
        argv += ["--file", str(CONTEXT / f"{name}.Dockerfile"), str(CONTEXT)]
        built = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        if built.returncode != 0:
            raise WorkloadUnavailable(f"building {tag} from {name}.Dockerfile failed: {built.stderr.strip()[-500:]}")
        images[name] = tag
    return images


def _factory(backend: str, image: str, engine: str) -> SandboxFactory:
    if backend == "docker":
        return DockerSandbox.factory(image, engine=engine, timeout=60)
    from ..sandboxes.shell.sandbox import ShellSandbox

    return ShellSandbox.from_image(image, engine=engine, timeout=60)


def dockerfile_workload(
    data_dir: Path, *, backend: str = "image", engine: str = "docker", base: str = BASE_IMAGE
) -> Workload:
    """The ledger tasks, their images built from their Dockerfiles, run through ``backend`` ("image" or
    "docker"). ``data_dir`` is unused: the images live in the engine (and their exports in tvcache's image
    cache), kept between runs like the base image."""
    del data_dir
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    why = unavailable_reason(backend, engine=engine, base=base)
    if why is not None:
        raise WorkloadUnavailable(why)
    tasks: list[Task] = []

    def close() -> None:
        for task in tasks:
            close_factory(task.factory)

    try:
        for name, image in build_images(engine=engine, base=base).items():
            spec = TASKS[name]
            config = inspect_image(image, engine=engine)
            # The digest, not the tag, names the image: a sandbox never starts from a tag rebuilt meanwhile.
            factory = _factory(backend, config.digest, engine)
            commands = [*COMMON[:2], spec.inspect, *COMMON[2:], spec.right, *spec.wrong, "rm -rf build"]
            actions = tuple(Action(name="sh", arguments={"cmd": command}) for command in commands)
            actions += (Action(name="sh", arguments={"cmd": "echo submitted"}, terminal=True),)
            tasks.append(
                Task(
                    id=config.task_id(name),
                    prompt=spec.prompt,
                    actions=actions,
                    reward=_passes,
                    factory=factory,
                    check=Action(name="sh", arguments={"cmd": CHECK}).call,
                    horizon=6,
                )
            )
    except BaseException:
        close()
        raise
    how = "overlay sandboxes over the images" if backend == "image" else "a Docker container per sandbox"
    return Workload(
        name="dockerfile" if backend == "image" else "dockerfile-docker",
        tasks=tasks,
        description=f"repair a project built from Dockerfiles (build, tests, HTTP service); {how}",
        close=close,
    )
