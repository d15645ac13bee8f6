"""NeMo-Gym: rollouts through its own agent (``SimpleAgent``'s ``/run``: ``/seed_session``, the model, the tool
routes, ``/verify``, all over real HTTP on loopback) against a resources server whose tool calls go through
``RolloutSessions``, compared with the same rollouts against the same server run uncached.

The model is a test double (``nemo_gym_shell_server.ScriptedModel``, a model server replaying scripted tool
calls; there is no model here). Everything else is real: NeMo-Gym's agent, server base classes, session
middleware and HTTP client; uvicorn; tvcache's persistent shell sandboxes on overlayfs (root).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nemo_gym", reason="the 'nemo-gym' extra is not installed: pip install 'tvcache[nemo-gym]'")

import httpx  # noqa: E402
from nemo_gym import server_utils  # noqa: E402
from nemo_gym.base_resources_server import BaseResourcesServerConfig, ResourcesSeedSessionRequest  # noqa: E402
from nemo_gym.config_types import ModelServerRef, ResourcesServerRef  # noqa: E402
from nemo_gym.episode_types import EpisodeId, TaskId  # noqa: E402
from nemo_gym.server_utils import BaseServerConfig, ServerClient  # noqa: E402
from nemo_gym.testing.session_conformance import check_resources_session_contract  # noqa: E402
from nemo_gym_shell_server import (  # noqa: E402
    RUN_COMMAND_TOOL,
    NotesServer,
    ScriptedModel,
    UncachedSandboxes,
    free_socket,
    serving,
)
from omegaconf import OmegaConf  # noqa: E402
from responses_api_agents.simple_agent.app import SimpleAgent, SimpleAgentConfig  # noqa: E402

from tvcache import AlwaysSnapshot, Cache  # noqa: E402
from tvcache.integrations.nemo_gym import RolloutSessions, task_id_of  # noqa: E402
from tvcache.sandboxes import ShellSandbox  # noqa: E402
from tvcache.sandboxes.shell.linux import overlay_supported  # noqa: E402

pytestmark = pytest.mark.skipif(not overlay_supported(), reason="persistent shell sandboxes need overlay mounts (root)")

SCRIPTS = {
    sample: [
        "cat notes.txt",
        f"export WORD={word}; cd sub",
        "echo $WORD >> ../notes.txt; cat ../notes.txt; pwd",
        "ls; echo to stderr >&2; false",
    ]
    for sample, word in (("a", "hello"), ("b", "bye"))
}


def row(sample: str) -> dict[str, Any]:
    """One row of the task: the same prompt every time; ``sample`` stands for the model's sampling."""
    prompt = "Add the word hello to notes.txt, once."
    return {
        "responses_create_params": {
            "input": [{"role": "user", "content": prompt}],
            "tools": [RUN_COMMAND_TOOL],
            "metadata": {"sample": sample},
        },
        "task_id": "notes",
        "expected": "hello",
    }


class Gym:
    """NeMo-Gym's three servers, wired as its global config wires them: the resources server, the scripted
    model server and a SimpleAgent, each on a loopback port of its own."""

    def __init__(self, rollouts: Any, notes: Path) -> None:
        sockets = {name: free_socket() for name in ("resources", "model", "agent")}
        ports = {name: sock.getsockname()[1] for name, sock in sockets.items()}
        place = {name: {"host": "127.0.0.1", "port": port} for name, port in ports.items()}
        config = OmegaConf.create(
            {
                "notes_resources": {"resources_servers": {"notes": place["resources"]}},
                "scripted_model": {"responses_api_models": {"scripted": place["model"]}},
                "notes_agent": {"responses_api_agents": {"simple_agent": place["agent"]}},
            }
        )
        client = ServerClient(head_server_config=BaseServerConfig(host="127.0.0.1", port=1), global_config_dict=config)
        resources = NotesServer(
            config=BaseResourcesServerConfig(entrypoint="", name="notes_resources", **place["resources"]),
            server_client=client,
        ).use(rollouts, str(notes))
        agent = SimpleAgent(
            config=SimpleAgentConfig(
                entrypoint="",
                name="notes_agent",
                model_server=ModelServerRef(type="responses_api_models", name="scripted_model"),
                resources_server=ResourcesServerRef(type="resources_servers", name="notes_resources"),
                **place["agent"],
            ),
            server_client=client,
        )
        self.apps = [
            (resources.setup_webserver(), sockets["resources"]),
            (ScriptedModel(SCRIPTS).app(), sockets["model"]),
            (agent.setup_webserver(), sockets["agent"]),
        ]
        self.agent_url = f"http://127.0.0.1:{ports['agent']}"

    def run(self, sample: str) -> dict[str, Any]:
        """One rollout, as rollout collection starts it: a POST of the row to the agent's /run."""
        response = httpx.post(f"{self.agent_url}/run", json=row(sample), timeout=120)
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result


@contextmanager
def running(rollouts: Any, notes: Path) -> Iterator[Gym]:
    gym = Gym(rollouts, notes)
    # NeMo-Gym's HTTP client is one per process, bound to the loop that made it: each gym's agent makes its own
    # (NeMo-Gym's own tests reset it the same way).
    server_utils._GLOBAL_AIOHTTP_CLIENT = None
    with serving(gym.apps):
        yield gym


@pytest.fixture(autouse=True)
def gym_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """What NeMo-Gym gives each server process it starts: its global config (here only the HTTP client's
    defaults; the servers are wired by their ServerClient), so no process parses a command line."""
    monkeypatch.setenv("NEMO_GYM_CONFIG_DICT", "{}")


