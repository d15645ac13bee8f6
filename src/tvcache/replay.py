"""``tvcache replay TRACE...``: what tvcache would have saved on recorded rollouts, without executing anything.

A trace is JSONL, one tool call per line (see README): ``workload``, ``task``, ``epoch``, ``group``,
``rollout``, ``step`` (-1 for an end-of-rollout check), ``call`` (``name``, ``arguments``), ``output_digest``,
``seconds``, and optionally ``hit``, ``read_only`` and ``cached`` (False: a non-deterministic call). Replay
rebuilds each task's tool call graph from the traced calls in order: a call already executed in the same state
is a hit and saves the seconds its execution took. Calls not marked ``read_only`` are taken to change state
(the conservative choice). Each distinct (state, call) is executed once whatever the interleaving of the
rollouts, so the hit rate of a tvcache run is reproduced from its own trace.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .calls import ToolCall

__all__ = ["ReplayResult", "replay"]


@dataclass
class _State:
    children: dict[bytes, tuple[_State, float, str]] = field(default_factory=dict)
    reads: dict[bytes, tuple[float, str]] = field(default_factory=dict)


@dataclass(kw_only=True)
class ReplayResult:
    workload: str
    calls: int = 0
    hits: int = 0
    seconds_traced: float = 0.0
    seconds_saved: float = 0.0
    recorded_hits: int | None = None
    divergent_outputs: int = 0  # same call in the same state, different output digests: non-determinism

    @property
    def hit_rate(self) -> float:
        return self.hits / self.calls if self.calls else 0.0

    def to_json(self) -> dict[str, Any]:
        recorded = None if self.recorded_hits is None else self.recorded_hits / max(1, self.calls)
        return {"workload": self.workload, "calls": self.calls, "hit_rate": self.hit_rate,
                "recorded_hit_rate": recorded, "seconds_traced": self.seconds_traced,
                "seconds_saved": self.seconds_saved, "divergent_outputs": self.divergent_outputs}  # fmt: skip


def _load(paths: list[Path]) -> list[dict[str, Any]]:
    records = []
    for path in paths:
        with open(path) as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    record["_call"] = ToolCall(record["call"]["name"], record["call"].get("arguments", {}))
                    record["seconds"] = float(record["seconds"])
                    if not isinstance(record["step"], int) or isinstance(record["step"], bool):
                        raise TypeError(f"step must be an integer, got {record['step']!r}")
                    record["task"], record["rollout"] = str(record["task"]), str(record["rollout"])
                except (ValueError, KeyError, TypeError, AttributeError) as error:
                    raise SystemExit(f"tvcache replay: {path}:{number}: not a trace record ({error!r})") from error
                records.append(record)
    return records


def replay(paths: list[Path]) -> dict[str, ReplayResult]:
    records = _load(paths)
    rollouts: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        key = (record.get("workload", "trace"), record.get("epoch", 0), record["task"], record.get("group", 0),
               record["rollout"])  # fmt: skip
        rollouts[key].append(record)
    graphs: dict[tuple[str, str], _State] = defaultdict(_State)
    results: dict[str, ReplayResult] = {}
    for key in sorted(rollouts, key=lambda k: tuple(str(part) for part in k)):
        workload, task = key[0], key[2]
        result = results.setdefault(workload, ReplayResult(workload=workload))
        steps = sorted(rollouts[key], key=lambda r: (r["step"] < 0, r["step"]))
        state: _State | None = graphs[(workload, task)]
        for record in steps:
            call: ToolCall = record["_call"]
            seconds, digest = float(record["seconds"]), record.get("output_digest", "")
            read_only = bool(record.get("read_only")) or record["step"] < 0
            result.calls += 1
            result.seconds_traced += seconds
            if "hit" in record:
                result.recorded_hits = (result.recorded_hits or 0) + bool(record["hit"])
            if state is None or record.get("cached") is False:
                if not read_only:
                    state = None  # a state no cache can reproduce: the rest of the rollout runs uncached
                continue
            if call.digest in state.children:
                child, cost, output = state.children[call.digest]
                result.hits += 1
                result.seconds_saved += cost
                result.divergent_outputs += output != digest
                state = child
            elif call.digest in state.reads:
                cost, output = state.reads[call.digest]
                result.hits += 1
                result.seconds_saved += cost
                result.divergent_outputs += output != digest
            elif read_only:
                state.reads[call.digest] = (seconds, digest)
            else:
                child = _State()
                state.children[call.digest] = (child, seconds, digest)
                state = child
    return results


def main(paths: list[str], json_path: str | None = None) -> int:
    missing = [path for path in paths if not Path(path).is_file()]
    if missing:
        raise SystemExit(f"tvcache replay: no such trace file: {', '.join(missing)}")
    results = replay([Path(path) for path in paths])
    for result in results.values():
        recorded = ""
        if result.recorded_hits is not None:
            recorded = f" (the run recorded {result.recorded_hits / max(1, result.calls):.1%})"
        print(
            f"{result.workload}: {result.calls} calls, hit rate {result.hit_rate:.1%}{recorded}; "
            f"tool time spent in the traced run {result.seconds_traced:.2f} s; hits saved {result.seconds_saved:.2f} s"
        )
        if result.divergent_outputs:
            divergent = result.divergent_outputs
            print(f"{result.workload}: {divergent} hits whose traced output differs: non-deterministic tools?")
    if json_path:
        Path(json_path).write_text(json.dumps([r.to_json() for r in results.values()], indent=2))
    return 0
