"""verifiers (Prime Intellect's environment library; prime-rl trains on it): per-rollout sandboxes and tool servers
served from a tvcache graph per task, for both of its stacks.

**v0** (``vf.StatefulToolEnv``; ``pip install 'tvcache[verifiers-v0]'``: verifiers 0.3.1, the last release that
ships it). ``TVCacheSandboxEnv`` is shaped like verifiers' ``SandboxEnv`` — a ``bash`` tool, one sandbox per
rollout, ``post_rollout`` before it goes — and ``TVCacheSandboxMixin`` is the same for a ``StatefulToolEnv`` of
your own. The rollout's sandbox is a tvcache session: it opens in ``setup_state``, reaches each sandbox tool as
the hidden argument ``sandbox`` (a ``RolloutSandbox``, injected by ``update_tool_args``, never shown to the
model), and closes in a ``@vf.cleanup`` handler after ``post_rollout``. The backend is any tvcache factory:
overlay shell (``ShellSandbox.factory(tree)``), persistent shell (``persistent=True``), image or Docker. A
group's ``rollouts_per_example`` siblings run through one task's graph, so they share its calls (two running one
call at once execute it once), and the next epoch's groups hit.

    import verifiers as vf
    from tvcache.integrations.verifiers import TVCacheSandboxEnv
    from tvcache.sandboxes import ShellSandbox

    env = TVCacheSandboxEnv(dataset=dataset, rubric=rubric, sandbox=ShellSandbox.factory(checkout),
                            cache="/data/tvcache", max_turns=20)

*What is cached*: each bash command (and each backend call a sandbox tool makes through ``sandbox.bash`` /
``sandbox.call``), keyed by the rollout's history in its task, timeout included; results are served only where
executing would give the same (see ``tvcache.Session``); ``sandbox.test`` caches end-of-rollout checks per state.
*Not cached*: tools that do not take ``sandbox`` (they run as verifiers runs them), commands that timed out, and a
rollout after a call its backend saw to be non-deterministic (it runs live from there). Shell commands are
declared deterministic by the shell backends (``SH_TOOL``): keep commands that read the clock, randomness or the
network out of them, or route them through a backend tool declared ``deterministic=False``. There is no upload
route: files a rollout needs belong in the factory's tree (or image). *Task ids*: the dataset row — ``example_id``
and a digest of its prompt, info and answer (``row_task_id``), stable across epochs and shared by siblings;
override ``task_id(state)`` to choose another (a row's ``info["instance_id"]``).

**v1** (``verifiers.v1``; ``pip install 'tvcache[verifiers]'``, verifiers 0.4). Tools are ``@vf.tool`` methods of
a ``vf.Toolset``, an MCP server verifiers launches once per rollout (for ``Task.toolsets``) and the harness program
reaches over streamable HTTP. Of the two seams its design offers, the runtime and the tool server, only the tool
server sees tool calls: a harness program runs whole inside its runtime (the chat loop's local bash included), so
a runtime of ours could cache its setup commands, never its tool calls. So tools are cached through our MCP proxy:
``CachedToolset`` is a ``vf.Toolset`` declared in place of yours; for its rollout it holds one connection to the
proxy (``CachingProxy``, in the tool server's process), so one tvcache session, and the proxy starts your toolset
over stdio — configured, ``setup()`` and ``setup_task(task)`` as verifiers does — only when a call misses, in a
fresh process per sandbox it needs (replaying the path's state-changing calls into it).

    class MyTask(vf.Task[MyData, vf.State, MyTaskConfig]):
        @classmethod
        def toolsets(cls, config):
            return [CachedToolset(CachedToolsetConfig(toolset="my_env.tools:SearchToolset",
                                                      cache="http://127.0.0.1:8000", read_only=["search"]))]

*What is cached*: each tool call's MCP result (tool errors included), keyed by the history of the rollout's
state-changing calls; tools listed ``read_only`` are keyed by the state they read; the tool listing too. Every
tool starts undeclared, so its first hit per task is executed once more and compared, unless listed in
``deterministic``; tools listed ``uncached`` always run and take the rollout off the cached paths. *Not cached*: a
toolset that reads or writes the rollout's ``State`` (refused: its results depend on more than its calls),
taskset-scoped (shared) toolsets (refused: no rollout's history keys their calls), and anything outside the tool
server (the harness's own bash). The toolset must start in the same state every time it is built: keep its data
in the task's config or in ``sandbox_dir``. *Task ids*: ``verifiers:<toolset name>:<TaskData.id>``, else the task
data's content hash (the trace's ``task.hash``) in place of the id (``toolset_task_id``); stable across epochs
and shared by a task's rollouts. Rollouts' tool servers are separate processes: share a ``tvcache serve`` URL.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._verifiers_v0 import RolloutSandbox, TVCacheSandboxEnv, TVCacheSandboxMixin, row_task_id
    from ._verifiers_v1 import CachedToolset, CachedToolsetConfig, toolset_task_id

__all__ = [
    "CachedToolset",
    "CachedToolsetConfig",
    "RolloutSandbox",
    "TVCacheSandboxEnv",
    "TVCacheSandboxMixin",
    "row_task_id",
    "toolset_task_id",
]

# Each stack needs its own verifiers release, so each half is imported only when one of its names is used.
_HOMES = {
    "RolloutSandbox": "._verifiers_v0",
    "TVCacheSandboxEnv": "._verifiers_v0",
    "TVCacheSandboxMixin": "._verifiers_v0",
    "row_task_id": "._verifiers_v0",
    "CachedToolset": "._verifiers_v1",
    "CachedToolsetConfig": "._verifiers_v1",
    "toolset_task_id": "._verifiers_v1",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __package__), name)
    globals()[name] = value
    return value
