"""Sessions: the two history streams and the frozen main view, persisted as JSON after every turn.

*compact* is what first-round triage sees (one question and one short answer per finished turn); *full* is what
the tool loop sees (every message, tool call and result). Both only ever grow at the end, which is what keeps
their prefixes cacheable. The main view's text is stored too, so a resumed session sends the very same bytes.
A turn whose model call failed after tools had run is stored as well, closed by a ``[TURN ABORTED]`` note (path
``"aborted"``): the tools' effects are real, so the history must not forget them.

Chat APIs reject a history in which an assistant message's tool call has no tool message answering it (HTTP 400),
so :func:`answer_tool_calls` completes such calls with placeholder error results before a turn is stored, and
again when a session is loaded (files written before that rule).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..canonical import canonical_json
from ..errors import SessionError
from ..models.base import Message
from .mainview import MainView

_ID = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")
UNANSWERED = "this call was not run: the model asked for it where no tool could be called"


def answer_tool_calls(messages: list[Message]) -> list[Message]:
    """``messages`` with a placeholder error result for every tool call no tool message answers.

    Each placeholder goes right after the answers the call's assistant message already has, where the API expects
    it. The model's own messages are kept byte for byte: the history repeats them for cache hits.
    """
    out: list[Message] = []
    index = 0
    while index < len(messages):
        message = messages[index]
        out.append(message)
        index += 1
        calls = (message.get("tool_calls") or []) if message.get("role") == "assistant" else []
        answered: set[Any] = set()
        while index < len(messages) and messages[index].get("role") == "tool":
            answered.add(messages[index].get("tool_call_id"))
            out.append(messages[index])
            index += 1
        for call in calls:
            if call.get("id") not in answered:
                name = (call.get("function") or {}).get("name", "")
                payload = {"status": "error", "tool": name, "error": UNANSWERED}
                out.append({"role": "tool", "tool_call_id": call.get("id"), "content": canonical_json(payload)})
    return out


@dataclass
class ChatSession:
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
        target = directory / f"{self.id}.json"
        tmp = target.with_suffix(".json.tmp")
        try:
            directory.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.to_json(), ensure_ascii=False, indent=1), encoding="utf-8")
            os.replace(tmp, target)
        except OSError as e:
            raise SessionError(f"cannot save session {self.id} in {directory}: {e}; choose a writable directory") from e
        return target

    @classmethod
    def load(cls, directory: Path, session_id: str) -> ChatSession:
        if not _ID.match(session_id):
            raise SessionError(f"invalid session id {session_id!r}")
        path = directory / f"{session_id}.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(
                view=MainView.from_json(data["view"]),
                id=data["id"],
                compact=data["compact"],
                full=answer_tool_calls(data["full"]),
                turns=data["turns"],
            )
        except FileNotFoundError as e:
            raise SessionError(f"no session {session_id!r} in {directory}") from e
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise SessionError(f"session file {path} is unreadable: {e}") from e
