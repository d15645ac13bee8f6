"""Harbor: a task directory of ours run through Harbor's own trial machinery (``Trial.create(...).run()``, its
oracle agent and verifier) on ``OverlayEnvironment`` (no engine), uncached and through ``CachingEnvironment``;
and the environment API directly for a divergent rollout, uploads and pass-throughs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "harbor", reason="the 'harbor' extra is not installed (Python >= 3.12): pip install 'tvcache[harbor]'"
)

from harbor.models.trial.config import EnvironmentConfig, TaskConfig, TrialConfig  # noqa: E402
from harbor.models.trial.paths import TrialPaths  # noqa: E402
from harbor.trial.trial import Trial  # noqa: E402
from harbor_task import ENVIRONMENT, make_rootfs, make_task  # noqa: E402

from tvcache import Cache  # noqa: E402
from tvcache.integrations import harbor as adapter  # noqa: E402
from tvcache.sandboxes.shell import linux  # noqa: E402

pytestmark = pytest.mark.skipif(not linux.overlay_supported(), reason="overlay shell sandboxes need root")

OVERLAY = "tvcache.integrations.harbor:OverlayEnvironment"
CACHING = "tvcache.integrations.harbor:CachingEnvironment"


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_rootfs(tmp_path_factory.mktemp("rootfs"))


@pytest.fixture
def task(tmp_path: Path) -> Path:
    return make_task(tmp_path)


def trial_config(task: Path, trials: Path, name: str, environment: EnvironmentConfig) -> TrialConfig:
    return TrialConfig(
        task=TaskConfig(path=task),
        trial_name=name,
        trials_dir=trials,
        agent={"name": "oracle"},
        environment=environment,
    )


def test_trials_through_harbor_machinery_hit_and_match_uncached(task: Path, rootfs: Path, tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")  # a trial config holds JSON: trials of one location share one open cache
    overlay = EnvironmentConfig(import_path=OVERLAY, kwargs={"rootfs": str(rootfs), "environment": ENVIRONMENT})
    cached_env = EnvironmentConfig(
        import_path=CACHING,
        kwargs={
            "inner": OVERLAY,
            "inner_kwargs": {"rootfs": str(rootfs), "environment": ENVIRONMENT},
            "cache": cache,
            "deterministic": True,
        },
    )

    async def run(name: str, environment: EnvironmentConfig) -> tuple[Any, Any]:
        trial = await Trial.create(trial_config(task, tmp_path / "trials", name, environment))
        result = await trial.run()
        return result, trial

    async def main() -> list[tuple[Any, Any]]:
        return [
            await run("uncached", overlay),
            await run("cached-1", cached_env),
            await run("cached-2", cached_env),
        ]

    (uncached, _), (first, trial_1), (second, trial_2) = asyncio.run(main())
    for result in (uncached, first, second):
        assert result.exception_info is None, result.exception_info
        assert result.verifier_result.rewards == {"reward": 1.0}
    paths = [TrialPaths(tmp_path / "trials" / name) for name in ("uncached", "cached-1", "cached-2")]
    logs = [(p.agent_dir / "oracle.txt").read_text() for p in paths]
    assert logs == ["done\n"] * 3
    environment_1, environment_2 = trial_1.agent_environment, trial_2.agent_environment
    assert environment_1.environments_started == 1
    assert environment_1.session.stats.hits == 0
    assert environment_2.environments_started == 0  # trial 2: every call a hit, no environment started
    assert environment_2.session.stats.misses == 0
    assert environment_2.session.stats.hits > 0


def test_a_divergent_rollout_hits_on_its_prefix(task: Path, rootfs: Path, tmp_path: Path) -> None:
    cache = Cache()
    trial_paths = TrialPaths(tmp_path / "trial")
    trial_paths.mkdir()
    config = adapter.CachingEnvironment  # built as Harbor builds it, from the task's environment config

    def build(kind: str) -> Any:
        from harbor.models.task.task import Task

        common = dict(
            environment_dir=task / "environment",
            environment_name="hello-overlay",
            session_id=f"s-{kind}",
            trial_paths=trial_paths,
            task_env_config=Task(task).config.environment,
        )
        if kind == "uncached":
            return adapter.OverlayEnvironment(**common, rootfs=rootfs, environment=ENVIRONMENT)
        return config(
            **common,
            inner=adapter.OverlayEnvironment,
            inner_kwargs={"rootfs": rootfs, "environment": ENVIRONMENT},
            cache=cache,
        )

    script = tmp_path / "greet.sh"
    script.write_text('#!/bin/bash\necho "hi $1"\n')
    script.chmod(0o755)

    async def rollout(environment: Any, word: str) -> list[Any]:
        await environment.start(force_build=False)
        seen: list[Any] = [await environment.exec("mkdir -p /app && ls /app", cwd="/")]
        await environment.upload_file(script, "/app/greet.sh")
        seen.append(await environment.exec(f"/app/greet.sh {word} > out.txt; cat out.txt", cwd="/app"))
        seen.append(await environment.exec("echo $GREETING >&2; exit 3", env={"GREETING": word}))
        download = tmp_path / f"out-{word}-{id(environment)}.txt"
        await environment.download_file("/app/out.txt", download)
        seen.append(download.read_text())
        await environment.stop(delete=True)
        return seen

    async def main() -> tuple[list[Any], list[Any], list[Any]]:
        uncached = [await rollout(build("uncached"), word) for word in ("a", "a", "b")]
        cached, stats = [], []
        for word in ("a", "a", "b"):
            environment = build("cached")
            cached.append(await rollout(environment, word))
            stats.append(
                (environment.session.stats.hits, environment.session.stats.misses, environment.session.stats.verified)
            )
        return uncached, cached, stats

    uncached, cached, stats = asyncio.run(main())
    assert cached == uncached
    assert uncached[0][2].stderr == "a\n"
    assert uncached[0][2].return_code == 3
    assert stats[0][:2] == (0, 5)
    assert stats[1] == (4, 0, 1)  # rollout 2: no miss; its first exec checked once (determinism undeclared)
    assert stats[2][0] == 2
    assert stats[2][1] == 3


def test_a_streamed_exec_passes_through_uncached(task: Path, rootfs: Path, tmp_path: Path) -> None:
    from harbor.models.task.task import Task

    trial_paths = TrialPaths(tmp_path / "trial")
    trial_paths.mkdir()
    environment = adapter.CachingEnvironment(
        environment_dir=task / "environment",
        environment_name="hello-overlay",
        session_id="s",
        trial_paths=trial_paths,
        task_env_config=Task(task).config.environment,
        inner=adapter.OverlayEnvironment,
        inner_kwargs={"rootfs": rootfs, "environment": ENVIRONMENT},
        cache=Cache(),
    )
    chunks: list[str] = []

    async def collect(text: str, stream: str) -> None:
        chunks.append(text)

    async def main() -> Any:
        await environment.start(force_build=False)
        with environment.scoped_output_callback(collect):
            result = await environment.exec("echo live")
        await environment.stop(delete=True)
        return result

    result = asyncio.run(main())
    assert result.stdout == "live\n"
    assert environment.pass_throughs.counts["streamed exec"] == 1
    assert environment.session.stats.uncached == 1


def test_the_persistent_flavour_keeps_processes_and_tmp_between_execs(task: Path, rootfs: Path, tmp_path: Path) -> None:
    """Harbor's exec is one process per command, so one-shot stays the default: there a background process and
    /tmp end with the exec. ``persistent=True`` (for agents that keep a tmux session or a server) keeps both,
    while each exec still gets only its own working directory and environment; and it runs a whole trial."""
    from harbor.models.task.task import Task

    trial_paths = TrialPaths(tmp_path / "trial")
    trial_paths.mkdir()

    def build(persistent: bool) -> Any:
        return adapter.OverlayEnvironment(
            environment_dir=task / "environment",
            environment_name="hello-overlay",
            session_id=f"s-{persistent}",
            trial_paths=trial_paths,
            task_env_config=Task(task).config.environment,
            rootfs=rootfs,
            environment=ENVIRONMENT,
            persistent=persistent,
        )

    async def steps(environment: Any) -> list[Any]:
        await environment.start(force_build=False)
        seen = [
            await environment.exec("sleep 600 & echo $! > /app/pid; cd /app; X=1; echo started"),
            await environment.exec('kill -0 "$(cat /app/pid)" && echo alive; pwd; echo "x=$X"'),
            await environment.exec("echo kept > /tmp/note; cat /tmp/note"),
            await environment.exec("cat /tmp/note", cwd="/app", env={"X": "2"}),
            await environment.exec('echo "x=$X"; exit 4', env={"X": "2"}),
        ]
        await environment.stop(delete=True)
        return seen

    async def main() -> tuple[list[Any], list[Any]]:
        return await steps(build(False)), await steps(build(True))

    one_shot, persistent = asyncio.run(main())
    assert [r.stdout for r in persistent] == ["started\n", "alive\n/\nx=\n", "kept\n", "kept\n", "x=2\n"]
    assert persistent[4].return_code == 4
    assert one_shot[1].stdout == "/\nx=\n"  # the background process ended with its exec
    assert "No such process" in one_shot[1].stderr
    assert one_shot[3].return_code != 0  # and so did /tmp
    assert [r.stdout for r in one_shot][::2] == [r.stdout for r in persistent][::2]

    async def trial() -> Any:
        environment = EnvironmentConfig(
            import_path=OVERLAY, kwargs={"rootfs": str(rootfs), "environment": ENVIRONMENT, "persistent": True}
        )
        return await Trial.create(trial_config(task, tmp_path / "trials", "persistent", environment))

    async def run_trial() -> Any:
        return await (await trial()).run()

    result = asyncio.run(run_trial())
    assert result.exception_info is None, result.exception_info
    assert result.verifier_result.rewards == {"reward": 1.0}
