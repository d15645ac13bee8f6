"""veRL: tools loaded by veRL's own tool registry from a tool-config YAML, called through ToolAgentLoop's own
``_call_tool`` (create / execute / release per call, parallel calls of a turn gathered as veRL does)."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "verl.experimental.agent_loop.tool_agent_loop",
    reason="the 'verl' extra is not installed (veRL needs torch and ray, ~1.9 GB): pip install 'tvcache[verl]'",
)

import verl_kv_tool  # noqa: E402
import yaml  # noqa: E402
from verl.experimental.agent_loop.agent_loop import _agent_loop_registry  # noqa: E402
from verl.experimental.agent_loop.tool_agent_loop import AgentData, ToolAgentLoop  # noqa: E402
from verl.experimental.agent_loop.tool_parser import FunctionCall  # noqa: E402
from verl.tools.tool_registry import initialize_tools_from_config  # noqa: E402

from tvcache.integrations.verl import TVCacheToolAgentLoop, rollout_scope, task_key  # noqa: E402

HERE = Path(__file__).parent
PROMPT = [{"role": "user", "content": "Count to two in key a."}]
# Turns of tool calls (several per turn run in parallel). The second rollout makes the same calls with the
# parallel ones in the other order; the third diverges at the second turn.
ROLLOUTS = [
    [[("set", "a", 1)], [("incr", "a", None), ("get", "b", None)], [("get", "a", None)]],
    [[("set", "a", 1)], [("get", "b", None), ("incr", "a", None)], [("get", "a", None)]],
    [[("set", "a", 1)], [("incr", "a", None)], [("incr", "a", None)], [("get", "a", None)]],
]


def agent_loop(tools: list[Any]) -> ToolAgentLoop:
    """A ToolAgentLoop with just what ``_call_tool`` reads (the rest needs a model server and a tokenizer)."""
    loop = TVCacheToolAgentLoop.__new__(TVCacheToolAgentLoop)
    loop.tools = {tool.name: tool for tool in tools}
    loop.max_parallel_calls = 2
    loop.max_tool_response_length = 256
    loop.tool_response_truncate_side = "middle"
    return loop


def call(op: str, key: str, value: int | None) -> FunctionCall:
    arguments = {"op": op, "key": key} if value is None else {"op": op, "key": key, "value": value}
    return FunctionCall(name="kv", arguments=json.dumps(arguments))


async def rollout(loop: ToolAgentLoop, turns: list[list[tuple]]) -> list[list[tuple]]:
    agent_data = AgentData(
        messages=list(PROMPT), image_data=None, video_data=None, audio_data=None, mm_processor_kwargs=None,
        metrics={}, request_id=uuid.uuid4().hex, tools_kwargs={},
    )  # fmt: skip
    responses = []
    for turn in turns:
        agent_data.tool_calls = [call(*c) for c in turn]  # what the generating state parses from the model
        batch = agent_data.tool_calls[: loop.max_parallel_calls]
        results = await asyncio.gather(*(loop._call_tool(c, agent_data.tools_kwargs, agent_data) for c in batch))
        responses.append([(r.text, reward, metrics) for r, reward, metrics in results])
    return responses


def load_tools(tmp_path: Path, cache: Any) -> list[Any]:
    config = yaml.safe_load((HERE / "verl_tools.yaml").read_text())
    config["tools"][0]["config"]["cache"] = cache
    path = tmp_path / f"tools-{uuid.uuid4().hex}.yaml"
    path.write_text(yaml.safe_dump(config))
    return initialize_tools_from_config(str(path))


def uncached_tools() -> list[Any]:
    config = yaml.safe_load((HERE / "verl_tools.yaml").read_text())["tools"][0]
    from verl.tools.schemas import OpenAIFunctionToolSchema

    return [
        verl_kv_tool.KVTool(config={"type": "native"}, tool_schema=OpenAIFunctionToolSchema(**config["tool_schema"]))
    ]


async def group(tools: list[Any]) -> tuple[list[Any], list[Any]]:
    loop = agent_loop(tools)
    results, stats = [], []
    for turns in ROLLOUTS:
        async with rollout_scope(task_key({"raw_prompt": PROMPT, "uid": uuid.uuid4().hex}), max_parallel=2) as scope:
            results.append(await rollout(loop, turns))
            stats.append([session.stats for session in scope.sessions.values()])
    return results, stats


def test_group_of_rollouts_through_tool_agent_loop_hits_and_matches_uncached(tmp_path: Path) -> None:
    expected = [asyncio.run(rollout(agent_loop(uncached_tools()), turns)) for turns in ROLLOUTS]
    verl_kv_tool.EXECUTIONS.clear()
    results, stats = asyncio.run(group(load_tools(tmp_path, None)))
    assert results == expected
    assert [(s[0].hits, s[0].misses) for s in stats] == [(0, 4), (4, 0), (2, 2)]
    # Real executions: 4 in the first rollout, none in the second, and in the third the new sandbox replays the
    # two state-changing calls (set, incr) before the two new ones.
    assert len(verl_kv_tool.EXECUTIONS) == 4 + 0 + 2 + 2
    assert _agent_loop_registry["tvcache_tool_agent"]["_target_"].endswith("TVCacheToolAgentLoop")


def test_one_setting_selects_a_tvcache_server(tmp_path: Path) -> None:
    for module in ("httpx", "starlette", "uvicorn"):
        pytest.importorskip(module, reason="the 'server' extra is not installed: pip install 'tvcache[server]'")
    from tvcache.server import CacheService, ServerThread

    expected = [asyncio.run(rollout(agent_loop(uncached_tools()), turns)) for turns in ROLLOUTS]
    service = CacheService()
    with ServerThread(service) as server:
        results, stats = asyncio.run(group(load_tools(tmp_path, server.url)))
    service.close()
    assert results == expected
    assert [(s[0].hits, s[0].misses) for s in stats] == [(0, 4), (4, 0), (2, 2)]


def test_task_key_is_stable_across_epochs_and_prefers_an_explicit_key() -> None:
    one = task_key({"raw_prompt": PROMPT, "uid": "step-1", "index": 0})
    assert one == task_key({"raw_prompt": PROMPT, "uid": "step-2", "index": 0})
    assert one != task_key({"raw_prompt": [{"role": "user", "content": "other"}], "uid": "step-1"})
    assert task_key({"raw_prompt": PROMPT, "extra_info": {"tvcache_task": "q-17"}}) == "q-17"
