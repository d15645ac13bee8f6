"""SkyRL-gym: skyrl_gym's own text2sql environment (make/init/step/close), its tool calls through tvcache."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

skyrl_gym = pytest.importorskip("skyrl_gym", reason="the 'skyrl' extra is not installed: pip install 'tvcache[skyrl]'")

from skyrl_gym.envs.sql.env import Text2SQLEnvConfig  # noqa: E402

from tvcache import Cache  # noqa: E402
from tvcache.integrations.skyrl import TEXT2SQL, ToolBinding, cache_env, register_cached_env  # noqa: E402


@dataclass
class TrajectoryID:
    """The shape of skyrl.train.generators.base.TrajectoryID (skyrl-train needs torch; see the report)."""

    instance_id: str
    repetition_id: int


PROMPT = [{"role": "user", "content": "How many albums does each artist have?"}]
GOLD = "SELECT artist, count(*) FROM albums GROUP BY artist ORDER BY artist"
# Rollouts of one prompt: the same exploration in another order, so queries repeat at other turns.
THINK = "<think>look</think>"
TABLES = f"{THINK}<sql>SELECT name FROM sqlite_master WHERE type='table'</sql>"
ALBUMS = f"{THINK}<sql>SELECT * FROM albums</sql>"
ANSWER = f"<think>done</think><solution>{GOLD}</solution>"
ROLLOUTS = [
    [TABLES, ALBUMS, ANSWER],
    [ALBUMS, TABLES, f"{THINK}<sql>SELECT count(*) FROM albums</sql>", ANSWER],
    [ALBUMS, f"{THINK}<sql>SELECT nonsense FROM nowhere</sql>", "<think>guess</think><solution>SELECT 1</solution>"],
]
# (SkyRL's reward wants a <think> block before every action.)


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    folder = tmp_path / "SynSQL-2.5M" / "databases" / "music"
    folder.mkdir(parents=True)
    with sqlite3.connect(folder / "music.sqlite") as db:
        db.execute("CREATE TABLE albums (title TEXT, artist TEXT)")
        db.executemany(
            "INSERT INTO albums VALUES (?, ?)", [("Kind of Blue", "Miles Davis"), ("Blue Train", "John Coltrane")]
        )
    return tmp_path


def extras(trajectory: TrajectoryID | None = None) -> dict[str, Any]:
    base = {"db_id": "music", "data": "synsql", "reward_spec": {"ground_truth": GOLD}, "max_turns": 5}
    return base if trajectory is None else {**base, "trajectory_id": trajectory}


def rollout(env: Any, actions: list[str]) -> list[Any]:
    """What SkyRL's generator does with an environment, minus the model: init, step per action, close."""
    observed: list[Any] = [env.init(PROMPT)[0]]
    for action in actions:
        out = env.step(action)
        observed.append((out["observations"], out["reward"], out["done"]))
        if out["done"]:
            break
    env.close()
    return observed


def test_text2sql_group_hits_on_later_rollouts_with_identical_observations_and_rewards(db_path: Path) -> None:
    config = Text2SQLEnvConfig(db_path=str(db_path))
    expected = [rollout(skyrl_gym.make("text2sql", env_config=config, extras=extras()), a) for a in ROLLOUTS]
    assert expected[0][-1][1] == 1.0  # the gold answer really earns the reward

    cache = Cache()
    got, stats = [], []
    for repetition, actions in enumerate(ROLLOUTS):
        env = cache_env(
            skyrl_gym.make("text2sql", env_config=config, extras=extras()),
            trajectory_id=TrajectoryID(instance_id="17", repetition_id=repetition),
            cache=cache,
        )
        got.append(rollout(env, actions))
        stats.append(env.tvcache.session.stats)
    assert got == expected
    assert (stats[0].hits, stats[0].misses) == (0, 2)
    # Same queries at other turns: hits, with the reminder of *this* turn (the raw result is what is cached).
    # TEXT2SQL does not declare its determinism (a query may call random()), so its first would-be hit in the
    # task is executed once more and compared (verified) before the tool is trusted there.
    assert (stats[1].hits, stats[1].verified, stats[1].misses) == (1, 1, 1)
    assert (stats[2].hits, stats[2].verified, stats[2].misses) == (1, 0, 1)
    first_tables, second_tables = got[0][1][0][0]["content"], got[1][2][0][0]["content"]
    assert "albums" in first_tables
    assert "You have 4 turns left" in first_tables
    assert "albums" in second_tables
    assert "You have 3 turns left" in second_tables
    assert cache.stats().sandboxes_started == 3  # one environment used per rollout that missed, none restarted
    cache.close()


def test_registered_env_keys_by_instance_id_and_works_against_a_server(db_path: Path) -> None:
    for module in ("httpx", "starlette", "uvicorn"):
        pytest.importorskip(module, reason="the 'server' extra is not installed: pip install 'tvcache[server]'")
    from tvcache.server import CacheService, ServerThread

    config = Text2SQLEnvConfig(db_path=str(db_path))
    expected = rollout(skyrl_gym.make("text2sql", env_config=config, extras=extras()), ROLLOUTS[0])
    service = CacheService()
    with ServerThread(service) as server:
        cache = register_cached_env("text2sql-tvcache-test", base="text2sql", cache=server.url)
        try:
            for repetition in range(3):
                trajectory = TrajectoryID(instance_id="3", repetition_id=repetition)
                env = skyrl_gym.make("text2sql-tvcache-test", env_config=config, extras=extras(trajectory))
                assert rollout(env, ROLLOUTS[0]) == expected
            other = skyrl_gym.make("text2sql-tvcache-test", env_config=config, extras=extras(TrajectoryID("4", 0)))
            rollout(other, ROLLOUTS[0][:1])
            stats = cache.stats()  # type: ignore[attr-defined]
            # instance 3: 2 misses, then the first would-be hit verified (TEXT2SQL is undeclared) and 1+2 hits;
            # instance 4: 1 miss
            assert (stats.hits, stats.verified, stats.misses) == (3, 1, 3)
        finally:
            cache.close()
            skyrl_gym.envs.registration.registry.pop("text2sql-tvcache-test", None)
    service.close()


def test_bindings_are_checked_and_unbound_tools_run_uncached(db_path: Path) -> None:
    with pytest.raises(ValueError, match="presentation arguments"):
        ToolBinding(group="g", tool="t", arguments=("a",), presentation=frozenset({"b"}))
    with pytest.raises(ValueError, match="TrajectoryID"):
        cache_env(object(), trajectory_id="17", cache=Cache())
    assert TEXT2SQL.name == "SQLCodeExecutorToolGroup.sql"
