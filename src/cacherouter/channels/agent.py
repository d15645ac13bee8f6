"""The main channel: first-round triage, the tool loop, deep thinking and the honest fallback.

Every main-model request carries the same ``MainView.tools_json`` and the same system prompt, so the request
head never changes. Triage differs from the loop only in ``tool_choice="none"`` and in using the compact history
(the paper also swaps the tool list for triage; we keep one tool segment so both share the cached head).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..canonical import canonical_json
from ..errors import CacheRouterError, SessionError
from ..models.base import ChatModel, ChatRequest, ChatResponse, ChatToolCall, Message
from ..prompts import (
    DEEP_THINKING,
    DIRECT_ANSWER,
    FALLBACK,
    INCOMPLETE,
    MAIN_SYSTEM,
    NEED_TOOLS,
    PLACEHOLDER_TOOL,
    ROUTER_TOOL,
    TURN_ABORTED,
    UNCERTAIN,
)
from ..tools.gateway import Gateway
from .conversation import ChatSession, answer_tool_calls
from .mainview import MainView
from .router import Router, router_arguments

# Output that reports failure although the process exited 0: the "implicit" errors.
IMPLICIT_ERROR = re.compile(
    r"permission denied|no such file|not found|does not exist|unavailable|traceback \(most recent|^error[:\s]",
    re.IGNORECASE | re.MULTILINE,
)
REPLAN_NOTE = "This call failed. Do not repeat it unchanged: re-plan from the error."
# finish_reason values that mean the reply is not the model's whole answer, and how the INCOMPLETE note says so.
CUT_OFF = {
    "length": "was cut off at the output limit",
    "content_filter": "was withheld by the provider's content filter",
}


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    round_limit: int = 8  # R1: tool rounds before deep thinking is forced
    extended_round_limit: int = 14  # R2: the limit once deep thinking has run
    slow_seconds: float = 60.0
    fragmentation_rounds: int = 4
    max_parallel: int = 4
    summary_chars: int = 400
    tool_timeout: float = 60.0
    triage: bool = True
    sessions_dir: Path | None = None


@dataclass(frozen=True, kw_only=True)
class CallRecord:
    name: str
    ok: bool
    routed_to: str | None = None


@dataclass(frozen=True, kw_only=True)
class Answer:
    text: str
    path: str  # "direct", "tools" or "fallback"
    rounds: int
    router_calls: int
    calls: tuple[CallRecord, ...]
    errors: int
    deep_thinking: tuple[str, ...]


class Agent:
    def __init__(
        self,
        *,
        gateway: Gateway,
        main_model: ChatModel,
        router: Router,
        config: AgentConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.gateway = gateway
        self.main = main_model
        self.router = router
        self.config = config or AgentConfig()
        self.clock = clock

    def new_session(self, view: MainView) -> ChatSession:
        return ChatSession(view=view)

    def ask(self, session: ChatSession, query: str) -> Answer:
        system: Message = {"role": "system", "content": MAIN_SYSTEM}
        user: Message = {"role": "user", "content": query}
        view = session.view
        if self.config.triage:
            reply = self.main.complete(
                ChatRequest(
                    messages=(system, *session.compact, user),
                    tools_json=view.tools_json,
                    tool_choice="none",
                    channel="triage",
                )
            )
            if _is_direct(reply):
                text = _strip_markers(reply.content)
                self._finish(session, [user, reply.assistant_message()], text, "direct")
                return Answer(text=text, path="direct", rounds=0, router_calls=0, calls=(), errors=0, deep_thinking=())
        # Anything else -- NEED_TOOLS, no marker at all, a cut-off or empty reply, or tool calls the provider let
        # through despite tool_choice="none" -- goes to the tool loop, as the paper's Algorithm 1 does. The triage
        # reply is not kept.
        return self._loop(session, system, user)

    def _loop(self, session: ChatSession, system: Message, user: Message) -> Answer:
        start = self.clock()
        new: list[Message] = [user]
        rounds = penalty = errors = router_calls = 0
        limit = self.config.round_limit
        deep: list[str] = []
        calls: list[CallRecord] = []
        answer: str | None = None  # the model's final text, once it answers without calling tools
        while True:
            if rounds + penalty >= limit:
                if deep:
                    break
                deep.append("round limit reached without an answer")
                limit = self.config.extended_round_limit
                new.append({"role": "user", "content": DEEP_THINKING.format(reason=deep[-1])})
            request = ChatRequest(
                messages=(system, *session.full, *new),
                tools_json=session.view.tools_json,
                tool_choice="auto",
                channel="main",
            )
            reply = self._complete_after_tools(session, request, new, calls)
            rounds += 1
            if not reply.tool_calls:
                problem = _not_an_answer(reply)
                if problem is None:
                    new.append(reply.assistant_message())
                    answer = _strip_markers(reply.content)
                    break
                # Not an answer: ask again, at the price of a failed round. A cut-off text stays in the history
                # (the model's bytes, for the cache); an empty assistant message is refused by many chat APIs.
                if reply.content:
                    new.append(reply.assistant_message())
                new.append({"role": "user", "content": INCOMPLETE.format(problem=problem)})
                penalty += 1
                continue
            new.append(reply.assistant_message())
            context = [str(m.get("content", ""))[:300] for m in new if m.get("role") == "tool"][-3:]
            results = self._run_calls(session.view, reply.tool_calls, context)
            failed_round = False
            for call, (content, record) in zip(reply.tool_calls, results, strict=True):
                new.append({"role": "tool", "tool_call_id": call.id, "content": content})
                calls.append(record)
                router_calls += call.name == ROUTER_TOOL
                if not record.ok:
                    errors += 1
                    failed_round = True
            if failed_round:
                penalty += 1  # a failed round costs one extra round of budget, so loops on errors end sooner
            if not deep:
                reason = None
                if self.clock() - start > self.config.slow_seconds:
                    reason = f"more than {self.config.slow_seconds:g}s spent"
                elif rounds >= self.config.fragmentation_rounds:
                    reason = f"{rounds} consecutive tool rounds"
                if reason is not None:
                    deep.append(reason)
                    limit = self.config.extended_round_limit
                    new.append({"role": "user", "content": DEEP_THINKING.format(reason=reason)})
        path = "tools" if answer is not None else "fallback"
        text = answer if answer is not None else self._fallback(session, system, new, calls)
        self._finish(session, new, text, path)
        return Answer(
            text=text,
            path=path,
            rounds=rounds,
            router_calls=router_calls,
            calls=tuple(calls),
            errors=errors,
            deep_thinking=tuple(deep),
        )

    def _fallback(self, session: ChatSession, system: Message, new: list[Message], calls: list[CallRecord]) -> str:
        new.append({"role": "user", "content": FALLBACK})
        request = ChatRequest(
            messages=(system, *session.full, *new),
            tools_json=session.view.tools_json,
            tool_choice="none",
            channel="fallback",
        )
        reply = self._complete_after_tools(session, request, new, calls)
        text = _strip_markers(reply.content)
        if not text:
            text = "I could not finish this task with the tools available, and will not guess the result."
        elif reply.finish_reason in CUT_OFF:
            text = f"{text} (this answer {CUT_OFF[reply.finish_reason]})"
        if UNCERTAIN not in text:
            text = f"{UNCERTAIN} {text}"
        if reply.content or reply.tool_calls:  # the model's bytes, for the cache; the user sees ``text``
            new.append(reply.assistant_message())
        return text

    def _complete_after_tools(
        self, session: ChatSession, request: ChatRequest, new: list[Message], calls: list[CallRecord]
    ) -> ChatResponse:
        """One main-model request of the loop. If it fails (or is interrupted) after tools have run, their calls
        and results are stored as an aborted turn before the error goes on: the tools' effects are real, and
        neither the user nor the model may lose track of them."""
        try:
            return self.main.complete(request)
        except BaseException as e:
            if any(m.get("role") == "tool" for m in new):
                self._abort(session, new, calls, e)
            raise

    def _abort(self, session: ChatSession, new: list[Message], calls: list[CallRecord], error: BaseException) -> None:
        """Store the partial turn in both streams, closed by a TURN_ABORTED note, and save the session.

        The note is an assistant message, so the history stays valid for chat APIs (every call answered, no empty
        message) and reads as the turn's outcome; the compact stream gets the same note in place of an answer.
        """
        reason = (
            "interrupted by the user" if isinstance(error, KeyboardInterrupt) else f"{type(error).__name__}: {error}"
        )
        made = ", ".join(
            (f"{c.routed_to} via {c.name}" if c.routed_to else c.name) + ("" if c.ok else " (failed)") for c in calls
        )
        note = TURN_ABORTED.format(calls=made, reason=reason[:200])  # calls first: the compact copy is cut
        new.append({"role": "assistant", "content": note})
        try:
            self._finish(session, new, note, "aborted")
        except SessionError as save_error:  # the model's failure stays the error raised; this one rides along
            error.add_note(f"the partial turn could not be saved either: {save_error}")

    def _run_calls(
        self, view: MainView, tool_calls: tuple[ChatToolCall, ...], context: list[str]
    ) -> list[tuple[str, CallRecord]]:
        workers = max(1, min(len(tool_calls), self.config.max_parallel))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(lambda call: self._run_call(view, call, context), tool_calls))

    def _run_call(self, view: MainView, call: ChatToolCall, context: list[str]) -> tuple[str, CallRecord]:
        """Always returns one result per call: a tool message is owed for every tool_call id."""
        try:
            if call.raw_arguments:
                return _error(call.name, f"arguments are not a JSON object: {call.raw_arguments[:200]}")
            if call.name == ROUTER_TOOL:
                task, hint = router_arguments(call.arguments)
                outcome = self.router.route(task, hint=hint, context=context)
                payload = dict(outcome.payload)
                ok = outcome.status == "ok" and not _implicit_error(payload)
                if not ok:
                    payload["note"] = REPLAN_NOTE
                return canonical_json(payload), CallRecord(name=call.name, ok=ok, routed_to=outcome.tool)
            if call.name == PLACEHOLDER_TOOL:
                return _error(
                    call.name,
                    f"{PLACEHOLDER_TOOL} is a placeholder and cannot be called; use a listed " f"tool or {ROUTER_TOOL}",
                )
            if not view.is_core(call.name):
                return _error(call.name, f"no tool {call.name!r} here; use a listed tool or {ROUTER_TOOL}")
            result = self.gateway.call(call.name, call.arguments, timeout=self.config.tool_timeout)
            payload = result.to_json()
            ok = result.ok and not _implicit_error(payload)
            if not ok:
                payload["note"] = REPLAN_NOTE
            return canonical_json(payload), CallRecord(name=call.name, ok=ok)
        except CacheRouterError as e:
            return _error(call.name, str(e))

    def _finish(self, session: ChatSession, new: list[Message], text: str, path: str) -> None:
        """Append the turn to both streams. ``new`` holds the model's replies exactly as it produced them (markers
        included): providers persist a request's output as a cache boundary, so the next request hits through
        the reply only if the history repeats its bytes. ``text`` is the answer shown to the user."""
        session.full.extend(answer_tool_calls(new))  # a provider may return tool calls where none can run
        reply = str(next((m for m in reversed(new) if m.get("role") == "assistant"), {}).get("content") or "")
        limit = self.config.summary_chars
        summary = reply if len(reply) <= limit else reply[:limit] + "..."
        session.compact.extend([new[0], {"role": "assistant", "content": summary}])
        session.turns.append({"query": new[0]["content"], "answer": text, "path": path})
        if self.config.sessions_dir is not None:
            session.save(self.config.sessions_dir)


def _is_direct(reply: ChatResponse) -> bool:
    """Triage answers directly only when its last marker is DIRECT_ANSWER (reasoning before it may mention either
    marker), with no tool calls, and with a whole, non-empty answer."""
    content = reply.content
    last_is_direct = content.rfind(DIRECT_ANSWER) > content.rfind(NEED_TOOLS)
    return last_is_direct and not reply.tool_calls and _not_an_answer(reply) is None


def _not_an_answer(reply: ChatResponse) -> str | None:
    """Why a reply without tool calls is no answer to show the user (cut off, filtered, empty), or None."""
    if reply.finish_reason in CUT_OFF:
        return CUT_OFF[reply.finish_reason]
    if not _strip_markers(reply.content):
        return "was empty"
    return None


def _strip_markers(text: str) -> str:
    return text.replace(NEED_TOOLS, "").replace(DIRECT_ANSWER, "").strip()


def _implicit_error(payload: dict[str, Any]) -> bool:
    return bool(IMPLICIT_ERROR.search(str(payload.get("stdout", ""))))


def _error(name: str, message: str) -> tuple[str, CallRecord]:
    payload = {"status": "error", "tool": name, "error": message, "note": REPLAN_NOTE}
    return canonical_json(payload), CallRecord(name=name, ok=False)
