"""The Anthropic Messages dialect of the proxy: ``POST /v1/messages``, streamed and not.

Shapes (docs.anthropic.com/en/api/messages): tools are ``{"name", "description", "input_schema", ...}``; a reply's
``content`` is a list of blocks, calls being ``{"type": "tool_use", "id", "name", "input"}`` with ``input`` an
*object*; results are ``{"type": "tool_result", "tool_use_id", "content", "is_error"}`` blocks at the head of the
next user message. The system prompt is the top-level ``system`` member, passed through as sent. A stream is
``message_start``, per block ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta`` (stop reason,
output usage) and ``message_stop``; usage needs no option.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..prompts import ROUTER_SYSTEM, ROUTER_TOOL, router_tool_definition
from .dialect import DialectError, declared_tool
from .openai_api import _text
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


class AnthropicDialect:
    name = "anthropic"
    path = "/messages"
    auth_headers: tuple[str, ...] = ("x-api-key", "authorization", "anthropic-version", "anthropic-beta")

    def router_definition(self, *, router_model: bool) -> Json:
        if router_model:
            function = router_tool_definition()["function"]
            return {"name": ROUTER_TOOL, "description": function["description"], "input_schema": function["parameters"]}
        return {
            "name": ROUTER_TOOL,
            "description": retrieval_description(),
            "input_schema": retrieval_definition_parameters(),
        }

    def name_of(self, definition: Json) -> str:
        return str(definition.get("name", ""))

    def client_tools(self, body: Json) -> list[ClientTool]:
        tools = body.get("tools")
        if not isinstance(tools, list):
            raise DialectError("'tools' must be an array of tools")
        out: list[ClientTool] = []
        seen: set[str] = set()
        for index, tool in enumerate(tools):
            out.append(
                declared_tool(
                    tool if isinstance(tool, dict) else {},
                    schema_key="input_schema",
                    definition=tool,
                    index=index,
                    seen=seen,
                    unnamed=f"a tool needs a unique 'name' other than {ROUTER_TOOL}",
                )
            )
        return out

    def session_head(self, body: Json) -> Any:
        messages = body.get("messages") or []
        return [body.get("model"), body.get("system"), messages[:1]]

    def set_tool_choice(self, body: Json, core: frozenset[str]) -> None:
        choice = body.get("tool_choice")
        if isinstance(choice, dict) and choice.get("type") == "tool" and choice.get("name") not in core:
            body["tool_choice"] = {**choice, "name": ROUTER_TOOL}

    def rewrite_history(self, messages: list[Any], *, session: str, store: TurnStore) -> list[Any]:
        out: list[Any] = []
        pending: tuple[Any, ...] = ()
        for message in messages:
            if not isinstance(message, dict):
                out.append(message)
                continue
            role, content = message.get("role"), message.get("content")
            if role == "assistant":
                if pending:  # proxy-answered results with no user message after them: one of their own
                    out.append({"role": "user", "content": list(pending)})
                    pending = ()
                blocks = content if isinstance(content, list) else []
                ids = [b.get("id", "") for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"]
                stored = store.get(turn_key(session, ids, _block_text(content)))
                if stored is not None:
                    out.extend(stored.before)
                    pending = stored.results
                out.append(self._restore_calls(message, stored))
            elif role == "user" and isinstance(content, list):
                restored = [_restore_result(block) for block in content]
                if pending:
                    at = sum(1 for b in restored if isinstance(b, dict) and b.get("type") == "tool_result")
                    restored[at:at] = list(pending)
                    pending = ()
                out.append({**message, "content": restored})
            else:
                if pending:
                    out.append({"role": "user", "content": list(pending)})
                    pending = ()
                out.append(message)
        if pending:
            out.append({"role": "user", "content": list(pending)})
        return out

    def _restore_calls(self, message: Json, stored: StoredTurn | None) -> Json:
        content = message.get("content")
        if not isinstance(content, list):
            return message
        restored: list[Any] = []
        for block in content:
            decoded = (
                decode_routed_id(block.get("id", ""))
                if isinstance(block, dict) and block.get("type") == "tool_use"
                else None
            )
            if decoded is None:
                restored.append(block)
                continue
            restored.append({**block, "id": decoded[0], "name": ROUTER_TOOL, "input": _object(decoded[1])})
        for position, call in stored.inserted if stored else ():
            restored.insert(position, call)
        return {key: (restored if key == "content" else value) for key, value in message.items()}

    # -- the reply ----------------------------------------------------------------------------------------

    @staticmethod
    def _blocks(completion: Json) -> list[Any]:
        content = completion.get("content")
        return content if isinstance(content, list) else []

    def calls(self, completion: Json) -> list[tuple[ProviderCall, Json]]:
        out = []
        for block in self._blocks(completion):
            if isinstance(block, dict) and block.get("type") == "tool_use":
                call = ProviderCall(
                    id=str(block.get("id", "")),
                    name=str(block.get("name", "")),
                    arguments=dumps(block.get("input", {})),
                )
                out.append((call, block))
        return out

    def position(self, completion: Json, call_id: str) -> int:
        blocks = self._blocks(completion)
        return next((i for i, b in enumerate(blocks) if isinstance(b, dict) and b.get("id") == call_id), len(blocks))

    def routed_call(self, raw: Json, *, call_id: str, tool: str, arguments: str) -> Json:
        return {**raw, "id": call_id, "name": tool, "input": _object(arguments)}

    def call_object(self, call: ProviderCall) -> Json:
        return {"type": "tool_use", "id": call.id, "name": call.name, "input": _object(call.arguments)}

    def error_body(self, message: str, *, kind: str = "api_error") -> Json:
        return {"type": "error", "error": {"type": kind, "message": message}}

    def with_calls(self, completion: Json, replacements: Sequence[Json | None]) -> Json:
        remaining = iter(replacements)
        content: list[Any] = []
        for block in self._blocks(completion):
            if isinstance(block, dict) and block.get("type") == "tool_use":
                replacement = next(remaining)
                if replacement is not None:
                    content.append(replacement)
            else:
                content.append(block)
        out = {**completion, "content": content}
        if out.get("stop_reason") == "tool_use" and not any(
            isinstance(b, dict) and b.get("type") == "tool_use" for b in content
        ):
            out["stop_reason"] = "end_turn"
        return out

    def reply_key(self, completion: Json, *, session: str) -> str:
        blocks = self._blocks(completion)
        ids = [b.get("id", "") for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"]
        return turn_key(session, ids, _block_text(blocks))

    def history_reply(self, completion: Json) -> Json:
        return {"role": "assistant", "content": self._blocks(completion)}

    def tool_result(self, call_id: str, text: str, *, is_error: bool) -> Json:
        result: Json = {"type": "tool_result", "tool_use_id": call_id, "content": text}
        if is_error:
            result["is_error"] = True
        return result

    def append_round(self, body: Json, reply: Json, results: Sequence[Json]) -> None:
        body["messages"] = [*body["messages"], reply, {"role": "user", "content": list(results)}]

    def hidden_messages(self, reply: Json, results: Sequence[Json]) -> list[Json]:
        return [reply, {"role": "user", "content": list(results)}]

    def usage(self, completion: Json) -> Json | None:
        usage = completion.get("usage")
        return usage if isinstance(usage, dict) else None

    def context_lines(self, body: Json) -> list[str]:
        lines = []
        for message in body.get("messages") or ():
            if isinstance(message, dict) and message.get("role") == "user":
                text = _block_text(message.get("content"))
                if text:
                    lines.append(text)
        return lines[-3:]

    def router_body(self, *, model: str, summary: str, candidates: Sequence[ClientTool], max_tokens: int) -> Json:
        return {
            "model": model,
            "max_tokens": max_tokens,
            "system": ROUTER_SYSTEM,
            "messages": [{"role": "user", "content": summary}],
            "tools": [tool.definition for tool in candidates],
            "tool_choice": {"type": "auto"},
        }

    def router_reply_text(self, completion: Json) -> str:
        return _block_text(self._blocks(completion))

    # -- streams ------------------------------------------------------------------------------------------

    def prepare_stream(self, body: Json) -> bool:
        return True  # usage is always in the stream

    def assemble(self, events: Sequence[Json]) -> Json:
        message: Json = {}
        blocks: dict[int, Json] = {}
        partial: dict[int, list[str]] = {}
        for event in events:
            kind = event.get("type")
            if kind == "message_start" and isinstance(event.get("message"), dict):
                message = dict(event["message"])
                message["usage"] = dict(message.get("usage") or {})
            elif kind == "content_block_start" and isinstance(event.get("content_block"), dict):
                index = int(event.get("index", len(blocks)))
                blocks[index] = dict(event["content_block"])
                if blocks[index].get("type") == "tool_use":
                    partial[index] = []
            elif kind == "content_block_delta" and isinstance(event.get("delta"), dict):
                index = int(event.get("index", 0))
                block = blocks.setdefault(index, {"type": "text", "text": ""})
                delta = event["delta"]
                if delta.get("type") == "text_delta":
                    block["text"] = block.get("text", "") + str(delta.get("text", ""))
                elif delta.get("type") == "input_json_delta":
                    partial.setdefault(index, []).append(str(delta.get("partial_json", "")))
                elif delta.get("type") == "thinking_delta":
                    block["thinking"] = block.get("thinking", "") + str(delta.get("thinking", ""))
                elif delta.get("type") == "signature_delta":
                    block["signature"] = block.get("signature", "") + str(delta.get("signature", ""))
            elif kind == "message_delta":
                for key, value in (event.get("delta") or {}).items():
                    message[key] = value
                if isinstance(event.get("usage"), dict):
                    message.setdefault("usage", {}).update({k: v for k, v in event["usage"].items() if v is not None})
        for index, parts in partial.items():
            text = "".join(parts)
            blocks[index]["input"] = _object(text) if text.strip() else {}
        message["content"] = [blocks[i] for i in sorted(blocks)]
        return message

    def stream_events(self, completion: Json, *, include_usage: bool) -> list[bytes]:
        def event(kind: str, data: Json) -> bytes:
            return f"event: {kind}\ndata: {dumps({'type': kind, **data})}\n\n".encode()

        usage = completion.get("usage") or {}
        start = {key: value for key, value in completion.items() if key not in ("content", "stop_reason")}
        start.update(content=[], stop_reason=None, stop_sequence=None)
        out = [event("message_start", {"message": start})]
        for index, block in enumerate(self._blocks(completion)):
            kind = block.get("type")
            if kind == "tool_use":
                opening = {**block, "input": {}}
                delta: Json | None = {"type": "input_json_delta", "partial_json": dumps(block.get("input", {}))}
            elif kind == "text":
                opening = {**block, "text": ""}
                delta = {"type": "text_delta", "text": block.get("text", "")}
            elif kind == "thinking":
                opening = {**block, "thinking": "", "signature": ""}
                delta = {"type": "thinking_delta", "thinking": block.get("thinking", "")}
            else:
                opening, delta = block, None
            out.append(event("content_block_start", {"index": index, "content_block": opening}))
            if delta is not None:
                out.append(event("content_block_delta", {"index": index, "delta": delta}))
            if kind == "thinking" and block.get("signature"):
                signature = {"type": "signature_delta", "signature": block["signature"]}
                out.append(event("content_block_delta", {"index": index, "delta": signature}))
            out.append(event("content_block_stop", {"index": index}))
        final = {"stop_reason": completion.get("stop_reason"), "stop_sequence": completion.get("stop_sequence")}
        out.append(event("message_delta", {"delta": final, "usage": usage}))
        out.append(event("message_stop", {}))
        return out

    def is_usage_only(self, event: Json) -> bool:
        return False


def _object(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return {}


def _restore_result(block: Any) -> Any:
    if isinstance(block, dict) and block.get("type") == "tool_result" and isinstance(block.get("tool_use_id"), str):
        decoded = decode_routed_id(block["tool_use_id"])
        if decoded is not None:
            return {**block, "tool_use_id": decoded[0]}
    return block


def _block_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(
            b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text" and "text" in b
        )
    return _text(content)
