"""Sessions: the two history streams and the frozen main view, persisted as JSON after every turn.

*compact* is what first-round triage sees (one question and one short answer per finished turn); *full* is what
the tool loop sees (every message, tool call and result). Both only ever grow at the end, which is what keeps
their prefixes cacheable. The main view's text is stored too, so a resumed session sends the very same bytes.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import SessionError
from .mainview import MainView
from .models import Message

_ID = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


@dataclass
class Session:
    view: MainView
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    compact: list[Message] = field(default_factory=list)
    full: list[Message] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "view": self.view.to_json(),
            "compact": self.compact,
            "full": self.full,
            "turns": self.turns,
        }

    def save(self, directory: Path) -> Path:
        """Write atomically: a crash leaves the previous file, never half of one."""
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / f"{self.id}.json"
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_json(), ensure_ascii=False, indent=1), encoding="utf-8")
        os.replace(tmp, target)
        return target

    @classmethod
    def load(cls, directory: Path, session_id: str) -> Session:
        if not _ID.match(session_id):
            raise SessionError(f"invalid session id {session_id!r}")
        path = directory / f"{session_id}.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(
                view=MainView.from_json(data["view"]),
                id=data["id"],
                compact=data["compact"],
                full=data["full"],
                turns=data["turns"],
            )
        except FileNotFoundError as e:
            raise SessionError(f"no session {session_id!r} in {directory}") from e
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SessionError(f"session file {path} is unreadable: {e}") from e
