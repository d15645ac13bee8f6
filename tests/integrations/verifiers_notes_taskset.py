"""A verifiers v1 taskset for the tests: one task whose tools are ``NotesToolset``'s, served as they are or,
when the task config names a ``CachedToolsetConfig``, through tvcache (``CachedToolset``)."""

from __future__ import annotations

import verifiers.v1 as vf
from verifiers_notes_toolset import NotesToolset

from tvcache.integrations.verifiers import CachedToolset, CachedToolsetConfig


class NotesTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()
    cached: CachedToolsetConfig | None = None


class NotesTask(vf.Task[vf.TaskData, vf.State, NotesTaskConfig]):
    @classmethod
    def toolsets(cls, config: NotesTaskConfig) -> list[vf.Toolset]:
        if config.cached is not None:
            return [CachedToolset(config.cached)]
        return [NotesToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def finished(self, trace: vf.Trace) -> float:
        return 1.0 if trace.ok else 0.0


class NotesConfig(vf.TasksetConfig):
    task: NotesTaskConfig = NotesTaskConfig()


class NotesTaskset(vf.Taskset[NotesTask, NotesConfig]):
    def load(self) -> list[NotesTask]:
        return [NotesTask(vf.TaskData(id="notes-1", prompt="Keep notes."), self.config.task)]


__all__ = ["NotesTaskset"]
