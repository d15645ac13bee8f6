"""A verifiers v1 ``Toolset`` for the tests: notes kept in the server's memory, one server per rollout (so each
rollout starts with none). Writing takes a moment, as real tools do, so the time a hit saves shows."""

from __future__ import annotations

import time

import verifiers.v1 as vf

WRITE_SECONDS = 0.2


class NotesToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "notes"

    async def setup(self) -> None:
        self.notes: dict[str, str] = {}

    @vf.tool
    def write(self, name: str, text: str) -> str:
        """Write (or replace) the note called name."""
        time.sleep(WRITE_SECONDS)
        replaced = name in self.notes
        self.notes[name] = text
        return f"{'replaced' if replaced else 'wrote'} {name} ({len(self.notes)} notes)"

    @vf.tool
    def read(self, name: str) -> str:
        """Read the note called name."""
        if name not in self.notes:
            raise ValueError(f"no note called {name}")
        return self.notes[name]


class CountingState(vf.State):
    calls: int = 0


class StatefulNotesToolset(vf.Toolset[vf.ToolsetConfig, CountingState]):
    """Reads and writes the rollout's State: what a cached toolset must refuse."""

    @vf.tool
    def bump(self) -> str:
        """Count a call in the rollout's state."""
        self.state.calls += 1
        return str(self.state.calls)


if __name__ == "__main__":
    NotesToolset.run()
