"""Running verifiers v1 rollouts in the tests the way its eval runner does (``Env.serving`` then
``Env.run_slot`` per planned slot), with the bundled ``null`` chat harness in the subprocess runtime and
``ScriptedModel`` as the model, and reading the tool results back from the traces."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import verifiers.v1 as vf
from verifiers.v1.envs.single_agent import SingleAgentEnv, SingleAgentEnvConfig

HERE = Path(__file__).parent
KEY_VARIABLE = "TVCACHE_SCRIPTED_KEY"


def prepare(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the rollouts' processes need: this directory importable (the toolset fixtures) and ``uv`` — which
    the chat harness is run with, installed into this venv by the extra — on ``PATH``."""
    paths = [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    monkeypatch.setenv("PATH", os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    monkeypatch.setenv(KEY_VARIABLE, "scripted")


def make_env(taskset: dict[str, Any]) -> Any:
    config = SingleAgentEnvConfig(taskset=taskset, agent={"harness": {"id": "null"}, "runtime": {"type": "subprocess"}})
    return SingleAgentEnv(config)


def run_epoch(env: Any, base_url: str, rollouts: int) -> list[Any]:
    """One epoch: ``rollouts`` concurrent rollouts of each task; their episodes."""
    ctx = vf.ModelContext(client=vf.EvalClientConfig(base_url=base_url, api_key_var=KEY_VARIABLE), model="scripted")

    async def run() -> list[Any]:
        async with env.serving():
            slots = [slot for task in env.taskset for slot in env.slots(task, rollouts)]
            return list(await asyncio.gather(*(env.run_slot(slot, ctx) for slot in slots)))

    return asyncio.run(run())


def tool_results(episode: Any) -> tuple[int, list[Any]]:
    """The episode's script (from its first tool call's id) and the tool messages its model was shown."""
    (trace,) = episode.traces
    messages = [node.message for node in trace.nodes]
    calls = [call for m in messages if m.role == "assistant" for call in (m.tool_calls or [])]
    if not calls:
        raise AssertionError(f"a rollout made no tool call: {episode.errors or trace.errors}")
    script = int(calls[0].id.split("-")[1])
    return script, [(m.tool_call_id, m.content) for m in messages if m.role == "tool"]
