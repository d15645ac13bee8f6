"""A real local sandbox with tinker-cookbook's ``SandboxInterface``: the host's root filesystem seen through a
private overlay (writes land in the sandbox's own upper directory), each command chrooted into it in a mount
namespace of its own. Harbor tasks use absolute paths (/tests, /logs/verifier, /app), which this honours without
touching the host. Needs root (overlay mounts and chroot); tests skip elsewhere."""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
from pathlib import Path

from tinker_cookbook.sandbox import SandboxResult

_ids = itertools.count()
STARTED: list[str] = []  # every sandbox ever created, for tests to count

_RUN = r"""
set -e
mount -t overlay overlay -o "lowerdir=/,upperdir=$TVC_UPPER,workdir=$TVC_WORK" "$TVC_MERGED"
mount --rbind /dev "$TVC_MERGED/dev"
mount -t proc proc "$TVC_MERGED/proc"
exec chroot "$TVC_MERGED" /bin/bash -c 'cd "$1" && eval "$2"' _ "$TVC_CWD" "$TVC_CMD"
"""


def overlay_available() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None and shutil.which("chroot") is not None


class OverlaySandbox:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="tvcache-overlay-"))
        for part in ("upper", "work", "merged"):
            (self.root / part).mkdir()
        self._id = f"overlay-{next(_ids)}"
        STARTED.append(self._id)

    @property
    def sandbox_id(self) -> str:
        return self._id

    async def send_heartbeat(self, timeout: int = 30) -> None:
        return None

    async def _run(self, command: str, workdir: str, timeout: int, stdin: bytes | None = None) -> SandboxResult:
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root",
            "LANG": "C.UTF-8",
            "TVC_UPPER": str(self.root / "upper"),
            "TVC_WORK": str(self.root / "work"),
            "TVC_MERGED": str(self.root / "merged"),
            "TVC_CWD": workdir,
            "TVC_CMD": command,
        }
        process = await asyncio.create_subprocess_exec(
            "unshare", "--mount", "--pid", "--fork", "bash", "-c", _RUN,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        try:
            out, err = await asyncio.wait_for(process.communicate(stdin), timeout)
        except TimeoutError:
            process.kill()
            await process.wait()
            return SandboxResult(stdout="", stderr=f"timed out after {timeout} s", exit_code=124)
        assert process.returncode is not None
        return SandboxResult(stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
                             exit_code=process.returncode)  # fmt: skip

    async def run_command(
        self, command: str, workdir: str | None = None, timeout: int = 60, max_output_bytes: int | None = None
    ) -> SandboxResult:
        result = await self._run(command, workdir or "/", timeout)
        if max_output_bytes is not None:
            result = SandboxResult(stdout=result.stdout[:max_output_bytes], stderr=result.stderr[:max_output_bytes],
                                   exit_code=result.exit_code)  # fmt: skip
        return result

    async def read_file(self, path: str, max_bytes: int | None = None, timeout: int = 60) -> SandboxResult:
        command = f"head -c {max_bytes} -- {_quote(path)}" if max_bytes else f"cat -- {_quote(path)}"
        return await self._run(command, "/", timeout)

    async def write_file(
        self, path: str, content: str | bytes, executable: bool = False, timeout: int = 60
    ) -> SandboxResult:
        data = content.encode() if isinstance(content, str) else content
        mode = " && chmod +x -- " + _quote(path) if executable else ""
        command = f"mkdir -p -- $(dirname -- {_quote(path)}) && cat > {_quote(path)}{mode}"
        return await self._run(command, "/", timeout, stdin=data)

    async def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


async def overlay_sandbox_factory(env_dir: Path, timeout: int) -> OverlaySandbox:
    """A tinker-cookbook SandboxFactory (``env_dir`` would hold the Dockerfile; the host root stands in)."""
    return OverlaySandbox()