def tool_outputs(result: dict[str, Any]) -> list[str]:
    return [item["output"] for item in result["response"]["output"] if item["type"] == "function_call_output"]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "sub").mkdir(parents=True)
    (root / "notes.txt").write_text("one\n")
    (root / "sub" / "data.txt").write_text("x\n")
    return root


@pytest.fixture
def shell(tree: Path) -> Iterator[Any]:
    factory = ShellSandbox.factory(tree, persistent=True)
    yield factory
    factory.close()


@pytest.fixture
def report(capsys: pytest.CaptureFixture[str]) -> Callable[[str], None]:
    def show(line: str) -> None:
        with capsys.disabled():
            print(f"\n[nemo-gym] {line}")

    return show


@pytest.mark.parametrize("snapshots", ["cost-aware", "always"])
def test_divergent_rollouts_through_simple_agent_match_uncached_and_hit_on_the_second_epoch(
    tree: Path, shell: Any, report: Callable[[str], None], snapshots: str
) -> None:
    samples = ["a", "a", "b"]
    uncached_sandboxes = UncachedSandboxes(shell)
    with running(uncached_sandboxes, tree / "notes.txt") as gym:
        uncached = [gym.run(sample) for sample in samples]

    cache = Cache(snapshot_policy=AlwaysSnapshot()) if snapshots == "always" else Cache()
    rollouts = RolloutSessions(shell, cache=cache)
    epochs = []
    with running(rollouts, tree / "notes.txt") as gym:
        for _ in range(2):
            epochs.append([gym.run(sample) for sample in samples])

    different = sum(seen != expected for epoch in epochs for seen, expected in zip(epoch, uncached, strict=True))
    assert different == 0  # every verify response, tool outputs and rewards included, as the uncached server gave
    first = uncached[0]
    outputs = tool_outputs(first)
    assert len(outputs) == 4
    assert '"output":"one\\nhello\\n' in outputs[2].replace(" ", "")
    assert (first["reward"], uncached[2]["reward"]) == (1.0, 0.0)
    assert (tree / "notes.txt").read_text() == "one\n"  # the tree itself never changes

    stats = list(rollouts.finished)
    assert len(stats) == 6
    calls = len(SCRIPTS["a"])
    assert (stats[0].hits, stats[0].misses, stats[0].sandboxes_started) == (0, calls, 1)
    assert (stats[1].hits, stats[1].misses, stats[1].sandboxes_started + stats[1].sandboxes_forked) == (calls, 0, 0)
    assert (stats[2].hits, stats[2].misses) == (1, calls - 1)  # it diverges at the export
    if snapshots == "always":
        assert (stats[2].sandboxes_forked, stats[2].sandboxes_started, stats[2].calls_replayed) == (1, 0, 0)
    assert all((s.hits, s.misses) == (calls, 0) for s in stats[3:])
    saved = sum(s.seconds_saved for s in stats[3:])
    report(
        f"snapshots={snapshots}: {different} of {len(samples) * 2} rollouts differ from the uncached server; "
        f"epoch 2: {sum(s.hits for s in stats[3:])} hits, 0 misses; tool time uncached "
        f"{uncached_sandboxes.seconds:.3f} s per epoch, {saved:.3f} s saved in epoch 2; routes {shell.route_counts()}"
    )


def test_task_ids_follow_nemo_gym_fields_then_a_digest_of_the_row() -> None:
    assert task_id_of({"task_id": "t1", "problem_id": "p"}) == "nemo-gym:t1"
    assert task_id_of({"instance_id": "django-1"}) == "nemo-gym:django-1"
    assert task_id_of({"_ng_task_index": 4, "_ng_rollout_index": 2}) == "nemo-gym:4"
    one, two = row("a"), row("a")
    del one["task_id"], two["task_id"]
    two["_ng_rollout_index"] = 3  # per-rollout fields do not name another task
    assert task_id_of(one) == task_id_of(two) != task_id_of({**one, "expected": "bye"})
    typed = ResourcesSeedSessionRequest(
        resources_session_id="s", episode_id=EpisodeId(rollout_id="r"), task_id=TaskId(taskset="n", task_id="7"),
        task_data={},
    )  # fmt: skip
    assert task_id_of(typed.model_dump(mode="json")) == "n:7"


def test_the_environment_server_session_contract_holds(shell: Any) -> None:
    rollouts = RolloutSessions(shell, cache=Cache())
    server = NotesServer(
        config=BaseResourcesServerConfig(host="127.0.0.1", port=0, entrypoint="", name="notes"),
        server_client=ServerClient(head_server_config=BaseServerConfig(host="127.0.0.1", port=1),
                                   global_config_dict=OmegaConf.create({})),
    ).use(rollouts, "notes.txt")  # fmt: skip
    seed = ResourcesSeedSessionRequest(
        resources_session_id="rs-1", episode_id=EpisodeId(rollout_id="r-1"), task_id=TaskId(taskset="n", task_id="1"),
        task_data={},
    )  # fmt: skip
    check_resources_session_contract(server.setup_webserver(), seed, keeps_state=True)
    assert len(rollouts.finished) == 1  # the seeded session was closed once, never reopened


def test_a_tool_call_before_seed_session_is_refused_with_a_clear_error(shell: Any) -> None:
    from fastapi.testclient import TestClient

    server = NotesServer(
        config=BaseResourcesServerConfig(host="127.0.0.1", port=0, entrypoint="", name="notes"),
        server_client=ServerClient(head_server_config=BaseServerConfig(host="127.0.0.1", port=1),
                                   global_config_dict=OmegaConf.create({})),
    ).use(RolloutSessions(shell, cache=Cache()), "notes.txt")  # fmt: skip
    response = TestClient(server.setup_webserver()).post("/run_command", json={"command": "ls"})
    assert response.status_code == 409
    assert "seed_session" in response.json()["detail"]
