"""The ``tvcache`` command: ``demo``, ``replay``, ``serve``, ``mcp-proxy``, ``bench NAME``, ``inspect DIR`` and
``nondeterminism DIR``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from . import __version__
from .bench.commands import add_bench_parser
from .defaults import CLAIM_TTL, LEASE_TTL, MAX_BODY_BYTES, SNAPSHOT_BYTES, SNAPSHOTS_PER_TASK, TOKEN_ENV, env_token


def _serve(args: argparse.Namespace) -> int:
    import os

    from .errors import TVCacheError
    from .policies import Budget

    token = env_token(args.token)
    try:
        from .server import runner
    except ImportError as error:
        print(f"tvcache serve: {error}", file=sys.stderr)
        return 2
    try:
        runner.check_token(args.host, token)
    except TVCacheError as error:
        print(f"tvcache serve: {error}", file=sys.stderr)
        return 2
    options = [
        "--claim-ttl", str(args.claim_ttl), "--lease-ttl", str(args.lease_ttl),
        "--max-snapshots-per-task", str(args.max_snapshots_per_task),
        "--max-snapshot-bytes", str(args.max_snapshot_bytes), "--max-body-bytes", str(args.max_body_bytes),
    ]  # fmt: skip
    if args.fsync:
        options.append("--fsync")
    if args.shards > 1:
        if token is not None:
            os.environ[TOKEN_ENV] = token  # children read it from the environment, never from argv
        return runner.serve_shards(args.shards, host=args.host, port=args.port, data_dir=args.data_dir, argv=options)
    try:
        runner.serve(
            host=args.host,
            port=args.port,
            data_dir=args.data_dir,
            token=token,
            budget=Budget(max_snapshots_per_task=args.max_snapshots_per_task, max_bytes=args.max_snapshot_bytes),
            fsync=args.fsync,
            claim_ttl=args.claim_ttl,
            lease_ttl=args.lease_ttl,
            max_body_bytes=args.max_body_bytes,
        )
    except TVCacheError as error:
        print(f"tvcache serve: {error}", file=sys.stderr)
        return 2
    return 0


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.main(args)


def _replay(args: argparse.Namespace) -> int:
    from . import replay

    return replay.main(args.traces, json_path=args.json)


def _mcp_proxy(args: argparse.Namespace) -> int:
    command = list(args.upstream)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("tvcache mcp-proxy: give the upstream MCP server's command after '--'", file=sys.stderr)
        return 2
    try:
        from .integrations import mcp_proxy
    except ImportError as error:
        print(f"tvcache mcp-proxy: {error}", file=sys.stderr)
        return 2
    return mcp_proxy.main(
        command,
        task_id=args.task,
        cache=args.cache,
        token=args.token,
        uncached=args.uncached,
        deterministic=args.deterministic,
        audit_rate=args.audit_rate,
        sandbox_dir=args.sandbox_dir,
    )


def _ray(args: argparse.Namespace) -> int:
    try:
        from .integrations.ray import command
    except ImportError as error:
        print(f"tvcache ray: {error}", file=sys.stderr)
        return 2
    return command.run(
        args.action, shards=args.shards, data_dir=args.data_dir, namespace=args.namespace, address=args.address,
        host=args.host, port=args.port, token=env_token(args.token),
    )  # fmt: skip


def _inspect(args: argparse.Namespace) -> int:
    """Print a summary of a cache directory (JSON); exit 1 when its journal lost acknowledged records (what and
    where on stderr, and under "journal"), 2 when it cannot be opened."""
    import dataclasses
    import warnings
    from pathlib import Path

    from .cache import Cache
    from .errors import TVCacheError
    from .journal import Journal, JournalWarning

    if not (Path(args.path) / Journal.FILE).is_file():
        print(f"tvcache inspect: {args.path} is not a cache directory (it has no {Journal.FILE})", file=sys.stderr)
        return 2
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", JournalWarning)  # said below, once, without a source line
            cache = Cache(args.path, compact_on_open=False)
    except TVCacheError as error:
        print(f"tvcache inspect: {error}", file=sys.stderr)
        return 2
    with cache:
        tasks = {task: cache.graph(task).stats() for task in cache.tasks()}
        recovery = cache.recovery
        report = {
            "path": str(cache.root),
            "tasks": tasks,
            "nondeterministic_tools": cache.nondeterministic_tools,
            "journal": dataclasses.asdict(recovery) if recovery is not None else None,
        }
        print(json.dumps(report, indent=2))
    if recovery is not None and recovery.describe():
        print(f"tvcache inspect: {recovery.describe()}", file=sys.stderr)
    return 1 if recovery is not None and recovery.lost_records else 0


def _nondeterminism(args: argparse.Namespace) -> int:
    """List (or with --clear, forget) the non-determinism marks of a durable cache directory."""
    from .cache import Cache
    from .errors import TVCacheError

    try:
        cache = Cache(args.path, compact_on_open=False)
    except TVCacheError as error:
        print(f"tvcache nondeterminism: {error}", file=sys.stderr)
        return 2
    with cache:
        marks = [
            mark
            for mark in cache.nondeterministic_marks()
            if args.tool in (None, mark.tool) and args.task in (None, mark.task_id)
        ]
        cleared = cache.clear_nondeterministic(args.tool, task_id=args.task) if args.clear else 0
        listed = [{"tool": mark.tool, "task": mark.task_id, "reason": mark.reason} for mark in marks]
        print(json.dumps({"path": str(cache.root), "marks": listed, "cleared": cleared}, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tvcache",
        description="A stateful tool-value cache for post-training tool-using LLM agents.",
    )
    parser.add_argument("--version", action="version", version=f"tvcache {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="run small real RL loops through the cache, side by side with no cache",
        description="Trains a small learnable policy (standing in for the LLM) on SQL, shell and files/media tasks "
        "with real sandboxes, tools and rewards; runs it without a cache, with a naive call-keyed cache, and with "
        "tvcache with and without snapshots, checks that tvcache reproduced the uncached run exactly, and writes "
        "report.json, report.md, plots and JSONL traces.",
    )
    from .demo import add_arguments as add_demo_arguments

    add_demo_arguments(demo)
    demo.set_defaults(handler=_demo)

    serve = commands.add_parser(
        "serve",
        help="serve caches to many rollout workers over HTTP (needs the 'server' extra)",
        description="Holds the tool call graphs of many tasks for clients (tvcache.RemoteCache, "
        "tvcache.ShardedCache, or the original TVCache client's wire format). With --data-dir every insert is "
        "journaled before it is acknowledged, so a restart (even after kill -9) loses nothing acknowledged. "
        "Native API under /v1 (OpenAPI at /openapi.json), /metrics, /healthz.",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1); any non-loopback "
                       "address requires --token")  # fmt: skip
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000; shards use PORT..PORT+N-1)")
    serve.add_argument("--data-dir", default=None, help="durable cache directory (default: in memory only)")
    serve.add_argument("--token", default=None, help="bearer token clients must send (default: $TVCACHE_TOKEN)")
    serve.add_argument("--shards", type=int, default=1, help="start N shard processes (default 1); route with "
                       "tvcache.ShardedCache")  # fmt: skip
    serve.add_argument("--fsync", action="store_true", help="fsync each journal record (survives power loss)")
    serve.add_argument("--claim-ttl", type=float, default=CLAIM_TTL, help="seconds before a silent executing "
                       f"client's claim is taken over (default {CLAIM_TTL:g})")  # fmt: skip
    serve.add_argument("--lease-ttl", type=float, default=LEASE_TTL, help="seconds a snapshot lease or a "
                       f"wire-format env reference lasts without release (default {LEASE_TTL:g})")  # fmt: skip
    serve.add_argument(
        "--max-snapshots-per-task",
        type=int,
        default=SNAPSHOTS_PER_TASK,
        help=f"snapshot budget per task (default {SNAPSHOTS_PER_TASK})",
    )
    serve.add_argument("--max-snapshot-bytes", type=int, default=SNAPSHOT_BYTES, help="snapshot bytes budget in all")
    serve.add_argument(
        "--max-body-bytes", type=int, default=MAX_BODY_BYTES, help=f"request body limit ({MAX_BODY_BYTES >> 20} MiB)"
    )
    serve.set_defaults(handler=_serve)

    add_bench_parser(commands)

    replay = commands.add_parser(
        "replay",
        help="measure hit rate and time saved on recorded traces",
        description="Replays JSONL traces of tool calls (as `tvcache demo` writes them, or your own: see README) "
        "through a tool call graph without executing anything, and prints the hit rate and tool time saved.",
    )
    replay.add_argument("traces", nargs="+", metavar="TRACE", help="JSONL trace files")
    replay.add_argument("--json", metavar="PATH", default=None, help="also write the figures as JSON to PATH")
    replay.set_defaults(handler=_replay)

    proxy = commands.add_parser(
        "mcp-proxy",
        help="serve an MCP server's tools through the cache (needs the 'mcp' extra)",
        description="An MCP server on stdio that forwards to the upstream MCP server started by the command after "
        "'--' and answers repeated calls from a tvcache graph: one connection is one rollout of --task. Tools "
        "annotated readOnlyHint are read-only, all others change state; no annotation makes a tool deterministic, "
        "so the first hit of each tool in a task is executed once more and compared unless --deterministic or "
        "--uncached declares it. Statistics: resource tvcache://stats. See docs/mcp-proxy.md.",
    )
    proxy.add_argument("--task", default=None, help="task id (default: $TVCACHE_TASK, else a digest of the command)")
    proxy.add_argument("--cache", default=None, help="a directory (embedded, durable), a tvcache serve URL, or "
                       "comma-separated URLs (sharded); default: in memory")  # fmt: skip
    proxy.add_argument("--token", default=None, help="bearer token of the server (default: $TVCACHE_TOKEN)")
    proxy.add_argument("--uncached", action="append", default=[], metavar="TOOL", help="never serve TOOL from "
                       "cache (non-deterministic); repeatable")  # fmt: skip
    proxy.add_argument("--deterministic", action="append", default=[], metavar="TOOL", help="declare TOOL "
                       "deterministic: its first hit in a task is not re-executed to check it; repeatable")  # fmt: skip
    proxy.add_argument("--audit-rate", type=float, default=0.0, metavar="FLOAT", help="re-execute this fraction "
                       "of hits in a fresh upstream and compare (0 to 1; default 0)")  # fmt: skip
    proxy.add_argument("--sandbox-dir", default=None, metavar="DIR", help="run the upstream confined on an "
                       "overlay of its data directory DIR (seen at its own path), so every rollout starts from DIR as "
                       "it is and DIR never changes; needs root (overlay mounts)")  # fmt: skip
    proxy.add_argument("upstream", nargs=argparse.REMAINDER, help="-- then the upstream server's command")
    proxy.set_defaults(handler=_mcp_proxy)

    inspect = commands.add_parser(
        "inspect",
        help="summarise a durable cache directory",
        description="Prints the tasks, non-determinism marks and journal health of a cache directory as JSON. Exits "
        "1 when the journal holds damaged records (which ones, and the calls lost with them, on stderr), 2 when the "
        "directory cannot be opened (not a cache, in use, or a damaged record the cache refuses to guess about).",
    )
    inspect.add_argument("path", help="a directory created by Cache(path=...)")
    inspect.set_defaults(handler=_inspect)

    nondeterminism = commands.add_parser(
        "nondeterminism",
        help="list or clear the tools a durable cache no longer serves from cache",
        description="Lists the non-determinism marks of a cache directory (JSON): a tool marked in one task, where a "
        "replay, an audit or a first-hit check saw one call give two results (task: the task id), or in every task "
        "(task: null; declared with Cache.mark_nondeterministic, or journaled by tvcache before marks were scoped). "
        "--clear forgets the listed marks, so those tools are cached, and checked, again. Stop the process using "
        "the directory first.",
    )
    nondeterminism.add_argument("path", help="a directory created by Cache(path=...)")
    nondeterminism.add_argument("--tool", default=None, help="only the marks of TOOL")
    nondeterminism.add_argument("--task", default=None, help="only the marks of task TASK (tool-wide marks have none)")
    nondeterminism.add_argument("--clear", action="store_true", help="forget the marks listed")
    nondeterminism.set_defaults(handler=_nondeterminism)

    ray = commands.add_parser(
        "ray",
        help="manage graph shards as Ray actors (needs the 'ray' extra)",
        description="Shard actors in a running Ray cluster (see docs/ray.md): up starts them detached and "
        "restartable, status shows where each runs and its counters, down stops them (journals stay), "
        "dashboard serves their web dashboard and Prometheus /metrics.",
    )
    ray.add_argument("action", choices=["up", "status", "down", "dashboard"])
    ray.add_argument("--shards", type=int, default=1, help="up: number of shard actors (default 1)")
    ray.add_argument("--data-dir", default=None, help="up: journal directory, on a filesystem every node mounts")
    ray.add_argument("--namespace", default="tvcache", help="Ray namespace of the shards (default tvcache)")
    ray.add_argument("--address", default=None, help="Ray cluster address (default: auto)")
    ray.add_argument("--host", default="127.0.0.1", help="dashboard: address to bind (default 127.0.0.1); any "
                     "non-loopback address requires --token")  # fmt: skip
    ray.add_argument("--port", type=int, default=None, help="dashboard: port (default 8100)")
    ray.add_argument("--token", default=None, help="dashboard: bearer token (default: $TVCACHE_TOKEN)")
    ray.set_defaults(handler=_ray)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.handler(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    raise SystemExit(main())
