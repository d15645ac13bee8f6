"""``tvcache bench lookup``: longest-prefix lookup latency and memory per node on a large graph.

Builds one task graph of ``--nodes`` nodes (default 100k): paths of depth 64 branching off random prefixes,
with read-only calls hanging off some states, results of a realistic size. Then times, per history depth:

* ``match``: ``ToolCallGraph.match`` of a whole history of pre-built calls (the graph walk itself);
* ``match+keys``: the same, building the calls (canonical JSON + blake2b) from dicts first;
* ``session hit``: one ``Session.call`` that hits, end to end (validation, lock, stats), at that depth.

Bytes per node are measured with tracemalloc while building, less the result strings themselves.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
import tracemalloc
from typing import Any

from ..cache import Cache
from ..calls import ToolCall
from ..graph import ToolCallGraph
from ..store.local import LocalStore
from . import HitsOnly, write_figures

DEPTHS = (1, 2, 4, 8, 16, 32, 64)
COMMANDS = ("cat src/main.py", "make -j2", "pytest -x tests/", "git diff", "sed -i s/a/b/ f.py", "ls -la")


def _call(rng: random.Random, path_id: int, step: int) -> ToolCall:
    command = f"{rng.choice(COMMANDS)} # {path_id}.{step}"
    return ToolCall("sh", {"cmd": command, "timeout": 60})


def build_graph(nodes: int, seed: int, depth: int = 64) -> tuple[ToolCallGraph, list[list[ToolCall]], int]:
    """A graph of about ``nodes`` nodes; returns it, the full stateful histories, and bytes of results."""
    rng = random.Random(seed)
    graph = ToolCallGraph("bench")
    histories: list[list[ToolCall]] = []
    result_bytes = 0
    path_id = 0
    while len(graph) <= nodes:
        branch = rng.choice(histories) if histories else []
        prefix = branch[: rng.randrange(0, len(branch) + 1)]
        state = graph.root
        for call in prefix:
            node = state.step(call)
            assert node is not None
            state = node
        history = list(prefix)
        for step in range(len(prefix), depth):
            if len(graph) > nodes:
                break
            call = _call(rng, path_id, step)
            output = "x" * rng.randrange(64, 512)
            result_bytes += sys.getsizeof(output)
            state = graph.insert(state, call, output=output, seconds=rng.random(), read_only=False)
            history.append(call)
            if rng.random() < 0.25 and len(graph) <= nodes:  # a read-only call at this state
                read = ToolCall("sh", {"cmd": f"cat notes.txt # {path_id}.{step}"})
                output = "r" * rng.randrange(64, 512)
                result_bytes += sys.getsizeof(output)
                graph.insert(state, read, output=output, seconds=0.01, read_only=True)
        histories.append(history)
        path_id += 1
    return graph, [h for h in histories if len(h) == depth], result_bytes


def _percentiles(samples_ns: list[int]) -> dict[str, float]:
    samples = sorted(samples_ns)
    return {
        "p50_us": samples[len(samples) // 2] / 1000,
        "p99_us": samples[min(len(samples) - 1, int(len(samples) * 0.99))] / 1000,
        "mean_us": statistics.fmean(samples) / 1000,
    }


async def _session_hits(cache: Cache, history: list[ToolCall], repeats: int) -> list[int]:
    """Time the last call of ``history`` in fresh sessions that hit all the way down."""
    samples = []
    arguments = [call.arguments for call in history]
    for _ in range(repeats):
        async with cache.session("bench", sandbox=HitsOnly("sh")) as session:
            for call, args in zip(history[:-1], arguments[:-1], strict=True):
                await session.call(call.name, args)
            began = time.perf_counter_ns()
            result = await session.call(history[-1].name, arguments[-1])
            samples.append(time.perf_counter_ns() - began)
            if not result.hit:
                raise RuntimeError("benchmark bug: a stored history did not hit")
    return samples


def run(*, nodes: int = 100_000, repeats: int = 2000, seed: int = 0, json_path: str | None = None) -> dict[str, Any]:
    tracemalloc.start()
    began = time.perf_counter()
    graph, histories, result_bytes = build_graph(nodes, seed)
    build_seconds = time.perf_counter() - began
    allocated, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    node_count = len(graph) - 1
    bytes_per_node = (allocated - result_bytes) / node_count
    print(f"graph: {node_count:,} nodes ({graph.stats()['read_nodes']:,} read-only) built in {build_seconds:.1f} s")
    print(f"memory: {bytes_per_node:,.0f} bytes per node besides results ({allocated / 2**20:,.1f} MiB in all)")

    store = LocalStore()
    store.adopt(graph)  # benchmark the populated graph through the public session path
    cache = Cache(store=store)
    rng = random.Random(seed + 1)
    rows: list[dict[str, Any]] = []
    header = f"{'depth':>5} | {'match p50':>10} {'p99':>8} | {'+keys p50':>10} {'p99':>8}"
    print(f"\n{header} | {'session hit p50':>15} {'p99':>8}")
    for depth in DEPTHS:
        match_ns: list[int] = []
        keyed_ns: list[int] = []
        for _ in range(repeats):
            history = rng.choice(histories)[:depth]
            began_ns = time.perf_counter_ns()
            result = graph.match(history)
            match_ns.append(time.perf_counter_ns() - began_ns)
            if not (result.hit and result.matched == depth):
                raise RuntimeError(f"benchmark bug: a stored history of depth {depth} did not hit")
            raw = [(call.name, call.arguments) for call in history]
            began_ns = time.perf_counter_ns()
            graph.match([ToolCall(name, args) for name, args in raw])
            keyed_ns.append(time.perf_counter_ns() - began_ns)
        session_ns = asyncio.run(_session_hits(cache, rng.choice(histories)[:depth], max(50, repeats // 20)))
        row: dict[str, Any] = {
            "depth": depth,
            "match": _percentiles(match_ns),
            "match_with_keys": _percentiles(keyed_ns),
            "session_hit": _percentiles(session_ns),
        }
        rows.append(row)
        print(
            f"{depth:>5} | {row['match']['p50_us']:>8.2f}us {row['match']['p99_us']:>6.2f}us |"
            f" {row['match_with_keys']['p50_us']:>8.2f}us {row['match_with_keys']['p99_us']:>6.2f}us |"
            f" {row['session_hit']['p50_us']:>13.2f}us {row['session_hit']['p99_us']:>6.2f}us"
        )
    cache.close()
    figures = {
        "nodes": node_count,
        "bytes_per_node_besides_results": bytes_per_node,
        "build_seconds": build_seconds,
        "depths": rows,
        "python": sys.version.split()[0],
    }
    write_figures(figures, json_path, blank_line=True)
    return figures
