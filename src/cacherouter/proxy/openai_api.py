"""The OpenAI chat-completions dialect of the proxy: ``POST /v1/chat/completions``, streamed and not.

Shapes (platform.openai.com/docs/api-reference/chat): tools are ``{"type": "function", "function": {"name",
"description", "parameters", ...}}``; a reply's calls are ``message.tool_calls[i] = {"id", "type", "function":
{"name", "arguments"}}`` with ``arguments`` JSON *text*; results are ``{"role": "tool", "tool_call_id", "content"}``
messages. A stream is ``data: {chunk}`` events ending in ``data: [DONE]``; usage comes in a last chunk with empty
``choices`` when ``stream_options.include_usage`` is set (the proxy sets it, for its accounting, and drops that
chunk again if the client did not ask for it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..prompts import ROUTER_SYSTEM, ROUTER_TOOL, router_tool_definition
from .dialect import DialectError, declared_tool
from .routing import (
    ClientTool,
    ProviderCall,
    StoredTurn,
    TurnStore,
    decode_routed_id,
    dumps,
    retrieval_definition_parameters,
    retrieval_description,
    turn_key,
)

Json = dict[str, Any]


class OpenAIDialect:
    name = "openai"
    path = "/chat/completions"
    auth_headers: tuple[str, ...] = ("authorization", "openai-organization", "openai-project")

    # -- the request ---------------------------------------------------------------------------------------

    def router_definition(self, *, router_model: bool) -> Json:
        if router_model:
            return router_tool_definition()
        return {
            "type": "function",
            "function": {
                "name": ROUTER_TOOL,
                "description": retrieval_description(),
                "parameters": retrieval_definition_parameters(),
            },
        }

    def name_of(self, definition: Json) -> str:
        return str((definition.get("function") or {}).get("name", ""))

    def client_tools(self, body: Json) -> list[ClientTool]:
        tools = body.get("tools")
        if not isinstance(tools, list):
            raise DialectError("'tools' must be an array of function tools")
        out: list[ClientTool] = []
        seen: set[str] = set()
        for index, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
                raise DialectError(
                    f"tools[{index}]: the proxy routes function tools only ({{'type': 'function', 'function': ...}})"
                )
            out.append(
                declared_tool(
                    function,
                    schema_key="parameters",
                    definition=tool,
                    index=index,
                    seen=seen,
                    unnamed=f"a function needs a unique name other than {ROUTER_TOOL}",
                )
            )
        return out

    def session_head(self, body: Json) -> Any:
        """What names a conversation: the model, and the messages up to and including the first user message."""
        head: list[Any] = []
        for message in body.get("messages") or ():
            head.append(message)
            if isinstance(message, dict) and message.get("role") == "user":
                break
        return [body.get("model"), head]

    def set_tool_choice(self, body: Json, core: frozenset[str]) -> None:
        """A tool_choice naming a tool outside the view names INTERNAL_ROUTER instead (the model reaches it there)."""
        choice = body.get("tool_choice")
        if not isinstance(choice, dict):
            return
        if choice.get("type") == "function" and isinstance(choice.get("function"), dict):
            if choice["function"].get("name") not in core:
                choice["function"] = {**choice["function"], "name": ROUTER_TOOL}
        elif choice.get("type") == "allowed_tools" and isinstance(choice.get("allowed_tools"), dict):
            allowed = choice["allowed_tools"]
            listed = allowed.get("tools")
            if isinstance(listed, list):
                kept: list[Any] = []
                for entry in listed:
                    function = entry.get("function") if isinstance(entry, dict) else None
                    if isinstance(function, dict) and function.get("name") not in core:
                        entry = {**entry, "function": {**function, "name": ROUTER_TOOL}}
                    if entry not in kept:
                        kept.append(entry)
                allowed["tools"] = kept

    def rewrite_history(self, messages: list[Any], *, session: str, store: TurnStore) -> list[Any]:
        """The client's history as the provider produced it: routed calls back to INTERNAL_ROUTER calls (from
        their ids), and the hidden rounds and proxy-answered calls the store holds put back in their places."""
        out: list[Any] = []
        pending: tuple[Any, ...] = ()
        for message in messages:
            if not isinstance(message, dict):
                out.append(message)
                continue
            role = message.get("role")
            if role != "tool" and pending:
                out.extend(pending)
                pending = ()
            if role == "assistant":
                calls = message.get("tool_calls")
                ids = [c.get("id", "") for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []
                stored = store.get(turn_key(session, ids, _text(message.get("content"))))
                if stored is not None:
                    out.extend(stored.before)
                    pending = stored.results
                out.append(self._restore_calls(message, stored))
            elif role == "tool" and isinstance(message.get("tool_call_id"), str):
                decoded = decode_routed_id(message["tool_call_id"])
                out.append(message if decoded is None else {**message, "tool_call_id": decoded[0]})
            else:
                out.append(message)
        out.extend(pending)
        return out

    def _restore_calls(self, message: Json, stored: StoredTurn | None) -> Json:
        calls = message.get("tool_calls")
        if not isinstance(calls, list) and not (stored and stored.inserted):
            return message
        restored: list[Any] = []
        for call in calls if isinstance(calls, list) else []:
            decoded = decode_routed_id(call.get("id", "")) if isinstance(call, dict) else None
            if decoded is None:
                restored.append(call)
                continue
            function = call.get("function") if isinstance(call.get("function"), dict) else {}
            new_function = {**function, "name": ROUTER_TOOL, "arguments": decoded[1]}
            restored.append({**call, "id": decoded[0], "function": new_function})
        for position, call in stored.inserted if stored else ():
            restored.insert(position, call)
        if "tool_calls" in message:
            return {key: (restored if key == "tool_calls" else value) for key, value in message.items()}
        return {**message, "tool_calls": restored}

    # -- the reply ----------------------------------------------------------------------------------------

    @staticmethod
    def _message(completion: Json) -> Json:
        choices = completion.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return {}
        message = choices[0].get("message")
        return message if isinstance(message, dict) else {}

    def calls(self, completion: Json) -> list[tuple[ProviderCall, Json]]:
        """The reply's tool calls, each as read and as the provider sent it."""
        calls = self._message(completion).get("tool_calls")
        out = []
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                arguments = function.get("arguments")
                parsed = ProviderCall(
                    id=str(call.get("id", "")),
                    name=str(function.get("name", "")),
                    arguments=arguments if isinstance(arguments, str) else dumps(arguments or {}),
                )
                out.append((parsed, call))
        return out

    def position(self, completion: Json, call_id: str) -> int:
        """Where the call ``call_id`` sits in the reply's ``tool_calls``, to put it back there in the history."""
        calls = self._message(completion).get("tool_calls") or []
        return next((i for i, c in enumerate(calls) if isinstance(c, dict) and c.get("id") == call_id), len(calls))

    def routed_call(self, raw: Json, *, call_id: str, tool: str, arguments: str) -> Json:
        """The provider's INTERNAL_ROUTER call as the client gets it: a call of ``tool`` under ``call_id``."""
        function = raw.get("function")
        members = function if isinstance(function, dict) else {}
        return {**raw, "id": call_id, "function": {**members, "name": tool, "arguments": arguments}}

    def error_body(self, message: str, *, kind: str = "proxy_error") -> Json:
        return {"error": {"message": message, "type": kind, "param": None, "code": None}}

    def call_object(self, call: ProviderCall) -> Json:
        return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}

    def with_calls(self, completion: Json, replacements: Sequence[Json | None]) -> Json:
        """``completion`` as the client gets it: each call of :meth:`calls` replaced by its entry of
        ``replacements`` (None: left out, the proxy answered it)."""
        choice = dict(completion["choices"][0])
        message = dict(choice.get("message") or {})
        calls = [call for call in replacements if call is not None]
        if calls:
            message["tool_calls"] = calls
        else:
            message.pop("tool_calls", None)
            if choice.get("finish_reason") == "tool_calls":
                choice["finish_reason"] = "stop"
        choice["message"] = message
        return {**completion, "choices": [choice, *completion["choices"][1:]]}

    def reply_key(self, completion: Json, *, session: str) -> str:
        message = self._message(completion)
        ids = [c.get("id", "") for c in message.get("tool_calls") or () if isinstance(c, dict)]
        return turn_key(session, ids, _text(message.get("content")))

    def history_reply(self, completion: Json) -> Json:
        """The provider's reply as a history message (a hidden round's assistant message)."""
        message = self._message(completion)
        out: Json = {"role": "assistant", "content": message.get("content")}
        if message.get("reasoning_content") is not None:
            out["reasoning_content"] = message["reasoning_content"]  # DeepSeek's thinking mode requires it back
        out["tool_calls"] = [self.call_object(call) for call, _ in self.calls(completion)]
        return out

    def tool_result(self, call_id: str, text: str, *, is_error: bool) -> Json:
        return {"role": "tool", "tool_call_id": call_id, "content": text}

    def append_round(self, body: Json, reply: Json, results: Sequence[Json]) -> None:
        body["messages"] = [*body["messages"], reply, *results]

    def hidden_messages(self, reply: Json, results: Sequence[Json]) -> list[Json]:
        return [reply, *results]

    def usage(self, completion: Json) -> Json | None:
        usage = completion.get("usage")
        return usage if isinstance(usage, dict) else None

    def context_lines(self, body: Json) -> list[str]:
        """Recent user text for the router's task summary."""
        lines = []
        for message in body.get("messages") or ():
            if isinstance(message, dict) and message.get("role") == "user":
                lines.append(_text(message.get("content")))
        return lines[-3:]

    # -- the router sub-call -----------------------------------------------------------------------------

    def router_body(self, *, model: str, summary: str, candidates: Sequence[ClientTool], max_tokens: int) -> Json:
        return {
            "model": model,
            "messages": [{"role": "system", "content": ROUTER_SYSTEM}, {"role": "user", "content": summary}],
            "tools": [tool.definition for tool in candidates],
            "tool_choice": "auto",
            "max_tokens": max_tokens,
        }

    def router_reply_text(self, completion: Json) -> str:
        return _text(self._message(completion).get("content"))

    # -- streams ------------------------------------------------------------------------------------------

    def prepare_stream(self, body: Json) -> bool:
        """Ask the provider for usage in the stream; True when the client asked for it itself."""
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            return True
        body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
        return False

    def assemble(self, events: Sequence[Json]) -> Json:
        """The whole completion a stream of chunks adds up to (first choice only; others are not streamed back)."""
        base: Json = {}
        content: list[str] = []
        reasoning: list[str] = []
        calls: dict[int, Json] = {}
        finish: Any = None
        usage: Any = None
        for event in events:
            for key in ("id", "created", "model", "system_fingerprint", "service_tier"):
                if key in event and key not in base:
                    base[key] = event[key]
            if isinstance(event.get("usage"), dict):
                usage = event["usage"]
            for choice in event.get("choices") or ():
                if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                    continue
                delta = choice.get("delta") or {}
                if isinstance(delta.get("content"), str):
                    content.append(delta["content"])
                if isinstance(delta.get("reasoning_content"), str):
                    reasoning.append(delta["reasoning_content"])
                for part in delta.get("tool_calls") or ():
                    slot = calls.setdefault(int(part.get("index", 0)), {"id": "", "name": "", "arguments": ""})
                    slot["id"] = part.get("id") or slot["id"]
                    function = part.get("function") or {}
                    slot["name"] += function.get("name") or ""
                    slot["arguments"] += function.get("arguments") or ""
                if choice.get("finish_reason") is not None:
                    finish = choice["finish_reason"]
        message: Json = {"role": "assistant", "content": "".join(content) if content or not calls else None}
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
        if calls:
            message["tool_calls"] = [
                self.call_object(ProviderCall(id=c["id"], name=c["name"], arguments=c["arguments"]))
                for _, c in sorted(calls.items())
            ]
        completion: Json = {**base, "object": "chat.completion"}
        completion["choices"] = [{"index": 0, "message": message, "finish_reason": finish}]
        if usage is not None:
            completion["usage"] = usage
        return completion

    def stream_events(self, completion: Json, *, include_usage: bool) -> list[bytes]:
        """A completion as the SSE events of a stream that adds up to it."""
        base = {key: completion[key] for key in ("id", "created", "model", "system_fingerprint") if key in completion}
        base["object"] = "chat.completion.chunk"
        message = self._message(completion)
        choice = completion["choices"][0]
        first: Json = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("reasoning_content") is not None:
            first["reasoning_content"] = message["reasoning_content"]
        deltas: list[Json] = [first]
        for index, call in enumerate(message.get("tool_calls") or ()):
            deltas.append({"tool_calls": [{"index": index, **call}]})
        chunks = [{**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]} for delta in deltas]
        chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice.get("finish_reason")}]})
        if include_usage and "usage" in completion:
            chunks.append({**base, "choices": [], "usage": completion["usage"]})
        return [f"data: {dumps(chunk)}\n\n".encode() for chunk in chunks] + [b"data: [DONE]\n\n"]

    def is_usage_only(self, event: Json) -> bool:
        return not event.get("choices") and "usage" in event


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):  # content parts: the text parts, in order
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return json.dumps(content, ensure_ascii=False)
