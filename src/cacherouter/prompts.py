"""Fixed texts and pseudo-tool definitions of the main and router channels (our own wording).

These never change at run time: they are part of the main model's cached prefix.
"""

from __future__ import annotations

from typing import Any

ROUTER_TOOL = "INTERNAL_ROUTER"
PLACEHOLDER_TOOL = "TOOL_WHICH_WOULD_BE_USED"
NEED_TOOLS = "[STATUS: NEED_TOOLS]"
DIRECT_ANSWER = "[STATUS: DIRECT_ANSWER]"
UNCERTAIN = "[UNCERTAIN]"
MAX_TASK_CHARS = 800

MAIN_SYSTEM = (
    "You are an assistant that works in two phases.\n"
    "Phase 1 (you cannot call tools yet): decide whether the request needs anything outside your own knowledge "
    "(live data, files, running code, external services). If it does not, answer it and end with "
    f"{DIRECT_ANSWER}. If it does, split it into sub-tasks, say which need an external call, and end with "
    f"{NEED_TOOLS}. If the user asks you to use tools, always end with {NEED_TOOLS}.\n"
    "Phase 2 (tools enabled): use the listed tools; independent calls may be issued together. Anything the listed "
    f"tools cannot do, ask {ROUTER_TOOL} for, describing the task and its concrete inputs. When a call fails, read "
    "the error and change the plan instead of repeating it. Never invent results: if something could not be "
    f"established, say so and mark the answer with {UNCERTAIN}."
)

ROUTER_SYSTEM = (
    "You pick and call exactly one tool for the task below. Call the best-fitting tool once with complete "
    "arguments. If no listed tool can do the task, do not call any; reply with one line saying what is missing. "
    "Do not add commentary and do not make up data."
)

DEEP_THINKING = (
    "[RE-PLAN] Progress has stalled ({reason}). Look back over the calls made so far and their results, decide "
    "what is still missing, and either finish with what is known or take a different route."
)

INCOMPLETE = (
    "[INCOMPLETE] Your last reply {problem}, so it is not an answer. Give the complete answer again, concisely, "
    "or call a tool if one is still needed."
)

# Not sent as a request of its own: it closes a turn whose model call failed after tools had run, in both history
# streams, so the model (and a resumed session) know those calls did run and their effects stand.
TURN_ABORTED = (
    "[TURN ABORTED] This turn's tool calls were made and their results stand: {calls}. Then the turn ended "
    "without an answer: {reason}."
)

FALLBACK = (
    "[FINAL] No more tool calls are possible. Answer now from the information already gathered. State plainly "
    f"what could not be established, and begin the answer with {UNCERTAIN} if any part is unverified."
)


def router_tool_definition() -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": ROUTER_TOOL,
            "description": (
                "Reach every tool not listed here. Describe one task; a router finds a suitable tool, runs it and "
                "returns its result as JSON (or a retry signal). Call it again for further tasks."
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    "task": {"type": "string", "description": "What to do, with all concrete inputs."},
                    "hint": {"type": "string", "description": "Optional keywords or a tool name, if known."},
                },
                "required": ["task"],
                "additionalProperties": False,
            },
        },
    }


def placeholder_tool_definition() -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": PLACEHOLDER_TOOL,
            "description": (
                "Stands for every external capability (live data such as weather or news, running code, reading "
                "and writing files, calling services). Never called directly: it only tells you such capabilities "
                "exist, so that phase 1 can decide whether the request needs them."
            ),
            "parameters": {
                "type": "object",
                "properties": {"intent_summary": {"type": "string", "description": "What the capability would do."}},
                "required": ["intent_summary"],
                "additionalProperties": False,
            },
        },
    }
