"""What both SWE-ReX runtimes over tvcache share (``swerex.CachingRuntime``, which replays into a real deployment,
and ``ShellRuntime``, on a persistent shell): liveness, the uploads each keeps for replays, and an idempotent
close that always removes them."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from ._swerex_shell_sandbox import keep_upload

__all__ = ["RolloutRuntime"]


class RolloutRuntime:
    """The base of both runtimes. A subclass sets ``_abstract`` (``swerex.runtime.abstract``), ``_uploads`` (a
    directory of its own) and ``closed = False`` in its constructor, and stops what it started in ``_stop``."""

    _abstract: Any
    _uploads: Path
    closed: bool

    async def is_alive(self, *, timeout: float | None = None) -> Any:
        message = "the runtime was closed" if self.closed else ""
        return self._abstract.IsAliveResponse(is_alive=not self.closed, message=message)

    async def close(self) -> Any:
        """End the rollout: stop what it started, if anything. Idempotent."""
        if not self.closed:
            self.closed = True
            try:
                await self._stop()
            finally:
                shutil.rmtree(self._uploads, ignore_errors=True)
        return self._abstract.CloseResponse()

    async def _stop(self) -> None:
        raise NotImplementedError

    def _upload_arguments(self, request: Any) -> dict[str, Any]:
        """An UploadRequest as call arguments: keyed by the content uploaded (a file or a tree), never by the
        local path, which is copied into the uploads for replays."""
        return {**keep_upload(Path(request.source_path), self._uploads), "target_path": request.target_path}
