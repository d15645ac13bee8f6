"""``tvcache demo``: small but real RL post-training runs through the cache, side by side with no cache.

For each workload (SQL, shell, files/media, and a terminal driven through one persistent shell per rollout), a
learnable policy — standing in for the LLM, see ``workloads.policy`` — samples groups of rollouts per task over
several epochs and is updated GRPO-style. The sandboxes, tools, outputs and rewards are real. Four runs use the
same seeds:

* ``uncached``: every rollout executes every call in a fresh sandbox (the ground truth);
* ``naive``: a dict keyed by the call alone, the failure the paper is about; its wrong results are counted
  against a shadow execution of every call;
* ``tvcache-nosnap``: the tool call graph without snapshots (misses replay from a fresh sandbox);
* ``tvcache``: the full design.

A cache that returns exactly what execution returns reproduces the uncached run call for call, reward for
reward — the demo checks it and says so, then writes ``report.json``, ``report.md``, plots and traces.
"""

from .command import WORKLOADS, add_arguments, audit_rate, load_workload, main, unavailable
from .records import MODES, CallRecord, RunResult
from .runner import Runner, RunProgress

__all__ = [
    "MODES",
    "WORKLOADS",
    "CallRecord",
    "RunProgress",
    "RunResult",
    "Runner",
    "add_arguments",
    "audit_rate",
    "load_workload",
    "main",
    "unavailable",
]
