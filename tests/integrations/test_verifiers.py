"""verifiers v1 (``verifiers.v1``, verifiers 0.4) with the tools of a ``vf.Toolset`` cached through tvcache's MCP
proxy (``CachedToolset``), through verifiers' own rollout path: ``Env.serving`` and ``Env.run_slot`` (what its
eval runner drives), the bundled ``null`` chat harness run by ``uv`` in the subprocess runtime, verifiers'
interception server, and one tool server per rollout, launched by verifiers.

The model is the one test double: ``ScriptedModel``, a local OpenAI-compatible HTTP server of our own that replays
scripted tool calls (reached over real HTTP through verifiers' interception). The cache is a real ``tvcache serve``
(in-process, real HTTP), shared by every rollout's proxy process. The uncached reference is the same taskset with
the plain ``NotesToolset``.
"""

from __future__ import annotations

import pytest

vf = pytest.importorskip(
    "verifiers.v1", reason="the 'verifiers' extra is not installed: pip install 'tvcache[verifiers]'"
)
if not hasattr(vf, "Toolset"):
    pytest.skip("this verifiers has no v1 Toolset (verifiers >= 0.4 has)", allow_module_level=True)
for module in ("httpx", "starlette", "uvicorn"):
    pytest.importorskip(module, reason="tvcache serve needs the 'server' extra")

from verifiers_notes_toolset import WRITE_SECONDS  # noqa: E402
from verifiers_scripted_model import ScriptedModel  # noqa: E402
from verifiers_v1_rollouts import make_env, prepare, run_epoch, tool_results  # noqa: E402

from tvcache.integrations.verifiers import CachedToolset, CachedToolsetConfig, toolset_task_id  # noqa: E402
from tvcache.server import CacheService, ServerThread  # noqa: E402

SCRIPTS = [
    [[("notes_write", {"name": "a", "text": "x"})], [("notes_read", {"name": "a"})]],
    [
        [("notes_write", {"name": "a", "text": "x"})],
        [("notes_read", {"name": "a"})],
        [("notes_write", {"name": "b", "text": "y"}), ("notes_read", {"name": "a"})],
        [("notes_read", {"name": "b"})],
    ],
    [[("notes_write", {"name": "a", "text": "z"})], [("notes_read", {"name": "a"})], [("notes_read", {"name": "b"})]],
]
TASKSET = "verifiers_notes_taskset"


def test_divergent_rollouts_hit_on_the_second_epoch_and_match_the_uncached_toolset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prepare(monkeypatch)
    service = CacheService()
    with ServerThread(service) as server, ScriptedModel(SCRIPTS) as model:
        reference = dict(map(tool_results, run_epoch(make_env({"id": TASKSET}), model.base_url, len(SCRIPTS))))
        cached = CachedToolsetConfig(
            toolset="verifiers_notes_toolset:NotesToolset",
            cache=server.url,
            read_only=["read"],
            deterministic=["write", "read"],
        )
        env = make_env({"id": TASKSET, "task": {"cached": cached.model_dump()}})
        epochs = []
        for _ in range(2):
            episodes = run_epoch(env, model.base_url, len(SCRIPTS))
            epochs.append((dict(map(tool_results, episodes)), dict(service.stats()), episodes))
    service.close()
    assert sorted(reference) == [0, 1, 2]
    assert reference[0] == [("call-0-0-0", "wrote a (1 notes)"), ("call-0-1-0", "x")]
    assert "no note called b" in reference[2][2][1]  # a tool error, shown to the model
    (first, after_first, first_episodes), (second, after_second, second_episodes) = epochs
    assert first == reference  # every tool result equals the uncached run's
    assert second == reference
    assert all(episode.ok for episode in first_episodes + second_episodes)
    assert after_second["hits"] > after_first["hits"]
    assert after_second["misses"] == after_first["misses"]  # the second epoch executed nothing
    saved = after_second["seconds_saved"] - after_first["seconds_saved"]
    print(
        f"\nverifiers v1: epoch 1 hits={after_first['hits']} misses={after_first['misses']}; epoch 2 "
        f"hits={after_second['hits'] - after_first['hits']} misses={after_second['misses'] - after_first['misses']}; "
        f"tool time saved: epoch 1 {after_first['seconds_saved']:.2f} s, epoch 2 {saved:.2f} s "
        f"(each write takes {WRITE_SECONDS} s)"
    )


def test_a_toolset_that_reads_the_rollouts_state_is_refused() -> None:
    config = CachedToolsetConfig(toolset="verifiers_notes_toolset:StatefulNotesToolset", cache="/unused")
    with pytest.raises(vf.ToolsetError, match="cannot be cached"):
        CachedToolset(config)


def test_the_task_is_the_datas_durable_id_else_its_content_hash() -> None:
    named = vf.TaskData(id="row-7", prompt="p")
    assert toolset_task_id("notes", named) == "verifiers:notes:row-7"
    anonymous = vf.TaskData(prompt="p")
    assert toolset_task_id("notes", anonymous) == f"verifiers:notes:{vf.Task(anonymous).hash}"
    assert toolset_task_id("notes", vf.TaskData(prompt="q")) != toolset_task_id("notes", anonymous)


def test_the_cached_toolset_serves_under_the_cached_toolsets_name() -> None:
    toolset = CachedToolset(CachedToolsetConfig(toolset="verifiers_notes_toolset:NotesToolset", cache="/unused"))
    assert toolset.server_name == "notes"
    with pytest.raises(vf.ToolsetError, match=r"declare it in Task\.toolsets"):
        toolset._connected()
