"""A NeMo-Gym resources server with one tool, ``run_command`` (a command in the rollout's persistent shell), and a
reward read from the sandbox: cached through ``tvcache.integrations.nemo_gym.RolloutSessions``, or, with
``UncachedSandboxes`` in its place, run straight on one sandbox per rollout (the uncached reference).

Served for real by the tests (uvicorn on loopback ports), together with NeMo-Gym's own ``SimpleAgent`` and
``ScriptedModel``, a test double of a model server that replays scripted tool calls (there is no model here).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseSeedSessionRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ResourcesCloseSessionRequest,
    ResourcesCloseSessionResponse,
    ResourcesSeedSessionRequest,
    ResourcesSeedSessionResponse,
    SimpleResourcesServer,
)
from nemo_gym.openai_utils import (
    NeMoGymResponse,
    NeMoGymResponseFunctionToolCall,
    NeMoGymResponseOutputMessage,
    NeMoGymResponseOutputText,
)
from nemo_gym.server_utils import SESSION_ID_KEY
from pydantic import BaseModel, ConfigDict, PrivateAttr

from tvcache import ToolCall

RUN_COMMAND_TOOL = {
    "type": "function",
    "name": "run_command",
    "description": "Run a shell command in the task's repository; the shell keeps its directory and variables.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    "strict": True,
}


class RunCommandRequest(BaseModel):
    command: str


class RunCommandResponse(BaseModel):
    output: str
    is_error: bool


class NotesVerifyRequest(BaseVerifyRequest):
    model_config = ConfigDict(extra="allow")
    expected: str


class NotesVerifyResponse(BaseVerifyResponse):
    model_config = ConfigDict(extra="allow")


class UncachedSandboxes:
    """The same interface as ``RolloutSessions`` on one fresh sandbox per rollout, without tvcache: what the
    server does uncached."""

    def __init__(self, factory: Any) -> None:
        self.factory = factory
        self._open: dict[str, Any] = {}
        self.seconds = 0.0  # tool time, summed over rollouts

    async def open(self, request: Request) -> Any:
        rollout = request.session[SESSION_ID_KEY]
        if rollout not in self._open:
            self._open[rollout] = await self.factory.start()
        return self._open[rollout]

    async def call(self, request: Request, tool: str, arguments: dict[str, Any]) -> Any:
        began = time.perf_counter()
        outcome = await self._open[request.session[SESSION_ID_KEY]].execute(ToolCall(tool, arguments))
        self.seconds += time.perf_counter() - began
        return outcome

    async def test(self, request: Request, fn: Any, *, key: str) -> Any:
        return _Value(await fn(self._open[request.session[SESSION_ID_KEY]]))

    async def close(self, request: Request) -> None:
        await self.close_id(request.session[SESSION_ID_KEY])

    async def close_id(self, rollout: str, *, tombstone: bool = False) -> None:
        sandbox = self._open.pop(rollout, None)
        if sandbox is not None:
            await sandbox.stop()


class _Value:
    def __init__(self, value: Any) -> None:
        self.value = value


def count_of(expected: str, notes: str) -> Any:
    """The reward check: how many lines of ``notes`` hold ``expected``, read in the rollout's sandbox (its shell
    may be anywhere by then: the path is absolute)."""

    async def check(sandbox: Any) -> int:
        outcome = await sandbox.execute(ToolCall("sh", {"cmd": f"grep -c {expected} {notes} || true"}))
        return int(outcome.output.strip() or 0)

    return check


class NotesServer(SimpleResourcesServer):
    """Tool ``run_command``; the reward is 1 when notes.txt holds the expected word exactly once."""

    config: BaseResourcesServerConfig
    _rollouts: Any = PrivateAttr(default=None)
    _notes: str = PrivateAttr(default="")

    def use(self, rollouts: Any, notes: str) -> NotesServer:
        self._rollouts, self._notes = rollouts, notes
        return self

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/run_command")(self.run_command)
        return app

    async def seed_session(
        self, request: Request, body: ResourcesSeedSessionRequest | BaseSeedSessionRequest
    ) -> ResourcesSeedSessionResponse | BaseSeedSessionResponse:
        await self._rollouts.open(request)
        if isinstance(body, ResourcesSeedSessionRequest):  # an Environment Server's seed gets its id back
            return ResourcesSeedSessionResponse(resources_session_id=body.resources_session_id)
        return BaseSeedSessionResponse()

    async def run_command(self, request: Request, body: RunCommandRequest) -> RunCommandResponse:
        result = await self._rollouts.call(request, "sh", {"cmd": body.command})
        return RunCommandResponse(output=result.output, is_error=result.is_error)

    async def verify(self, request: Request, body: NotesVerifyRequest) -> NotesVerifyResponse:
        count = await self._rollouts.test(request, count_of(body.expected, self._notes), key=f"count {body.expected}")
        await self._rollouts.close(request)
        return NotesVerifyResponse(**body.model_dump(), reward=float(count.value == 1))

    async def close_resources_session(self, body: ResourcesCloseSessionRequest) -> ResourcesCloseSessionResponse:
        await self._rollouts.close_id(body.resources_session_id, tombstone=True)
        return ResourcesCloseSessionResponse(resources_session_id=body.resources_session_id)


class ScriptedModel:
    """A test double of a NeMo-Gym model server (``/v1/responses``): for the sample named in the request's
    metadata, the next scripted ``run_command`` call, one per turn, then a final message."""

    def __init__(self, scripts: Mapping[str, list[str]]) -> None:
        self.scripts = scripts

    def app(self) -> FastAPI:
        app = FastAPI()
        app.post("/v1/responses")(self.responses)
        return app

    async def responses(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        script = self.scripts[body["metadata"]["sample"]]
        step = sum(1 for item in body["input"] if item.get("type") == "function_call_output")
        if step < len(script):
            arguments = json.dumps({"command": script[step]})
            output: Any = NeMoGymResponseFunctionToolCall(
                type="function_call", call_id=f"call-{step}", name="run_command", arguments=arguments, id=f"fc-{step}"
            )
        else:
            text = NeMoGymResponseOutputText(type="output_text", text="done", annotations=[])
            output = NeMoGymResponseOutputMessage(
                id="msg", content=[text], role="assistant", status="completed", type="message"
            )
        response = NeMoGymResponse(
            id=f"resp-{step}",
            created_at=0.0,
            model="scripted",
            object="response",
            output=[output],
            parallel_tool_calls=False,
            tool_choice="auto",
            tools=[],
        )
        return response.model_dump(mode="json")


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def serving(apps: list[tuple[FastAPI, socket.socket]]) -> Iterator[None]:
    """Serve each app with uvicorn on its bound loopback socket, each in a thread of its own; stop them all."""
    servers = []
    for app, sock in apps:
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        servers.append((server, thread))
    deadline = time.monotonic() + 30
    while not all(server.started for server, _ in servers):
        if time.monotonic() > deadline:
            raise TimeoutError("the NeMo-Gym test servers did not start within 30 s")
        time.sleep(0.01)
    try:
        yield
    finally:
        for server, thread in servers:
            server.should_exit = True
            thread.join(timeout=30)
